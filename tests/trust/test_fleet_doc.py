"""docs/fleet-trust.md as an operator runs it: its marked blocks — set up a fleet in five
commands, rotate the CA, revoke a node — run as written in a shell (real processes), and what
they produce admits and refuses exactly as the page says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from ectransport.config import load_settings
from ectransport.control.keys import load_public
from ectransport.trust import RefusalReason, Role, TrustPolicy
from ectransport.trust.files import read_cert
from ectransport.trust.watch import FileTrust

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "fleet-trust.md"
TIMEOUT_S = 300  # a dozen CLI processes on a busy machine


def doc_blocks() -> dict[str, str]:
    """``<!-- test: NAME -->`` + the fenced block after it, by NAME."""
    text = DOC.read_text(encoding="utf-8")
    found = re.findall(r"<!-- test: (\w+) -->\n```\w+\n(.*?)```", text, re.DOTALL)
    return dict(found)


def sh(script: str, cwd: Path) -> subprocess.CompletedProcess:
    prelude = (f'set -euo pipefail\nectransport() {{ "{sys.executable}" -m ectransport.cli '
               '"$@"; }\n')
    env = {**os.environ, "ECT_CA_PASSPHRASE": "a long test passphrase", "COLUMNS": "200"}
    env.pop("ECTRANSPORT_CONFIG", None)
    r = subprocess.run(["bash", "-c", prelude + script], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"exit {r.returncode}\n{script}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    return r


def admit(trust: FileTrust, d: Path, name: str, role: Role):
    key = load_public(d / "keys" / f"{name}.key")
    policy = TrustPolicy("certificate", trust.store)
    return policy.admit(curve_key=key, cert=read_cert(d / "keys" / f"{name}.cert"),
                        role_wanted=role, now=time.time())


def test_setup_rotation_and_revocation_run_as_written(tmp_path):
    blocks = doc_blocks()
    assert set(blocks) == {"setup", "config", "rotate", "revoke"}
    commands = [ln for ln in blocks["setup"].splitlines() if ln.startswith("ectransport ")]
    assert len(commands) == 5, "the page promises five commands"

    # -- set up: the five commands, and the same for a consumer ------------------------------
    (tmp_path / "node.toml").write_text(blocks["config"])
    r = sh(blocks["setup"], tmp_path)
    assert "verifies:         yes" in r.stdout
    assert 'admission = "certificate"' in r.stdout and "trust_ca = [" in r.stdout
    consumer = "\n".join(ln.replace("encoder-0", "pd-0").replace("--role producer",
                                                                 "--role consumer")
                         for ln in commands[1:3])
    sh(consumer, tmp_path)
    s = load_settings(tmp_path / "node.toml", env={}).settings
    assert s.trust.admission == "certificate" and s.trust.cert_file == "keys/encoder-0.cert"
    # the page writes paths relative to the node's directory
    trust = FileTrust.from_settings(msgspec.structs.replace(
        s.trust, trust_ca=tuple(str(tmp_path / p) for p in s.trust.trust_ca),
        revocation_file=tuple(str(tmp_path / p) for p in s.trust.revocation_file)))
    assert trust is not None
    assert admit(trust, tmp_path, "encoder-0", Role.PRODUCER).ok
    assert admit(trust, tmp_path, "pd-0", Role.CONSUMER).ok
    assert admit(trust, tmp_path, "pd-0", Role.PRODUCER).reason is RefusalReason.WRONG_ROLE
    old_pd0 = read_cert(tmp_path / "keys" / "pd-0.cert")

    # -- rotate: both CAs trusted, encoder-0 re-issued, then the old CA retired --------------
    rotate = blocks["rotate"]
    step4 = rotate.index("# 4.")
    r = sh(rotate[:step4], tmp_path)
    assert "verifies:         yes" in r.stdout
    bundle = tmp_path / "trusted-cas.pem"
    revs = [tmp_path / "ca" / "revocations.pem", tmp_path / "ca-next" / "revocations.pem"]
    overlap = FileTrust([bundle], revs, skew_s=300, reload_s=2)
    assert len(overlap.store.cas) == 2 and len(overlap.store.revocations) == 2
    assert admit(overlap, tmp_path, "encoder-0", Role.PRODUCER).ok  # the new CA's
    assert admit(overlap, tmp_path, "pd-0", Role.CONSUMER).ok  # still the old CA's
    sh(rotate[step4:], tmp_path)
    assert overlap.reload() is True and len(overlap.store.cas) == 1
    assert admit(overlap, tmp_path, "encoder-0", Role.PRODUCER).ok
    assert admit(overlap, tmp_path, "pd-0", Role.CONSUMER).reason is RefusalReason.UNKNOWN_CA
    assert read_cert(tmp_path / "keys" / "pd-0.cert") == old_pd0

    # -- revoke encoder-0: a running node's reload sees it ----------------------------------
    node = FileTrust([bundle], [revs[1]], skew_s=300, reload_s=2)
    admitted = admit(node, tmp_path, "encoder-0", Role.PRODUCER)
    assert admitted.ok
    r = sh(blocks["revoke"], tmp_path)
    assert "encoder-0 is revoked" in r.stdout and "NO (revoked)" in r.stdout
    assert node.reload_if_changed(time.monotonic()) is True
    assert TrustPolicy("certificate", node.store).recheck(admitted, now=time.time()).reason \
        is RefusalReason.REVOKED
    assert admit(node, tmp_path, "encoder-0", Role.PRODUCER).reason is RefusalReason.REVOKED
