"""The installed distribution registers the plane where ectransport discovers plugins."""

from __future__ import annotations

import importlib.metadata

import pytest
from ectransport.data.registry import discover, load_plane
from ectransport.plugin import PLUGIN_API_VERSION, DataTransport, plane_halves

from ectransport_shm import ShmPlane

try:
    importlib.metadata.distribution("ectransport-shm")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a checkout
    pytest.skip("ectransport-shm is not installed (pip install -e plugins/ectransport-shm)",
                allow_module_level=True)


def test_discovered_from_its_distribution(monkeypatch):
    monkeypatch.delenv("ECTRANSPORT_PLANES", raising=False)
    info = discover()["shm"]
    assert info.dist == "ectransport-shm"
    assert info.entry_point.value == "ectransport_shm:ShmPlane"
    assert load_plane("shm") is ShmPlane
    assert ShmPlane.plugin_api_version == PLUGIN_API_VERSION == 3
    assert issubclass(ShmPlane, DataTransport) and plane_halves(ShmPlane) == ("serve", "fetch")
    assert ShmPlane.probe()[0] is True


def test_planes_filter(monkeypatch):
    monkeypatch.setenv("ECTRANSPORT_PLANES", "tcp")
    assert "shm" not in discover()
    monkeypatch.setenv("ECTRANSPORT_PLANES", "tcp,shm")
    assert set(discover()) <= {"tcp", "shm"} and "shm" in discover()
