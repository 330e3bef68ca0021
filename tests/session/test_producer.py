"""ProducerSession: given a state and an event, the commands and the pins (fake clock)."""

from __future__ import annotations

from ectransport.protocol import (
    Hello,
    Renew,
    Status,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    compat_hash,
    encode,
)
from ectransport.session import ProducerSession, notif_for
from ectransport.session.grants import PlaneFacts
from ectransport.store import BlockStore

from .helpers import BLOCK, COMPAT, describe, make_producer, msgs, producer_config, put

SID = "s" * 32


def hello(sid=SID, versions=(1,), planes=("nixl",), compat=COMPAT, v=None):
    return encode(
        Hello(
            v=v or max(versions),
            session_id=sid,
            node_id="c",
            versions=list(versions),
            planes=list(planes),
            compat_hash=compat,
            mem_kinds=["DRAM"],
        )
    )


def req(mm, sid=SID, v=1, compat=COMPAT):
    return encode(XferReq(v=v, session_id=sid, mm_hash=mm, compat_hash=compat, dest=b""))


def welcomed(p, peer="peer1", sid=SID, user=""):
    (w,) = msgs(p.on_frame(peer, hello(sid), 0.0, user=user))
    assert isinstance(w, Welcome) and w.status is Status.OK, w
    return w


def ack_of(cmds) -> XferAck:
    (a,) = msgs(cmds)
    assert isinstance(a, XferAck)
    return a


def test_grant_pins_only_granted_blocks_and_lease_expiry_unpins():
    p, store = make_producer()
    put(store, "other", 3)
    e = put(store, "a", 5)
    welcomed(p)
    a = ack_of(p.on_frame("peer1", req("a"), 1.0))
    assert a.status is Status.OK and a.grant is not None
    assert a.grant.plane_grant == repr([(r.start, r.count) for r in e.runs]).encode()
    assert a.grant.num_blocks == 5 and a.grant.entry_bytes == 5 * BLOCK
    assert store.get("a").pins == 1 and store.get("other").pins == 0
    p.poll(30.9)
    assert store.get("a").pins == 1
    p.poll(31.0)  # lease 30 s from t=1: the grant ends, its blocks stay pinned for the grace
    assert store.get("a").pins == 1 and p.active_grants == 0 and p.stats["expired"] == 1
    assert p.grace_pins == 1 and p.pinned_bytes() == 5 * BLOCK  # still charged to the budget
    p.check_invariants()
    p.poll(31.0 + p.settings.grace_s - 0.01)
    assert store.get("a").pins == 1
    p.poll(31.0 + p.settings.grace_s)
    assert store.get("a").pins == 0 and p.grace_pins == 0 and p.pinned_bytes() == 0
    p.poll(100.0)
    assert store.get("a").pins == 0  # exactly once
    store.check_invariants()


def test_notification_or_done_unpins_exactly_once():
    p, store = make_producer()
    put(store, "a", 2)
    welcomed(p)
    g = ack_of(p.on_frame("peer1", req("a"), 0.0)).grant
    p.on_notification(notif_for((SID, "a", g.grant_id)), 0.5)
    assert store.get("a").pins == 0
    done = encode(XferDone(v=1, session_id=SID, mm_hash="a", grant_id=g.grant_id, ok=True))
    assert msgs(p.on_frame("peer1", done, 0.6)) == []
    assert store.get("a").pins == 0 and p.stats["late_signals"] == 1
    p.on_notification(b"garbage", 0.7)
    p.on_notification(notif_for((SID, "a", g.grant_id + 1)), 0.7)
    assert store.get("a").pins == 0
    store.check_invariants()


def test_duplicate_request_returns_same_grant_without_second_pin():
    p, store = make_producer()
    put(store, "a", 2)
    welcomed(p)
    g1 = ack_of(p.on_frame("peer1", req("a"), 0.0)).grant
    g2 = ack_of(p.on_frame("peer1", req("a"), 0.1)).grant
    assert g1 == g2 and store.get("a").pins == 1


def test_two_sessions_pin_twice():
    p, store = make_producer()
    put(store, "a", 2)
    welcomed(p, "peer1", "1" * 32)
    welcomed(p, "peer2", "2" * 32)
    ack_of(p.on_frame("peer1", req("a", "1" * 32), 0.0))
    ack_of(p.on_frame("peer2", req("a", "2" * 32), 0.0))
    assert store.get("a").pins == 2


def test_nacks_missing_not_ready_incompat_bad_request():
    p, store = make_producer()
    put(store, "nr", 2, ready=False)
    assert ack_of(p.on_frame("peer1", req("x"), 0.0)).status is Status.NACK_BAD_REQUEST  # no Hello
    welcomed(p)
    assert ack_of(p.on_frame("peer1", req("x"), 0.0)).status is Status.NACK_MISSING
    assert ack_of(p.on_frame("peer1", req("nr"), 0.0)).status is Status.NACK_NOT_READY
    other = compat_hash("m", "float16", 8)
    assert ack_of(p.on_frame("peer1", req("nr", compat=other), 0.0)).status is Status.NACK_INCOMPAT
    assert ack_of(p.on_frame("peer1", req("nr", sid=""), 0.0)).status is Status.NACK_BAD_REQUEST
    assert (
        ack_of(p.on_frame("peer1", req("nr", sid="f" * 32), 0.0)).status is Status.NACK_BAD_REQUEST
    )
    assert store.get("nr").pins == 0 and p.active_grants == 0


