"""``python -m interop`` end to end as a third party uses it: an implementation plugged in with
``--impl NAME=CMD`` (this tree's adapter behind a wrapper script) appears in the tables as
producer and consumer as its ``hello`` declares; an ``--impl`` that cannot run fails the run
(unless ``--allow-unavailable`` names it); ``--list`` builds and starts nothing (real processes,
loopback addresses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from interop.__main__ import _parser
from interop.impls import HEAD

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WRAPPED = f"{sys.executable} {HERE / '_wrapped_adapter.py'}"
QUIET = ["--loopback", "--no-releases", "--no-c-client", "--no-vllm"]


def _interop(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "interop", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_impl_joins_the_tables_as_producer_and_consumer(tmp_path):
    r = _interop(
        "--impl",
        f"ext-both={WRAPPED}",
        "--impl",
        f"ext-cons={WRAPPED} --consumer-only",
        "--cross-only",
        "--only",
        "ext-",
        "--out",
        str(tmp_path),
        *QUIET,
        timeout_s=840,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    bad = [(c["name"], c["deviations"]) for c in report["results"] if c["deviations"]]
    assert r.returncode == 0 and not bad, (bad, r.stderr[-3000:])
    impls = {i["name"]: i for i in report["implementations"]}
    assert impls["ext-both"]["roles"] == ["producer", "consumer"]
    assert impls["ext-cons"]["roles"] == ["consumer"]
    assert impls["ext-both"]["impl"]["name"] == "wrapped-ectransport"
    for group in ("handshake", "transfer", "negotiate", "auth", "layout"):
        t = report["tables"][group]
        assert t["producers"] == [HEAD, "ext-both"], group  # ext-cons has no producer row
        assert t["consumers"] == [HEAD, "ext-both", "ext-cons"], group
        pairs = t["pairs"]
        for p, c in (
            (HEAD, "ext-both"),
            ("ext-both", HEAD),
            ("ext-both", "ext-both"),
            (HEAD, "ext-cons"),
            ("ext-both", "ext-cons"),
        ):
            assert pairs[p][c]["passed"] >= 1 and not pairs[p][c]["deviations"], (group, p, c)
    # without fleet trust of their own, they meet this tree's nodes configured with it
    trust = report["tables"]["trust"]["pairs"]
    assert trust[HEAD]["ext-both"]["passed"] == 2 and trust["ext-both"][HEAD]["passed"] == 2
    md = (tmp_path / "report.md").read_text()
    assert "| `ext-both` | --impl " in md and "| `ext-cons` | --impl " in md
    assert "### transfer" in md and "**DEVIATION**" not in md


@pytest.mark.timeout(300)
def test_an_impl_that_cannot_run_fails_the_run(tmp_path):
    r = _interop(
        "--impl", "bad=false", "--cross-only", "--only", "bad", "--out", str(tmp_path), *QUIET
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "implementation bad is unavailable" in r.stderr
    assert "--allow-unavailable bad" in r.stderr
    assert not (tmp_path / "report.json").exists()  # no cell ran
    r = _interop("--impl", "gone=/no/such/adapter", "--out", str(tmp_path), *QUIET)
    assert r.returncode == 2 and "implementation gone is unavailable" in r.stderr
    r = _interop(
        "--impl", "bad=false", "--allow-unavailable", "typo", "--out", str(tmp_path), *QUIET
    )
    assert r.returncode == 2 and "--allow-unavailable names no implementation" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_allow_unavailable_runs_without_it_and_says_why(tmp_path):
    r = _interop(
        "--impl",
        "bad=false",
        "--allow-unavailable",
        "bad",
        "--cross-only",
        "--only",
        f"handshake: {HEAD} -> {HEAD} over tcp",
        "--out",
        str(tmp_path),
        *QUIET,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["cells"] == 1 and report["passed"] == 1
    bad = {i["name"]: i for i in report["implementations"]}["bad"]
    assert bad["unavailable"].startswith("no hello answer")
    assert (
        "| `bad` | --impl false | unavailable: no hello answer"
        in (tmp_path / "report.md").read_text()
    )
    # every cell filtered out: nothing ran, which is no pass
    r = _interop(
        "--impl",
        "bad=false",
        "--allow-unavailable",
        "bad",
        "--cross-only",
        "--only",
        "bad",
        "--out",
        str(tmp_path / "none"),
        *QUIET,
    )
    assert r.returncode == 2 and "no cell selected" in r.stderr


@pytest.mark.timeout(120)
def test_list_builds_and_starts_nothing(tmp_path):
    cache, marker = tmp_path / "cache", tmp_path / "started"
    probe = f"{sys.executable} -c \"open('{marker}', 'w')\""
    r = _interop("--list", "--full", "--cache", str(cache), "--impl", f"probe={probe}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not cache.exists() and not marker.exists()  # no venv, no binary, no adapter
    lines = r.stdout.splitlines()
    for name in (
        "ectransport@d2f36d8",
        "ectransport@27e05cf",
        "ectp-c",
        "ectp-c-v1",
        "probe",
        f"{HEAD}+pyzmq==25.1.0",
        f"{HEAD}+pyzmq==27.3.0",
        f"{HEAD}+msgspec==0.23.0",
    ):
        line = next(x for x in lines if x.startswith(f"impl {name}:"))
        assert "not built or started" in line, line
    assert any(f"transfer: {HEAD} -> {HEAD} over nixl" in x for x in lines)  # this tree's cells


def test_the_lib_option_names_every_default_library():
    lib = next(a for a in _parser()._actions if "--lib" in a.option_strings)
    for pin in (
        "pyzmq==25.1.0",
        "msgspec==0.18.0",
        "nixl==1.0.0,nixl-cu13==1.0.0",
        "pyzmq==27.3.0",
        "msgspec==0.23.0",
        "nixl==1.5.1,nixl-cu13==1.5.1",
    ):
        assert pin in lib.help, pin
    assert "(pyzmq, msgspec, nixl with its nixl-cu13 backend)" in lib.help
