"""Conformance suite for data planes: what every plane (a
:class:`~ectransport.plugin.ServingPlane`, a :class:`~ectransport.plugin.FetchingPlane` or both, a
:class:`~ectransport.plugin.DataTransport`) must do, run against real instances of the plane (a
producer and a consumer plane over two host regions, one process).

How a plane or plugin author runs it, in their own test file (pytest)::

    import pytest
    from ectransport.testing.conformance import PlaneConformance
    from my_plugin import MyPlane

    class TestMyPlaneConformance(PlaneConformance):
        @pytest.fixture
        def plane_class(self):
            return MyPlane

        @pytest.fixture
        def plane_options(self):          # optional: constructor options of every plane
            return {"some_option": 1}

        def granted_ranges(self, plane, plane_grant):   # optional hook, see below
            ...

A plane with **one half** names the class of the other half it works with::

    class TestMyExportConformance(PlaneConformance):
        @pytest.fixture
        def plane_class(self):
            return MyExport                # a ServingPlane only

        @pytest.fixture
        def counterpart_class(self):
            return MyReader                # the FetchingPlane that fetches from it

``PlaneConformance`` itself is not collected (its name does not start with ``Test``); the
subclass inherits every ``test_*`` method. A plane whose :meth:`probe` fails, or that cannot move
``"DRAM"``, is skipped. Knobs (class attributes): :attr:`~Kit.block_bytes`,
:attr:`~Kit.num_blocks`, :attr:`~Kit.deadline_s`, :attr:`~Kit.release_stops_landing`,
:attr:`~Kit.revoke_refuses`, :attr:`~Kit.control_host`, :attr:`~Kit.public_api_only`.

The class under test is taken as the registry takes it (:func:`ectransport.data.registry.accept`):
an API-3 plane as it is, an API-2 plane (a ``DataTransport`` declaring ``plugin_api_version = 2``)
through the API-2 adapter, as a plane with both halves. Planes are built as the nodes build them:
``Plane(node_id=..., region=..., identity=..., **plane_options)``, each node with its own
identity; the producer is the serving half, the consumer the fetching half (for a plane with both,
two instances of it); the consumer binds the producer's ``endpoint()`` once (``bind_peer(...,
host=control_host, identity=<producer's>)``) and every transfer is started with that binding.

What is checked (each test bounded by ``deadline_s`` and cleaning up after itself):

* declarations: name, :class:`Capabilities`, ``probe``, ``describe_transport``; the halves: the
  class has at least one, a counterpart has the other, and both share the name and transfer model;
* the plugin API: the class declares ``plugin_api_version`` itself, one the registry loads
  (:data:`~ectransport.plugin.SUPPORTED_API_VERSIONS`: 3, or 2 through the adapter — which the
  test shows), and a plane outside ectransport imports nothing of ectransport but the public
  module :mod:`ectransport.plugin` (:func:`private_imports`; knob :attr:`~Kit.public_api_only`);
* session binding (:mod:`~ectransport.testing.conformance_binding`): ``endpoint()`` is bytes of at
  most ``MAX_ENDPOINT_BYTES`` and ``locality()`` of at most ``MAX_LOCALITY_BYTES``; the producer
  can reach the consumer's locality; ``bind_peer`` accepts the producer's own declaration; and,
  for planes that declare something, ``bind_peer`` refuses a wrong identity and a malformed or
  oversized declaration, and ``start`` refuses a grant of producer B under producer A's binding
  (``DataPlaneError``), while B's grant under B's binding still works;
* round trips of 0 B, 1 B, 4 KiB, 1 MiB and 64 MiB (64 KiB blocks, the last one partial), with
  the bytes outside the consumer's runs untouched and, for planes with notifications, the
  consumer's ``notif`` delivered exactly once to the producer;
* many blocks (256 single-block runs) and scattered runs whose boundaries differ on each side;
* 8 concurrent transfers;
* ``describe`` exposes only the granted runs (optional hook :meth:`~Kit.granted_ranges`) and
  rejects runs outside the region; ``start`` rejects malformed and mismatched grants with
  DataPlaneError;
* lifecycle (:mod:`~ectransport.testing.conformance_lifecycle`): a deadline that expires while a
  transfer may still be PROC (the consumer releases it, the handle ends DONE or ERR, no byte lands
  after ``release`` returns unless ``release_stops_landing`` is False, and revocable planes revoke
  it as the node would; a fast plane may finish first, so the suite asserts the clean outcome of
  either case); cancel of several transfers in flight; peer death (the producer closes during a
  64 MiB transfer: the consumer's handle leaves PROC within ``deadline_s``, and the consumer works
  with a new producer); revoke (planes that override :meth:`ServingPlane.revoke`: a later transfer
  of a revoked grant ends in ERR or DataPlaneError; revoking garbage is a no-op); teardown
  (``close`` is idempotent, later calls fail cleanly, no Python thread is left).

Transfers are driven as the nodes drive them: ``describe`` on the producer, then
``start``/``check``/``release`` on the consumer, ``poll_notifications`` and ``revoke`` on the
producer.

Helpers usable on their own live in :mod:`ectransport.testing.helpers` (patterns, waits,
:class:`~ectransport.testing.helpers.Pair`) and :mod:`ectransport.testing.imports` (the import
check); this module re-exports them.
"""

