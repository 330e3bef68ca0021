"""The vLLM wire compatibility profile against vLLM 0.33.0's own EC P2P classes (real ZMQ, real
NIXL, in this process): vLLM's ConsumerSession fetches from our producer, our consumer fetches from
vLLM's ProducerSession; bytes verified; refusals typed; opt-in enforced."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from ectransport.compat.vllm_wire import (
    PROFILE,
    VllmWireConsumer,
    VllmWireProducerNode,
    WireAck,
    encode_req,
    vllm_compat_hash,
)
from ectransport.errors import ConfigError
from ectransport.node import Fetched, Layout, Miss, MissReason, Security
from interop.vllm_side import (
    EC_CONNECTOR_VERSION,
    VLLM_VERSION,
    StockVllmConsumer,
    StockVllmProducer,
    vllm_hash,
)
from tests.conftest import wait_for

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow

LAYOUT = Layout(model_id="org/encoder-x", dtype="bfloat16", hidden=256)  # 512-byte rows
BB = LAYOUT.block_bytes
INSECURE = Security(insecure=True)


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def test_compat_hash_and_ack_encoding_match_vllm():
    from vllm.distributed.ec_transfer.ec_connector.cpu.protocol import XferAck, XferStatus

    assert vllm_compat_hash(VLLM_VERSION, LAYOUT.model_id, "bfloat16", BB) == \
        vllm_hash(LAYOUT.model_id, "bfloat16", BB)
    enc = msgspec.msgpack.Encoder()
    ours = WireAck(mm_hash="m", status=0, session_id="s", src_block_indices=[0, 1],
                   agent_metadata=b"md", mem_descriptor=b"dd")
    theirs = XferAck(mm_hash="m", status=XferStatus.OK, session_id="s", src_block_indices=[0, 1],
                     agent_metadata=b"md", mem_descriptor=b"dd")
    assert enc.encode(ours) == enc.encode(theirs)
    assert enc.encode(WireAck(mm_hash="m", status=1)) == \
        enc.encode(XferAck(mm_hash="m", status=XferStatus.NACK_MISSING))
    assert EC_CONNECTOR_VERSION == 2


@pytest.mark.parametrize("kw", [dict(profile=None, security=INSECURE),
                                dict(profile="vllm", security=INSECURE),
                                dict(profile=PROFILE, security=Security())])
def test_profile_is_refused_without_opt_in(kw):
    with pytest.raises(ConfigError):
        VllmWireProducerNode(layout=LAYOUT, **kw)
    with pytest.raises(ConfigError):
        VllmWireConsumer(layout=LAYOUT, **kw)


@pytest.fixture
def our_producer():
    p = VllmWireProducerNode(profile=PROFILE, security=INSECURE, layout=LAYOUT,
                             region_bytes=256 * BB, vllm_version=VLLM_VERSION)
    p.start()
    yield p
    p.close()


@pytest.fixture
def stock_consumer():
    c = StockVllmConsumer(model=LAYOUT.model_id, dtype="bfloat16", block_bytes=BB, num_blocks=256)
    yield c
    c.close()


def test_stock_vllm_consumer_fetches_from_our_producer(our_producer, stock_consumer):
    a, b = _rows(7, 1), _rows(33, 2)
    our_producer.put("a", a)
    our_producer.put("filler", _rows(5, 3))
    our_producer.put("b", b)
    addr = ("127.0.0.1", our_producer.port)
    # two fetches on one vLLM session: the second grant's metadata differs, so vLLM re-registers
    for mm, rows in (("a", a), ("b", b), ("a", a)):
        out = stock_consumer.fetch(addr, mm, rows.shape[0])
        assert out.state == "completed", out
        assert np.array_equal(out.data, rows.reshape(-1))
    assert wait_for(lambda: our_producer.stats()["active_grants"] == 0, 5.0), our_producer.stats()
    assert our_producer.stats()["pinned_bytes"] == 0
    assert our_producer.session.stats["completed"] == 3


def test_our_grant_exposes_only_granted_blocks(our_producer):
    import zmq

    our_producer.put("x", _rows(4, 4))
    our_producer.put("y", _rows(4, 5))
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{our_producer.port}")
    h = vllm_hash(LAYOUT.model_id, "bfloat16", BB)
    try:
        s.send_multipart([b"", encode_req("y", h, "sess-1")])
        assert s.poll(5000)
        ack = msgspec.msgpack.decode(s.recv_multipart()[1], type=WireAck)
        assert ack.status == 0 and ack.src_block_indices == [0, 1, 2, 3]
        descs = msgspec.msgpack.decode(ack.mem_descriptor)
        y = our_producer.lookup("y")
        base = our_producer.region.addr
        want = [[base + (r.start + i) * BB, BB, 0] for r in y.runs for i in range(r.count)]
        assert descs == want  # only y's blocks, in payload order
        # a second request of the same session while the first grant is live: NOT_READY
        s.send_multipart([b"", encode_req("x", h, "sess-1")])
        assert s.poll(5000)
        assert msgspec.msgpack.decode(s.recv_multipart()[1], type=WireAck).status == 5
        # an explicit foreign connector version: NACK_VERSION
        s.send_multipart([b"", encode_req("x", h, "sess-2", connector_version=3)])
        assert s.poll(5000)
        assert msgspec.msgpack.decode(s.recv_multipart()[1], type=WireAck).status == 3
    finally:
        s.close(0)
        ctx.term()


@pytest.mark.parametrize("case", ["missing", "incompat"])
def test_stock_vllm_consumer_refusals(our_producer, case):
    our_producer.put("a", _rows(3, 6))
    model = LAYOUT.model_id if case == "missing" else "other/model"
    c = StockVllmConsumer(model=model, dtype="bfloat16", block_bytes=BB, num_blocks=16)
    try:
        out = c.fetch(("127.0.0.1", our_producer.port), "nope" if case == "missing" else "a", 3,
                      timeout_s=5.0)
        assert out.state == "tombstoned", out
    finally:
        c.close()
    assert our_producer.stats()["pinned_bytes"] == 0


@pytest.fixture
def stock_producer():
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    p = StockVllmProducer(host="127.0.0.1", port=port, model=LAYOUT.model_id, dtype="bfloat16",
                          block_bytes=BB, num_blocks=128)
    yield p
    p.close()


def test_our_consumer_fetches_from_stock_vllm_producer(stock_producer):
    a, b = _rows(9, 7), _rows(40, 8)
    stock_producer.put("a", a)
    stock_producer.put("b", b)
    stock_producer.put("late", _rows(2, 9), ready=False)
    c = VllmWireConsumer(profile=PROFILE, security=INSECURE, layout=LAYOUT, region_bytes=64 * BB)
    addr = ("127.0.0.1", stock_producer.port)
    try:
        for mm, rows in (("a", a), ("b", b)):
            out = c.fetch(addr, mm, rows.nbytes, timeout_s=10.0)
            assert isinstance(out, Fetched), out
            assert np.array_equal(out.data, rows.reshape(-1))
        assert wait_for(lambda: stock_producer.pinned("a") == 0 and stock_producer.pinned("b") == 0,
                     5.0)
        out = c.fetch(addr, "nope", BB, timeout_s=5.0)
        assert isinstance(out, Miss) and out.reason is MissReason.MISSING, out
        out = c.fetch(addr, "late", 2 * BB, timeout_s=0.5)  # NOT_READY until the deadline
        assert isinstance(out, Miss) and out.reason is MissReason.MISSING, out
        stock_producer.mark_ready("late")
        assert isinstance(c.fetch(addr, "late", 2 * BB, timeout_s=5.0), Fetched)
        assert c.store.free_blocks == c.store.num_blocks
    finally:
        c.close()
    for kw, reason in ((dict(layout=Layout(LAYOUT.model_id, "float16", 256)),
                        MissReason.INCOMPATIBLE),
                       (dict(layout=LAYOUT, connector_version=3), MissReason.VERSION)):
        c = VllmWireConsumer(profile=PROFILE, security=INSECURE, region_bytes=64 * BB, **kw)
        try:
            out = c.fetch(addr, "a", a.nbytes, timeout_s=5.0)
            assert isinstance(out, Miss) and out.reason is reason, out
        finally:
            c.close()


def test_our_consumer_pipelines_fetches_on_the_shared_driver(stock_producer):
    """VllmWireConsumer runs on ConsumerNode's driver and I/O loop: several fetches in flight at
    once, each verified; afterwards nothing is in flight and every landing block is free."""
    rows = {f"p{i}": _rows(10 + i, 20 + i) for i in range(4)}
    for k, r in rows.items():
        stock_producer.put(k, r)
    c = VllmWireConsumer(profile=PROFILE, security=INSECURE, layout=LAYOUT, region_bytes=128 * BB)
    addr = ("127.0.0.1", stock_producer.port)
    try:
        futs = {k: c.submit(addr, k, r.nbytes, timeout_s=20.0) for k, r in rows.items()}
        for k, fut in futs.items():
            out = fut.result(timeout=30.0)
            assert isinstance(out, Fetched), out
            assert np.array_equal(out.data, rows[k].reshape(-1))
        assert wait_for(lambda: c.stats()["in_flight"] == 0), c.stats()
        assert c.stats()["producers"] == 1 and c.store.free_blocks == c.store.num_blocks
    finally:
        c.close()
