"""The library-version axis: its pins are the oldest and the newest versions pyproject.toml
admits; a lib venv holds exactly its pins, installed into the venv itself (the newest too, though
the main environment may have the same version), and refuses a venv resolving another copy; an
adapter reporting other versions than its venv's pins is unavailable; the report states the
versions loaded. Cheap: one small wheel (msgspec) is installed; the full axis runs with
``python -m interop --full``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from interop import impls, venvs
from interop.impls import HEAD, Impl
from interop.report import write

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, Requirement]:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in meta["dependencies"]]
    reqs += [Requirement(r) for rs in meta["optional-dependencies"].values() for r in rs]
    return {r.name: r for r in reqs}


def _pins(sets) -> dict[str, str]:
    return {n: v for pins in sets for n, _, v in (p.partition("==") for p in pins)}


def test_the_pins_are_the_oldest_and_newest_versions_pyproject_admits():
    declared, oldest, newest = _declared(), _pins(impls.OLDEST_LIBS), _pins(impls.NEWEST_LIBS)
    for name in ("pyzmq", "msgspec", "nixl"):
        spec = declared[name].specifier
        assert spec.contains(oldest[name]) and spec.contains(newest[name]), name
        lower = next(s.version for s in spec if s.operator == ">=")
        assert Version(oldest[name]) == Version(lower), (name, spec)  # the oldest admitted
        assert Version(newest[name]) > Version(oldest[name]), name
    # nixl's backend is pinned with it (the meta package would load the main environment's)
    assert oldest["nixl-cu13"] == oldest["nixl"] and newest["nixl-cu13"] == newest["nixl"]


@pytest.mark.timeout(600)
def test_a_lib_venv_holds_exactly_its_pins_even_the_main_environments_version(tmp_path):
    version = _pins(impls.NEWEST_LIBS)["msgspec"]
    try:
        py = venvs.lib_venv([f"msgspec=={version}"], tmp_path)
    except venvs.BuildError as e:
        if "No matching distribution" in str(e) or "Could not find a version" in str(e):
            pytest.skip(f"msgspec {version} cannot be downloaded here: {e}")
        raise
    code = "import msgspec, zmq; print(msgspec.__version__, msgspec.__file__, zmq.__file__)"
    got, where, other = subprocess.run(
        [str(py), "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert got == version
    assert where.startswith(str(tmp_path))  # the venv's own copy, not the main environment's
    assert not other.startswith(str(tmp_path))  # what was not pinned is the main environment's
    recipe = (py.parents[2] / ".recipe").read_text()
    assert f"msgspec=={version}" in recipe
    with pytest.raises(venvs.BuildError, match="name==version"):
        venvs.lib_venv(["msgspec>=0.18"], tmp_path)


def test_the_pin_check_refuses_a_copy_outside_the_venv(tmp_path):
    import msgspec

    want = {"msgspec": msgspec.__version__}
    r = subprocess.run(
        [sys.executable, "-I", "-c", venvs._CHECK_PINS, str(tmp_path), repr(want)],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "msgspec: " in r.stderr and "not the pinned copies" in r.stderr


@pytest.mark.timeout(120)
def test_an_adapter_loading_other_versions_than_its_pins_is_unavailable():
    impl = Impl(
        f"{HEAD}+msgspec==0.0.1",
        [sys.executable, "-m", "interop.node"],
        axis="lib",
        env={"PYTHONPATH": str(REPO)},
        pinned_libs={"msgspec": "0.0.1"},
    )
    assert not impl.probe()
    assert "loads {'msgspec': " in impl.unavailable and "0.0.1" in impl.unavailable


def test_the_report_states_the_versions_a_lib_venv_loaded(tmp_path):
    lib = impls.lib(("msgspec==0.23.0",), tmp_path)
    lib.caps = {
        "roles": ["producer", "consumer"],
        "versions": [1, 2],
        "planes": ["tcp"],
        "features": [],
        "libs": {"msgspec": "0.23.0", "pyzmq": "27.3.0"},
    }
    write(
        [],
        tmp_path,
        mode="loopback",
        mode_reason="",
        full=True,
        versions={},
        wall_s=1.0,
        extra=[],
        impls=[lib],
    )
    md = (tmp_path / "report.md").read_text()
    assert f"| `{HEAD}+msgspec==0.23.0` | venv with msgspec==0.23.0; loads msgspec 0.23.0 |" in md
    j = json.loads((tmp_path / "report.json").read_text())
    assert j["implementations"][0]["pinned_libs"] == {"msgspec": "0.23.0"}


def test_the_full_run_builds_both_ends_of_the_axis():
    from interop.__main__ import _parser, select_impls

    args = _parser().parse_args(["--full", "--no-releases", "--no-c-client", "--no-vllm"])
    names = [i.name for i in select_impls(args) if i.axis == "lib"]
    assert names == [f"{HEAD}+{','.join(p)}" for p in (*impls.OLDEST_LIBS, *impls.NEWEST_LIBS)]
