"""The plugin API, ``ectransport.plugin``: the one module plugins import (issue 15)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import ectransport.plugin as api
from ectransport.data.registry import check_plane, declared_api_version
from ectransport.data.socketplane import SocketServingPlane
from ectransport.data.tcp import TcpPlane
from ectransport.testing.conformance import ectransport_imports, package_files


def test_every_exported_name_exists_and_is_in_the_reference():
    """The module docstring is the API reference: it names every exported name."""
    assert len(set(api.__all__)) == len(api.__all__)
    for name in api.__all__:
        assert hasattr(api, name), name
        assert f"``{name}``" in (api.__doc__ or ""), f"{name} is missing from the reference"


def test_the_version_is_the_registrys():
    assert api.PLUGIN_API_VERSION == 3 and api.SUPPORTED_API_VERSIONS == (2, 3)
    assert declared_api_version(TcpPlane) == api.PLUGIN_API_VERSION
    assert check_plane(TcpPlane, "tcp") == 3  # what the registry and the conformance kit require


def test_the_contract_has_two_halves_and_data_transport_is_both():
    serving = {"describe", "revoke", "poll_notifications", "endpoint", "reachable"}
    fetching = {"start", "check", "error_detail", "release", "locality", "bind_peer",
                "unbind_peer", "forget_peer"}
    shared = {"probe", "describe_transport", "close", "__init__"}
    for name in shared:
        assert name in vars(api.PlaneBase)
    assert serving <= set(vars(api.ServingPlane)) and not fetching & set(dir(api.ServingPlane))
    assert fetching <= set(vars(api.FetchingPlane)) and not serving & set(dir(api.FetchingPlane))
    assert api.DataTransport.__mro__[1:3] == (api.ServingPlane, api.FetchingPlane)
    assert not vars(api.DataTransport).keys() & (serving | fetching | shared)  # adds nothing
    assert api.plane_halves(api.DataTransport) == (api.SERVE, api.FETCH)
    assert api.plane_halves(api.ServingPlane) == ("serve",)
    assert api.plane_halves(api.FetchingPlane) == ("fetch",)
    assert api.plane_halves(api.PlaneBase) == () and api.plane_halves(object()) == ()


def test_the_built_in_socket_planes_share_the_base():
    assert issubclass(TcpPlane, api.SocketServingPlane) and api.SocketServingPlane is \
        SocketServingPlane
    if importlib.util.find_spec("ectransport_shm") is None:
        pytest.skip("the shm plugin is not installed")
    from ectransport_shm import ShmPlane

    assert issubclass(ShmPlane, api.SocketServingPlane)
    for f in package_files("ectransport_shm"):
        assert ectransport_imports(f.read_text()) == [], f


def test_importing_ectransport_does_not_import_the_plugin_api():
    code = "import sys, ectransport; print('ectransport.plugin' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
