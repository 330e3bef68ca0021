"""Project-wide promises: layering, no pickle on any wire, cheap imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ectransport"


def test_layers_only_import_downwards():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is not installed (pip install -e '.[dev]')")
    r = subprocess.run(
        [exe, "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


BANNED = {
    "pickle",
    "cPickle",
    "_pickle",
    "recv_pyobj",
    "send_pyobj",
    "marshal",
    "dill",
    "cloudpickle",
}


def banned_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every banned identifier used as code (strings and comments ignored)."""
    import io
    import tokenize

    toks = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(t.start[0], t.string) for t in toks if t.type == tokenize.NAME and t.string in BANNED]


def test_no_pickle_anywhere_in_the_package():
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {name}"
        for p in PKG.rglob("*.py")
        for n, name in banned_names(p.read_text())
    ]
    assert not hits, (
        "pickle-like calls in the package (the wire must never use pickle):\n" + "\n".join(hits)
    )


def test_pickle_detector_detects():
    assert banned_names("import pickle\nx = sock.recv_pyobj()\n") == [
        (1, "pickle"),
        (2, "recv_pyobj"),
    ]
    assert banned_names("# pickle\ns = 'send_pyobj'\n") == []


def test_import_is_cheap_and_pulls_no_heavy_dependency():
    code = (
        "import sys, ectransport, ectransport.node, ectransport.data.nixl, ectransport.cli.main;"
        "print(sorted(m for m in ('nixl', 'ucxx', 'torch', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_module_of_the_package_is_over_500_lines():
    """Each module reads in one sitting (issue 22's bound): split by concept past 500 lines."""
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"
