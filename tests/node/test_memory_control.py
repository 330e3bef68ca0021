"""Node logic over the in-memory control pair and the in-memory planes: the real ProducerNode
and ConsumerNode, no sockets — so a test can hold back the producer's answers (a stopped
consumer loop) deterministically, with no signals and no sleeps."""

from __future__ import annotations

import numpy as np
import pytest

from ectransport.control.memory import MemoryControlClient, MemoryControlServer, MemoryNetwork
from ectransport.node import (
    ConsumerNode,
    Fetched,
    Layout,
    Miss,
    MissReason,
    ProducerAddress,
    ProducerNode,
    Security,
)
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import sections, wait_for

LAYOUT = Layout(hidden=256, dtype="bfloat16")
ROWS = 16
PLANES = ["memory-push", "memory"]  # PUSH and READ


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)


def _pair(closing, plane: str, **producer_kw):
    net = MemoryNetwork()
    producer_kw.setdefault("inline_max_bytes", 0)  # grants and leases: never inline (ECTP v2)
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            control=MemoryControlServer(net, "127.0.0.1", 5601),
            **sections(
                ProducerSettings(
                    region_bytes=ROWS * LAYOUT.block_bytes, budget_bytes=ROWS * LAYOUT.block_bytes
                ),
                NodeSettings(planes=(plane,)),
                **producer_kw,
            ),
        )
    )
    client = MemoryControlClient(net)
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            control=client,
            settings=ConsumerSettings(region_bytes=4 * ROWS * LAYOUT.block_bytes),
            node=NodeSettings(planes=(plane,)),
        )
    )
    return p, c, client, ProducerAddress("127.0.0.1", 5601)


@pytest.mark.parametrize("plane", PLANES)
def test_fetch_over_the_memory_control_pair(closing, plane):
    p, c, _, addr = _pair(closing, plane)
    a = _rows(1)
    assert p.put("a", a)
    p.start()
    out = c.fetch(addr, "a", timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, a.reshape(-1))
    assert wait_for(lambda: p.stats()["completed"] == 1, 5.0), p.stats()


@pytest.mark.parametrize("plane", PLANES)
def test_an_ack_held_past_the_lease_is_never_used(closing, plane):
    """Issue 13 point 1 without signals: the producer's answer is held back (the consumer's loop
    is stuck) while the lease expires and another entry takes the very blocks; the late grant
    is not used — the fetch asks again and misses (the entry is gone), never lands B's bytes."""
    p, c, client, addr = _pair(closing, plane, lease_s=0.3, grace_s=0.0)
    a, b = _rows(1), _rows(2)
    assert p.put("a", a)
    p.start()
    c.connect(addr, timeout_s=10.0)
    client.freeze(addr.key)  # from now on the producer's frames wait
    fut = c.submit(addr, "a", timeout_s=20.0)
    assert wait_for(lambda: p.stats()["grants"] == 1, 10.0), p.stats()
    assert wait_for(lambda: p.stats()["expired"] == 1, 10.0), p.stats()
    assert wait_for(lambda: p.lookup("a").pins == 0, 10.0)
    blocks = p.lookup("a").runs
    assert p.put("b", b) and p.lookup("a") is None and p.lookup("b").runs == blocks
    client.freeze(addr.key, False)  # the stale grant arrives now
    out = fut.result(timeout=30.0)
    assert isinstance(out, Miss), f"a stale grant was used: {out}"
    assert out.reason is MissReason.MISSING, out  # asked again: a is gone
    del out
