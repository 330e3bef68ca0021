"""The reduced interop matrix, end to end: real node processes on their own addresses (network
namespaces when running as root with ``ip netns``, else loopback addresses), every cell checked.

Slow (about 2 minutes on 2 cores): marked ``slow``. vLLM cells run only when ``.venv-vllm`` has
vLLM (they are reported as skipped otherwise; tests/vllm/test_interop_vllm_wire.py covers the
profile inside the vLLM venv).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("nixl")


def _netns_usable() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    from interop.netns import netns_available

    return netns_available()[0]


@pytest.mark.parametrize("mode", ["netns", "loopback"])
def test_reduced_matrix_has_no_deviation(tmp_path, mode):
    if mode == "netns" and not _netns_usable():
        pytest.skip("network namespaces unavailable (needs root and ip netns)")
    argv = [sys.executable, "-m", "interop", "--out", str(tmp_path), f"--{mode}"]
    if mode == "netns":  # vLLM's cells run where .venv-vllm exists (CI builds it later)
        argv += ["--allow-unavailable", "vllm-0.33.0"]
    if mode == "loopback":
        # the topology-dependent cells (shm is negotiated in one namespace, skipped across), on
        # 127.0.0.N addresses with N != 1 for every plane, quickly
        argv += ["--only", "planes", "--no-vllm", "--no-releases", "--no-c-client"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _, stderr = proc.communicate(timeout=840)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["topology"] == mode
    bad = [(c["name"], c["deviations"]) for c in report["results"] if c["deviations"]]
    assert proc.returncode == 0 and not bad, (bad, stderr[-3000:])
    assert report["cells"] >= (4 if mode == "loopback" else 20)
    md = (tmp_path / "report.md").read_text()
    assert "| # | cell |" in md and "**DEVIATION**" not in md
    if mode == "netns":  # the run tore its namespaces down
        from interop.netns import list_namespaces

        assert not [n for n in list_namespaces() if n.startswith(f"ecti-{proc.pid}-")]


def test_reduced_cross_matrix_with_the_c_client_and_a_release(tmp_path, c_client):
    """Implementation × implementation cells, on loopback addresses so that it runs without
    root: this tree, the last v1-only release (built into its own venv, cached) and the
    independent C consumer in both its variants, every producer against every consumer."""
    from interop.impls import C_CLIENT, C_CLIENT_V1, HEAD, LAST_V1
    from interop.venvs import BuildError, resolve_revision

    try:
        resolve_revision(LAST_V1)
    except BuildError:
        pytest.skip(f"revision {LAST_V1} is not in this clone (a shallow checkout?)")
    argv = [sys.executable, "-m", "interop", "--out", str(tmp_path), "--loopback",
            "--cross-only", "--no-vllm"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=840)
    report = json.loads((tmp_path / "report.json").read_text())
    bad = [(c["name"], c["deviations"]) for c in report["results"] if c["deviations"]]
    assert r.returncode == 0 and not bad, (bad, r.stderr[-3000:])
    impls = {i["name"]: i for i in report["implementations"]}
    release = f"ectransport@{LAST_V1}"
    for name in (HEAD, release, C_CLIENT, C_CLIENT_V1):
        assert not impls[name]["unavailable"], impls[name]
    assert impls[release]["versions"] == [1] and impls[C_CLIENT]["roles"] == ["consumer"]
    assert impls[C_CLIENT_V1]["versions"] == [1]
    t = report["tables"]
    for group in ("handshake", "transfer", "negotiate", "auth", "layout"):
        pairs = t[group]["pairs"]
        for p in (HEAD, release):  # every producer against every consumer
            for c in (HEAD, release, C_CLIENT, C_CLIENT_V1):
                assert pairs[p][c]["passed"] >= 1 and not pairs[p][c]["deviations"], (group, p, c)
        assert C_CLIENT not in pairs and C_CLIENT_V1 not in pairs  # consumers only
    hs = {c["name"]: c for c in report["results"] if c["group"] == "handshake"}
    connect = hs[f"handshake: {HEAD} -> {C_CLIENT_V1} over tcp"]["steps"][1]
    assert connect["observed"] == "ok" and "v1" in connect["expected"]
    # fleet trust: certificates between this tree's nodes; this tree's producer refusing (and,
    # with `either`, serving) the release's and the C client's consumers, which send no
    # certificate; this tree's consumer refusing the release's producer (no Welcome.cert)
    trust = t["trust"]["pairs"]
    assert trust[HEAD][HEAD]["passed"] >= 5 and trust[HEAD][C_CLIENT]["passed"] == 2
    assert trust[HEAD][C_CLIENT_V1]["passed"] == 2
    assert trust[HEAD][release]["passed"] == 2 and trust[release][HEAD]["passed"] == 2
    assert release not in trust[release]  # neither side has fleet trust: nothing to check
    md = (tmp_path / "report.md").read_text()
    assert "## Implementation × implementation" in md and "**DEVIATION**" not in md
