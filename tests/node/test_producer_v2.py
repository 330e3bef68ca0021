"""A real ProducerNode speaking ECTP v2, driven with hand-made frames from a raw client: over the
in-memory control pair (node logic, no sockets, no sleeps) and over real ZeroMQ + CURVE.

Batches answered at once, waiting items named in a ``Parked`` frame at once and answered on
``commit`` / ``abort`` / at the end of their wait, inline entries with their exact bytes, batch grants completed by ``XferDone``, and a batch
on a v1 session refused while the node keeps serving.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from ectransport.control.base import Received, Up
from ectransport.control.memory import MemoryControlClient, MemoryControlServer, MemoryNetwork
from ectransport.node import Layout, ProducerNode, Security
from ectransport.protocol import (
    AckBatch,
    Hello,
    Nack,
    Parked,
    ReqBatch,
    ReqItem,
    Status,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)
from ectransport.settings_schema import NodeSettings, ProducerSettings
from tests.conftest import new_keypair, sections, wait_for
from tests.node._ectp_raw import RawClient

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
ROW = LAYOUT.block_bytes
V = (1, 2)


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, ROW), dtype=np.uint8)


class MemoryRaw:
    """A consumer that speaks raw ECTP frames over the in-memory control pair."""

    def __init__(self, net: MemoryNetwork, port: int, versions=V):
        self.client = MemoryControlClient(net, public_key="consumer-key")
        self.conn = self.client.connect("127.0.0.1", port, None)
        self.session_id = uuid.uuid4().hex
        self.versions = versions
        self.v = max(versions)
        self._pending: list[bytes] = []
        deadline = time.monotonic() + 5.0
        while not any(isinstance(ev, Up) for ev in self.client.poll(0.1)):
            assert time.monotonic() < deadline, "no Up"

    def send(self, msg) -> None:
        assert self.client.send(self.conn, encode(msg))

    def recv(self, timeout_s: float = 5.0):
        deadline = time.monotonic() + timeout_s
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no frame within {timeout_s} s")
            self._pending += [ev.data for ev in self.client.poll(left)
                              if isinstance(ev, Received)]
        return decode(self._pending.pop(0), versions=V)

    def silent(self, timeout_s: float) -> bool:
        self._pending += [ev.data for ev in self.client.poll(timeout_s)
                          if isinstance(ev, Received)]
        return not self._pending

    def hello(self) -> Welcome:
        self.send(Hello(v=self.v, session_id=self.session_id, node_id="raw",
                        versions=list(self.versions), planes=["tcp"],
                        compat_hash=LAYOUT.compat_hash, mem_kinds=["DRAM"]))
        w = self.recv()
        assert isinstance(w, Welcome) and w.status is Status.OK, w
        self.v = w.version
        return w

    def batch(self, *mms: str, batch_id: int = 1, wait_s: float = 0.0,
              inline_max: int = 0, v: int | None = None) -> None:
        self.send(ReqBatch(v=self.v if v is None else v, session_id=self.session_id,
                           batch_id=batch_id, compat_hash=LAYOUT.compat_hash, wait_s=wait_s,
                           inline_max=inline_max,
                           items=[ReqItem(mm_hash=m, dest=b"") for m in mms]))

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def mem(closing):
    def make(versions=V, client_versions=V, **kw):
        net = MemoryNetwork()
        p = closing(
            ProducerNode(
                layout=LAYOUT,
                security=Security(insecure=True),
                control=MemoryControlServer(net, "127.0.0.1", 5601),
                **sections(
                    ProducerSettings(region_bytes=64 * ROW),
                    NodeSettings(planes=("tcp",), versions=versions),
                    **kw,
                ),
            )
        )
        p.start()
        return p, closing(MemoryRaw(net, 5601, client_versions))

    return make


def test_batch_answered_at_once_inline_and_grants(mem):
    p, c = mem(inline_max_bytes=4 * ROW)
    small, big = _rows(2, 1), _rows(8, 2)
    assert p.put("small", small) and p.put("big", big)
    assert c.hello().version == 2
    c.batch("small", "big", "nope", batch_id=11, inline_max=1 << 20)
    a = c.recv()
    assert isinstance(a, AckBatch) and a.batch_id == 11 and a.v == 2
    got = {it.mm_hash: it for it in a.items}
    assert [it.mm_hash for it in a.items] == ["small", "big", "nope"]
    assert got["small"].status is Status.OK and got["small"].grant is None
    assert got["small"].data == small.tobytes()  # the exact bytes, inline
    assert got["big"].status is Status.OK and got["big"].grant is not None
    assert got["big"].grant.entry_bytes == big.nbytes and got["big"].data == b""
    assert got["nope"].status is Status.NACK_MISSING
    assert p.lookup("small").pins == 0 and p.lookup("big").pins == 1
    assert p.stats()["inline"] == 1 and p.stats()["grants"] == 1
    c.send(XferDone(v=2, session_id=c.session_id, mm_hash="big",
                    grant_id=got["big"].grant.grant_id, ok=True))
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0, 5.0), p.stats()
    assert p.stats()["completed"] == 1


def test_waiting_item_answered_on_commit_without_polling(mem):
    p, c = mem(max_wait_s=10.0)
    data = _rows(3, 3)
    e = p.reserve("late", data.nbytes)
    c.hello()
    c.batch("late", batch_id=5, wait_s=10.0)
    pk = c.recv()  # parked at once: the consumer knows the producer is alive and waiting
    assert isinstance(pk, Parked) and pk.batch_id == 5 and pk.items == ["late"], pk
    assert pk.wait_s == 10.0 and pk.v == 2
    assert c.silent(0.2)  # waits at the producer: no NOT_READY, no retry
    p.region.write(e.runs, data.reshape(-1))
    t0 = time.monotonic()
    assert p.commit("late", e.entry_id)
    a = c.recv()
    took = time.monotonic() - t0
    assert isinstance(a, AckBatch) and a.batch_id == 5
    (it,) = a.items
    assert it.status is Status.OK and it.grant is not None and p.lookup("late").pins == 1
    assert took < 1.0, f"answered {took:.3f} s after the commit"  # not after the 10 s wait
    assert p.session.waiting_items == 0


def test_waiting_item_answered_missing_on_abort_and_not_ready_at_the_end(mem):
    p, c = mem(max_wait_s=0.3)
    e = p.reserve("aborted", 4 * ROW)
    p.reserve("never", 4 * ROW)
    c.hello()
    c.batch("aborted", "never", batch_id=2, wait_s=30.0)  # capped to the node's 0.3 s
    t0 = time.monotonic()
    pk = c.recv()
    assert isinstance(pk, Parked) and pk.items == ["aborted", "never"] and pk.wait_s == 0.3, pk
    assert p.abort("aborted", e.entry_id)
    a = c.recv()
    assert [(it.mm_hash, it.status) for it in a.items] == [("aborted", Status.NACK_MISSING)]
    a = c.recv()
    waited = time.monotonic() - t0
    assert [(it.mm_hash, it.status) for it in a.items] == [("never", Status.NACK_NOT_READY)]
    assert 0.25 <= waited < 5.0, waited
    assert p.session.waiting_items == 0 and p.stats()["pinned_bytes"] == 0


def test_batch_on_a_v1_session_is_refused_and_the_node_keeps_serving(mem):
    p, c = mem(client_versions=(1,))
    assert p.put("a", _rows(1, 4))
    assert c.hello().version == 1
    for v in (1, 2):
        c.batch("a", v=v)
        n = c.recv()
        assert isinstance(n, Nack) and n.status is Status.NACK_VERSION and n.v == 1, n
    c.send(XferReq(v=1, session_id=c.session_id, mm_hash="a", compat_hash=LAYOUT.compat_hash,
                   dest=b""))
    ack = c.recv()
    assert isinstance(ack, XferAck) and ack.status is Status.OK and ack.v == 1
    assert p.stats()["bad_frames"] == 2


def test_a_node_configured_for_v1_only_speaks_v1(mem):
    p, c = mem(versions=(1,))
    assert p.put("a", _rows(1, 5))
    w = c.hello()
    assert w.version == 1 and w.versions == [1]
    c.batch("a", v=2)
    n = c.recv()
    assert isinstance(n, Nack) and n.status is Status.NACK_VERSION


def test_duplicate_items_and_a_reused_batch_id_are_refused(mem):
    p, c = mem()
    assert p.put("a", _rows(1, 6))
    p.reserve("nr", ROW)
    c.hello()
    c.batch("a", "a", batch_id=1)
    a = c.recv()
    assert [it.status for it in a.items] == [Status.NACK_BAD_REQUEST] * 2
    c.batch("nr", batch_id=2, wait_s=5.0)
    pk = c.recv()
    assert isinstance(pk, Parked) and pk.batch_id == 2 and pk.items == ["nr"], pk
    c.batch("a", batch_id=2)
    n = c.recv()
    assert isinstance(n, Nack) and n.status is Status.NACK_BAD_REQUEST and "batch 2" in n.detail
    assert p.stats()["grants"] == 0 and p.lookup("a").pins == 0


# -- real ZeroMQ + CURVE ----------------------------------------------------------------------------
def test_v2_over_zmq_and_curve(closing):
    kp_p, kp_c = new_keypair(), new_keypair()
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=kp_p.public, secret_key=kp_p.secret, allow=lambda k: k == kp_c.public
            ),
            settings=ProducerSettings(region_bytes=64 * ROW, inline_max_bytes=4 * ROW),
            node=NodeSettings(planes=("tcp",)),
        )
    )
    small, big = _rows(1, 7), _rows(6, 8)
    assert p.put("small", small) and p.put("big", big)
    e = p.reserve("late", ROW)
    p.start()
    raw = closing(RawClient("127.0.0.1", p.port, server_key=kp_p.public, public_key=kp_c.public,
                            secret_key=kp_c.secret))
    w = raw.hello(LAYOUT.compat_hash, planes=("tcp",), versions=V)
    assert w.status is Status.OK and w.version == 2, w
    raw.send_raw(encode(ReqBatch(v=2, session_id=raw.session_id, batch_id=77,
                                 compat_hash=LAYOUT.compat_hash, wait_s=5.0, inline_max=1 << 16,
                                 items=[ReqItem(mm_hash=m, dest=b"")
                                        for m in ("small", "big", "late")])))
    a = raw.recv()
    assert isinstance(a, AckBatch) and a.batch_id == 77
    got = {it.mm_hash: it for it in a.items}
    assert set(got) == {"small", "big"}
    assert got["small"].data == small.tobytes() and got["small"].grant is None
    assert got["big"].grant is not None
    pk = raw.recv()  # in the same step: the waiting item is named parked
    assert isinstance(pk, Parked) and pk.batch_id == 77 and pk.items == ["late"], pk
    assert pk.wait_s == 5.0
    p.region.write(e.runs, np.zeros(ROW, dtype=np.uint8))
    assert p.commit("late", e.entry_id)
    a = raw.recv()
    assert [it.mm_hash for it in a.items] == ["late"] and a.items[0].status is Status.OK
    # the late entry is one row: within 4 rows, so inline as well
    assert a.items[0].data == bytes(ROW) and a.items[0].grant is None
    raw.done("big", got["big"].grant.grant_id)
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0, 5.0), p.stats()
