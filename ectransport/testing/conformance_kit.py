"""The base of :class:`~ectransport.testing.conformance.PlaneConformance`: its knobs, hooks and
fixtures (which plane classes play producer and consumer, how planes are built and bound). The
checks themselves are in :mod:`~ectransport.testing.conformance` and the modules it combines.

Roles: the producer is a serving half, the consumer a fetching half. A plane with both halves
plays both; a plane with one half is tested with a *counterpart* class that has the other
(``counterpart_class`` fixture), e.g. a serving-only export with the reader that fetches from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from ectransport.data.registry import accept, describe_halves
from ectransport.plugin import (
    SERVE,
    FetchingPlane,
    PlaneBase,
    PlaneUnavailable,
    ServingPlane,
    plane_halves,
)
from ectransport.store import HostRegion
from ectransport.testing.helpers import (
    CONSUMER_IDENTITY,
    PRODUCER_IDENTITY,
    SENTINEL,
    KiB,
    Pair,
)

Roles = tuple[type[ServingPlane], type[FetchingPlane]]


class Kit:
    """Knobs, hooks and fixtures of the conformance suite (not collected: no ``Test`` prefix)."""

    #: block size of both regions, bytes (64 KiB: 4 KiB is one partial block, 64 MiB 1024 blocks)
    block_bytes: ClassVar[int] = 64 * KiB
    #: blocks per region (1100 × 64 KiB ≈ 69 MiB: one 64 MiB transfer plus room around it)
    num_blocks: ClassVar[int] = 1100
    #: bound of every wait, seconds
    deadline_s: ClassVar[float] = 10.0
    #: whether no byte may land in the consumer's blocks once ``release`` returned; a plane that
    #: cannot cancel a DMA (the node then quarantines the blocks) sets it False and says why
    release_stops_landing: ClassVar[bool] = True
    #: whether a transfer of a grant the producer revoked ends ERR (or is refused); a READ plane
    #: whose ``revoke`` only drops the grant's registration, which some transports (e.g. UCX over
    #: cma/shm on one host) do not enforce, sets it False and says why
    revoke_refuses: ClassVar[bool] = True
    #: the host the consumer "dialed for the control plane" (``bind_peer``'s ``host``); planes
    #: whose producer advertises another address of this machine set it to that address
    control_host: ClassVar[str] = "127.0.0.1"
    #: whether a plane outside ectransport must import nothing of ectransport but
    #: ``ectransport.plugin`` (the only module whose names are stable under a plugin API version)
    public_api_only: ClassVar[bool] = True

    # -- hooks -------------------------------------------------------------------------------------
    @pytest.fixture
    def plane_class(self) -> type[PlaneBase]:
        """The plane class under test (one half or both): override it."""
        pytest.fail("override the plane_class fixture in your PlaneConformance subclass")

    @pytest.fixture
    def counterpart_class(self) -> type[PlaneBase] | None:
        """For a plane with one half: the class of the other half it works with (same name and
        transfer model). None (the default) for a plane with both halves."""
        return None

    @pytest.fixture
    def plane_options(self) -> dict[str, Any]:
        """Constructor options of every plane the suite builds (both roles)."""
        return {}

    def granted_ranges(self, plane: ServingPlane,
                       plane_grant: bytes) -> list[tuple[int, int]] | None:
        """Optional: the ``(offset, length)`` byte ranges of the producer's region that
        ``plane_grant`` exposes (offsets from the region start), in payload order; None (the
        default) skips the check."""
        return None

    # -- fixtures ----------------------------------------------------------------------------------
    @staticmethod
    def _usable(cls: object, what: str) -> type[PlaneBase]:
        """``cls`` as the registry loads it (API-3 planes as they are, API-2 ones through the
        adapter), skipping the test where it cannot run or move DRAM."""
        try:
            plane = accept(cls, what)
        except PlaneUnavailable as exc:
            pytest.fail(str(exc))
        ok, why = plane.probe()
        if not ok:
            pytest.skip(f"plane {plane.__name__} cannot run here: {why}")
        if "DRAM" not in plane.capabilities.mem_kinds:
            pytest.skip(f"plane {plane.__name__} does not move DRAM")
        return plane

    @pytest.fixture
    def checked_class(self, plane_class: type[PlaneBase]) -> type[PlaneBase]:
        """The class under test, loaded as the registry would (or the test skipped)."""
        return self._usable(plane_class, f"plane class {plane_class.__name__}")

    @pytest.fixture
    def roles(self, checked_class: type[PlaneBase],
              counterpart_class: type[PlaneBase] | None) -> Roles:
        """``(serving class, fetching class)``: the class under test in every role it has, its
        counterpart in the other (:func:`plane_roles`)."""
        other = None if counterpart_class is None else self._usable(
            counterpart_class, f"counterpart {counterpart_class.__name__}")
        return plane_roles(checked_class, other)

    @pytest.fixture
    def make_plane(self, roles: Roles, plane_options: dict[str, Any]
                   ) -> Iterator[Callable[..., Any]]:
        """``make(node_id, region, identity="", role=SERVE)``: a plane of the serving role
        (``role=FETCH``: the fetching role) with ``plane_options``, closed at teardown."""
        made: list[PlaneBase] = []

        def make(node_id: str, region: HostRegion, identity: str = "", role: str = SERVE) -> Any:
            cls = roles[0] if role == SERVE else roles[1]
            plane = cls(node_id=node_id, region=region, identity=identity, **plane_options)
            made.append(plane)
            return plane

        yield make
        for plane in reversed(made):
            plane.close()

    @pytest.fixture
    def regions(self) -> Iterator[tuple[HostRegion, HostRegion]]:
        prod = HostRegion(self.num_blocks, self.block_bytes)
        cons = HostRegion(self.num_blocks, self.block_bytes)
        cons.buf[:] = SENTINEL
        yield prod, cons
        prod.close()
        cons.close()

    @pytest.fixture
    def pair(self, make_plane: Callable[..., Any], regions: tuple[HostRegion, HostRegion]
             ) -> Pair:
        """A producer (serving role) and a consumer (fetching role), the consumer bound to the
        producer as after ``Welcome``."""
        prod_region, cons_region = regions
        pair = Pair(make_plane("conf-producer", prod_region, PRODUCER_IDENTITY),
                    make_plane("conf-consumer", cons_region, CONSUMER_IDENTITY, "fetch"),
                    prod_region, cons_region, self.deadline_s)
        pair.binding = self.bind(pair.consumer, pair.producer, PRODUCER_IDENTITY)
        return pair

    def bind(self, consumer: FetchingPlane, producer: ServingPlane, identity: str,
             peer: str | None = None) -> Any:
        """``consumer.bind_peer`` of ``producer``'s declaration, as the consumer node does after
        ``Welcome``: ``host`` is :attr:`control_host`, ``peer`` one control connection."""
        peer = peer or f"{self.control_host}:5555"
        return consumer.bind_peer(producer.endpoint(), peer=peer, host=self.control_host,
                                  identity=identity)

    @staticmethod
    def _revocable(plane: ServingPlane) -> bool:
        """Whether the plane overrides :meth:`ServingPlane.revoke` (a no-op by default)."""
        return type(plane).revoke is not ServingPlane.revoke


def plane_roles(plane: type[PlaneBase], counterpart: type[PlaneBase] | None) -> Roles:
    """``(serving class, fetching class)`` of a plane under test and its counterpart: a plane with
    both halves plays both (and takes no counterpart); a plane with one half needs a counterpart
    with the other.

    Raises:
        pytest.fail.Exception: a missing, superfluous or wrong counterpart.
    """
    halves = plane_halves(plane)
    if len(halves) == 2:
        if counterpart is not None:
            pytest.fail(f"{plane.__name__} has both halves: it is its own counterpart (leave "
                        f"counterpart_class None)")
        assert issubclass(plane, ServingPlane) and issubclass(plane, FetchingPlane)
        return plane, plane
    if counterpart is None:
        pytest.fail(f"{plane.__name__} has the {describe_halves(plane)} only: override "
                    f"counterpart_class with the class of the other half")
    serving, fetching = (plane, counterpart) if SERVE in halves else (counterpart, plane)
    if not (issubclass(serving, ServingPlane) and issubclass(fetching, FetchingPlane)):
        pytest.fail(f"counterpart {counterpart.__name__} has the {describe_halves(counterpart)}, "
                    f"not the other half of {plane.__name__}")
    return serving, fetching