def test_version_mismatch_in_hello_and_in_request():
    p, _ = make_producer(versions=(1,))  # a v1-only node and a v2-only consumer
    (w,) = msgs(p.on_frame("peer1", hello(versions=(2,)), 0.0), versions=(1, 2))
    assert w.status is Status.NACK_VERSION and "[1]" in w.detail and "[2]" in w.detail
    welcomed(p)
    a = ack_of(p.on_frame("peer1", req("a", v=2), 0.0))
    assert a.status is Status.NACK_VERSION and a.mm_hash == "a" and a.session_id == SID


def test_hello_rejections():
    p, _ = make_producer()
    bad = compat_hash("other-model", "bfloat16", 8)
    (w,) = msgs(p.on_frame("peer1", hello(compat=bad), 0.0))
    assert w.status is Status.NACK_INCOMPAT
    (w,) = msgs(p.on_frame("peer1", hello(planes=("ucx", "tcp")), 0.0))
    assert w.status is Status.NACK_INCOMPAT and "no common data plane" in w.detail
    assert "ucx" in w.detail and "nixl" in w.detail
    (w,) = msgs(p.on_frame("peer1", hello(sid=""), 0.0))
    assert w.status is Status.NACK_BAD_REQUEST


def test_session_cannot_be_taken_over_by_another_identity():
    p, store = make_producer()
    put(store, "a", 1)
    welcomed(p, "peer1", user="K1")
    (w,) = msgs(p.on_frame("peer2", hello(), 0.0, user="K2"))
    assert w.status is Status.NACK_BAD_REQUEST
    welcomed(p, "peer3", user="K1")  # same identity, new route: a reconnect


def test_budget_nacks_busy():
    p, store = make_producer(num_blocks=64, budget_bytes=10 * BLOCK)
    put(store, "a", 6)
    put(store, "b", 6)
    welcomed(p, user="K")
    assert ack_of(p.on_frame("peer1", req("a"), 0.0)).status is Status.OK
    assert ack_of(p.on_frame("peer1", req("b"), 0.0)).status is Status.NACK_BUSY
    assert p.pinned_bytes("K") == 6 * BLOCK
    assert p.budget_bytes == 10 * BLOCK


def test_default_budget_is_a_quarter_of_region():
    p, store = make_producer(num_blocks=64)
    assert p.budget_bytes == 16 * BLOCK


def test_peer_down_releases_grants_at_once():
    p, store = make_producer()
    put(store, "a", 2)
    put(store, "b", 2)
    welcomed(p)
    ack_of(p.on_frame("peer1", req("a"), 0.0))
    ack_of(p.on_frame("peer1", req("b"), 0.0))
    p.on_peer_down("peer1", 1.0)
    assert p.active_grants == 0 and p.grace_pins == 2 and p.pinned_bytes() == 4 * BLOCK
    # a consumer that missed the drop may use its grants until their lease deadline (30 s)
    p.poll(30.0 + p.settings.grace_s - 0.01)
    assert store.get("a").pins == 1
    p.poll(30.0 + p.settings.grace_s)
    assert store.get("a").pins == 0 and store.get("b").pins == 0 and p.pinned_bytes() == 0


def test_renew_extends_never_shortens():
    p, store = make_producer(lease_s=30.0)
    put(store, "a", 1)
    welcomed(p)
    g = ack_of(p.on_frame("peer1", req("a"), 0.0)).grant
    p.on_frame(
        "peer1", encode(Renew(v=1, session_id=SID, grant_ids=[g.grant_id], extend_s=20.0)), 25.0
    )
    p.poll(44.9)
    assert store.get("a").pins == 1
    p.on_frame(
        "peer1", encode(Renew(v=1, session_id=SID, grant_ids=[g.grant_id], extend_s=1.0)), 45.0
    )
    p.poll(45.01)
    assert store.get("a").pins == 1  # a shorter extension did not shorten the lease
    p.poll(45.0 + 0.1 + 0.0)
    p.poll(46.0)
    assert p.active_grants == 0 and p.stats["expired"] == 1
    p.poll(46.0 + p.settings.grace_s)
    assert store.get("a").pins == 0


def test_garbage_frames_get_nack_and_take_no_pin():
    p, store = make_producer()
    put(store, "a", 1)
    for junk in (
        b"",
        b"\xc1",
        b"\x80",
        encode(
            Hello(
                v=1, session_id="", node_id="", versions=[], planes=[], compat_hash="", mem_kinds=[]
            )
        )[:-3],
    ):
        out = p.on_frame("peer1", junk, 0.0)
        assert len(out) == 1
    assert store.get("a").pins == 0


