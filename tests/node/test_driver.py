"""The drivers under the nodes, driven by the test itself: ``step(now)`` with the in-memory
control pair and the in-memory planes (``memory``: READ, ``memory-push``: PUSH), no node threads
— and, where time matters, a clock the test sets. Nothing here sleeps or measures wall-clock
time; the real planes are tested on their own (tests/data) and across processes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from ectransport.control.base import Received
from ectransport.control.memory import MemoryControlClient, MemoryControlServer, MemoryNetwork
from ectransport.errors import NoCommonPlane, ProtocolError
from ectransport.node import (
    ConsumerDriver,
    ConsumerNode,
    Fetched,
    Layout,
    Miss,
    MissReason,
    ProducerAddress,
    ProducerNode,
    Security,
)
from ectransport.node.driver import Parts, load_planes
from ectransport.node.inbox import ReleaseFetched, Snapshot, StartFetch
from ectransport.node.producer_driver import SWEEP_S
from ectransport.protocol import (
    SUPPORTED_VERSIONS,
    Hello,
    Renew,
    Status,
    Welcome,
    XferAck,
    XferReq,
    decode,
    encode,
)
from ectransport.session import ConsumerConfig
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from ectransport.store import BlockStore, HostRegion
from ectransport.testing.memory import MemoryFabric
from tests.conftest import sections, wait_for

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
BB = LAYOUT.block_bytes
ROWS = 16
HOST, PORT = "127.0.0.1", 5601
ADDR = ProducerAddress(HOST, PORT)


def _rows(seed: int, n: int = ROWS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def _producer(closing, net: MemoryNetwork, planes=("memory",), **kw) -> ProducerNode:
    """A ProducerNode that is never started: the test steps its driver."""
    return closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            control=MemoryControlServer(net, HOST, PORT),
            **sections(ProducerSettings(region_bytes=1 << 20), NodeSettings(planes=planes), **kw),
        )
    )


@pytest.fixture
def consumer_driver():
    """``make(net, planes)``: a ConsumerDriver built by hand (what ConsumerNode builds)."""
    made: list[ConsumerDriver] = []

    def make(net: MemoryNetwork, planes=("memory",), clock=time.monotonic) -> ConsumerDriver:
        region = HostRegion(4 * ROWS, BB)
        loaded = load_planes(tuple(planes), node_id="driver-test", region=region, public_key=None)
        # inline_max_bytes=0: these entries are granted and READ (ECTP v2 would send them
        # inline); the inline path through a driver: tests/node/test_v2.py
        config = ConsumerConfig(node_id="driver-test", compat_hash=LAYOUT.compat_hash,
                                planes=tuple(planes), settings=ConsumerSettings(inline_max_bytes=0),
                                localities=tuple((n, p.locality()) for n, p in loaded.items()))
        d = ConsumerDriver(Parts(MemoryControlClient(net), loaded, region, True),
                           BlockStore(region.num_blocks, BB), LAYOUT, config, clock=clock)
        made.append(d)
        return d

    yield make
    for d in made:
        d.shutdown()
        d.parts.close()


def _drive(consumer: ConsumerDriver, producer: ProducerNode, fut: Future, timeout_s: float = 20.0):
    """One thread steps both sides until ``fut`` resolves (as a scheduler loop would)."""
    limit = time.monotonic() + timeout_s
    while not fut.done() and time.monotonic() < limit:
        consumer.step()
        producer.driver.step()
    return fut.result(timeout=0)


@pytest.mark.parametrize("plane", ["memory", "memory-push"])
def test_one_thread_steps_both_drivers_through_a_fetch(closing, consumer_driver, plane):
    net = MemoryNetwork()
    p = _producer(closing, net, planes=(plane,))
    a = _rows(1)
    assert p.put("a", a)
    d = consumer_driver(net, (plane,))
    fut: Future = Future()
    d.post(StartFetch(ADDR, "a", d.clock() + 20.0, fut))
    out = _drive(d, p, fut)
    assert isinstance(out, Fetched), out
    assert out.plane == plane and np.array_equal(out.data, a.reshape(-1))
    assert d.gauges()["free_blocks"] < d.store.num_blocks  # held by the zero-copy result
    del out, fut
    assert len(d.inbox) == 1  # the finalizer only queued the release ...
    d.step()  # ... which the driving thread performs at its next step
    assert d.gauges()["free_blocks"] == d.store.num_blocks
    # the producer learns of completion from the consumer's XferDone at its next step
    limit = time.monotonic() + 20.0
    while p.stats()["completed"] < 1 and time.monotonic() < limit:
        p.driver.step()
    assert p.stats()["completed"] == 1 and p.stats()["pinned_bytes"] == 0


def test_a_release_from_a_finalizer_is_queued_and_taken_at_the_next_step(consumer_driver):
    d = consumer_driver(MemoryNetwork())
    e = d.store.alloc("landed#1", 3 * BB)
    d.store.mark_ready("landed#1")
    d.store.pin_if_ready("landed#1")
    d.release_later("landed#1", e.entry_id)  # any thread: it never touches the store
    assert d.inbox == type(d.inbox)([ReleaseFetched("landed#1", e.entry_id)])
    assert "landed#1" in d.store
    d.step(now=0.0)
    assert "landed#1" not in d.store and not d.inbox


def test_an_unanswered_fetch_misses_exactly_at_its_deadline_on_the_drivers_clock(consumer_driver):
    """No producer listens: the fetch ends as a miss when the clock the test sets passes its
    deadline — not before, whatever the wall clock says."""
    now = [100.0]
    d = consumer_driver(MemoryNetwork(), clock=lambda: now[0])
    fut: Future = Future()
    d.post(StartFetch(ADDR, "a", 103.0, fut))
    for t in (100.0, 101.0, 102.9):
        now[0] = t
        d.step(now=t)
        assert not fut.done()
        assert d.gauges()["in_flight"] == 1
    now[0] = 103.0
    d.step(now=103.0)
    out = fut.result(timeout=0)
    assert isinstance(out, Miss) and out.reason is MissReason.TIMEOUT, out


def test_snapshot_is_answered_by_the_driving_thread(consumer_driver):
    d = consumer_driver(MemoryNetwork())
    fut: Future = Future()
    d.post(Snapshot(fut))
    d.step(now=0.0)
    assert fut.result(timeout=0) == {"producers": 0, "in_flight": 0, "quarantined_peers": 0,
                                     "quarantined_transfers": 0,
                                     "free_blocks": d.store.num_blocks, "offer_reads": 0,
                                     "offers_held": 0}


@pytest.mark.parametrize(("producer_planes", "consumer_planes", "chosen"), [
    (("memory", "memory-push"), ("ucx", "memory-push"), "memory-push"),  # the only common plane
    (("memory-push", "memory"), ("memory", "memory-push"), "memory"),  # the consumer's preference wins
])
def test_best_common_plane_is_chosen(closing, producer_planes, consumer_planes, chosen):
    pytest.importorskip("ucxx") if "ucx" in consumer_planes else None
    net = MemoryNetwork()
    p = _producer(closing, net, planes=producer_planes).start()
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            control=MemoryControlClient(net),
            settings=ConsumerSettings(region_bytes=4 * ROWS * BB),
            node=NodeSettings(planes=consumer_planes),
        )
    )
    rows = _rows(5, 37)
    assert p.put("m", rows)
    assert c.connect(ADDR, timeout_s=20.0) == chosen
    got = c.fetch(ADDR, "m", timeout_s=20.0)
    assert isinstance(got, Fetched) and got.plane == chosen, got
    assert np.array_equal(got.data, rows.reshape(-1))


@pytest.mark.parametrize(("case", "want"), [("planes", NoCommonPlane), ("layout", ProtocolError)])
def test_connect_names_the_refusal_by_type(closing, case, want):
    """Disjoint planes → NoCommonPlane; another layout → ProtocolError (not NoCommonPlane: the
    Welcome's compatibility hash differs from ours), whatever the detail text says."""
    net = MemoryNetwork()
    p = _producer(closing, net, planes=("memory",)).start()
    c = closing(
        ConsumerNode(
            layout=Layout(hidden=512) if case == "layout" else LAYOUT,
            security=Security(insecure=True),
            control=MemoryControlClient(net),
            settings=ConsumerSettings(region_bytes=4 << 20),
            node=NodeSettings(planes=("memory-push",) if case == "planes" else ("memory",)),
        )
    )
    with pytest.raises(want) as err:
        c.connect(ADDR, timeout_s=20.0)
    assert type(err.value) is want
    miss = c.fetch(ADDR, "m", timeout_s=20.0)
    assert isinstance(miss, Miss) and miss.reason is MissReason.INCOMPATIBLE, miss
    assert p.stats()["grants"] == 0


def test_stats_is_one_consistent_copy_while_fetches_run(closing):
    """stats() from another thread while the I/O thread drives: never torn, never an error."""
    net = MemoryNetwork()
    p = _producer(closing, net, planes=("memory-push",)).start()
    for i in range(4):
        assert p.put(f"e{i}", _rows(i, 4))
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            control=MemoryControlClient(net),
            settings=ConsumerSettings(region_bytes=64 * ROWS * BB),
            node=NodeSettings(planes=("memory-push",)),
        )
    )
    stop, seen, errors = threading.Event(), [], []

    def watch():
        while not stop.is_set():
            try:
                st = c.stats()
            except Exception as e:  # noqa: BLE001 - the assertion below reports it
                errors.append(e)
                return
            seen.append(st)

    t = threading.Thread(target=watch)
    t.start()
    try:
        futs = [c.submit(ADDR, f"e{i % 4}", timeout_s=20.0) for i in range(40)]
        outs = [f.result(timeout=30.0) for f in futs]
        assert all(isinstance(o, Fetched) for o in outs), outs
        del outs, futs
    finally:
        stop.set()
        t.join(timeout=30.0)
    assert not errors, errors
    # checked here, not in the thread: an assertion failing there would not fail the test
    assert seen and all(set(st) == {"producers", "in_flight", "quarantined_peers",
                                    "quarantined_transfers", "free_blocks", "offer_reads",
                                    "offers_held"} for st in seen)
    assert all(0 <= st["in_flight"] <= 40 for st in seen)
    assert wait_for(lambda: c.stats()["in_flight"] == 0)


