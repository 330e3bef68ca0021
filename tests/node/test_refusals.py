"""Refusals on a real CURVE producer: each gets its typed Miss, takes no pin, and leaves the node
serving an allowed consumer afterwards.

In-process ProducerNode (CURVE, allow-list callback) and ConsumerNodes over loopback + NIXL.
"""

from __future__ import annotations

import numpy as np
import pytest

from ectransport.errors import AuthError, ProtocolError, VersionError
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
from ectransport.protocol import Status
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import new_keypair, sections, wait_for, wait_free
from tests.node._ectp_raw import RawClient

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
ROWS = 40
DATA = np.random.default_rng(7).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)
MM = "item-0"


@pytest.fixture
def keys():
    return {"producer": new_keypair(), "consumer": new_keypair(), "stranger": new_keypair()}


@pytest.fixture
def producer(keys, closing):
    allowed = {keys["consumer"].public}
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=keys["producer"].public,
                secret_key=keys["producer"].secret,
                allow=lambda k: k in allowed,
            ),
            settings=ProducerSettings(region_bytes=1 << 20, lease_s=30.0),
            node=NodeSettings(versions=(1,)),
        )
    )
    assert p.put(MM, DATA)
    return p.start()


def _addr(p: ProducerNode, key: str | None = None) -> ProducerAddress:
    return ProducerAddress("127.0.0.1", p.port, key or p.public_key)


def _consumer(closing, kp=None, *, layout=LAYOUT, **kw) -> ConsumerNode:
    sec = Security(insecure=True) if kp is None else Security(public_key=kp.public,
                                                              secret_key=kp.secret)
    return closing(
        ConsumerNode(
            layout=layout, security=sec, **sections(ConsumerSettings(region_bytes=1 << 20), **kw))
    )


def _assert_no_pin(p: ProducerNode) -> None:
    st = p.stats()
    assert st["grants"] == 0, st
    assert st["pinned_bytes"] == 0 and st["active_grants"] == 0, st
    assert p.lookup(MM).pins == 0
    assert p.store.pinned_blocks == 0


def _assert_healthy(p: ProducerNode, keys, closing) -> None:
    """An allowed, compatible consumer still gets exact bytes afterwards."""
    c = _consumer(closing, keys["consumer"])
    out = c.fetch(_addr(p), MM, timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, DATA.reshape(-1))
    assert p.stats()["grants"] >= 1
    del out
    assert wait_for(lambda: p.stats()["pinned_bytes"] == 0), p.stats()


@pytest.mark.parametrize("layout", [
    Layout(model_id=LAYOUT.model_id, dtype="bfloat16", hidden=512),
    Layout(model_id="someone/other-encoder", dtype="bfloat16", hidden=256),
    Layout(model_id=LAYOUT.model_id, dtype="float16", hidden=256),
], ids=["hidden", "model_id", "dtype"])
def test_compat_hash_mismatch_is_incompatible(producer, keys, closing, layout):
    assert layout.compat_hash != LAYOUT.compat_hash
    c = _consumer(closing, keys["consumer"], layout=layout)
    out = c.fetch(_addr(producer), MM, timeout_s=10.0)
    assert isinstance(out, Miss), out
    assert out.reason is MissReason.INCOMPATIBLE, out
    assert "compatibility hash" in out.detail
    _assert_no_pin(producer)
    assert producer.session.nacks == {Status.NACK_INCOMPAT: 1}
    _assert_healthy(producer, keys, closing)


def test_req_with_foreign_compat_hash_after_good_hello_takes_no_pin(producer, keys):
    """Two-phase check: a Welcome'd session still has every XferReq's hash checked."""
    kp = keys["consumer"]
    raw = RawClient("127.0.0.1", producer.port, server_key=producer.public_key,
                    public_key=kp.public, secret_key=kp.secret)
    try:
        assert raw.hello(LAYOUT.compat_hash).status is Status.OK
        ack = raw.req(MM, Layout(hidden=512).compat_hash)
        assert ack.status is Status.NACK_INCOMPAT and ack.grant is None
        assert ack.mm_hash == MM and ack.session_id == raw.session_id
        _assert_no_pin(producer)
        ok = raw.req(MM, LAYOUT.compat_hash)  # the same session is still usable
        assert ok.status is Status.OK and ok.grant is not None
        assert ok.grant.entry_bytes == DATA.nbytes and ok.grant.num_blocks == ROWS
        raw.done(MM, ok.grant.grant_id)
        assert wait_for(lambda: producer.stats()["pinned_bytes"] == 0)
    finally:
        raw.close()


