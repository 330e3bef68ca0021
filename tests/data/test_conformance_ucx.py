"""The UCX plane (ucxx) passes the plane conformance suite (ectransport.testing.conformance)."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("ucxx")

from ectransport.data.ucx import UcxGrant, UcxPlane  # noqa: E402
from ectransport.testing.conformance import PlaneConformance  # noqa: E402


class TestUcxConformance(PlaneConformance):
    @pytest.fixture
    def plane_class(self):
        return UcxPlane

    @pytest.fixture
    def plane_options(self):
        return {"transfer_timeout_s": 5.0}

    def granted_ranges(self, plane, plane_grant):
        """What the producer will serve for this grant: its registered pieces (region offsets)."""
        token = msgspec.msgpack.decode(plane_grant, type=UcxGrant).token
        return list(plane._grants[token])  # noqa: SLF001 - the suite's white-box hook