# -- the producer's driver on a clock the test sets -----------------------------------------------
class _RawMemoryConsumer:
    """A hand-rolled ECTP consumer on the memory pair; every exchange steps the producer's driver
    at the time the test names."""

    def __init__(self, net: MemoryNetwork, p: ProducerNode):
        self.client = MemoryControlClient(net)
        self.conn = self.client.connect(HOST, PORT, None)
        self.p = p
        self.session_id = "raw" + "0" * 29
        self.v = max(SUPPORTED_VERSIONS)

    def exchange(self, msg, now: float) -> list:
        if msg is not None:
            assert self.client.send(self.conn, encode(msg))
        self.p.driver.step(now=now)
        return [decode(ev.data, versions=SUPPORTED_VERSIONS)
                for ev in self.client.poll(0.0) if isinstance(ev, Received)]


LEASE_S = 1.0


def _granted(closing) -> tuple[ProducerNode, _RawMemoryConsumer, XferAck]:
    """A producer (lease LEASE_S, grace 0.5 s) that granted "a" to a raw consumer at t = 0."""
    net = MemoryNetwork()
    p = _producer(closing, net, lease_s=LEASE_S, grace_s=0.5)
    assert p.put("a", _rows(3))
    raw = _RawMemoryConsumer(net, p)
    (w,) = raw.exchange(Hello(v=raw.v, session_id=raw.session_id, node_id="raw",
                              versions=list(SUPPORTED_VERSIONS), planes=["memory"],
                              compat_hash=LAYOUT.compat_hash, mem_kinds=["DRAM"],
                              localities={"memory": MemoryFabric.shared().locality}), now=0.0)
    assert isinstance(w, Welcome) and w.status is Status.OK, w
    (ack,) = raw.exchange(XferReq(v=raw.v, session_id=raw.session_id, mm_hash="a",
                                  compat_hash=LAYOUT.compat_hash, dest=b""), now=0.0)
    assert isinstance(ack, XferAck) and ack.status is Status.OK, ack
    return p, raw, ack


