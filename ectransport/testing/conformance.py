"""Conformance suite for data planes: what every :class:`~ectransport.data.base.DataTransport`
must do, run against real instances of the plane (two planes over two host regions, one process).

How a plane or plugin author runs it, in their own test file (pytest)::

    import pytest
    from ectransport.testing.conformance import PlaneConformance
    from my_plugin import MyPlane

    class TestMyPlaneConformance(PlaneConformance):
        @pytest.fixture
        def plane_class(self):
            return MyPlane

        @pytest.fixture
        def plane_options(self):          # optional: constructor options of both planes
            return {"some_option": 1}

        def granted_ranges(self, plane, plane_grant):   # optional hook, see below
            ...

``PlaneConformance`` itself is not collected (its name does not start with ``Test``); the
subclass inherits every ``test_*`` method. A plane whose :meth:`probe` fails, or that cannot move
``"DRAM"``, is skipped. Knobs (class attributes): :attr:`PlaneConformance.block_bytes`,
:attr:`~PlaneConformance.num_blocks`, :attr:`~PlaneConformance.deadline_s`,
:attr:`~PlaneConformance.release_stops_landing`, :attr:`~PlaneConformance.revoke_refuses`,
:attr:`~PlaneConformance.control_host`, :attr:`~PlaneConformance.public_api_only`.

Planes are built as the nodes build them (plugin API 2): ``Plane(node_id=..., region=...,
identity=..., **plane_options)``, each node with its own identity; the consumer binds the
producer's :meth:`~DataTransport.endpoint` once (``bind_peer(..., host=control_host, identity=
<producer's>)``) and every transfer is started with that binding as ``prepared``.

What is checked (each test bounded by ``deadline_s`` and cleaning up after itself):

* declarations: name, :class:`Capabilities`, ``probe``, ``describe_transport``;
* the plugin API: the class declares ``plugin_api_version`` itself and it is this ectransport's
  :data:`~ectransport.plugin.PLUGIN_API_VERSION` (what the registry requires to load it), and a
  plane outside ectransport imports nothing of ectransport but the public module
  :mod:`ectransport.plugin` (:func:`private_imports`; knob :attr:`~PlaneConformance.public_api_only`);
* session binding (API 2, issue 17: a compromised producer must not redirect a consumer):
  ``endpoint()`` is bytes of at most ``MAX_ENDPOINT_BYTES`` and ``locality()`` of at most
  ``MAX_LOCALITY_BYTES``; the producer can reach the consumer's locality; ``bind_peer`` accepts the
  producer's own declaration; and, for planes that declare something (a non-empty ``endpoint()``),
  ``bind_peer`` refuses a wrong identity and a malformed or oversized declaration, and ``start``
  refuses a grant of producer B under producer A's binding (``DataPlaneError``), while B's grant
  under B's binding still works;
* round trips of 0 B, 1 B, 4 KiB, 1 MiB and 64 MiB (64 KiB blocks, the last one partial), with
  the bytes outside the consumer's runs untouched and, for planes with notifications, the
  consumer's ``notif`` delivered exactly once to the producer;
* many blocks (256 single-block runs) and scattered runs whose boundaries differ on each side;
* 8 concurrent transfers;
* a deadline that expires while a transfer may still be PROC: the consumer releases it (what the
  node does), the handle ends DONE or ERR (never PROC), no byte lands after ``release`` returns
  (unless ``release_stops_landing`` is False), and for revocable planes the producer revokes it as
  the node would. A fast plane may finish before the deadline; the suite cannot force a transfer to
  stay in flight, so it asserts the clean outcome of either case;
* cancel: releasing several transfers in flight leaves both planes usable;
* peer death: the producer plane is closed while the consumer transfers 64 MiB; the consumer's
  handle leaves PROC within ``deadline_s`` and the consumer works with a new producer;
* ``describe`` exposes only the granted runs (optional hook :meth:`granted_ranges`) and rejects
  runs outside the region; ``start`` rejects malformed and mismatched grants with DataPlaneError;
* revoke (planes that override :meth:`DataTransport.revoke`): a later transfer of a revoked grant
  ends in ERR or DataPlaneError; revoking garbage is a no-op;
* teardown: ``close`` is idempotent, later calls fail cleanly, and no Python thread is left.

Transfers are driven as the nodes drive them: ``describe`` on the producer, then
``start``/``check``/``release`` on the consumer, ``poll_notifications`` and ``revoke`` on the
producer.

Helpers usable on their own live in :mod:`ectransport.testing.helpers` (patterns, waits,
:class:`~ectransport.testing.helpers.Pair`) and :mod:`ectransport.testing.imports` (the import
check); this module re-exports them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

from ectransport.data.registry import check_plane
from ectransport.plugin import (
    MAX_ENDPOINT_BYTES,
    MAX_LOCALITY_BYTES,
    PLUGIN_API_VERSION,
    Capabilities,
    DataPlaneError,
    DataTransport,
    PlaneUnavailable,
    Run,
    TransferModel,
    XferState,
)
from ectransport.store import HostRegion
from ectransport.testing.helpers import (
    CONSUMER_IDENTITY,
    OTHER_PRODUCER_IDENTITY,
    PRODUCER_IDENTITY,
    SENTINEL,
    KiB,
    MiB,
    Pair,
    Transfer,
    assert_same,
    blocks_for,
    gaps,
    notif_arrives,
    pattern,
    read_runs,
    untouched_outside,
    wait_notifs,
    wait_state,
)
from ectransport.testing.imports import (
    PUBLIC_MODULE,
    ectransport_imports,
    package_files,
    private_imports,
)

__all__ = [
    "CONSUMER_IDENTITY", "OTHER_PRODUCER_IDENTITY", "PRODUCER_IDENTITY", "PUBLIC_MODULE",
    "SENTINEL", "KiB", "MiB", "Pair", "PlaneConformance", "Transfer", "assert_same",
    "blocks_for", "ectransport_imports", "gaps", "notif_arrives", "package_files", "pattern",
    "private_imports", "read_runs", "untouched_outside", "wait_notifs", "wait_state",
]


class PlaneConformance:
    """Subclass in a ``Test*`` class and override the ``plane_class`` fixture (see module doc)."""

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
    def plane_class(self) -> type[DataTransport]:
        pytest.fail("override the plane_class fixture in your PlaneConformance subclass")

    @pytest.fixture
    def plane_options(self) -> dict[str, Any]:
        return {}

    def granted_ranges(self, plane: DataTransport,
                       plane_grant: bytes) -> list[tuple[int, int]] | None:
        """Optional: the ``(offset, length)`` byte ranges of the producer's region that
        ``plane_grant`` exposes (offsets from the region start), in payload order; None (the
        default) skips the check."""
        return None

    # -- fixtures ----------------------------------------------------------------------------------
    @pytest.fixture
    def checked_class(self, plane_class: type[DataTransport]) -> type[DataTransport]:
        ok, why = plane_class.probe()
        if not ok:
            pytest.skip(f"plane {plane_class.__name__} cannot run here: {why}")
        if "DRAM" not in plane_class.capabilities.mem_kinds:
            pytest.skip(f"plane {plane_class.__name__} does not move DRAM")
        return plane_class

    @pytest.fixture
    def make_plane(self, checked_class: type[DataTransport], plane_options: dict[str, Any]
                   ) -> Iterator[Callable[..., DataTransport]]:
        """``make(node_id, region, identity="")``: a plane of the class under test, closed at
        teardown."""
        made: list[DataTransport] = []

        def make(node_id: str, region: HostRegion, identity: str = "") -> DataTransport:
            plane = checked_class(node_id=node_id, region=region, identity=identity,
                                  **plane_options)
            made.append(plane)
            return plane

        yield make
        for plane in reversed(made):
            plane.close()

    @pytest.fixture
    def regions(self):
        prod = HostRegion(self.num_blocks, self.block_bytes)
        cons = HostRegion(self.num_blocks, self.block_bytes)
        cons.buf[:] = SENTINEL
        yield prod, cons
        prod.close()
        cons.close()

    @pytest.fixture
    def pair(self, make_plane, regions) -> Pair:
        prod_region, cons_region = regions
        pair = Pair(make_plane("conf-producer", prod_region, PRODUCER_IDENTITY),
                    make_plane("conf-consumer", cons_region, CONSUMER_IDENTITY), prod_region,
                    cons_region, self.deadline_s)
        pair.binding = self.bind(pair.consumer, pair.producer, PRODUCER_IDENTITY)
        return pair

    def bind(self, consumer: DataTransport, producer: DataTransport, identity: str,
             peer: str | None = None) -> Any:
        """``consumer.bind_peer`` of ``producer``'s declaration, as the consumer node does after
        ``Welcome``: ``host`` is :attr:`control_host`, ``peer`` one control connection."""
        peer = peer or f"{self.control_host}:5555"
        return consumer.bind_peer(producer.endpoint(), peer=peer, host=self.control_host,
                                  identity=identity)

    # -- declarations ------------------------------------------------------------------------------
    def test_declarations(self, checked_class, pair):
        cls = checked_class
        assert isinstance(cls.name, str) and cls.name
        assert isinstance(cls.capabilities, Capabilities)
        assert isinstance(cls.capabilities.transfer_model, TransferModel)
        ok, why = cls.probe()
        assert ok is True and isinstance(why, str)
        assert isinstance(pair.producer.describe_transport(), str)

    # -- the plugin API ------------------------------------------------------------------------------
    def test_plugin_api_version(self, plane_class):
        """The class declares the API it implements, and it is this ectransport's: exactly what
        the registry checks before loading a plane (a plane inheriting ``DataTransport``'s
        default, or written for another API version, is never loaded)."""
        try:
            check_plane(plane_class, plane_class.__name__)
        except PlaneUnavailable as exc:
            pytest.fail(f"{exc}; this ectransport implements plugin API {PLUGIN_API_VERSION} "
                        f"(ectransport.plugin.PLUGIN_API_VERSION)")
        assert plane_class.plugin_api_version == PLUGIN_API_VERSION

    def test_imports_only_the_public_plugin_api(self, plane_class):
        """A plane outside ectransport imports ectransport only through ``ectransport.plugin``:
        the names stable under its plugin API version."""
        package = plane_class.__module__.split(".")[0]
        if package == "ectransport":
            pytest.skip("a built-in plane: part of ectransport itself")
        if not self.public_api_only:
            pytest.skip("public_api_only = False")
        bad = private_imports(package)
        assert not bad, (f"{package} imports ectransport internals (import them from "
                         f"{PUBLIC_MODULE} instead, or ask for them to be added there):\n"
                         + "\n".join(bad))

    # -- session binding (plugin API 2, issue 17) ---------------------------------------------------
    def test_session_binding_declarations(self, pair):
        for plane in (pair.producer, pair.consumer):
            assert type(plane).plugin_api_version == PLUGIN_API_VERSION
            endpoint, locality = plane.endpoint(), plane.locality()
            assert isinstance(endpoint, bytes) and len(endpoint) <= MAX_ENDPOINT_BYTES
            assert isinstance(locality, bytes) and len(locality) <= MAX_LOCALITY_BYTES
        # both planes run in this process: the producer's plane must reach the consumer's
        assert pair.producer.reachable(pair.consumer.locality()) is True
        assert isinstance(pair.producer.reachable(b""), bool)  # an older consumer: no raise

    def test_bind_peer_accepts_the_producers_declaration(self, pair):
        again = self.bind(pair.consumer, pair.producer, PRODUCER_IDENTITY, peer="second:1")
        pair.consumer.unbind_peer(again)  # a second session of the same producer ends
        pair.consumer.unbind_peer(again)  # never raises
        pair.round_trip([Run(0, 2)], [Run(4, 2)], 2 * self.block_bytes - 1, seed=80)
        if pair.producer.endpoint():
            # insecure mode (no identity known) binds too
            pair.consumer.unbind_peer(self.bind(pair.consumer, pair.producer, "", "insecure:1"))

    def test_bind_peer_refuses_another_identity_and_bad_declarations(self, pair):
        endpoint = pair.producer.endpoint()
        if not endpoint:
            pytest.skip("the plane declares nothing (empty endpoint): nothing to bind")
        with pytest.raises(DataPlaneError):
            self.bind(pair.consumer, pair.producer, OTHER_PRODUCER_IDENTITY)
        for label, bad in {
            "garbage": b"\xc1\x00garbage",
            "other msgpack": msgspec.msgpack.encode({"hello": [1, 2, 3]}),
            "truncated": endpoint[: len(endpoint) // 2],
            "oversized": endpoint + b"\x00" * MAX_ENDPOINT_BYTES,
        }.items():
            try:
                binding = pair.consumer.bind_peer(bad, peer="bad:1", host=self.control_host,
                                                  identity=PRODUCER_IDENTITY)
            except DataPlaneError:
                continue
            pair.consumer.unbind_peer(binding)
            pytest.fail(f"declaration {label!r} was accepted")
        pair.round_trip([Run(0, 2)], [Run(4, 2)], 2 * self.block_bytes, seed=81)

    def test_start_refuses_a_grant_of_another_producer(self, pair, make_plane):
        """Producer A's binding must not carry producer B's grant: a compromised producer must not
        point the consumer at another producer (issue 17). Refused before any I/O."""
        if not pair.producer.endpoint():
            pytest.skip("the plane declares nothing (empty endpoint): grants are not bound")
        region_b = HostRegion(16, self.block_bytes)
        producer_b = make_plane("conf-producer-b", region_b, OTHER_PRODUCER_IDENTITY)
        try:
            binding_b = self.bind(pair.consumer, producer_b, OTHER_PRODUCER_IDENTITY,
                                  peer="producer-b:1")
            nbytes = 2 * self.block_bytes - 3
            grant_b = producer_b.describe([Run(1, 2)], nbytes)
            with pytest.raises(DataPlaneError):
                handle = pair.consumer.start(pair.binding, grant_b, [Run(8, 2)], nbytes, b"x")
                pair.consumer.release(handle)
            grant_a = pair.producer.describe([Run(1, 2)], nbytes)
            with pytest.raises(DataPlaneError):
                handle = pair.consumer.start(binding_b, grant_a, [Run(8, 2)], nbytes, b"x")
                pair.consumer.release(handle)
            # each grant under its own producer's binding still works
            data = pattern(nbytes, 82)
            region_b.write([Run(1, 2)], data)
            handle = pair.consumer.start(binding_b, grant_b, [Run(8, 2)], nbytes, b"b")
            assert pair.finish(Transfer(grant_b, handle, [Run(1, 2)], [Run(8, 2)], nbytes, data,
                                        b"b")) is XferState.DONE
            assert_same(read_runs(pair.cons_region, [Run(8, 2)], nbytes), data)
            pair.consumer.unbind_peer(binding_b)
            pair.round_trip([Run(1, 2)], [Run(12, 2)], nbytes, seed=83, grant=grant_a)
        finally:
            producer_b.close()  # before its region goes away
            region_b.close()

    # -- round trips -------------------------------------------------------------------------------
    @pytest.mark.parametrize("nbytes", [0, 1, 4 * KiB, 1 * MiB, 64 * MiB],
                             ids=["0B", "1B", "4KiB", "1MiB", "64MiB"])
    def test_round_trip(self, pair, nbytes):
        n = blocks_for(nbytes, self.block_bytes)
        prod_runs, cons_runs = [Run(3, n)], [Run(self.num_blocks - n - 5, n)]
        pair.producer.poll_notifications()
        t = pair.round_trip(prod_runs, cons_runs, nbytes, seed=nbytes + 1)
        assert untouched_outside(pair.cons_region, cons_runs), "bytes outside the runs changed"
        if pair.producer.capabilities.notifications:
            assert wait_notifs(pair.producer, 1, self.deadline_s) == [t.notif]
            assert pair.producer.poll_notifications() == []  # delivered once

    def test_many_blocks(self, pair):
        prod_runs = [Run(3 * i, 1) for i in range(256)]  # 256 one-block runs, gaps between
        cons_runs = [Run(1 + 2 * i, 1) for i in reversed(range(256))]  # other gaps, reversed
        pair.round_trip(prod_runs, cons_runs, 256 * self.block_bytes - 3, seed=7)

    @pytest.mark.parametrize(("prod_runs", "cons_runs", "nblocks"), [
        ([Run(3, 2), Run(10, 5), Run(40, 1)], [Run(0, 1), Run(20, 4), Run(50, 3)], 8),
        ([Run(5, 2), Run(7, 3), Run(30, 1)], [Run(60, 4), Run(1, 1), Run(40, 1)], 6),
        ([Run(100, 17)], [Run(2, 1), Run(9, 3), Run(200, 5), Run(300, 8)], 17),
    ], ids=["three-vs-three", "adjacent-vs-scattered", "one-vs-four"])
    def test_scattered_runs(self, pair, prod_runs, cons_runs, nblocks):
        nbytes = nblocks * self.block_bytes - 5
        pair.round_trip(prod_runs, cons_runs, nbytes, seed=nblocks)
        assert untouched_outside(pair.cons_region, cons_runs), "bytes outside the runs changed"

    def test_concurrent_transfers(self, pair):
        pair.producer.poll_notifications()
        width = 16  # 1 MiB each
        transfers = [pair.begin([Run(i * width, width)], [Run(500 + i * width, width)],
                                width * self.block_bytes - i, seed=100 + i) for i in range(8)]
        states = [pair.finish(t) for t in transfers]
        assert states == [XferState.DONE] * 8
        for t in transfers:
            assert_same(read_runs(pair.cons_region, t.cons_runs, t.nbytes),
                                          t.data)
        if pair.producer.capabilities.notifications:
            got = wait_notifs(pair.producer, 8, self.deadline_s)
            assert sorted(got) == sorted(t.notif for t in transfers)

    # -- deadlines, cancel, peer death -------------------------------------------------------------
    def test_deadline_expiry_releases_cleanly(self, pair):
        """The node's consumer releases a transfer whose deadline passed (here: 1 ms)."""
        n = 1024
        t = pair.begin([Run(0, n)], [Run(10, n)], n * self.block_bytes, seed=11)
        wait_state(pair.consumer, t.handle, 0.001)
        pair.consumer.release(t.handle)
        pair.consumer.release(t.handle)  # idempotent
        if self._revocable(pair.producer):
            pair.producer.revoke(t.grant)  # the producer's lease/notification ends the grant
        state = pair.consumer.check(t.handle)
        assert state in (XferState.DONE, XferState.ERR)
        if self.release_stops_landing:
            snapshot = pair.cons_region.buf.copy()
            time.sleep(0.2)
            assert np.array_equal(pair.cons_region.buf, snapshot), "bytes landed after release"
        assert pair.consumer.check(t.handle) is state  # final states stay
        pair.round_trip([Run(0, 4)], [Run(1050, 4)], 4 * self.block_bytes, seed=12)

    def test_cancel_leaves_both_planes_usable(self, pair):
        transfers = [pair.begin([Run(i * 256, 256)], [Run(i * 256 + 20, 256)],
                                256 * self.block_bytes, seed=20 + i) for i in range(4)]
        for t in transfers:
            pair.consumer.release(t.handle)
            if self._revocable(pair.producer):
                pair.producer.revoke(t.grant)
        for t in transfers:
            assert pair.consumer.check(t.handle) in (XferState.DONE, XferState.ERR)
        t = pair.round_trip([Run(1030, 3)], [Run(1060, 3)], 3 * self.block_bytes, seed=30)
        if pair.producer.capabilities.notifications:
            assert notif_arrives(pair.producer, t.notif, self.deadline_s)

    def test_peer_death_ends_the_transfer(self, pair, make_plane):
        n = 1024
        t = pair.begin([Run(0, n)], [Run(10, n)], n * self.block_bytes, seed=40)
        pair.producer.close()
        start = time.monotonic()
        state = wait_state(pair.consumer, t.handle, self.deadline_s)
        assert state is not XferState.PROC, f"still PROC {self.deadline_s} s after peer death"
        assert time.monotonic() - start < self.deadline_s
        pair.consumer.release(t.handle)
        # the consumer still works, with a restarted producer
        pair.producer = make_plane("conf-producer", pair.prod_region, PRODUCER_IDENTITY)
        pair.consumer.unbind_peer(pair.binding)  # the node: session ended, new session
        pair.binding = self.bind(pair.consumer, pair.producer, PRODUCER_IDENTITY)
        pair.round_trip([Run(5, 3)], [Run(1070, 3)], 3 * self.block_bytes - 1, seed=41)

    # -- grants ------------------------------------------------------------------------------------
    def test_describe_covers_only_granted_runs(self, pair):
        runs = [Run(3, 2), Run(5, 1), Run(20, 4), Run(9, 1)]
        nbytes = 8 * self.block_bytes
        grant = pair.producer.describe(runs, nbytes)
        ranges = self.granted_ranges(pair.producer, grant)
        if ranges is None:
            pytest.skip("no granted_ranges hook for this plane")
        outside = gaps(pair.prod_region, runs)
        for off, length in ranges:
            assert off >= 0 and off + length <= pair.prod_region.nbytes
            assert not any(off < g_off + g_n and g_off < off + length for g_off, g_n in outside), \
                f"the grant exposes bytes {off}..{off + length} outside the granted runs"
        assert sum(length for _, length in ranges) >= nbytes

    def test_describe_rejects_bad_runs(self, pair):
        with pytest.raises(DataPlaneError):
            pair.producer.describe([Run(self.num_blocks - 1, 2)], self.block_bytes)
        with pytest.raises(DataPlaneError):
            pair.producer.describe([], 0)
        with pytest.raises(DataPlaneError):
            pair.producer.describe([Run(0, 1)], self.block_bytes + 1)

    def test_start_rejects_bad_grants(self, pair):
        runs = [Run(0, 2)]
        good = pair.producer.describe(runs, 2 * self.block_bytes)
        bad = {
            "empty": b"",
            "garbage": b"\xc1\x00garbage",
            "other msgpack": msgspec.msgpack.encode({"hello": [1, 2, 3]}),
            "truncated": good[: len(good) // 2],
        }
        for label, grant in bad.items():
            try:
                handle = pair.consumer.start(pair.binding, grant, [Run(8, 2)],
                                             2 * self.block_bytes, b"x")
            except DataPlaneError:
                continue
            pair.consumer.release(handle)
            pytest.fail(f"grant {label!r} was accepted")
        with pytest.raises(DataPlaneError):  # the local runs are longer than the grant's
            pair.consumer.start(pair.binding, good, [Run(8, 3)], 2 * self.block_bytes, b"x")
        with pytest.raises(DataPlaneError):  # local runs outside the consumer's region
            pair.consumer.start(pair.binding, good, [Run(self.num_blocks - 1, 2)],
                                2 * self.block_bytes, b"x")
        pair.round_trip(runs, [Run(8, 2)], 2 * self.block_bytes, seed=50)

    @staticmethod
    def _revocable(plane: DataTransport) -> bool:
        return type(plane).revoke is not DataTransport.revoke

    def test_revoke(self, pair):
        if not self._revocable(pair.producer):
            pytest.skip("plane cannot revoke (inherits DataTransport.revoke)")
        if not self.revoke_refuses:
            pytest.skip("the plane's revoke does not refuse later transfers here "
                        "(revoke_refuses=False)")
        pair.producer.revoke(b"")  # garbage: no-op
        pair.producer.revoke(b"\xc1garbage")
        runs = [Run(0, 4)]
        grant = pair.producer.describe(runs, 4 * self.block_bytes)
        pair.producer.revoke(grant)
        pair.producer.revoke(grant)  # twice: no-op
        try:
            t = pair.begin(runs, [Run(100, 4)], 4 * self.block_bytes, seed=60, grant=grant)
        except DataPlaneError:
            pass
        else:
            assert pair.finish(t) is XferState.ERR, "a revoked grant was served"
        pair.round_trip(runs, [Run(100, 4)], 4 * self.block_bytes, seed=61)

    # -- teardown ----------------------------------------------------------------------------------
    def test_close_is_idempotent_and_releases_everything(self, checked_class, plane_options,
                                                          regions):
        prod_region, cons_region = regions
        before = threading.active_count()
        producer = checked_class(node_id="conf-producer", region=prod_region,
                                 identity=PRODUCER_IDENTITY, **plane_options)
        consumer = checked_class(node_id="conf-consumer", region=cons_region,
                                 identity=CONSUMER_IDENTITY, **plane_options)
        pair = Pair(producer, consumer, prod_region, cons_region, self.deadline_s)
        try:
            pair.binding = self.bind(consumer, producer, PRODUCER_IDENTITY)
            done = pair.round_trip([Run(0, 2)], [Run(0, 2)], 2 * self.block_bytes, seed=70)
            in_flight = pair.begin([Run(10, 512)], [Run(10, 512)], 512 * self.block_bytes,
                                   seed=71)
        finally:
            consumer.close()
            consumer.close()
            producer.close()
            producer.close()
        consumer.release(done.handle)  # after close: no error
        consumer.release(in_flight.handle)
        assert consumer.check(in_flight.handle) in (XferState.DONE, XferState.ERR)
        assert producer.poll_notifications() == []
        with pytest.raises(DataPlaneError):
            producer.describe([Run(0, 1)], self.block_bytes)
        with pytest.raises(DataPlaneError):
            consumer.start(pair.binding, done.grant, [Run(0, 2)], 2 * self.block_bytes, b"")
        end = time.monotonic() + self.deadline_s
        while threading.active_count() > before and time.monotonic() < end:
            time.sleep(0.01)
        assert threading.active_count() <= before, \
            f"threads left after close: {[t.name for t in threading.enumerate()]}"
