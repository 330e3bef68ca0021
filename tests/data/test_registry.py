"""Plane discovery: validation, broken plugins skipped, collision rule, ECTRANSPORT_PLANES.

Entry points are built with importlib.metadata's own EntryPoint class, pointing at real modules
(this one), so loading goes through the real import machinery.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint

import pytest

from ectransport.data import registry
from ectransport.data.base import DataTransport
from ectransport.data.nixl import NixlPlane
from ectransport.data.tcp import TcpPlane
from ectransport.errors import PlaneUnavailable


class OldApiPlane(TcpPlane):
    plugin_api_version = 0


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
    with pytest.raises(PlaneUnavailable, match="not a DataTransport"):
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
