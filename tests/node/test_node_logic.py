"""Node logic without sockets: both drivers stepped by this thread on one fake clock, over the
in-memory control pair and ``MemoryPlane``, whose transfers the test scripts (fail, stall,
delay, reorder). What the real planes do is in their own tests (tests/data); what crosses
processes is in the stopped-process and two-process tests.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from ectransport.control.memory import MemoryControlClient, MemoryControlServer, MemoryNetwork
from ectransport.node import (
    ConsumerDriver,
    Fetched,
    Layout,
    Miss,
    MissReason,
    ProducerAddress,
    ProducerNode,
    Security,
)
from ectransport.node.driver import Parts, load_planes
from ectransport.node.inbox import StartBatch, StartFetch
from ectransport.session import ConsumerConfig
from ectransport.settings_schema import (
    ConsumerSettings,
    NodeSettings,
    PlanesSettings,
    ProducerSettings,
)
from ectransport.store import BlockStore, HostRegion
from ectransport.testing.memory import Fail, ManualClock, MemoryFabric

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
BB = LAYOUT.block_bytes
ROWS = 8
HOST, PORT = "mem", 5601
ADDR = ProducerAddress(HOST, PORT)
LEASE_S, GRACE_S, READ_S = 4.0, 1.0, 2.0
TICK_S = 0.01


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (ROWS, BB), dtype=np.uint8)


class Rig:
    """A producer node (never started: stepped here) and a consumer driver on one fake clock."""

    def __init__(self, closing, plane: str = "memory", versions: tuple[int, ...] = (1, 2),
                 **consumer: object):
        self.clock = ManualClock(100.0)
        self.fabric = MemoryFabric(clock=self.clock)
        net = MemoryNetwork()
        planes = PlanesSettings(plugins={plane: {"fabric": self.fabric}})
        self.producer = closing(ProducerNode(
            layout=LAYOUT, security=Security(insecure=True),
            control=MemoryControlServer(net, HOST, PORT),
            settings=ProducerSettings(region_bytes=8 * ROWS * BB, budget_bytes=8 * ROWS * BB,
                                      lease_s=LEASE_S,
                                      grace_s=GRACE_S, inline_max_bytes=0),
            node=NodeSettings(planes=(plane,)), plane_settings=planes))
        region = HostRegion(8 * ROWS, BB)
        loaded = load_planes((plane,), node_id="logic", region=region, public_key=None,
                             plane_options=planes.options())
        config = ConsumerConfig(
            node_id="logic", compat_hash=LAYOUT.compat_hash, planes=(plane,), versions=versions,
            localities=tuple((n, p.locality()) for n, p in loaded.items()),
            settings=ConsumerSettings(**{"read_timeout_s": READ_S, "quarantine_s": 30.0,
                                         **consumer}))
        self.consumer = ConsumerDriver(Parts(MemoryControlClient(net), loaded, region, True),
                                       BlockStore(region.num_blocks, BB), LAYOUT, config,
                                       clock=self.clock)
        closing(self)

    def fetch(self, *keys: str, timeout_s: float = 20.0) -> list[Future]:
        deadline = self.clock() + timeout_s
        items = tuple(StartFetch(ADDR, k, deadline, Future()) for k in keys)
        self.consumer.post(StartBatch(ADDR, deadline, items) if len(items) > 1 else items[0])
        return [it.future for it in items]

    def step(self, dt_s: float = TICK_S) -> None:
        """One round of both sides at the current fake time, then time moves on."""
        now = self.clock()
        self.consumer.step(now=now)
        self.producer.driver.step(now=now)
        self.consumer.step(now=now)
        self.clock.advance(dt_s)

    def run(self, done, limit_s: float = 60.0, dt_s: float = TICK_S) -> None:
        end = self.clock() + limit_s
        while not done() and self.clock() < end:
            self.step(dt_s)
        assert done(), "not done within the fake time limit"

    def close(self) -> None:
        self.consumer.shutdown()
        self.consumer.parts.close()


def test_a_failed_read_is_a_miss_and_its_grant_is_given_back(closing):
    rig = Rig(closing)
    assert rig.producer.put("a", _rows(1))
    rig.fabric.fail_next("NIC on fire")
    (fut,) = rig.fetch("a")
    rig.run(fut.done)
    out = fut.result(timeout=0)
    assert isinstance(out, Miss) and out.reason is MissReason.INTERNAL, out
    assert "NIC on fire" in out.detail
    rig.run(lambda: rig.producer.stats()["abandoned"] == 1)  # the XferDone(ok=False)
    rig.run(lambda: rig.producer.lookup("a").pins == 0)  # after its grace period (a READ plane)
    assert rig.consumer.gauges()["free_blocks"] == rig.consumer.store.num_blocks


def test_a_stalled_read_is_quarantined_at_its_deadline_and_settled_once_it_is_over(closing):
    rig = Rig(closing)
    assert rig.producer.put("a", _rows(2))
    rig.fabric.stall_next()
    (fut,) = rig.fetch("a")
    t0 = rig.clock()
    rig.run(fut.done)
    out = fut.result(timeout=0)
    assert isinstance(out, Miss) and out.reason is MissReason.TIMEOUT, out
    assert rig.clock() - t0 >= READ_S - TICK_S  # not before the read deadline, on the fake clock
    g = rig.consumer.gauges()
    assert g["quarantined_transfers"] == 1 and g["free_blocks"] < rig.consumer.store.num_blocks
    (xfer,) = rig.fabric.stalled()
    xfer.resume(Fail("gave up"))  # the plane reports the transfer over ...
    rig.run(lambda: rig.consumer.gauges()["quarantined_transfers"] == 0)
    assert rig.consumer.gauges()["free_blocks"] == rig.consumer.store.num_blocks  # ... blocks back
    assert xfer.released


def test_a_completion_seen_after_the_validity_window_is_never_a_fetch(closing):
    """The READ completes just after ``request sent + lease - margin`` (the step that sees it
    checks the plane before it applies deadlines): whatever its bytes, the fetch is a miss
    (ECTP v1 §6.3), never Fetched. (A v1 consumer: its Renews are never confirmed; confirmed
    ones, ECTP v2 §11, are in test_renewals.py.)"""
    rig = Rig(closing, validity_margin_s=0.25, read_timeout_s=30.0, versions=(1,))
    assert rig.producer.put("a", _rows(3))
    sent = rig.clock()  # the request leaves in the first step
    rig.fabric.delay_next(at=sent + LEASE_S - 0.25 + 0.001)
    (fut,) = rig.fetch("a", timeout_s=60.0)
    rig.run(fut.done)
    out = fut.result(timeout=0)
    assert isinstance(out, Miss) and out.reason is MissReason.TIMEOUT, out
    assert "after its grant's validity window" in out.detail, out


def test_completions_out_of_posting_order_each_land_their_own_bytes(closing):
    rig = Rig(closing)
    rows = {k: _rows(10 + i) for i, k in enumerate("abcd")}
    for k, v in rows.items():
        assert rig.producer.put(k, v)
    group = rig.fabric.reorder_next(4)  # the four READs of one batch complete in reverse order
    futs = rig.fetch(*rows)
    rig.run(lambda: all(f.done() for f in futs))
    for (k, v), f in zip(rows.items(), futs, strict=True):
        out = f.result(timeout=0)
        assert isinstance(out, Fetched) and np.array_equal(out.data, v.reshape(-1)), (k, out)
    assert [x.seq for x in group.members] == sorted(x.seq for x in group.members)


@pytest.mark.parametrize(("plane", "held_s"), [("memory", GRACE_S), ("memory-push", 0.0)])
def test_an_abandoned_grant_keeps_its_pin_for_the_grace_period_only_on_a_read_plane(
        closing, plane, held_s):
    """A grant given back (the READ failed): on a READ plane the producer cannot revoke a READ
    in flight, so the blocks stay pinned ``grace_s`` more; a PUSH plane stops every access when
    it revokes, so the pin goes at the next sweep."""
    rig = Rig(closing, plane=plane)
    assert rig.producer.put("a", _rows(4))
    rig.fabric.fail_next()
    (fut,) = rig.fetch("a")
    rig.run(fut.done)
    rig.run(lambda: rig.producer.stats()["abandoned"] == 1)
    ended = rig.clock()
    rig.run(lambda: rig.producer.lookup("a").pins == 0)
    assert held_s - 0.1 <= rig.clock() - ended <= held_s + 0.2, rig.clock() - ended
