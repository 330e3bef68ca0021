"""Grant leases on a real ProducerNode, driven by a hand-rolled ECTP client (raw pyzmq DEALER).

The raw client gets OK grants and then misbehaves: never completes, completes late, repeats its
request, sends garbage. The producer must unpin exactly once and keep serving real consumers.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from ectransport.node import ConsumerNode, Fetched, Layout, ProducerAddress, ProducerNode, Security
from ectransport.protocol import Nack, Status, XferAck, XferReq, encode
from ectransport.settings_schema import ConsumerSettings, ProducerSettings
from tests.conftest import DEADLINE_S, wait_for
from tests.node._ectp_raw import RawClient

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
ROWS = 30
DATA = np.random.default_rng(3).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)
MM = "lease-item"
PIN_BYTES = ROWS * LAYOUT.block_bytes
LEASE_S = 1.0


GRACE_S = 0.5


def _producer(closing, lease_s: float) -> ProducerNode:
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            settings=ProducerSettings(
                region_bytes=1 << 20, lease_s=lease_s, grace_s=GRACE_S, inline_max_bytes=0
            ),
        )
    )  # leases: every fetch takes a grant
    assert p.put(MM, DATA)
    return p.start()


@pytest.fixture
def raw_for(closing):
    def make(p: ProducerNode) -> RawClient:
        c = closing(RawClient("127.0.0.1", p.port))
        w = c.hello(LAYOUT.compat_hash, versions=(1,))  # these tests speak v1's frames
        assert w.status is Status.OK and w.version == 1 and w.plane == "nixl", w
        return c

    return make


def _pins(p: ProducerNode) -> int:
    return p.lookup(MM).pins


def _real_fetch_ok(p: ProducerNode, closing) -> None:
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            settings=ConsumerSettings(region_bytes=1 << 20),
        )
    )
    out = c.fetch(ProducerAddress("127.0.0.1", p.port), MM, timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, DATA.reshape(-1))
    # completion (NIXL notification / XferDone) reaches the producer shortly after the fetch
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0), p.stats()


def test_lease_expiry_unpins_an_abandoned_grant(closing, raw_for):
    p = _producer(closing, LEASE_S)
    raw = raw_for(p)
    ack = raw.req(MM, LAYOUT.compat_hash)
    assert ack.status is Status.OK and ack.grant is not None, ack
    assert ack.grant.lease_s == LEASE_S
    assert ack.grant.entry_bytes == DATA.nbytes and ack.grant.num_blocks == ROWS
    st = p.stats()
    assert st["pinned_bytes"] == PIN_BYTES and st["active_grants"] == 1 and st["grants"] == 1, st
    assert _pins(p) == 1

    # (that it is not cut short is tested on the test's own clock in test_driver.py)
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0, LEASE_S + DEADLINE_S), p.stats()
    st = p.stats()
    assert st["expired"] == 1 and st["completed"] == 0 and st["released_peer_down"] == 0, st
    assert st["active_grants"] == 0
    # the expired grant's blocks stay pinned for the grace period, then are free (ECTP §6.3)
    assert wait_for(lambda: _pins(p) == 0, GRACE_S + DEADLINE_S)
    assert p.store.pinned_blocks == 0

    # a late XferDone for the expired grant is a harmless late signal
    raw.done(MM, ack.grant.grant_id)
    assert wait_for(lambda: p.stats()["late_signals"] == 1), p.stats()
    assert p.stats()["completed"] == 0
    # the same session may ask again and gets a fresh grant
    again = raw.req(MM, LAYOUT.compat_hash)
    assert again.status is Status.OK and again.grant.grant_id != ack.grant.grant_id
    assert p.stats()["pinned_bytes"] == PIN_BYTES and _pins(p) == 1
    raw.done(MM, again.grant.grant_id)
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0)
    assert _pins(p) == 0


# Renewals and the exact moment a lease ends are tested on a clock the test sets, with the
# producer's driver stepped by hand: test_driver.py::test_renewals_keep_a_grant_then_it_expires...


def test_xfer_done_releases_at_once(closing, raw_for):
    p = _producer(closing, 60.0)
    raw = raw_for(p)
    ack = raw.req(MM, LAYOUT.compat_hash)
    assert ack.status is Status.OK
    assert p.stats()["pinned_bytes"] == PIN_BYTES and _pins(p) == 1
    raw.done(MM, ack.grant.grant_id, ok=True)
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0), p.stats()
    # released by the XferDone ("completed"), not by its 60 s lease ("expired"); a confirmed
    # completion needs no grace period: the pin is gone too
    st = p.stats()
    assert st["completed"] == 1 and st["expired"] == 0 and st["active_grants"] == 0, st
    assert _pins(p) == 0
    # a second XferDone for the same grant is a late signal, not a second unpin
    raw.done(MM, ack.grant.grant_id, ok=True)
    assert wait_for(lambda: p.stats()["late_signals"] == 1), p.stats()
    assert p.stats()["completed"] == 1 and _pins(p) == 0


def test_duplicate_req_returns_same_grant_without_second_pin(closing, raw_for):
    p = _producer(closing, 60.0)
    raw = raw_for(p)
    first = raw.req(MM, LAYOUT.compat_hash)
    second = raw.req(MM, LAYOUT.compat_hash)
    assert first.status is Status.OK and second.status is Status.OK
    assert second.grant.grant_id == first.grant.grant_id
    assert second == first
    st = p.stats()
    assert st["grants"] == 1 and st["active_grants"] == 1 and st["pinned_bytes"] == PIN_BYTES, st
    assert _pins(p) == 1
    raw.done(MM, first.grant.grant_id)
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0), p.stats()
    assert _pins(p) == 0 and p.stats()["completed"] == 1


def test_garbage_frames_get_nacks_and_node_stays_healthy(closing, raw_for):
    p = _producer(closing, 60.0)
    raw = closing(RawClient("127.0.0.1", p.port))

    # before Hello: not msgpack, unknown kind, an XferReq without a session
    raw.send_raw(b"\x00\xffnot msgpack at all")
    nack = raw.recv()
    assert isinstance(nack, Nack) and nack.status is Status.NACK_BAD_REQUEST, nack
    raw.send_raw(msgspec.msgpack.encode({"k": "launch-missiles", "v": 1}))
    nack = raw.recv()
    assert isinstance(nack, Nack) and nack.status is Status.NACK_BAD_REQUEST, nack
    assert "unknown message kind" in nack.detail
    raw.send_raw(msgspec.msgpack.encode([1, 2, 3]))
    assert isinstance(raw.recv(), Nack)
    ack = raw.req(MM, LAYOUT.compat_hash)
    assert ack.status is Status.NACK_BAD_REQUEST and ack.grant is None and "Hello" in ack.detail

    # after Hello: a request at an un-negotiated version, a malformed request body
    w = raw.hello(LAYOUT.compat_hash, versions=(1,))  # the frames below are v1's
    assert w.status is Status.OK
    ack = raw.req(MM, LAYOUT.compat_hash, v=7)
    assert ack.status is Status.NACK_VERSION and ack.grant is None, ack
    assert ack.mm_hash == MM and ack.session_id == raw.session_id
    raw.send_raw(msgspec.msgpack.encode({"k": "req", "v": 1, "session_id": raw.session_id,
                                         "mm_hash": MM, "compat_hash": 5, "dest": b""}))
    ack = raw.recv()
    assert isinstance(ack, XferAck) and ack.status is Status.NACK_BAD_REQUEST, ack
    assert ack.mm_hash == MM
    # a request for another session id on this connection
    raw.send_raw(encode(XferReq(v=1, session_id="someone-else", mm_hash=MM,
                                compat_hash=LAYOUT.compat_hash, dest=b"")))
    ack = raw.recv()
    assert isinstance(ack, XferAck) and ack.status is Status.NACK_BAD_REQUEST, ack

    st = p.stats()
    assert st["grants"] == 0 and st["pinned_bytes"] == 0 and _pins(p) == 0, st
    assert st["bad_frames"] == 5, st  # not msgpack, unknown kind, list, v=7, bad body

    # the raw session still works, and a real consumer is served
    ok = raw.req(MM, LAYOUT.compat_hash)
    assert ok.status is Status.OK
    raw.done(MM, ok.grant.grant_id)
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0)
    _real_fetch_ok(p, closing)
    st = p.stats()
    assert st["grants"] == 2 and st["pinned_bytes"] == 0 and _pins(p) == 0, st
