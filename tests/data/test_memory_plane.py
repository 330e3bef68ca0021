"""ectransport.testing.MemoryPlane: the in-memory data plane and its fabric's fault script.

The planes pass the conformance kit in every shape (both halves READ and PUSH, a serving-only and
a fetching-only plane with their counterparts, an API-2 form through the registry's adapter);
then each fault mode (delay by checks and by clock, fail, stall, reorder, rules, a lost
notification), the two revoke rules, release semantics, the binding checks and the bytes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import tomllib

from ectransport.data import registry
from ectransport.errors import ConfigError, DataPlaneError, PlaneUnavailable
from ectransport.plugin import DataTransport, FetchingPlane, ServingPlane, TransferModel, XferState
from ectransport.store import HostRegion, Run
from ectransport.testing import memory as mem
from ectransport.testing.conformance import PlaneConformance, assert_same, pattern, read_runs
from ectransport.testing.conformance_kit import plane_roles
from ectransport.testing.memory import (
    Complete,
    Delay,
    Fail,
    ManualClock,
    MemoryFabric,
    MemoryFetchingPlane,
    MemoryPlane,
    MemoryPushPlane,
    MemoryServingPlane,
    Reorder,
    Stall,
)

BLOCK = 4096
SENTINEL = 0xEE
ID_P, ID_Q = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"


# -- the conformance kit, every shape ---------------------------------------------------------
class _MemoryKit(PlaneConformance):
    @pytest.fixture
    def plane_options(self):
        return {"fabric": MemoryFabric()}  # one fabric per test: scripts never leak

    def granted_ranges(self, plane, plane_grant):
        return plane.exposed_ranges(plane_grant)


class TestMemoryPlaneConformance(_MemoryKit):
    @pytest.fixture
    def plane_class(self):
        return MemoryPlane


class TestMemoryPushPlaneConformance(_MemoryKit):
    @pytest.fixture
    def plane_class(self):
        return MemoryPushPlane


class TestServingOnlyConformance(_MemoryKit):
    """A plane with the serving half only, fetched by its counterpart."""

    @pytest.fixture
    def plane_class(self):
        return MemoryServingPlane

    @pytest.fixture
    def counterpart_class(self):
        return MemoryFetchingPlane


class TestFetchingOnlyConformance(_MemoryKit):
    @pytest.fixture
    def plane_class(self):
        return MemoryFetchingPlane

    @pytest.fixture
    def counterpart_class(self):
        return MemoryServingPlane


class Api2MemoryPlane(MemoryPlane):
    """The plane as an API-2 plugin declares it: a DataTransport saying 2."""

    plugin_api_version = 2


class TestApi2MemoryPlaneConformance(_MemoryKit):
    public_api_only = False  # defined in a test module: the import rule is for plugins

    @pytest.fixture
    def plane_class(self):
        return Api2MemoryPlane


def test_the_kit_pairs_a_half_plane_with_its_counterpart_only():
    assert plane_roles(MemoryFetchingPlane, MemoryServingPlane) == (MemoryServingPlane,
                                                                    MemoryFetchingPlane)
    assert plane_roles(MemoryPlane, None) == (MemoryPlane, MemoryPlane)
    with pytest.raises(pytest.fail.Exception, match="counterpart_class"):
        plane_roles(MemoryServingPlane, None)
    with pytest.raises(pytest.fail.Exception, match="own counterpart"):
        plane_roles(MemoryPlane, MemoryFetchingPlane)
    with pytest.raises(pytest.fail.Exception, match="not the other half"):
        plane_roles(MemoryServingPlane, MemoryServingPlane)


# -- a producer and a consumer on one fabric --------------------------------------------------
class Nodes:
    def __init__(self, fabric: MemoryFabric, cls=MemoryPlane, **options):
        self.fabric = fabric
        self.pr, self.cr = HostRegion(64, BLOCK), HostRegion(64, BLOCK)
        self.cr.buf[:] = SENTINEL
        self.producer = cls(node_id="prod", region=self.pr, identity=ID_P, fabric=fabric,
                            **options)
        self.consumer = cls(node_id="cons", region=self.cr, identity="", fabric=fabric, **options)
        self.binding = self.consumer.bind_peer(self.producer.endpoint(), peer="127.0.0.1:1",
                                               host="127.0.0.1", identity=ID_P)

    def start(self, prod_runs, cons_runs, nbytes, seed, notif=None):
        data = pattern(nbytes, seed)
        self.pr.write(prod_runs, data)
        grant = self.producer.describe(prod_runs, nbytes)
        h = self.consumer.start(self.binding, grant, cons_runs, nbytes,
                                notif if notif is not None else f"n{seed}".encode())
        return grant, h, data

    def landed(self, cons_runs, nbytes):
        return read_runs(self.cr, cons_runs, nbytes)

    def untouched(self, cons_runs, nbytes):
        return bool((self.landed(cons_runs, nbytes) == SENTINEL).all())

    def close(self):
        self.consumer.close()
        self.producer.close()
        self.pr.close()
        self.cr.close()


@pytest.fixture
def clock():
    return ManualClock(100.0)


@pytest.fixture
def fabric(clock):
    return MemoryFabric(clock=clock)


@pytest.fixture
def nodes(fabric):
    n = Nodes(fabric)
    yield n
    n.close()


@pytest.fixture
def push_nodes(fabric):
    n = Nodes(fabric, MemoryPushPlane)
    yield n
    n.close()


def checks(plane, handle, n):
    return [plane.check(handle) for _ in range(n)]


P, D, E = XferState.PROC, XferState.DONE, XferState.ERR


# -- declarations and registration ------------------------------------------------------------
def test_halves_and_models_are_declared_by_class():
    assert issubclass(MemoryPlane, DataTransport) and issubclass(MemoryPushPlane, DataTransport)
    assert issubclass(MemoryServingPlane, ServingPlane)
    assert not issubclass(MemoryServingPlane, FetchingPlane)
    assert issubclass(MemoryFetchingPlane, FetchingPlane)
    assert not issubclass(MemoryFetchingPlane, ServingPlane)
    assert not hasattr(MemoryServingPlane, "start") and not hasattr(MemoryFetchingPlane, "describe")
    assert MemoryPlane.capabilities.transfer_model is TransferModel.READ
    assert MemoryPushPlane.capabilities.transfer_model is TransferModel.PUSH
    assert (MemoryPlane.name, MemoryPushPlane.name) == ("memory", "memory-push")
    for cls in (MemoryPlane, MemoryPushPlane, MemoryServingPlane, MemoryFetchingPlane):
        assert registry.check_plane(cls, cls.__name__) == 3


def test_entry_points_are_declared_and_resolve():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    eps = pyproject["project"]["entry-points"]["ectransport.data_planes"]
    assert eps["memory"] == "ectransport.testing.memory:MemoryPlane"
    assert eps["memory-push"] == "ectransport.testing.memory:MemoryPushPlane"
    found = registry.discover()
    if "memory" not in found:
        pytest.skip("the installed metadata predates the memory entry points (pip install -e .)")
    assert registry.load_plane("memory") is MemoryPlane
    assert registry.load_serving_plane("memory-push") is MemoryPushPlane


def test_options_are_checked():
    region = HostRegion(4, BLOCK)
    try:
        with pytest.raises(ConfigError, match="unknown"):
            MemoryPlane(node_id="x", region=region, colour="red")
        with pytest.raises(ConfigError, match="MemoryFabric"):
            MemoryPlane(node_id="x", region=region, fabric="not a fabric")
        plane = MemoryPlane(node_id="x", region=region)  # the shared fabric by default
        assert plane.fabric is MemoryFabric.shared()
        plane.close()
    finally:
        region.close()


def test_variants_change_capabilities_not_behaviour_elsewhere(fabric):
    quiet = MemoryPlane.variant(notifications=False)
    assert quiet is MemoryPlane.variant(notifications=False)  # made once
    assert quiet.capabilities.notifications is False and quiet.name == "memory"
    assert MemoryPlane.capabilities.notifications is True
    small = MemoryServingPlane.variant(max_transfer_bytes=BLOCK)
    assert registry.check_plane(quiet, "quiet") == 3 and registry.check_plane(small, "s") == 3
    n = Nodes(fabric, quiet)
    try:
        _, h, data = n.start([Run(0, 1)], [Run(1, 1)], 100, seed=1)
        assert n.consumer.check(h) is D and n.producer.poll_notifications() == []
        region = HostRegion(4, BLOCK)
        p = small(node_id="s", region=region, fabric=fabric)
        with pytest.raises(DataPlaneError, match="exceed"):
            p.describe([Run(0, 2)], BLOCK + 1)
        p.close()
        region.close()
    finally:
        n.close()


# -- bytes -----------------------------------------------------------------------------------
def test_bytes_land_in_the_local_runs_only(nodes):
    prod_runs, cons_runs, nbytes = [Run(3, 2), Run(9, 3)], [Run(40, 1), Run(20, 4)], 5 * BLOCK - 7
    _, h, data = nodes.start(prod_runs, cons_runs, nbytes, seed=5)
    assert nodes.untouched(cons_runs, nbytes), "nothing lands before the transfer completes"
    assert nodes.consumer.check(h) is D
    assert_same(nodes.landed(cons_runs, nbytes), data)
    outside = np.ones(nodes.cr.nbytes, bool)
    for r in cons_runs:
        outside[r.start * BLOCK:(r.start + r.count) * BLOCK] = False
    assert (nodes.cr.buf[outside] == SENTINEL).all()
    assert nodes.producer.poll_notifications() == [b"n5"]
    assert nodes.producer.poll_notifications() == []
    x = nodes.fabric.transfers[0]
    assert (x.seq, x.producer, x.consumer, x.nbytes, x.landed, x.checks) == (0, "prod", "cons",
                                                                            nbytes, True, 1)


# -- fault modes -----------------------------------------------------------------------------
def test_delay_by_checks(nodes):
    nodes.fabric.delay_next(checks=3)
    _, h, data = nodes.start([Run(0, 1)], [Run(1, 1)], BLOCK, seed=1)
    assert checks(nodes.consumer, h, 3) == [P, P, P] and nodes.untouched([Run(1, 1)], BLOCK)
    assert nodes.consumer.check(h) is D
    assert_same(nodes.landed([Run(1, 1)], BLOCK), data)


def test_delay_until_the_fake_clock_reaches_a_time(nodes, clock):
    nodes.fabric.next(Delay(at=clock() + 5.0))
    _, h, data = nodes.start([Run(0, 1)], [Run(1, 1)], 10, seed=2)
    assert checks(nodes.consumer, h, 10) == [P] * 10
    clock.advance(4.999)
    assert nodes.consumer.check(h) is P
    clock.advance(0.001)
    assert nodes.consumer.check(h) is D
    assert_same(nodes.landed([Run(1, 1)], 10), data)


def test_fail_with_a_detail(nodes):
    nodes.fabric.fail_next("NIC on fire")
    _, h, _ = nodes.start([Run(0, 2)], [Run(4, 2)], 2 * BLOCK, seed=3)
    assert nodes.consumer.check(h) is E
    assert nodes.consumer.error_detail(h) == "NIC on fire"
    assert nodes.untouched([Run(4, 2)], 2 * BLOCK)
    assert nodes.producer.poll_notifications() == []  # a failed transfer notifies nobody
    # the next transfer is unaffected
    _, h2, _ = nodes.start([Run(0, 2)], [Run(4, 2)], 2 * BLOCK, seed=4)
    assert nodes.consumer.check(h2) is D


def test_fail_after_checks(nodes):
    nodes.fabric.next(Fail("late", checks=2))
    _, h, _ = nodes.start([Run(0, 1)], [Run(1, 1)], 1, seed=1)
    assert checks(nodes.consumer, h, 3) == [P, P, E]


def test_stall_until_resumed(nodes):
    nodes.fabric.stall_next(count=2)
    _, h1, d1 = nodes.start([Run(0, 1)], [Run(10, 1)], BLOCK, seed=1)
    _, h2, _ = nodes.start([Run(1, 1)], [Run(11, 1)], BLOCK, seed=2)
    assert checks(nodes.consumer, h1, 50) == [P] * 50
    assert nodes.fabric.stalled() == [h1, h2]
    assert h1.resume() is True
    assert nodes.fabric.stalled() == [h2]
    assert nodes.consumer.check(h1) is D
    assert_same(nodes.landed([Run(10, 1)], BLOCK), d1)
    h2.resume(Fail("gave up"))
    assert nodes.consumer.check(h2) is E and nodes.consumer.error_detail(h2) == "gave up"
    assert h2.resume() is False  # over
    assert nodes.untouched([Run(11, 1)], BLOCK)


def test_reorder_completes_in_reverse_posting_order(nodes):
    group = nodes.fabric.reorder_next(3)
    started = [nodes.start([Run(i, 1)], [Run(10 + i, 1)], BLOCK, seed=i) for i in range(3)]
    done_order = []
    while len(done_order) < 3:  # the consumer polls in posting order, as the node does
        for i, (_, h, _) in enumerate(started):
            if i not in done_order and nodes.consumer.check(h) is D:
                done_order.append(i)
    assert done_order == [2, 1, 0]
    assert group.members == [h for _, h, _ in started]
    for i, (_, _, data) in enumerate(started):
        assert_same(nodes.landed([Run(10 + i, 1)], BLOCK), data)
    assert nodes.producer.poll_notifications() == [b"n2", b"n1", b"n0"]


def test_reorder_waits_for_the_whole_group_and_skips_released_members(nodes):
    nodes.fabric.reorder_next(3, order=[1, 0, 2])
    _, a, _ = nodes.start([Run(0, 1)], [Run(10, 1)], 8, seed=1)
    _, b, _ = nodes.start([Run(1, 1)], [Run(11, 1)], 8, seed=2)
    assert [nodes.consumer.check(a), nodes.consumer.check(b)] == [P, P]  # group not yet full
    _, c, _ = nodes.start([Run(2, 1)], [Run(12, 1)], 8, seed=3)
    assert [nodes.consumer.check(x) for x in (a, c)] == [P, P]  # b comes first
    nodes.consumer.release(b)  # over (cancelled): the next in order may go
    assert [nodes.consumer.check(x) for x in (c, a, c)] == [P, D, D]
    with pytest.raises(ValueError, match="permutation"):
        Reorder(2, order=[0, 0])


def test_rules_decide_per_transfer(nodes):
    stall_big = nodes.fabric.script(lambda x: Stall() if x.nbytes > BLOCK else None)
    nodes.fabric.script(lambda x: Fail("odd notif") if x.notif.endswith(b"7") else None)
    _, small, _ = nodes.start([Run(0, 1)], [Run(10, 1)], BLOCK, seed=1)
    _, big, _ = nodes.start([Run(1, 2)], [Run(11, 2)], 2 * BLOCK, seed=2)
    _, odd, _ = nodes.start([Run(3, 1)], [Run(13, 1)], 1, seed=7)
    assert [nodes.consumer.check(h) for h in (small, big, odd)] == [D, P, E]
    nodes.fabric.fail_next("one-shot first")  # one-shots come before rules
    _, first, _ = nodes.start([Run(1, 2)], [Run(11, 2)], 2 * BLOCK, seed=3)
    assert nodes.consumer.check(first) is E
    assert nodes.consumer.error_detail(first) == "one-shot first"
    nodes.fabric.unscript(stall_big)
    _, later, _ = nodes.start([Run(1, 2)], [Run(11, 2)], 2 * BLOCK, seed=4)
    assert nodes.consumer.check(later) is D


def test_a_lost_notification(nodes):
    nodes.fabric.next(Complete(notify=False))
    _, h, _ = nodes.start([Run(0, 1)], [Run(1, 1)], 1, seed=1)
    assert nodes.consumer.check(h) is D and nodes.producer.poll_notifications() == []


def test_wait_for_a_transfer_posted_by_another_thread(nodes):
    nodes.fabric.stall_next()
    grant = nodes.producer.describe([Run(0, 1)], 1)
    worker = threading.Thread(target=nodes.consumer.start,
                              args=(nodes.binding, grant, [Run(1, 1)], 1, b"w"))
    worker.start()
    assert nodes.fabric.wait_for(lambda f: len(f.stalled()) == 1, timeout_s=10.0)
    worker.join(10.0)
    assert nodes.fabric.wait_for(lambda f: False, timeout_s=0.01) is False


# -- revoke: the two models -------------------------------------------------------------------
def test_read_revoke_does_not_stop_a_read_in_flight(nodes):
    """The grace-period hazard: a READ posted before revoke reads the blocks when it completes,
    so bytes written there after the grant ended land at the consumer (wrong bytes) — why the
    producer keeps a READ plane's blocks pinned for grace_s."""
    nodes.fabric.stall_next()
    grant, h, _ = nodes.start([Run(0, 1)], [Run(5, 1)], BLOCK, seed=1)
    nodes.producer.revoke(grant)
    reused = pattern(BLOCK, 99)
    nodes.pr.write([Run(0, 1)], reused)  # the producer reused the block
    h.resume()
    assert nodes.consumer.check(h) is D
    assert_same(nodes.landed([Run(5, 1)], BLOCK), reused)
    # a start after revoke fails (the registration is gone)
    h2 = nodes.consumer.start(nodes.binding, grant, [Run(6, 1)], BLOCK, b"")
    assert nodes.consumer.check(h2) is E and "revoked" in nodes.consumer.error_detail(h2)


