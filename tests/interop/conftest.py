"""Fixtures of the interop tests: the independent C client, built once per session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from interop import venvs


@pytest.fixture(scope="session")
def c_client(tmp_path_factory) -> Path:
    """The ``ectp-client`` binary, compiled from interop/clients/c into a temporary directory.
    Skipped only where no C toolchain or none of its libraries exist (``.ci/run`` installs
    them: libzmq3-dev, libmsgpack-dev, libjansson-dev)."""
    if not shutil.which("make") or not shutil.which("cc"):
        pytest.skip("no C toolchain (make, cc)")
    try:
        return venvs.c_client(tmp_path_factory.mktemp("c-client"))
    except venvs.BuildError as e:
        if "missing:" in str(e):
            pytest.skip(f"the C client's libraries are not installed: {e}")
        raise
