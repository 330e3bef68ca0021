"""The wheel: it builds from the sources, holds what the runtime reads, installs into a fresh
virtualenv and its ``ectransport`` command works from there (not from the source checkout).

Quick and offline: the wheel is built without build isolation (setuptools of this interpreter) from
a copy of the sources (so a stale ``build/`` folder of the checkout cannot leak deleted modules
into it), and the venv sees this interpreter's site directories for the dependencies — a ``.pth``
written by ``scripts/link-parent-env.py``, so that it works from a system Python and from inside
a virtualenv alike (``--system-site-packages`` would show a virtualenv's *base* interpreter's
packages only) — the wheel itself installed with ``--no-deps --no-index``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "ectransport", src / "ectransport",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = src / "dist"
    r = _run(sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-index",
             "--no-build-isolation", "-q", "-w", dist, cwd=src, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = dist.glob("ectransport-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A clean environment (no PYTHONPATH): with the checkout on the path, pip would see its
    # egg-info as "ectransport already installed" and install nothing; --force-reinstall too.
    root = tmp_path_factory.mktemp("venv")
    r = _run(sys.executable, "-m", "venv", root / "v", cwd=root, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(sys.executable, REPO / "scripts" / "link-parent-env.py", root / "v", cwd=root,
             env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bin_dir = root / "v" / "bin"
    r = _run(bin_dir / "python", "-m", "pip", "install", "--force-reinstall", "--no-deps",
             "--no-index", "-q", wheel, cwd=root, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return bin_dir


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ECTRANSPORT_BENCHMARKS_DIR", "ECTRANSPORT_CONFIG")}
    env["COLUMNS"] = "200"
    return env


def test_wheel_holds_the_package_data_the_runtime_reads(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "ectransport/py.typed" in names  # PEP 561: the package is typed (mypy strict layers)
    assert "ectransport/demo/images/LICENSES.md" in names
    assert sum(n.startswith("ectransport/demo/images/") for n in names) >= 7  # six photos + licenses
    for module in ("ectransport/cli/main.py", "ectransport/plugin.py",
                   "ectransport/testing/conformance.py", "ectransport/data/tcp.py"):
        assert module in names, module
    meta = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "ectransport = ectransport.cli.main:main" in meta
    for plane in ("nixl", "ucx", "tcp"):
        assert f"{plane} = ectransport.data." in meta, plane
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_installed_command_runs_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    env = _env()
    where = _run(venv / "python", "-c", "import ectransport; print(ectransport.__file__)",
                 cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv.parent), where.stdout  # not the checkout

    version = _run(venv / "ectransport", "--version", cwd=tmp_path, env=env)
    assert version.returncode == 0, version.stderr
    assert "ectransport" in version.stdout and "0." in version.stdout

    demo = _run(venv / "ectransport", "demo", "--help", cwd=tmp_path, env=env)
    assert demo.returncode == 0, demo.stderr
    assert "--plane" in demo.stdout

    bench = _run(venv / "ectransport", "bench", "--help", cwd=tmp_path, env=env)
    assert bench.returncode == 0, bench.stderr
    assert "--quick" in bench.stdout and "source checkout" in bench.stdout


def test_installed_bench_says_how_to_get_the_harness(venv: Path, tmp_path: Path) -> None:
    """The harness is not in the wheel: outside a checkout the command fails with exit code 2
    and one line that says where the benchmarks are and how to point at them."""
    r = _run(venv / "ectransport", "bench", "--quick", cwd=tmp_path, env=_env())
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "git clone" in r.stderr and "ECTRANSPORT_BENCHMARKS_DIR" in r.stderr
