"""Issue 23's done-when: a fleet is set up and changed without touching any allow-list file —
with the commands an operator types (``docs/fleet-trust.md``), each in a fresh interpreter:
``keys ca init`` / ``keys generate`` / ``keys issue``, ``serve`` on a wildcard address with
``--trust-ca --cert --admission certificate`` and no ``--allow-dir``, ``fetch --cert``; a
consumer added later is served by the running producer; ``keys revoke`` and the revoked
consumer is refused within seconds, while the others are still served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ectransport.cli.main import cli
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
SMALL_IMAGE = ROOT / "ectransport" / "demo" / "images" / "chelsea.png"
ENV = {**os.environ, "ECT_PW": "a long test passphrase", "COLUMNS": "200"}
ENV.pop("ECTRANSPORT_PLANES", None)
TRUST = ("--trust-ca", "ca/ca-public.pem", "--revocation-file", "ca/revocations.pem",
         "--admission", "certificate")
CA = ("--dir", "ca", "--passphrase-env", "ECT_PW")


def run(*args: str, cwd: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ectransport.cli", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def ok(*args: str, cwd: Path) -> str:
    r = run(*args, cwd=cwd)
    assert r.returncode == 0, f"{args}: {r.stdout}{r.stderr}"
    return r.stdout


def test_serve_and_fetch_list_the_trust_flags_of_the_schema():
    for command in ("serve", "fetch"):
        r = CliRunner().invoke(cli, [command, "--help"], terminal_width=200)
        assert r.exit_code == 0, r.output
        for flag in ("--trust-ca", "--cert", "--revocation-file", "--admission",
                     "--clock-skew-s", "--revocation-reload-s", "--expiry-check-s"):
            assert flag in r.output, f"{command} --help lacks {flag}"


def _member(d: Path, name: str, role: str) -> None:
    ok("keys", "generate", "--out", "keys", "--name", name, cwd=d)
    ok("keys", "issue", *CA, "--role", role, "--name", name, "--valid-days", "1",
       "--key", f"keys/{name}.key", "--out", f"keys/{name}.cert", cwd=d)


def _fetch(d: Path, info: dict, name: str) -> subprocess.CompletedProcess:
    (item,) = info["items"]
    return run("fetch", f"127.0.0.1:{info['port']}", item["mm_hash"],
               "--key", f"keys/{name}.key_secret", "--server-key", "keys/encoder-0.key",
               "--cert", f"keys/{name}.cert", *TRUST, "--timeout-s", "20", cwd=d)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fleet_is_set_up_changed_and_a_node_revoked_without_any_allow_list(tmp_path):
    d = tmp_path
    ok("keys", "ca", "init", *CA, cwd=d)
    _member(d, "encoder-0", "producer")
    _member(d, "pd-0", "consumer")
    out = ok("keys", "show", "keys/pd-0.cert", "--ca", "ca/ca-public.pem", "--revocations",
             "ca/revocations.pem", cwd=d)
    assert "verifies:         yes" in out, out
    ready = d / "ready.json"
    with open(d / "serve.out", "w+") as sout, open(d / "serve.err", "w+") as serr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ectransport.cli", "serve", "--host", "0.0.0.0", "--port", "0",
             "--images", str(SMALL_IMAGE), "--region-bytes", str(64 << 20),
             "--key", "keys/encoder-0.key_secret", "--cert", "keys/encoder-0.cert", *TRUST,
             "--revocation-reload-s", "0.2", "--ready-file", str(ready)],
            cwd=d, env=ENV, stdout=sout, stderr=serr, text=True)
        try:
            wait_for(lambda: ready.exists() or proc.poll() is not None, 180.0, 0.2)
            serr.seek(0)
            assert ready.exists(), f"serve not ready (rc={proc.poll()}): {serr.read()}"
            info = json.loads(ready.read_text())
            r = _fetch(d, info, "pd-0")
            assert r.returncode == 0 and "bytes in" in r.stdout, r.stdout + r.stderr
            # the fleet changes: a consumer added now is served, nothing on the producer touched
            _member(d, "pd-1", "consumer")
            r = _fetch(d, info, "pd-1")
            assert r.returncode == 0, r.stdout + r.stderr
            # pd-0 is removed: one command on the CA host (and the list copied to the nodes)
            ok("keys", "revoke", *CA, "--cert", "keys/pd-0.cert", cwd=d)
            t0 = time.monotonic()
            refused = None
            while time.monotonic() - t0 < 60.0:
                r = _fetch(d, info, "pd-0")
                if r.returncode != 0:
                    refused = r
                    break
            assert refused is not None, "pd-0 still served 60 s after its revocation"
            assert "trust: revoked: " in refused.stdout + refused.stderr, refused.stdout
            r = _fetch(d, info, "pd-1")
            assert r.returncode == 0, r.stdout + r.stderr
        finally:
            proc.terminate()
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait(timeout=10)
            sout.seek(0)
            serr.seek(0)
            stdout, stderr = sout.read(), serr.read()
    assert rc == 0, stderr
    assert "admission: certificate" in stdout, stdout
    assert "Traceback" not in stderr, stderr
    assert not any(p.is_dir() and "allow" in p.name for p in d.rglob("*")), \
        "an allow-list directory was made"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_with_certificates_admits_by_a_throwaway_ca_and_verifies_every_byte(tmp_path):
    r = run("demo", "--certificates", "--repeats", "1", "--images", str(SMALL_IMAGE),
            cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "consumer admitted by its certificate" in r.stdout, r.stdout
    assert "1/1 items fetched and verified" in r.stdout, r.stdout
