"""``python -m interop check-adapter``: this tree's adapter, the C client's and a release's shim
conform; a broken adapter is caught, each defect by name (real processes, loopback)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from interop import venvs
from interop.check_adapter import check

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(300)


def _run(argv: list[str]) -> tuple[int, dict[str, str]]:
    rep = check(argv, out=lambda _: None)
    return rep.failed, {name: status for status, name, _ in rep.lines}


def test_this_trees_adapter_conforms():
    failed, lines = _run([sys.executable, "-m", "interop.node"])
    assert failed == 0, lines
    # both roles were exercised, not skipped
    for name in ("start a producer", "this tree's consumer fetches chk-1MiB byte-exact",
                 "start a consumer", "fetch chk-1MiB byte-exact", "fetch_many byte-exact, "
                 "items in order", "a never-ready entry misses by its timeout_s",
                 "announce answers a ticket", "the process exits 0 after exit"):
        assert lines.get(name) == "ok", (name, lines.get(name))


def test_a_broken_adapter_is_caught():
    failed, lines = _run([sys.executable, str(HERE / "_broken_adapter.py")])
    assert failed >= 6
    for name in ("a line that is not JSON: error:BadRequest, seq null",
                 "unknown op: error:UnknownOp", "an id no start created: error:UnknownNode",
                 "fetch chk-one-row byte-exact", "fetch of an unknown key: miss:MISSING",
                 "a never-ready entry misses by its timeout_s",
                 "fetch with mm_hash not a string: error:BadRequest"):
        assert lines.get(name) == "FAIL", (name, lines.get(name))
    assert lines.get("producer role") == "skip"


def test_an_adapter_that_does_not_start_fails_hello():
    failed, lines = _run([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert failed == 1 and lines == {"hello answers ok": "FAIL"}


def test_the_c_clients_adapter_conforms(c_client):
    failed, lines = _run([str(c_client), "adapter"])
    assert failed == 0, lines
    assert lines["producer role"] == "skip" and lines["fetch_many byte-exact, items in order"] == "ok"


@pytest.mark.slow
def test_a_releases_shim_conforms():
    from interop import impls

    try:
        venvs.resolve_revision(impls.LAST_V1)
    except venvs.BuildError:
        pytest.skip(f"revision {impls.LAST_V1} is not in this clone (a shallow checkout?)")
    impl = impls.release(impls.LAST_V1, venvs.cache_dir())
    assert impl.prepare(), impl.unavailable
    failed, lines = _run(impl.argv)
    assert failed == 0, lines
    assert lines["fetch chk-1MiB byte-exact"] == "ok"
