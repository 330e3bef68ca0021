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
    if mode == "loopback":
        # the topology-dependent cells (shm is negotiated in one namespace, skipped across), on
        # 127.0.0.N addresses with N != 1 for every plane, quickly
        argv += ["--only", "planes", "--no-vllm"]
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
