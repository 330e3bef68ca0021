"""ECTP v2 negotiated with v1 between real nodes (real CURVE sockets, real planes; issue 16): a
node configured ``versions=(1,)`` against a default one, in both directions, per plane — the
highest common version is chosen and the bytes arrive exactly; ``fetch_many`` works on either.

The v2 wire behaviour itself (ReqBatch/AckBatch, inline, readiness wait, hostile answers) is
tested sans-I/O in ``tests/session/test_consumer_v2.py`` and against a hostile v2 child in
``test_hostile_producer.py``; the cells where both nodes speak v2 need a producer that does
(skipped while ``SUPPORTED_VERSIONS`` lacks 2).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

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
from ectransport.protocol import SUPPORTED_VERSIONS
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import new_keypair, sections, wait_for, wait_free

LAYOUT = Layout(model_id="v2-test", hidden=256)  # 512-byte rows
BB = LAYOUT.block_bytes
HAS_V2 = 2 in SUPPORTED_VERSIONS
needs_v2 = pytest.mark.skipif(not HAS_V2, reason="this build's producer does not speak v2 yet")
#: (producer versions, consumer versions, negotiated); None: the node's default.
CELLS = [
    pytest.param((1,), None, 1, id="p-v1xc-default"),
    pytest.param(None, (1,), 1, id="p-defaultxc-v1"),
    pytest.param((1,), (1, 2), 1, id="p-v1xc-v1v2"),
    pytest.param(None, None, 2, id="p-defaultxc-default", marks=needs_v2),
]


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def _nodes(closing, plane, pv, cv, **consumer_kw):
    pk, ck = new_keypair(), new_keypair()
    p_kw = {} if pv is None else {"versions": pv}
    c_kw = {} if cv is None else {"versions": cv}
    producer = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=pk.public, secret_key=pk.secret, allow=lambda key: key == ck.public
            ),
            **sections(
                ProducerSettings(region_bytes=8 << 20),
                NodeSettings(planes=(plane,), node_id="v2-producer"),
                **p_kw,
            ),
        ).start()
    )
    consumer = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=Security(public_key=ck.public, secret_key=ck.secret),
            **sections(
                ConsumerSettings(region_bytes=8 << 20),
                NodeSettings(planes=(plane,), node_id="v2-consumer"),
                **c_kw,
                **consumer_kw,
            ),
        )
    )
    return producer, consumer, ProducerAddress("127.0.0.1", producer.port, pk.public)


@pytest.mark.parametrize("plane", ["nixl", "tcp"])
@pytest.mark.parametrize(("pv", "cv", "negotiated"), CELLS)
def test_v1_and_v2_nodes_negotiate_and_move_exact_bytes(closing, plane, pv, cv, negotiated):
    producer, consumer, addr = _nodes(closing, plane, pv, cv)
    entries = {f"e{i}": _rows(40 + i, n) for i, n in enumerate((1, 16, 64, 2048))}  # ≤ 1 MiB
    for k, v in entries.items():
        assert producer.put(k, v)
    assert consumer.connect(addr) == plane
    s = consumer.session(addr)
    assert s is not None and s.version == negotiated
    got = consumer.fetch(addr, "e1", timeout_s=15)
    assert isinstance(got, Fetched) and np.array_equal(got.data, entries["e1"].reshape(-1))
    outs = consumer.fetch_many(addr, [*entries, "absent"], timeout_s=15)
    for (k, v), out in zip(entries.items(), outs, strict=False):
        assert isinstance(out, Fetched), (k, out)
        assert np.array_equal(out.data, v.reshape(-1)), k
    assert isinstance(outs[-1], Miss) and outs[-1].reason is MissReason.MISSING
    del got, outs, out
    gc.collect()
    assert wait_free(consumer), consumer.stats()
    assert wait_for(lambda: producer.stats()["pinned_bytes"] == 0, 10.0), producer.stats()


@needs_v2
@pytest.mark.parametrize("plane", ["nixl", "tcp"])
def test_v2_batch_of_eight_posts_the_reads_together(closing, plane):
    """Eight 1 MiB entries asked for with submit_many: one request frame, every entry exact."""
    producer, consumer, addr = _nodes(closing, plane, None, None)
    entries = {f"b{i}": _rows(60 + i, (1 << 20) // BB) for i in range(8)}
    for k, v in entries.items():
        assert producer.put(k, v)
    futs = consumer.submit_many(addr, list(entries), timeout_s=20)
    for (k, v), fut in zip(entries.items(), futs, strict=True):
        out = fut.result(timeout=30)
        assert isinstance(out, Fetched) and np.array_equal(out.data, v.reshape(-1)), (k, out)


@needs_v2
def test_v2_small_entry_comes_inline_without_a_grant(closing):
    events: list[dict] = []
    producer, consumer, addr = _nodes(closing, "tcp", None, None,
                                      observer=lambda e, f: events.append(f) if e == "fetch"
                                      else None)
    small = _rows(70, 4)
    assert producer.put("small", small)
    out = consumer.fetch(addr, "small", timeout_s=15)
    assert isinstance(out, Fetched) and np.array_equal(out.data, small.reshape(-1))
    # inline when the producer's threshold allows it: no grant, nothing pinned there
    inline = [f for f in events if f["outcome"] == "ok" and f["grant_id"] == -1]
    assert inline or producer.stats().get("grants", 0) >= 1
    assert wait_for(lambda: producer.stats()["pinned_bytes"] == 0, 10.0)


def test_inline_max_bytes_is_checked():
    from ectransport.errors import ConfigError

    with pytest.raises(ConfigError, match="inline_max_bytes"):
        ConsumerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            settings=ConsumerSettings(inline_max_bytes=2 << 20),
        )


def test_driver_lands_an_inline_entry_and_a_batch_over_the_memory_pair(closing):
    """One thread steps a ConsumerDriver and a ProducerNode's driver over the in-memory control
    pair: a small entry comes inline (copied into the landing region: exact bytes, no grant at
    the producer), and a submit_many-style batch of granted entries lands exact."""
    import time
    from concurrent.futures import Future

    from ectransport.control.memory import MemoryControlClient, MemoryControlServer, MemoryNetwork
    from ectransport.node import ConsumerDriver
    from ectransport.node.driver import Parts, load_planes
    from ectransport.node.inbox import StartBatch, StartFetch
    from ectransport.session import ConsumerConfig
    from ectransport.store import BlockStore, HostRegion

    net = MemoryNetwork()
    addr = ProducerAddress("127.0.0.1", 5609)
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            control=MemoryControlServer(net, "127.0.0.1", 5609),
            settings=ProducerSettings(region_bytes=4 << 20),
            node=NodeSettings(planes=("memory",)),
        )
    )
    small, big = _rows(80, 8), {f"g{i}": _rows(81 + i, 256) for i in range(3)}  # 4, 128 KiB
    assert p.put("small", small) and all(p.put(k, v) for k, v in big.items())
    region = HostRegion(2048, BB)
    planes = load_planes(("memory",), node_id="v2-driver", region=region, public_key=None)
    cfg = ConsumerConfig(node_id="v2-driver", compat_hash=LAYOUT.compat_hash, planes=("memory",),
                         localities=tuple((n, x.locality()) for n, x in planes.items()))
    d = ConsumerDriver(Parts(MemoryControlClient(net), planes, region, True),
                       BlockStore(2048, BB), LAYOUT, cfg)
    try:
        one: Future = Future()
        d.post(StartFetch(addr, "small", d.clock() + 20.0, one))
        dl = d.clock() + 20.0
        many = StartBatch(addr, dl, tuple(StartFetch(addr, k, dl, Future()) for k in big))
        d.post(many)
        limit = time.monotonic() + 20.0
        futs = [one, *(it.future for it in many.items)]
        while not all(f.done() for f in futs) and time.monotonic() < limit:
            d.step()
            p.driver.step()
        out = one.result(timeout=0)
        assert isinstance(out, Fetched) and np.array_equal(out.data, small.reshape(-1))
        assert d.sessions[addr.key].version == 2
        for (k, v), it in zip(big.items(), many.items, strict=True):
            got = it.future.result(timeout=0)
            assert isinstance(got, Fetched) and np.array_equal(got.data, v.reshape(-1)), k
        st = p.stats()
        assert st["grants"] == 3, st  # the small entry took no grant
    finally:
        d.shutdown()
        d.parts.close()


@needs_v2
def test_v2_an_entry_committed_after_the_ack_timeout_lands_without_blame(closing):
    """Real nodes, v2: the item whose entry is reserved is parked, and the producer says so at
    once (``Parked``), so the fetch outlives three ack timeouts and lands with its bytes when the
    entry is committed — nobody is blamed (the ack timeout is for items neither answered nor
    parked: ``test_producer_failures``)."""
    import time

    blamed: list[dict] = []
    producer, consumer, addr = _nodes(closing, "tcp", None, None, ack_timeout_s=0.5)
    consumer.add_observer(lambda e, f: blamed.append(f) if e == "peer_quarantined" else None)
    data = _rows(90, 6)
    e = producer.reserve("late", data.nbytes)
    fut = consumer.submit(addr, "late", timeout_s=20.0)
    time.sleep(1.5)  # a measurement window: three ack timeouts, the parked fetch still waits
    assert not fut.done()
    producer.region.write(e.runs, data.reshape(-1))
    assert producer.commit("late", e.entry_id)
    out = fut.result(timeout=20.0)
    assert isinstance(out, Fetched) and np.array_equal(out.data, data.reshape(-1)), out
    del out, fut
    assert blamed == [] and producer.stats()["parked_frames"] == 1, producer.stats()
    s = consumer.session(addr)
    assert s is not None and s.version == 2 and not s.ignored
