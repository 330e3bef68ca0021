"""The shm plane in API-2 form (``api2_plane.ShmPlaneApi2``) keeps working under plugin API 3:
the registry loads it through its API-2 adapter (and says so), and it passes the conformance kit
there, as a plane with both halves."""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint

import msgspec
import numpy as np
import pytest
from api2_plane import ShmPlaneApi2
from ectransport.data import registry
from ectransport.plugin import PLUGIN_API_VERSION, plane_halves
from ectransport.testing.conformance import PlaneConformance

from ectransport_shm import ShmGrant, ShmPlane


def test_the_registry_loads_the_api2_form_through_the_adapter(monkeypatch, caplog):
    ep = EntryPoint("shm", "api2_plane:ShmPlaneApi2", registry.GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep])
    monkeypatch.delenv(registry.ENV_FILTER, raising=False)
    with caplog.at_level(logging.INFO, logger="ectransport.data.registry"):
        assert registry.load_plane("shm") is ShmPlaneApi2
        assert registry.load_serving_plane("shm") is ShmPlaneApi2
        assert registry.load_fetching_plane("shm") is ShmPlaneApi2
    assert "plugin API 2, loaded through the API-2 adapter" in caplog.text
    assert plane_halves(ShmPlaneApi2) == ("serve", "fetch")
    # the plane itself is on API 3
    assert registry.check_plane(ShmPlane, "shm") == PLUGIN_API_VERSION == 3


class TestShmApi2Conformance(PlaneConformance):
    """The whole kit, through the adapter (``test_plugin_api_version`` checks the adapter)."""

    @pytest.fixture
    def plane_class(self):
        return ShmPlaneApi2

    @pytest.fixture
    def plane_options(self):
        return {"io_timeout_s": 5.0}

    def granted_ranges(self, plane, plane_grant):
        inner = plane.inner
        token = msgspec.msgpack.decode(plane_grant, type=ShmGrant).token
        origin = np.frombuffer(inner._mem, np.uint8).ctypes.data  # noqa: SLF001 - white box
        return [(np.frombuffer(v, np.uint8).ctypes.data - origin, v.nbytes)
                for v in inner._grants.lookup(token).views]  # noqa: SLF001
