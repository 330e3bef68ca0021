"""The harness's no-pin-leak check: a producer must report ``stats.pinned_bytes`` (ADAPTER.md
§3.2), and a cell whose producer does not, or reports bytes still pinned, fails although every
step met its expectation (real adapter processes on loopback addresses)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from interop import cases, impls
from interop.harness import Harness, _pinned

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _transfer_from(tmp_path: Path, stats: str | None):
    """The tcp transfer cell of producer ``x`` (this tree's adapter, its stats altered as
    ``stats`` says; None: unaltered) → this tree's consumer, run by a harness."""
    head = impls.head()
    cmd = (
        f"{sys.executable} {HERE / '_pins_adapter.py'} --stats {stats}"
        if stats
        else f"{sys.executable} -m interop.node"
    )
    x = impls.external(f"x={cmd}")
    assert head.probe(), head.unavailable
    assert x.probe(), x.unavailable
    cell = cases.pair_cells(x, head, full=False, groups=("transfer",))[0]
    assert cell.name == f"transfer: x -> {impls.HEAD} over tcp"
    h = Harness(
        sorted(set(cell.hosts())),
        mode="loopback",
        out_dir=tmp_path,
        impls={impls.HEAD: head, "x": x},
        with_vllm=False,
    )
    try:
        return h.run_cell(cell)
    finally:
        h.close()


def test_a_producer_reporting_no_pinned_bytes_fails_its_cell(tmp_path):
    res = _transfer_from(tmp_path, "none")
    assert all(s.deviation is None for s in res.steps), res.deviations  # the bytes all landed
    assert not res.passed
    assert any("reported no pinned_bytes" in d for d in res.deviations), res.deviations


def test_a_producer_reporting_pinned_bytes_left_fails_its_cell(tmp_path):
    res = _transfer_from(tmp_path, "leak")
    assert all(s.deviation is None for s in res.steps), res.deviations
    assert res.deviations == ["DEVIATION pins leaked: 4096 bytes"]


def test_a_producer_reporting_zero_passes(tmp_path):
    res = _transfer_from(tmp_path, None)
    assert res.passed, res.deviations
    assert "producer stats: grants=" in " ".join(res.notes)


def test_pinned_bytes_must_be_a_non_negative_integer():
    assert _pinned({"outcome": "ok", "stats": {"pinned_bytes": 0}}) == 0
    assert _pinned({"outcome": "ok", "stats": {"pinned_bytes": 8192}}) == 8192
    for bad in (
        {"outcome": "ok", "stats": {}},
        {"outcome": "ok"},
        {"outcome": "ok", "stats": {"pinned_bytes": "0"}},
        {"outcome": "ok", "stats": {"pinned_bytes": True}},
        {"outcome": "ok", "stats": {"pinned_bytes": -1}},
        {"outcome": "error:UnknownNode", "stats": {"pinned_bytes": 0}},
        {"outcome": "ok", "stats": [0]},
    ):
        assert _pinned(bad) is None, bad
