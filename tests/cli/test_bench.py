"""Where ``ectransport bench`` finds its harness, and what it says when it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from ectransport.cli.bench import _benchmarks_dir
from ectransport.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _harness(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "harness.py").write_text("")
    (d / "server.py").write_text("")
    return d


def test_the_variable_wins_and_a_bad_one_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("ECTRANSPORT_BENCHMARKS_DIR", str(_harness(tmp_path / "b")))
    assert _benchmarks_dir() == tmp_path / "b"
    monkeypatch.setenv("ECTRANSPORT_BENCHMARKS_DIR", str(tmp_path / "nothing"))
    with pytest.raises(ConfigError) as e:
        _benchmarks_dir()
    assert "ECTRANSPORT_BENCHMARKS_DIR=" in str(e.value) and "holds no benchmark harness" in \
        str(e.value) and "installed package" not in str(e.value)


@pytest.mark.skipif(not (REPO / "benchmarks" / "harness.py").exists(), reason="no checkout")
def test_a_checkout_finds_its_own_harness(tmp_path, monkeypatch):
    monkeypatch.delenv("ECTRANSPORT_BENCHMARKS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert _benchmarks_dir() == REPO / "benchmarks"