from __future__ import annotations

import logging

import msgspec
import pytest

from ectransport.data.registry import check_plane
from ectransport.plugin import (
    PLUGIN_API_VERSION,
    SUPPORTED_API_VERSIONS,
    Capabilities,
    DataPlaneError,
    DataTransport,
    FetchingPlane,
    Run,
    ServingPlane,
    TransferModel,
    XferState,
    plane_halves,
)
from ectransport.testing.conformance_binding import BindingChecks
from ectransport.testing.conformance_kit import Kit
from ectransport.testing.conformance_lifecycle import LifecycleChecks
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
    "SENTINEL", "Kit", "KiB", "MiB", "Pair", "PlaneConformance", "Transfer", "assert_same",
    "blocks_for", "ectransport_imports", "gaps", "notif_arrives", "package_files", "pattern",
    "private_imports", "read_runs", "untouched_outside", "wait_notifs", "wait_state",
]


class PlaneConformance(BindingChecks, LifecycleChecks, Kit):
    """Subclass in a ``Test*`` class and override the ``plane_class`` fixture (see module doc)."""

    # -- declarations ------------------------------------------------------------------------------
    def test_declarations(self, roles, pair):
        for cls in set(roles):
            assert isinstance(cls.name, str) and cls.name
            assert isinstance(cls.capabilities, Capabilities)
            assert isinstance(cls.capabilities.transfer_model, TransferModel)
            ok, why = cls.probe()
            assert ok is True and isinstance(why, str)
        assert isinstance(pair.producer.describe_transport(), str)
        assert isinstance(pair.consumer.describe_transport(), str)

    def test_halves(self, plane_class, roles):
        """The class declares its halves by what it derives from; the two roles are the halves
        of one plane: the same name (what nodes negotiate) and transfer model."""
        serving, fetching = roles
        halves = plane_halves(plane_class)
        assert halves, f"{plane_class.__name__} derives from neither ServingPlane nor FetchingPlane"
        if len(halves) == 2:
            assert issubclass(plane_class, DataTransport)
        assert issubclass(serving, ServingPlane) and issubclass(fetching, FetchingPlane)
        assert serving.name == fetching.name, "the two halves of a plane must share its name"
        assert serving.capabilities.transfer_model is fetching.capabilities.transfer_model

    # -- the plugin API ------------------------------------------------------------------------------
    def test_plugin_api_version(self, plane_class, caplog):
        """The class declares the API it implements, and the registry loads it: exactly what the
        registry checks before loading a plane (a plane inheriting the contract's default, or
        written for an unsupported API version, is never loaded). An API-2 plane goes through the
        API-2 adapter, as a plane with both halves."""
        try:
            version = check_plane(plane_class, plane_class.__name__)
        except Exception as exc:
            pytest.fail(f"{exc}; this ectransport implements plugin API {PLUGIN_API_VERSION} "
                        f"(ectransport.plugin.PLUGIN_API_VERSION)")
        assert version in SUPPORTED_API_VERSIONS and plane_class.plugin_api_version == version
        if version != PLUGIN_API_VERSION:
            assert issubclass(plane_class, DataTransport), "an API-2 plane has both halves"
            with caplog.at_level(logging.INFO, logger="ectransport.data.registry"):
                self._usable(plane_class, plane_class.__name__)
            assert "through the API-2 adapter" in caplog.text

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
