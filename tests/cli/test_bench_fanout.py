"""The benchmark's N-consumer-process phase (``benchmarks/fanout.py``, issue 16 item 7): how a
result becomes target rows, notes and the docs section (``fanout_report.py``) (made-up numbers, no measurement), and one
real run with two consumer processes per group that checks only that every fetch landed
byte-exact (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (REPO / "benchmarks" / "fanout.py").exists(),
                                reason="no checkout")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import fanout
    import fanout_report
    import report

    return report, fanout, fanout_report


def _block(group: str, b: int, gbps: float, p50: float, p99: float) -> dict:
    step = {"p50": 1.0, "max": 2.0}
    return {"group": group, "block": b, "n": 32, "aggregate_gbps": gbps, "fetches": 100,
            "fetches_in_window": 99, "misses": 0, "bytes_ok": True,
            "latency": {"p50": p50, "p90": p99, "p99": p99, "min": p50 / 2, "max": p99 * 2,
                        "n": 100},
            "per_process_gbps": [gbps / 40, gbps / 30],
            "warmup": {"all_warm_s": 20.0, "spawn_s": 0.5, "main_s": step, "preimport_s": step,
                       "plane_s": step, "connect_s": step, "first_s": step,
                       "cpu_s": {"p50": 0.7, "sum": 22.4}, "first_fetch_s": step},
            "loadavg": 3.0}


def _result(fanout, blocks: list[dict]) -> dict:
    cfg = fanout.FanoutConfig.full()
    f = {"config": cfg.__dict__, "size": "8.8MiB", "nbytes": 9225216, "blocks": blocks,
         "errors": {}}
    f["summary"] = fanout.summarize(blocks)
    return {"fanout": f, "latency": {}}


def test_met_targets_use_the_raw_group_as_the_floor(bench):
    report, fanout, fr = bench
    res = _result(fanout, [_block("ect-nixl", 0, 2.4, 0.030, 0.060),
                           _block("raw-nixl", 1, 2.6, 0.028, 0.120),
                           _block("raw-nixl", 2, 2.8, 0.028, 0.100),
                           _block("ect-nixl", 3, 2.6, 0.032, 0.080)])
    s = res["fanout"]["summary"]
    assert s["ect-nixl"]["aggregate_gbps"] == pytest.approx(2.5)
    assert s["raw-nixl"]["aggregate_gbps"] == pytest.approx(2.7)
    agg, tail = fr.targets(res)
    assert agg["met"] and agg["measured"].startswith("93 %") and "2.70 GB/s" in agg["floor"]
    assert tail["met"] and tail["measured"].startswith("2.3×")  # 0.070 / 0.031
    assert agg in report.targets(res) and tail in report.targets(res)
    md = "\n".join(fr.markdown_section(res))
    assert "32 processes" in md and "| 3 | ect-nixl | 2.60 |" in md


def test_a_missed_tail_that_the_raw_floor_also_misses_is_explained(bench):
    _, fanout, fr = bench
    res = _result(fanout, [_block("ect-nixl", 0, 1.0, 0.030, 0.150),
                           _block("raw-nixl", 1, 2.0, 0.020, 0.100)])
    agg, tail = fr.targets(res)
    assert not agg["met"] and not tail["met"]
    notes = "\n".join(fr.notes(res))
    assert "Aggregate missed (50 %)" in notes
    assert "the raw floor itself is 5.0×" in notes


def test_a_failed_run_is_a_missed_target_with_its_reason(bench):
    _, fanout, fr = bench
    res = {"fanout": {"config": fanout.FanoutConfig.full().__dict__, "size": "8.8MiB",
                      "nbytes": 1, "blocks": [], "summary": {},
                      "errors": {"ect-nixl-0": "RuntimeError: 3 process(es) sent no 'warm'"}}}
    (t,) = fr.targets(res)
    assert not t["met"] and "sent no 'warm'" in t["measured"]
    assert "Blocks that could not run" in "\n".join(fr.markdown_section(res))


@pytest.mark.slow
def test_two_consumer_processes_per_group_land_every_byte(bench):
    pytest.importorskip("nixl")
    _, fanout, fr = bench
    cfg = fanout.FanoutConfig(n=2, size="1MiB", duration_s=0.5,
                              blocks=["ect-nixl", "raw-nixl"], ready_timeout_s=240.0)
    f = fanout.run(cfg)
    assert f["errors"] == {}
    assert [b["group"] for b in f["blocks"]] == ["ect-nixl", "raw-nixl"]
    for b in f["blocks"]:
        assert b["bytes_ok"] and b["misses"] == 0 and b["fetches"] > 0