def test_a_completed_grant_unpins_at_once_an_abandoned_one_after_the_grace_period():
    """ECTP §6.3: only a confirmed completion frees the blocks at once; XferDone(ok=False) means
    the consumer gave up, perhaps with a READ still in flight."""
    p, store = make_producer(grace_s=2.0)
    put(store, "a", 1)
    put(store, "b", 1)
    welcomed(p)
    ga = ack_of(p.on_frame("peer1", req("a"), 0.0)).grant
    gb = ack_of(p.on_frame("peer1", req("b"), 0.0)).grant
    p.on_frame("peer1", encode(XferDone(v=1, session_id=SID, mm_hash="a", grant_id=ga.grant_id,
                                        ok=True)), 0.5)
    p.on_frame("peer1", encode(XferDone(v=1, session_id=SID, mm_hash="b", grant_id=gb.grant_id,
                                        ok=False)), 0.5)
    assert store.get("a").pins == 0 and store.get("b").pins == 1
    assert p.stats["completed"] == 1 and p.stats["abandoned"] == 1
    p.check_invariants()
    # the grace pin keeps b's blocks from being re-allocated: a full region cannot evict it
    assert store.evictable_blocks == 1
    p.poll(2.49)
    assert store.get("b").pins == 1
    p.poll(2.5)
    assert store.get("b").pins == 0 and p.grace_pins == 0
    p.check_invariants()
    store.check_invariants()


def test_oversized_grant_is_refused_at_issue_time_and_revoked():
    """A plane that describes a grant larger than the wire limit: NACK, no pin, revoked."""
    from ectransport.protocol.messages import MAX_GRANT_BYTES
    from ectransport.session import Revoke

    store = BlockStore(64, BLOCK)
    p = ProducerSession(producer_config(), store,
                        {"nixl": PlaneFacts(lambda runs, n: b"x" * (MAX_GRANT_BYTES + 1))})
    put(store, "a", 2)
    welcomed(p)
    out = p.on_frame("peer1", req("a"), 0.0)
    assert [type(c) for c in out][0] is Revoke
    a = ack_of(out[1:])
    assert a.status is Status.NACK_INTERNAL and "wire limit" in a.detail
    assert store.get("a").pins == 0 and p.active_grants == 0


def test_unreachable_planes_are_not_negotiated():
    """Issue 13 item 5: the first common plane that can reach the consumer is chosen; none at
    all is a NACK_INCOMPAT naming the reason, never a plane whose every fetch fails."""
    store = BlockStore(64, BLOCK)
    cfg = producer_config(planes=("shm", "tcp"))
    reach = {"shm": lambda loc: loc == b"here", "tcp": lambda loc: True}
    p = ProducerSession(cfg, store, {n: PlaneFacts(describe, reachable=reach[n],
                                                   endpoint=f"ep-{n}".encode())
                                     for n in ("shm", "tcp")})

    def hello(sid, planes, localities):
        return encode(Hello(v=1, session_id=sid, node_id="c", versions=[1], planes=planes,
                            compat_hash=COMPAT, mem_kinds=["DRAM"], localities=localities))

    (w,) = msgs(p.on_frame("near", hello("s1", ["shm", "tcp"], {"shm": b"here"}), 0.0))
    assert w.status is Status.OK and w.plane == "shm" and w.endpoint == b"ep-shm"
    (w,) = msgs(p.on_frame("far", hello("s2", ["shm", "tcp"], {"shm": b"elsewhere"}), 0.0))
    assert w.status is Status.OK and w.plane == "tcp" and w.endpoint == b"ep-tcp"
    (w,) = msgs(p.on_frame("far2", hello("s3", ["shm"], {}), 0.0))
    assert w.status is Status.NACK_INCOMPAT and "reach" in w.detail


def test_grants_of_revocable_planes_need_no_grace():
    """A PUSH plane's revoke stops every access before it returns: its blocks unpin at once."""
    store = BlockStore(64, BLOCK)
    cfg = producer_config(lease_s=30.0)
    p = ProducerSession(cfg, store, {"nixl": PlaneFacts(describe, revocable=True)})
    put(store, "a", 2)
    welcomed(p)
    ack_of(p.on_frame("peer1", req("a"), 0.0))
    p.on_peer_down("peer1", 1.0)
    # held until the node performed the Revoke: dropped at the next poll, no grace period
    assert store.get("a").pins == 1 and p.active_grants == 0
    p.poll(1.0)
    assert store.get("a").pins == 0 and p.grace_pins == 0 and p.pinned_bytes() == 0


def test_an_entry_over_the_planes_max_transfer_is_a_terminal_refusal():
    """Capabilities are enforced, not informational: ``max_transfer_bytes`` bounds a grant."""
    store = BlockStore(64, BLOCK)
    p = ProducerSession(producer_config(), store,
                        {"nixl": PlaneFacts(describe, max_bytes=2 * BLOCK)})
    put(store, "small", 2)
    put(store, "big", 3)
    welcomed(p)
    assert ack_of(p.on_frame("peer1", req("small"), 0.0)).status is Status.OK
    big = ack_of(p.on_frame("peer1", req("big"), 0.0))
    assert big.status is Status.NACK_BAD_REQUEST and "largest transfer" in big.detail
    assert store.get("big").pins == 0