def test_version_mismatch_is_version(producer, keys, closing):
    assert producer.session.config.versions == (1,)
    c = _consumer(closing, keys["consumer"], versions=(2,))
    out = c.fetch(_addr(producer), MM, timeout_s=10.0)
    assert isinstance(out, Miss), out
    assert out.reason is MissReason.VERSION, out
    assert "[1]" in out.detail and "[2]" in out.detail, out.detail
    _assert_no_pin(producer)
    assert producer.session.nacks == {Status.NACK_VERSION: 1}
    _assert_healthy(producer, keys, closing)


def test_unknown_mm_hash_is_missing(producer, keys, closing):
    c = _consumer(closing, keys["consumer"])
    out = c.fetch(_addr(producer), "never-stored", timeout_s=10.0)
    assert isinstance(out, Miss), out
    assert out.reason is MissReason.MISSING, out
    _assert_no_pin(producer)
    assert producer.session.nacks == {Status.NACK_MISSING: 1}
    assert c.store.free_blocks == c.store.num_blocks
    # the same connection serves a stored entry right after
    out = c.fetch(_addr(producer), MM, timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, DATA.reshape(-1))


@pytest.mark.parametrize("case", ["key_not_allowed", "wrong_server_key", "plain_consumer"])
def test_unauthenticated_consumer_gets_auth_and_nothing_else(producer, keys, closing, case):
    server_key = None
    if case == "key_not_allowed":
        c = _consumer(closing, keys["stranger"])
    elif case == "wrong_server_key":
        c = _consumer(closing, keys["consumer"])  # allowed key, but talks to the wrong server key
        server_key = new_keypair().public
    else:
        c = _consumer(closing, None)
    out = c.fetch(_addr(producer, server_key), MM, timeout_s=10.0)
    # refused by the handshake (AUTH, with its cause), not left to the deadline (TIMEOUT)
    assert isinstance(out, Miss), out
    assert out.reason is MissReason.AUTH, out
    assert {"key_not_allowed": "allow-list", "wrong_server_key": "producer key mismatch",
            "plain_consumer": "plain/CURVE mismatch"}[case] in out.detail, out.detail
    # the producer's session never saw a frame: no Welcome, no ack, no grant, no peer
    _assert_no_pin(producer)
    assert producer.session.nacks == {}
    assert producer.peers() == []

    def control() -> dict[str, int]:
        return producer.snapshot()["control"]

    assert control()["malformed_dropped"] == 0
    if case == "key_not_allowed":
        assert wait_for(lambda: control()["reject_count"] >= 1), control()
    else:
        assert control()["reject_count"] == 0
        # counted when the producer's loop drains its monitor (its own thread, maybe later)
        assert wait_for(lambda: control()["handshake_failures"] >= 1), control()
    # no retry storm afterwards: the failed session is dropped, and with it its connection (no
    # reconnecting) ...
    assert wait_for(lambda: c.session(_addr(producer)) is None), c.stats()
    assert c.stats()["producers"] == 0
    _assert_healthy(producer, keys, closing)
    # ... so the attempts made before AUTH are all the server ever counts
    assert control()["handshake_failures"] <= 8, control()


# -- typed errors from ConsumerNode.connect ----------------------------------------------------
@pytest.mark.parametrize("case", ["auth", "version", "compat"])
def test_connect_raises_typed_errors(producer, keys, closing, case):
    if case == "auth":
        c, want = _consumer(closing, keys["stranger"]), AuthError
    elif case == "version":
        c, want = _consumer(closing, keys["consumer"], versions=(2,)), VersionError
    else:
        c, want = _consumer(closing, keys["consumer"], layout=Layout(hidden=512)), ProtocolError
    with pytest.raises(want):  # the typed refusal, not the timeout's plain ECTransportError
        c.connect(_addr(producer), timeout_s=30.0)
    _assert_no_pin(producer)
    assert producer.session.nacks == ({} if case == "auth" else
                                      {Status.NACK_VERSION if case == "version"
                                       else Status.NACK_INCOMPAT: 1})
    ok = _consumer(closing, keys["consumer"])
    assert ok.connect(_addr(producer), timeout_s=5.0) == "nixl"


