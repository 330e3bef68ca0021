"""Every built-in data plane passes the plane conformance suite (ectransport.testing.conformance).

The TCP plane is instantiated directly (its class), so the suite runs whether or not its entry
point is registered in the installed metadata.
"""

from __future__ import annotations

import importlib.util

import msgspec
import pytest

from ectransport.data.tcp import TcpGrant, TcpPlane
from ectransport.testing.conformance import PlaneConformance


class TestTcpConformance(PlaneConformance):
    @pytest.fixture
    def plane_class(self):
        return TcpPlane

    @pytest.fixture
    def plane_options(self):
        return {"io_timeout_s": 5.0}

    def granted_ranges(self, plane, plane_grant):
        """What the producer will serve for this grant: its registered views, as region offsets."""
        token = msgspec.msgpack.decode(plane_grant, type=TcpGrant).token
        base = plane._mem  # noqa: SLF001 - the suite's white-box hook
        served = plane._grants.lookup(token)  # noqa: SLF001
        import numpy as np

        origin = np.frombuffer(base, dtype=np.uint8).ctypes.data
        return [(np.frombuffer(v, dtype=np.uint8).ctypes.data - origin, len(v))
                for v in served.views]


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
class TestNixlConformance(PlaneConformance):
    # NixlPlane.release of a READ NIXL cannot cancel yet keeps the handle (it never frees memory
    # under a landing DMA) but cannot stop bytes landing: the consumer node quarantines those
    # blocks instead (DESIGN.md, step 4).
    release_stops_landing = False
    # NixlPlane.revoke drops the grant's registration: over RDMA that invalidates the key the
    # consumer holds, but the loopback transports these tests run on (UCX cma/shm) read without
    # it, so a READ of a revoked grant can still succeed here.
    revoke_refuses = False

    @pytest.fixture
    def plane_class(self):
        from ectransport.data.nixl import NixlPlane

        return NixlPlane

    def granted_ranges(self, plane, plane_grant):
        from ectransport.data.nixl import NixlGrant

        grant = msgspec.msgpack.decode(plane_grant, type=NixlGrant)
        return [(addr - plane._base, length) for addr, length in grant.descs]  # noqa: SLF001