def test_an_abandoned_grant_expires_exactly_one_lease_after_it_was_issued(closing):
    p, raw, _ = _granted(closing)
    raw.exchange(None, now=LEASE_S - 0.01)
    assert p.stats()["active_grants"] == 1 and p.lookup("a").pins == 1  # not cut short
    raw.exchange(None, now=LEASE_S + SWEEP_S + 0.01)  # timers are swept every SWEEP_S
    st = p.stats()
    assert st["active_grants"] == 0 and st["expired"] == 1, st
    raw.exchange(None, now=LEASE_S + 0.5 + 2 * SWEEP_S)  # the grace period is over
    assert p.stats()["pinned_bytes"] == 0 and p.lookup("a").pins == 0, p.stats()


def test_renewals_keep_a_grant_then_it_expires_one_lease_after_the_last(closing):
    p, raw, ack = _granted(closing)
    t = 0.0
    for _ in range(10):  # renew every quarter lease: 2.5 leases in all
        t += LEASE_S / 4
        raw.exchange(Renew(v=raw.v, session_id=raw.session_id,
                           grant_ids=[ack.grant.grant_id], extend_s=LEASE_S), now=t)
        assert p.stats()["active_grants"] == 1, (t, p.stats())
    raw.exchange(None, now=t + LEASE_S - 0.1)
    assert p.stats()["active_grants"] == 1, p.stats()
    raw.exchange(None, now=t + LEASE_S + 0.1)
    st = p.stats()
    assert st["active_grants"] == 0 and st["expired"] == 1 and st["completed"] == 0, st
    assert p.lookup("a").pins == 1  # the grace period holds the blocks (ECTP §6.3) ...
    raw.exchange(None, now=t + LEASE_S + 0.7)
    assert p.lookup("a").pins == 0  # ... and then they are free