def test_push_revoke_stops_the_transfer(push_nodes):
    push_nodes.fabric.stall_next()
    grant, h, _ = push_nodes.start([Run(0, 1)], [Run(5, 1)], BLOCK, seed=1)
    push_nodes.producer.revoke(grant)
    h.resume()
    assert push_nodes.consumer.check(h) is E and "revoked" in push_nodes.consumer.error_detail(h)
    assert push_nodes.untouched([Run(5, 1)], BLOCK)
    h2 = push_nodes.consumer.start(push_nodes.binding, grant, [Run(6, 1)], BLOCK, b"")
    assert push_nodes.consumer.check(h2) is E


# -- release, close ---------------------------------------------------------------------------
def test_release_stops_landing(nodes):
    nodes.fabric.stall_next()
    _, h, _ = nodes.start([Run(0, 1)], [Run(5, 1)], BLOCK, seed=1)
    nodes.consumer.release(h)
    assert h.resume() is False and not h.in_flight and not h.landed
    assert nodes.consumer.check(h) is E and nodes.untouched([Run(5, 1)], BLOCK)


def test_a_read_that_cannot_be_cancelled_lands_after_release(fabric):
    n = Nodes(fabric, release_stops_landing=False)
    try:
        fabric.stall_next()
        _, h, data = n.start([Run(0, 1)], [Run(5, 1)], BLOCK, seed=1)
        n.consumer.release(h)
        assert n.consumer.check(h) is E and h.in_flight  # the consumer gave up; the DMA did not
        assert h.resume() is True and h.landed
        assert_same(n.landed([Run(5, 1)], BLOCK), data)  # landed into released blocks
        assert n.consumer.check(h) is E
    finally:
        n.close()


