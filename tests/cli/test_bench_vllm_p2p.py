"""The benchmark's vLLM P2P comparison (``benchmarks/vllm_p2p.py``, issue 16): how a result is
turned into speed-ups, the target row and the docs section, and how a missing vLLM is reported.
No measurement here: the numbers below are made up."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (REPO / "benchmarks" / "vllm_p2p.py").exists(),
                                reason="no checkout")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import report
    import vllm_p2p

    return report, vllm_p2p


def _stats(p50: float) -> dict:
    return {"p50": p50, "p90": p50 * 1.1, "p99": p50 * 1.2, "min": p50 * 0.9, "max": p50 * 1.3,
            "n": 5}


def _result(vllm_p2p, lat: dict[str, dict[str, float]]) -> dict:
    v = {"label": vllm_p2p.LABEL, "path": vllm_p2p.PATH, "vllm_version": "0.33.0",
         "latency": {lb: {k: _stats(x) for k, x in by.items()} for lb, by in lat.items()}}
    v["speedup"] = vllm_p2p.summarize(v)
    return {"vllm_p2p": v, "latency": {}}


def test_speedup_is_vllm_over_ectransport_and_the_floor_is_vllm_over_raw(bench):
    report, vp = bench
    res = _result(vp, {"1MiB": {vp.PATH: 3e-3, "ect-nixl": 1e-3, "ect-nixl-v1": 1.5e-3,
                                "raw-nixl": 0.5e-3, vp.PATH_PAUSED: 0.8e-3}})
    sp = res["vllm_p2p"]["speedup"]["1MiB"]
    assert sp[vp.PATH] == pytest.approx({"ect-nixl": 3.0, "ect-nixl-v1": 2.0, "floor": 6.0})
    assert sp[vp.PATH_PAUSED]["ect-nixl"] == pytest.approx(0.8)
    t = report.vllm_target(res)
    assert t["met"] and "3.00×" in t["measured"] and "6.00×" in t["floor"]


def test_the_target_is_missed_when_one_size_is_under_one_and_a_half(bench):
    report, vp = bench
    res = _result(vp, {"64KiB": {vp.PATH: 3e-3, "ect-nixl": 1e-3, "raw-nixl": 1e-4},
                       "8.8MiB": {vp.PATH: 3e-3, "ect-nixl": 2.5e-3, "raw-nixl": 2e-3}})
    t = report.vllm_target(res)
    assert not t["met"]
    assert t["measured"].startswith("worst 1.20× (8.8MiB")
    assert "1.50× at 8.8MiB" in t["floor"]  # vLLM ÷ raw: no design could reach 1.5× there
    assert t in report.targets(res)
    cols, rows = report.vllm_rows(res)
    assert cols[1].startswith(vp.LABEL) and [r[8] for r in rows] == ["yes", "**no**"]
    res["vllm_p2p"]["breakdown_p50"] = {"8.8MiB": {vp.PATH: {"ack": 1e-3, "read": 2e-3}}}
    res["vllm_p2p"]["producer"] = {vp.PATH: {"mem_descriptor_bytes": 1234, "num_blocks": 99}}
    md = "\n".join(report._vllm_section(res))
    assert vp.LABEL in md and "| 8.8MiB |" in md and "**Verdict (this run): missed**" in md
    assert "ack 1.00 ms · read 2.00 ms" in md and "1234 bytes for 99 blocks" in md


def test_a_run_without_vllm_says_why(bench):
    report, vp = bench
    res = {"latency": {}, "vllm_p2p": {"label": vp.LABEL, "skipped": "vllm is not importable"}}
    md = "\n".join(report._vllm_section(res))
    assert "Not measured in this run: vllm is not importable." in md
    t = report.vllm_target(res)
    assert not t["met"] and "not measured" in t["measured"]
    assert report.vllm_rows(res)[1] == []
    assert report.vllm_target({"latency": {}}) is None  # an older results.json: no row


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is importable")
def test_no_vllm_and_no_venv_is_a_reason_not_an_error(bench, tmp_path, monkeypatch):
    _, vp = bench
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "no-venv"))
    reason = vp.find_vllm()
    assert reason and "setup-vllm-venv.sh" in reason and "VLLM_VENV" in reason