# -- budget and local space: refused without leaking a pin --------------------------------------
MM2 = "item-1"
DATA2 = np.random.default_rng(8).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)


@pytest.fixture
def budget_producer(keys, closing):
    """A producer whose per-consumer budget is exactly one entry (never inline: an inline answer
    pins nothing and is not charged to the budget)."""
    allowed = {keys["consumer"].public}
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=keys["producer"].public,
                secret_key=keys["producer"].secret,
                allow=lambda k: k in allowed,
            ),
            settings=ProducerSettings(
                region_bytes=1 << 20,
                lease_s=30.0,
                budget_bytes=ROWS * LAYOUT.block_bytes,
                inline_max_bytes=0,
            ),
        )
    )
    assert p.put(MM, DATA) and p.put(MM2, DATA2)
    return p.start()


def _hog(p: ProducerNode, kp) -> tuple[RawClient, int]:
    """A raw client with the consumer's own key pins MM: that key's budget is used up."""
    raw = RawClient("127.0.0.1", p.port, server_key=p.public_key, public_key=kp.public,
                    secret_key=kp.secret)
    assert raw.hello(LAYOUT.compat_hash).status is Status.OK
    ack = raw.req(MM, LAYOUT.compat_hash)
    assert ack.status is Status.OK
    assert p.session.pinned_bytes(kp.public) == ROWS * LAYOUT.block_bytes
    return raw, ack.grant.grant_id


def test_busy_until_deadline_is_busy_and_pins_nothing(budget_producer, keys, closing):
    p = budget_producer
    raw, _ = _hog(p, keys["consumer"])
    try:
        c = _consumer(closing, keys["consumer"])
        out = c.fetch(_addr(p), MM2, timeout_s=1.0)
        assert isinstance(out, Miss) and out.reason is MissReason.BUSY, out
        # kept asking until its deadline: it retried (backoff timing: tests/session)
        assert p.session.nacks.get(Status.NACK_BUSY, 0) >= 2, p.session.nacks
        assert p.lookup(MM2).pins == 0
        assert p.stats()["grants"] == 1 and c.store.free_blocks == c.store.num_blocks
    finally:
        raw.close()


def test_busy_is_retried_until_the_budget_frees(budget_producer, keys, closing):
    p = budget_producer
    raw, gid = _hog(p, keys["consumer"])
    try:
        c = _consumer(closing, keys["consumer"])
        fut = c.submit(_addr(p), MM2, timeout_s=60.0)
        assert wait_for(lambda: p.session.nacks.get(Status.NACK_BUSY, 0) >= 1)
        assert not fut.done()
        raw.done(MM, gid)
        out = fut.result(timeout=70.0)
        del fut
        assert isinstance(out, Fetched), out
        assert np.array_equal(out.data, DATA2.reshape(-1))
        assert wait_for(lambda: p.stats()["pinned_bytes"] == 0), p.stats()
        assert p.stats()["grants"] == 2
    finally:
        raw.close()


def test_no_local_space_is_no_space_and_releases_the_producer_pin(producer, keys, closing):
    assert producer.put(MM2, DATA2)
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=Security(
                public_key=keys["consumer"].public, secret_key=keys["consumer"].secret
            ),
            settings=ConsumerSettings(region_bytes=ROWS * LAYOUT.block_bytes),
        )
    )
    held = c.fetch(_addr(producer), MM, timeout_s=10.0)
    assert isinstance(held, Fetched), held
    assert c.store.free_blocks == 0
    out = c.fetch(_addr(producer), MM2, timeout_s=10.0)
    assert isinstance(out, Miss) and out.reason is MissReason.NO_SPACE, out
    # the producer granted, the consumer gave the grant back at once (its blocks and budget are
    # held back for the grace period)
    assert wait_for(lambda: producer.stats()["active_grants"] == 0), producer.stats()
    st = producer.stats()
    assert st["grants"] == 2 and st["expired"] == 0 and st["abandoned"] == 1, st
    # given back unused (XferDone ok=False): ended at once, its blocks held for the grace period
    assert producer.lookup(MM2).pins == producer.session.grace_pins == 1
    # dropping the held result makes room again
    del held
    assert wait_free(c)
    out = c.fetch(_addr(producer), MM2, timeout_s=10.0)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, DATA2.reshape(-1))