def test_only_the_io_thread_drives_a_node_whoever_fetches(closing, monkeypatch):
    """The ownership rule: callers on any thread hand their work over; every step of the driver
    (sockets, planes, sessions, store) runs on the node's I/O thread, and a queued fetch posted
    after the node closed misses at once instead of waiting for its deadline."""
    net = MemoryNetwork()
    p = _producer(closing, net, planes=("memory-push",)).start()
    rows = {f"e{i}": _rows(i, 2) for i in range(6)}
    for k, v in rows.items():
        assert p.put(k, v)
    steppers: set[str] = set()
    orig = ConsumerDriver.step

    def step(self, *a, **kw):
        steppers.add(threading.current_thread().name)
        return orig(self, *a, **kw)

    monkeypatch.setattr(ConsumerDriver, "step", step)
    c = closing(ConsumerNode(layout=LAYOUT, security=Security(insecure=True),
                             control=MemoryControlClient(net),
                             settings=ConsumerSettings(region_bytes=4 * ROWS * BB),
                             node=NodeSettings(planes=("memory-push",), node_id="owner")))
    outs: dict[str, object] = {}

    def caller(keys):
        for k in keys:
            outs[k] = c.fetch(ADDR, k, timeout_s=20.0)
            c.stats()

    threads = [threading.Thread(target=caller, args=(ks,), name=f"caller-{i}")
               for i, ks in enumerate((["e0", "e1", "e2"], ["e3", "e4", "e5"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30.0)
    for k, v in rows.items():
        out = outs[k]
        assert isinstance(out, Fetched) and np.array_equal(out.data, v.reshape(-1)), (k, out)
    assert steppers == {"ect-owner"}, steppers
    c.close()
    late = c.fetch(ADDR, "e0", timeout_s=60.0)
    assert isinstance(late, Miss) and late.detail == "consumer closed", late