def test_producer_death_and_consumer_close(nodes):
    nodes.fabric.stall_next()
    _, stalled, _ = nodes.start([Run(0, 1)], [Run(5, 1)], BLOCK, seed=1)
    _, h, _ = nodes.start([Run(0, 1)], [Run(6, 1)], BLOCK, seed=2)
    nodes.producer.close()
    assert nodes.consumer.check(h) is E and "closed" in nodes.consumer.error_detail(h)
    stalled.resume()
    assert nodes.consumer.check(stalled) is E
    nodes.consumer.close()
    with pytest.raises(DataPlaneError, match="closed"):
        nodes.consumer.start(nodes.binding, b"", [Run(0, 1)], 1, b"")


def test_consumer_close_cancels_its_transfers(nodes):
    nodes.fabric.stall_next()
    _, h, _ = nodes.start([Run(0, 1)], [Run(5, 1)], BLOCK, seed=1)
    nodes.consumer.close()
    assert not h.in_flight and h.resume() is False and nodes.untouched([Run(5, 1)], BLOCK)


# -- binding ----------------------------------------------------------------------------------
def test_reachable_and_bound_only_on_one_fabric(nodes):
    other = MemoryFabric()
    region = HostRegion(4, BLOCK)
    stranger = MemoryPlane(node_id="s", region=region, identity=ID_P, fabric=other)
    try:
        assert nodes.producer.reachable(nodes.consumer.locality()) is True
        assert nodes.producer.reachable(stranger.locality()) is False
        assert nodes.producer.reachable(b"") is False
        with pytest.raises(DataPlaneError, match="fabric"):
            nodes.consumer.bind_peer(stranger.endpoint(), peer="s:1", host="h", identity=ID_P)
        with pytest.raises(DataPlaneError, match="refused"):
            nodes.consumer.bind_peer(b"", peer="s:1", host="h", identity=ID_P)
    finally:
        stranger.close()
        region.close()


