"""The shm plane passes ectransport's plane conformance kit (ectransport.testing.conformance)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from ectransport.testing.conformance import PlaneConformance

from ectransport_shm import ShmGrant, ShmPlane


class TestShmConformance(PlaneConformance):
    @pytest.fixture
    def plane_class(self):
        return ShmPlane

    @pytest.fixture
    def plane_options(self):
        return {"io_timeout_s": 5.0}

    def granted_ranges(self, plane, plane_grant):
        """What the producer will copy for this grant: its registered views, as region offsets."""
        token = msgspec.msgpack.decode(plane_grant, type=ShmGrant).token
        origin = np.frombuffer(plane._mem, np.uint8).ctypes.data  # noqa: SLF001 - white box
        served = plane._grants.lookup(token)  # noqa: SLF001
        return [(np.frombuffer(v, np.uint8).ctypes.data - origin, v.nbytes)
                for v in served.views]


class TestShmConformanceSmallRing(TestShmConformance):
    """A 4-slot ring of 64 KiB, so every transfer above 256 KiB waits on acks (flow control)."""

    @pytest.fixture
    def plane_options(self):
        return {"io_timeout_s": 5.0, "segment_bytes": 256 << 10, "chunk_bytes": 64 << 10}

    def test_ring_smaller_than_transfer(self, pair):
        from ectransport.store import Run

        pair.round_trip([Run(0, 40)], [Run(100, 40)], 40 * self.block_bytes - 7, seed=3)
