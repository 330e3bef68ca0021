"""Plane discovery: validation, broken plugins skipped, API 3 halves and the API-2 adapter,
collision rule, ECTRANSPORT_PLANES.

Entry points are built with importlib.metadata's own EntryPoint class, pointing at real modules
(this one), so loading goes through the real import machinery.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint

import pytest

from ectransport.data import registry
from ectransport.data.base import (
    PLUGIN_API_VERSION,
    DataTransport,
    FetchingPlane,
    ServingPlane,
    plane_halves,
)
from ectransport.data.nixl import NixlPlane
from ectransport.data.tcp import TcpPlane
from ectransport.data.ucx import UcxPlane
from ectransport.errors import PlaneUnavailable
from ectransport.testing.memory import MemoryFetchingPlane, MemoryServingPlane


class OldApiPlane(TcpPlane):
    plugin_api_version = 0


class Api1Plane(TcpPlane):
    plugin_api_version = 1


class Api2Plane(TcpPlane):
    """A plane as API 2 declared it: a DataTransport (both halves) saying 2."""

    plugin_api_version = 2


class Api2ServingOnly(MemoryServingPlane):
    """Says API 2, but has one half: API 2 had no halves."""

    plugin_api_version = 2


class SideBySide(MemoryServingPlane, MemoryFetchingPlane):
    """Both halves without DataTransport."""

    plugin_api_version = PLUGIN_API_VERSION


class NotAPlane:
    pass


class UndeclaredPlane(DataTransport):
    """Inherits DataTransport's default version: says nothing about what it was written for."""

    name = "undeclared"


class _Dist:
    def __init__(self, name):
        self.name = name


def _ep(name: str, value: str, dist: str) -> EntryPoint:
    ep = EntryPoint(name=name, value=value, group=registry.GROUP)
    return ep._for(_Dist(dist)) if hasattr(ep, "_for") else ep


@pytest.fixture
def fake_eps(monkeypatch):
    eps: list[EntryPoint] = []
    monkeypatch.setattr(registry, "entry_points", lambda group: [e for e in eps if e.group == group])
    monkeypatch.delenv(registry.ENV_FILTER, raising=False)
    return eps


def test_built_ins_are_registered_through_entry_points():
    found = registry.discover()
    assert {"nixl", "tcp", "ucx"} <= set(found)
    assert all(found[n].dist == "ectransport" for n in ("nixl", "tcp", "ucx"))
    assert registry.load_plane("nixl") is NixlPlane and issubclass(registry.load_plane("tcp"), DataTransport)


def test_built_in_planes_declare_api_3_and_both_halves():
    for cls in (NixlPlane, TcpPlane, UcxPlane):
        assert registry.declared_api_version(cls) == PLUGIN_API_VERSION == 3
        assert registry.check_plane(cls, cls.name) == 3
        assert plane_halves(cls) == ("serve", "fetch") and issubclass(cls, DataTransport)


def test_api_3_planes_load_with_the_halves_they_declare(fake_eps, caplog):
    fake_eps += [_ep("serve-only", "ectransport.testing.memory:MemoryServingPlane", "ext-a"),
                 _ep("fetch-only", "ectransport.testing.memory:MemoryFetchingPlane", "ext-a"),
                 _ep("both", "ectransport.data.tcp:TcpPlane", "ext-b")]
    with caplog.at_level(logging.INFO, logger="ectransport.data.registry"):
        assert registry.load_serving_plane("serve-only") is MemoryServingPlane
        assert registry.load_fetching_plane("fetch-only") is MemoryFetchingPlane
        assert registry.load_serving_plane("both") is TcpPlane
        assert registry.try_load("serve-only") is MemoryServingPlane  # listings take any half
    assert "plane 'serve-only' from ext-a: plugin API 3, serving half" in caplog.text
    assert "plane 'fetch-only' from ext-a: plugin API 3, fetching half" in caplog.text
    assert "plane 'both' from ext-b: plugin API 3, serving and fetching halves" in caplog.text
    with pytest.raises(PlaneUnavailable, match="has the fetching half only; this node needs its "
                                               "serving half"):
        registry.load_serving_plane("fetch-only")
    with pytest.raises(PlaneUnavailable, match="serving half only.*serving and fetching"):
        registry.load_plane("serve-only")  # the default: both halves