def test_a_producer_cannot_declare_another_producers_region(nodes):
    """A compromised producer Q declaring P's key under its own identity is refused: the fabric
    knows who registered each key."""
    import msgspec

    region = HostRegion(4, BLOCK)
    q = MemoryPlane(node_id="q", region=region, identity=ID_Q, fabric=nodes.fabric)
    try:
        forged = msgspec.msgpack.encode(mem.MemoryEndpoint(mem.WIRE_VERSION, nodes.fabric.id,
                                                           nodes.producer.key, "q", ID_Q))
        with pytest.raises(DataPlaneError, match="did not register"):
            nodes.consumer.bind_peer(forged, peer="q:1", host="h", identity=ID_Q)
        with pytest.raises(DataPlaneError, match="identity"):
            nodes.consumer.bind_peer(nodes.producer.endpoint(), peer="q:1", host="h",
                                     identity=ID_Q)
        binding_q = nodes.consumer.bind_peer(q.endpoint(), peer="q:1", host="h", identity=ID_Q)
        grant_p = nodes.producer.describe([Run(0, 1)], 1)
        with pytest.raises(DataPlaneError, match="bound to"):
            nodes.consumer.start(binding_q, grant_p, [Run(0, 1)], 1, b"")
        nodes.consumer.unbind_peer(binding_q)
        with pytest.raises(DataPlaneError, match="ended"):
            nodes.consumer.start(binding_q, q.describe([Run(0, 1)], 1), [Run(0, 1)], 1, b"")
    finally:
        q.close()
        region.close()


def test_a_grant_of_the_other_model_is_refused(fabric):
    read, push = Nodes(fabric), Nodes(fabric, MemoryPushPlane)
    try:
        grant = push.producer.describe([Run(0, 1)], 1)
        b = read.consumer.bind_peer(push.producer.endpoint(), peer="p:1", host="h", identity=ID_P)
        with pytest.raises(DataPlaneError, match="push"):
            read.consumer.start(b, grant, [Run(0, 1)], 1, b"")
    finally:
        read.close()
        push.close()


def test_load_plane_refuses_a_half_where_both_are_needed(monkeypatch):
    from importlib.metadata import EntryPoint

    ep = EntryPoint("memory-serve", "ectransport.testing.memory:MemoryServingPlane",
                    registry.GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep])
    monkeypatch.delenv(registry.ENV_FILTER, raising=False)
    assert registry.load_serving_plane("memory-serve") is MemoryServingPlane
    with pytest.raises(PlaneUnavailable, match="serving half only.*fetching half"):
        registry.load_fetching_plane("memory-serve")
    with pytest.raises(PlaneUnavailable, match="serving half only"):
        registry.load_plane("memory-serve")