def test_api_2_planes_load_through_the_adapter(fake_eps, caplog):
    fake_eps += [_ep("old", f"{__name__}:Api2Plane", "ext-old"),
                 _ep("oldhalf", f"{__name__}:Api2ServingOnly", "ext-old"),
                 _ep("api1", f"{__name__}:Api1Plane", "ext-old")]
    with caplog.at_level(logging.INFO, logger="ectransport.data.registry"):
        cls = registry.load_plane("old")
    assert cls is Api2Plane and registry.check_plane(cls, "old") == 2
    assert issubclass(registry.load_serving_plane("old"), FetchingPlane)  # both halves
    assert "plane 'old' from ext-old: plugin API 2, loaded through the API-2 adapter" in caplog.text
    with pytest.raises(PlaneUnavailable, match="declares plugin API 2 but has the serving half"):
        registry.load_serving_plane("oldhalf")
    with pytest.raises(PlaneUnavailable, match="plugin API 1, ectransport loads 2 and 3"):
        registry.load_plane("api1")


def test_both_halves_must_come_through_data_transport():
    with pytest.raises(PlaneUnavailable, match="derives from DataTransport"):
        registry.check_plane(SideBySide, "side-by-side")
    # the contract's own classes are not planes, and declare nothing
    for base in (ServingPlane, FetchingPlane, DataTransport):
        assert registry.declared_api_version(base) is None


def test_broken_plugins_are_skipped_with_a_clear_reason(fake_eps, caplog):
    fake_eps += [
        _ep("nomodule", "no_such_module_xyz:Plane", "ext-a"),
        _ep("notaplane", f"{__name__}:NotAPlane", "ext-b"),
        _ep("oldapi", f"{__name__}:OldApiPlane", "ext-c"),
        _ep("undeclared", f"{__name__}:UndeclaredPlane", "ext-e"),
        _ep("good", "ectransport.data.tcp:TcpPlane", "ext-d"),
    ]
    with pytest.raises(PlaneUnavailable, match="failed to import"):
        registry.load_plane("nomodule")
    with pytest.raises(PlaneUnavailable, match="not a data plane"):
        registry.load_plane("notaplane")
    with pytest.raises(PlaneUnavailable, match="plugin API 0"):
        registry.load_plane("oldapi")
    with pytest.raises(PlaneUnavailable, match="declares no plugin_api_version"):
        registry.load_plane("undeclared")
    with caplog.at_level(logging.WARNING, logger="ectransport.data.registry"):
        assert registry.try_load("nomodule") is None  # discovery never crashes
    assert "skipping data plane" in caplog.text
    assert registry.load_plane("good") is TcpPlane
    with pytest.raises(PlaneUnavailable, match="unknown data plane 'nosuch'.*good"):
        registry.load_plane("nosuch")


def test_collision_built_in_wins_then_first_distribution_by_name(fake_eps):
    fake_eps += [
        _ep("tcp", f"{__name__}:OldApiPlane", "zzz-ext"),
        _ep("tcp", "ectransport.data.tcp:TcpPlane", "ectransport"),
        _ep("fast", "ectransport.data.tcp:TcpPlane", "b-ext"),
        _ep("fast", f"{__name__}:NotAPlane", "a-ext"),
    ]
    found = registry.discover()
    assert found["tcp"].dist == "ectransport" and found["tcp"].shadowed == ("zzz-ext",)
    assert found["fast"].dist == "a-ext" and found["fast"].shadowed == ("b-ext",)


def test_env_filter_restricts_what_loads(fake_eps, monkeypatch):
    fake_eps += [_ep("tcp", "ectransport.data.tcp:TcpPlane", "ectransport"),
                 _ep("nixl", "ectransport.data.nixl:NixlPlane", "ectransport")]
    monkeypatch.setenv(registry.ENV_FILTER, "nixl")
    assert set(registry.discover()) == {"nixl"}
    with pytest.raises(PlaneUnavailable):
        registry.load_plane("tcp")
