"""ProducerSession, ECTP v2 (protocols/ectp-v2.md): batches, readiness wait (waiting items named
in a ``Parked`` frame at once), small entries inline.

Sans-I/O with a fake clock: given a state and a frame or event, the frames answered and the pins.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from ectransport.protocol import (
    AckBatch,
    Hello,
    Nack,
    Parked,
    Renew,
    ReqBatch,
    ReqItem,
    Status,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    compat_hash,
    decode,
    encode,
)
from ectransport.protocol.messages import MAX_INLINE_BYTES
from ectransport.session import ProducerSession, Revoke, Send, notif_for
from ectransport.session.grants import PlaneFacts
from ectransport.store import AllocFailed, BlockStore, HostRegion

from .helpers import BLOCK, COMPAT, describe, producer_config

SID = "v2" * 16
V = (1, 2)


@pytest.fixture
def regions():
    made: list[HostRegion] = []
    yield made
    for r in made:
        r.close()


def make(regions, num_blocks=64, *, inline=True, **kw):
    """A v1+v2 producer over a real host region, so inline answers carry the stored bytes."""
    store = BlockStore(num_blocks, BLOCK)
    region = HostRegion(num_blocks, BLOCK)
    regions.append(region)
    cfg = producer_config(versions=V, **kw)

    def read(runs, nbytes):
        return b"".join(region.view(runs, nbytes))

    p = ProducerSession(cfg, store, {"nixl": PlaneFacts(describe)}, rng=random.Random(7),
                        read=read if inline else None)
    return p, store, region


def rows(mm: str, n: int) -> bytes:
    seed = sum(mm.encode())
    return ((np.arange(n * BLOCK, dtype=np.uint32) + seed) % 251).astype(np.uint8).tobytes()


def put(p, region, mm, n, ready=True):
    e = p.store.alloc(mm, n * BLOCK)
    region.write(e.runs, np.frombuffer(rows(mm, n), dtype=np.uint8))
    if ready:
        p.store.mark_ready(mm)
    return e


def hello(sid=SID, versions=V):
    return encode(Hello(v=max(versions), session_id=sid, node_id="c", versions=list(versions),
                        planes=["nixl"], compat_hash=COMPAT, mem_kinds=["DRAM"]))


def welcomed(p, peer="peer1", sid=SID, versions=V, user=""):
    (s,) = p.on_frame(peer, hello(sid, versions), 0.0, user=user)
    w = decode(s.data, versions=V)
    assert isinstance(w, Welcome) and w.status is Status.OK, w
    return w


def batch(*mms, batch_id=1, wait_s=0.0, inline_max=0, sid=SID, compat=COMPAT, v=2):
    return encode(ReqBatch(v=v, session_id=sid, batch_id=batch_id, compat_hash=compat,
                           wait_s=wait_s, inline_max=inline_max,
                           items=[ReqItem(mm_hash=m, dest=b"") for m in mms]))


def frames(cmds):
    return [decode(c.data, versions=V) for c in cmds if isinstance(c, Send)]


def acks(cmds) -> list[AckBatch]:
    """The AckBatch frames of ``cmds`` (every other frame must be a ``Parked``: see
    :func:`parked`)."""
    out = frames(cmds)
    assert all(isinstance(m, (AckBatch, Parked)) for m in out), out
    return [m for m in out if isinstance(m, AckBatch)]


def parked(cmds) -> list[Parked]:
    """The Parked frames of ``cmds``; each comes after every AckBatch of its batch in ``cmds``
    (the answers the consumer waits for go first)."""
    out = frames(cmds)
    pk = [m for m in out if isinstance(m, Parked)]
    for m in pk:
        assert all(out.index(a) < out.index(m) for a in out
                   if isinstance(a, AckBatch) and a.batch_id == m.batch_id), out
    return pk


def items(cmds) -> dict:
    """mm_hash → AckItem over every AckBatch in ``cmds`` (each item answered once)."""
    got: dict = {}
    for a in acks(cmds):
        for it in a.items:
            assert it.mm_hash not in got, f"{it.mm_hash} answered twice"
            got[it.mm_hash] = it
    return got


def pins(p) -> dict[str, int]:
    return {e.mm_hash: e.pins for e in p.store.entries() if e.pins}


def test_v2_is_negotiated_when_both_speak_it_and_v1_otherwise(regions):
    p, _, _ = make(regions)
    assert welcomed(p, "a", "sa").version == 2
    assert welcomed(p, "b", "sb", versions=(1,)).version == 1
    p1 = ProducerSession(producer_config(versions=(1,)), BlockStore(8, BLOCK),
                         {"nixl": PlaneFacts(describe)})
    (s,) = p1.on_frame("c", hello(), 0.0)
    w = decode(s.data, versions=V)
    assert w.status is Status.OK and w.version == 1 and w.versions == [1]


def test_batch_of_ready_entries_is_one_frame_of_grants(regions):
    p, store, region = make(regions)
    es = {m: put(p, region, m, n) for m, n in (("a", 2), ("b", 3), ("c", 1))}
    welcomed(p)
    out = p.on_frame("peer1", batch("a", "b", "c", batch_id=7), 1.0)
    (a,) = acks(out)
    assert a.batch_id == 7 and a.session_id == SID and a.v == 2
    assert [it.mm_hash for it in a.items] == ["a", "b", "c"]  # in request order
    for it in a.items:
        assert it.status is Status.OK and it.grant is not None and it.data == b""
        assert it.grant.plane_grant == describe(es[it.mm_hash].runs, 0)
        assert it.grant.entry_bytes == es[it.mm_hash].nbytes and it.grant.lease_s == 30.0
    assert len({it.grant.grant_id for it in a.items}) == 3
    assert pins(p) == {"a": 1, "b": 1, "c": 1} and p.active_grants == 3
    p.check_invariants()
    # batch grants complete like XferAck grants: XferDone, notification, lease (+ grace)
    g = {it.mm_hash: it.grant.grant_id for it in a.items}
    p.on_frame("peer1", encode(XferDone(v=2, session_id=SID, mm_hash="a", grant_id=g["a"],
                                        ok=True)), 1.5)
    p.on_notification(notif_for((SID, "b", g["b"])), 1.5)
    assert pins(p) == {"c": 1} and p.stats["completed"] == 2
    p.on_frame("peer1", encode(Renew(v=2, session_id=SID, grant_ids=[g["c"]], extend_s=30.0)),
               20.0)
    p.poll(31.0 + 0.5)
    assert pins(p) == {"c": 1} and p.active_grants == 1  # renewed to 50 s
    p.poll(50.0)
    assert p.active_grants == 0 and p.grace_pins == 1 and p.stats["expired"] == 1
    p.poll(50.0 + p.settings.grace_s)
    assert pins(p) == {} and p.pinned_bytes() == 0
    p.check_invariants()
    store.check_invariants()


def test_mixed_batch_answers_every_item_once_in_one_frame(regions):
    p, _, region = make(regions, budget_bytes=6 * BLOCK)
    put(p, region, "ok", 4)
    put(p, region, "busy", 4)
    put(p, region, "huge", 7)
    put(p, region, "nr", 1, ready=False)
    welcomed(p)
    out = p.on_frame("peer1", batch("ok", "missing", "nr", "busy", "huge"), 0.0)
    (a,) = acks(out)
    got = {it.mm_hash: it for it in a.items}
    assert [it.mm_hash for it in a.items] == ["ok", "missing", "nr", "busy", "huge"]
    assert got["ok"].status is Status.OK and got["ok"].grant is not None
    assert got["missing"].status is Status.NACK_MISSING and got["missing"].grant is None
    assert got["nr"].status is Status.NACK_NOT_READY  # wait_s = 0: at once, as v1
    assert got["busy"].status is Status.NACK_BUSY and "pin budget" in got["busy"].detail
    assert got["huge"].status is Status.NACK_BAD_REQUEST and "whole pin" in got["huge"].detail
    assert pins(p) == {"ok": 1} and p.waiting_items == 0
    assert p.nacks == {Status.NACK_MISSING: 1, Status.NACK_NOT_READY: 1, Status.NACK_BUSY: 1,
                       Status.NACK_BAD_REQUEST: 1}
    p.check_invariants()


def test_budget_is_charged_item_by_item(regions):
    p, _, region = make(regions, budget_bytes=10 * BLOCK)
    for m in "abc":
        put(p, region, m, 4)
    welcomed(p, user="K")
    got = items(p.on_frame("peer1", batch("a", "b", "c"), 0.0))
    assert [got[m].status for m in "abc"] == [Status.OK, Status.OK, Status.NACK_BUSY]
    assert p.pinned_bytes("K") == 8 * BLOCK
    p.check_invariants()


def test_waiting_item_is_answered_when_its_entry_is_committed(regions):
    p, store, region = make(regions)
    put(p, region, "a", 2)
    put(p, region, "late", 3, ready=False)
    welcomed(p)
    out = p.on_frame("peer1", batch("a", "late", batch_id=3, wait_s=2.0), 10.0)
    (first,) = acks(out)
    assert [it.mm_hash for it in first.items] == ["a"]  # the ready one at once
    (pk,) = parked(out)  # and the waiting one named in the same step, with the wait honoured
    assert (pk.v, pk.session_id, pk.batch_id, pk.items, pk.wait_s) == (2, SID, 3, ["late"], 2.0)
    assert p.waits_for("late") and p.waiting_items == 1 and p.next_deadline() == 12.0
    assert store.get("late").pins == 0  # waiting takes no pin
    p.check_invariants()
    assert p.on_entries_changed(["late"], 10.5) == []  # not ready yet: keeps waiting
    store.mark_ready("late")
    (second,) = acks(p.on_entries_changed(["late", "unrelated"], 11.0))
    assert second.batch_id == 3 and [it.mm_hash for it in second.items] == ["late"]
    it = second.items[0]
    assert it.status is Status.OK and it.grant is not None and store.get("late").pins == 1
    assert not p.waits_for("late") and p.waiting_items == 0 and p.next_deadline() is None
    # the lease runs from the answer, not from the request
    (g,) = [g for g in p.grants() if g.key[1] == "late"]
    assert g.deadline == 11.0 + 30.0
    assert p.poll(12.5) == []  # nothing left to expire
    p.check_invariants()


def test_waiting_item_gets_not_ready_when_its_wait_is_over(regions):
    p, store, region = make(regions, max_wait_s=1.0)
    put(p, region, "nr", 1, ready=False)
    put(p, region, "nr2", 1, ready=False)
    welcomed(p)
    out = p.on_frame("peer1", batch("nr", "nr2", wait_s=30.0), 5.0)
    assert acks(out) == []  # nothing answerable yet: a Parked frame alone
    (pk,) = parked(out)
    assert pk.items == ["nr", "nr2"] and pk.wait_s == 1.0  # the wait it will honour
    assert p.next_deadline() == 6.0  # the producer's max_wait_s caps the consumer's 30 s
    assert p.poll(5.99) == []
    (a,) = acks(p.poll(6.0))
    assert [(it.mm_hash, it.status) for it in a.items] == \
        [("nr", Status.NACK_NOT_READY), ("nr2", Status.NACK_NOT_READY)]
    assert "after waiting 1 s" in a.items[0].detail
    assert p.waiting_items == 0 and p.nacks == {Status.NACK_NOT_READY: 2}
    store.mark_ready("nr")
    assert p.on_entries_changed(["nr"], 6.5) == []  # answered once, never again
    p.check_invariants()


def test_a_producer_that_never_waits_answers_not_ready_at_once(regions):
    p, _, region = make(regions, max_wait_s=0.0)
    put(p, region, "nr", 1, ready=False)
    welcomed(p)
    got = items(p.on_frame("peer1", batch("nr", wait_s=5.0), 0.0))
    assert got["nr"].status is Status.NACK_NOT_READY and p.waiting_items == 0


def test_abort_or_eviction_while_waiting_is_missing_at_once(regions):
    p, store, region = make(regions, num_blocks=8)
    put(p, region, "aborted", 1, ready=False)
    put(p, region, "evicted", 4, ready=False)
    welcomed(p)
    (pk,) = frames(p.on_frame("peer1", batch("aborted", "evicted", wait_s=5.0), 0.0))
    assert isinstance(pk, Parked) and pk.items == ["aborted", "evicted"]
    store.discard("aborted")  # the save failed
    (a,) = acks(p.on_entries_changed(["aborted"], 0.1))
    assert a.items[0].status is Status.NACK_MISSING and "discarded" in a.items[0].detail
    # ready, then evicted by another save before the node reported it
    store.mark_ready("evicted")
    assert not isinstance(store.alloc("other", 8 * BLOCK), AllocFailed)
    assert store.get("evicted") is None
    (a,) = acks(p.on_entries_changed(["evicted"], 0.2))
    assert a.items[0].mm_hash == "evicted" and a.items[0].status is Status.NACK_MISSING
    assert p.waiting_items == 0 and p.nacks == {Status.NACK_MISSING: 2}
    p.check_invariants()


def test_a_change_nobody_reported_is_found_by_the_sweep(regions):
    p, store, region = make(regions)
    put(p, region, "nr", 2, ready=False)
    welcomed(p)
    p.on_frame("peer1", batch("nr", wait_s=5.0), 0.0)
    store.mark_ready("nr")  # e.g. another writer of the store that does not tell the session
    (a,) = acks(p.poll(0.05))
    assert a.items[0].status is Status.OK and a.items[0].grant is not None


def test_items_of_two_batches_waiting_for_one_entry_share_its_grant(regions):
    p, store, region = make(regions)
    put(p, region, "nr", 2, ready=False)
    welcomed(p)
    p.on_frame("peer1", batch("nr", batch_id=1, wait_s=5.0), 0.0)
    p.on_frame("peer1", batch("nr", batch_id=2, wait_s=5.0), 0.1)
    store.mark_ready("nr")
    out = acks(p.on_entries_changed(["nr"], 0.2))
    assert sorted(a.batch_id for a in out) == [1, 2]
    g1, g2 = (a.items[0].grant for a in out)
    assert g1 == g2 and store.get("nr").pins == 1  # a duplicate request: no second pin
    p.check_invariants()


@pytest.mark.parametrize("inline_max", [0, 3 * BLOCK, 4 * BLOCK, 100 * BLOCK])
def test_inline_threshold_is_the_smaller_of_both_sides(regions, inline_max):
    """Entries of at most min(batch inline_max, producer inline_max_bytes) bytes come inline:
    their exact bytes, no grant, no pin, no budget; larger ones get a grant."""
    p, store, region = make(regions, inline_max_bytes=4 * BLOCK, budget_bytes=12 * BLOCK)
    for m, n in (("r3", 3), ("r4", 4), ("r5", 5)):
        put(p, region, m, n)
    welcomed(p)
    got = items(p.on_frame("peer1", batch("r3", "r4", "r5", inline_max=inline_max), 0.0))
    limit = min(inline_max, 4 * BLOCK)
    for m, n in (("r3", 3), ("r4", 4), ("r5", 5)):
        it = got[m]
        assert it.status is Status.OK
        if n * BLOCK <= limit:
            assert it.grant is None and it.data == rows(m, n), m
        else:
            assert it.data == b"" and it.grant is not None, m
    inline = sum(1 for n in (3, 4, 5) if n * BLOCK <= limit)
    assert p.stats["inline"] == inline and p.stats["grants"] == 3 - inline
    assert sum(pins(p).values()) == 3 - inline
    p.check_invariants()


def test_inline_entries_need_no_budget_and_no_completion(regions):
    p, store, region = make(regions, budget_bytes=2 * BLOCK, inline_max_bytes=64 * BLOCK)
    put(p, region, "big", 8)  # larger than the whole pin budget: never grantable, but inline
    welcomed(p)
    it = items(p.on_frame("peer1", batch("big", inline_max=MAX_INLINE_BYTES), 0.0))["big"]
    assert it.status is Status.OK and it.grant is None and it.data == rows("big", 8)
    assert p.active_grants == 0 and pins(p) == {} and p.pinned_bytes() == 0
    assert p.poll(1000.0) == []  # no lease to expire, nothing held back
    p.check_invariants()


def test_without_a_reader_every_entry_is_granted(regions):
    p, _, region = make(regions, inline=False)
    put(p, region, "a", 1)
    welcomed(p)
    it = items(p.on_frame("peer1", batch("a", inline_max=1 << 20), 0.0))["a"]
    assert it.grant is not None and it.data == b""


def test_an_empty_entry_is_inline_only_when_inline_is_accepted(regions):
    p, store, _ = make(regions)
    store.alloc("empty", 0)
    store.mark_ready("empty")
    welcomed(p)
    it = items(p.on_frame("peer1", batch("empty", batch_id=1), 0.0))["empty"]
    assert it.grant is not None  # inline_max 0: the consumer takes nothing inline
    it = items(p.on_frame("peer1", batch("empty", batch_id=2, inline_max=1), 0.0))["empty"]
    assert it.grant is not None  # a live grant is answered again (duplicate rule)
    p2, store2, _ = make(regions)
    store2.alloc("empty", 0)
    store2.mark_ready("empty")
    welcomed(p2)
    it = items(p2.on_frame("peer1", batch("empty", inline_max=1), 0.0))["empty"]
    assert it.grant is None and it.data == b"" and it.status is Status.OK


def test_inline_answers_larger_than_a_frame_are_split_over_frames(regions):
    mib = 1 << 20
    n = mib // BLOCK
    p, store, region = make(regions, num_blocks=10 * n, inline_max_bytes=mib,
                            budget_bytes=10 * mib)
    names = [f"m{i}" for i in range(9)]
    for m in names:
        put(p, region, m, n)
    welcomed(p)
    out = p.on_frame("peer1", batch(*names, inline_max=mib), 0.0)
    assert len(out) >= 2 and all(len(c.data) <= 8 << 20 for c in out)
    got = items(out)
    assert sorted(got) == names and all(got[m].data == rows(m, n) for m in names)
    assert {a.batch_id for a in acks(out)} == {1}


def test_duplicate_items_refuse_the_batch(regions):
    p, _, region = make(regions)
    put(p, region, "a", 1)
    put(p, region, "b", 1)
    welcomed(p)
    (a,) = acks(p.on_frame("peer1", batch("a", "b", "a"), 0.0))
    assert [it.mm_hash for it in a.items] == ["a", "b", "a"]
    assert all(it.status is Status.NACK_BAD_REQUEST for it in a.items)
    assert "more than once" in a.items[0].detail
    assert pins(p) == {} and p.active_grants == 0
    got = items(p.on_frame("peer1", batch("a", "b"), 0.1))  # the session still serves
    assert all(it.status is Status.OK for it in got.values())


def test_a_batch_id_still_waiting_cannot_be_reused(regions):
    p, store, region = make(regions)
    put(p, region, "nr", 1, ready=False)
    put(p, region, "a", 1)
    welcomed(p)
    p.on_frame("peer1", batch("nr", batch_id=9, wait_s=5.0), 0.0)
    (n,) = frames(p.on_frame("peer1", batch("a", batch_id=9), 0.1))
    assert isinstance(n, Nack) and n.status is Status.NACK_BAD_REQUEST and "batch 9" in n.detail
    assert pins(p) == {}
    store.mark_ready("nr")
    p.on_entries_changed(["nr"], 0.2)  # batch 9 fully answered: its id is free again
    got = items(p.on_frame("peer1", batch("a", batch_id=9), 0.3))
    assert got["a"].status is Status.OK
    p.check_invariants()


def test_a_batch_on_a_v1_session_is_refused_and_the_session_stays_healthy(regions):
    p, store, region = make(regions)
    put(p, region, "a", 1)
    assert welcomed(p, versions=(1,)).version == 1
    for v in (1, 2):  # a v2 frame, or a batch claiming v1 (SINCE)
        (n,) = p.on_frame("peer1", batch("a", v=v), 0.0)
        nack = decode(n.data, versions=(1,))
        assert isinstance(nack, Nack) and nack.status is Status.NACK_VERSION and nack.v == 1
    assert pins(p) == {}
    (s,) = p.on_frame("peer1", encode(XferReq(v=1, session_id=SID, mm_hash="a",
                                              compat_hash=COMPAT, dest=b"")), 0.1)
    ack = decode(s.data, versions=(1,))
    assert isinstance(ack, XferAck) and ack.status is Status.OK


def test_a_v1_frame_on_a_v2_session_is_version_and_a_v1_request_is_served(regions):
    p, _, region = make(regions)
    put(p, region, "a", 1)
    welcomed(p)
    (s,) = p.on_frame("peer1", encode(XferReq(v=1, session_id=SID, mm_hash="a",
                                              compat_hash=COMPAT, dest=b"")), 0.0)
    ack = decode(s.data, versions=V)
    assert isinstance(ack, XferAck) and ack.status is Status.NACK_VERSION and ack.v == 2
    (s,) = p.on_frame("peer1", encode(XferReq(v=2, session_id=SID, mm_hash="a",
                                              compat_hash=COMPAT, dest=b"")), 0.0)
    ack = decode(s.data, versions=V)
    assert ack.status is Status.OK and ack.grant is not None and ack.v == 2
    # the same (session, mm_hash) in a batch gets the same grant back
    it = items(p.on_frame("peer1", batch("a"), 0.1))["a"]
    assert it.grant == ack.grant and pins(p) == {"a": 1}


def test_a_batch_grant_asked_again_by_xferreq_is_the_same_grant(regions):
    p, _, region = make(regions)
    put(p, region, "a", 1)
    welcomed(p)
    it = items(p.on_frame("peer1", batch("a"), 0.0))["a"]
    (s,) = p.on_frame("peer1", encode(XferReq(v=2, session_id=SID, mm_hash="a",
                                              compat_hash=COMPAT, dest=b"")), 0.1)
    (s2,) = p.on_frame("peer1", encode(XferReq(v=2, session_id=SID, mm_hash="a",
                                               compat_hash=COMPAT, dest=b"")), 0.2)
    assert decode(s.data, versions=V).grant == it.grant and s.data == s2.data
    assert pins(p) == {"a": 1}


@pytest.mark.parametrize("case", ["no_hello", "foreign_session", "empty_session", "compat"])
def test_refused_batches_answer_every_item_and_pin_nothing(regions, case):
    p, _, region = make(regions)
    put(p, region, "a", 1)
    put(p, region, "b", 1)
    if case != "no_hello":
        welcomed(p)
    kw = {"foreign_session": {"sid": "f" * 32}, "empty_session": {"sid": ""},
          "compat": {"compat": compat_hash("m", "float16", 8)}}.get(case, {})
    (a,) = acks(p.on_frame("peer1", batch("a", "b", batch_id=4, **kw), 0.0))
    want = Status.NACK_INCOMPAT if case == "compat" else Status.NACK_BAD_REQUEST
    assert a.batch_id == 4 and [(it.mm_hash, it.status) for it in a.items] == \
        [("a", want), ("b", want)]
    assert pins(p) == {} and p.active_grants == 0


def test_a_malformed_batch_on_a_v2_session_is_answered_per_item(regions):
    import msgspec

    p, _, region = make(regions)
    put(p, region, "a", 1)
    welcomed(p)
    raw = msgspec.msgpack.decode(batch("a", "b", batch_id=5))
    raw["wait_s"] = 61.0  # over MAX_WAIT_S
    (a,) = acks(p.on_frame("peer1", msgspec.msgpack.encode(raw), 0.0))
    assert a.batch_id == 5 and [(it.mm_hash, it.status) for it in a.items] == \
        [("a", Status.NACK_BAD_REQUEST), ("b", Status.NACK_BAD_REQUEST)]
    raw["items"] = "junk"  # nothing to name: a Nack
    (n,) = frames(p.on_frame("peer1", msgspec.msgpack.encode(raw), 0.0))
    assert isinstance(n, Nack) and n.status is Status.NACK_BAD_REQUEST
    assert pins(p) == {} and p.stats["bad_frames"] == 2


def test_waiting_items_of_a_consumer_that_went_away_are_dropped(regions):
    p, store, region = make(regions)
    put(p, region, "nr", 1, ready=False)
    welcomed(p)
    p.on_frame("peer1", batch("nr", wait_s=5.0), 0.0)
    assert p.waiting_items == 1
    p.on_peer_down("peer1", 0.5)
    assert p.waiting_items == 0 and not p.waits_for("nr") and p.next_deadline() is None
    store.mark_ready("nr")
    assert p.on_entries_changed(["nr"], 0.6) == [] and p.poll(10.0) == []
    assert pins(p) == {}
    p.check_invariants()


def test_a_new_session_on_the_connection_drops_the_old_ones_waiting_items(regions):
    p, store, region = make(regions)
    put(p, region, "nr", 1, ready=False)
    welcomed(p)
    p.on_frame("peer1", batch("nr", wait_s=5.0), 0.0)
    welcomed(p, sid="other-session")
    assert p.waiting_items == 0
    p.check_invariants()


def test_close_drops_waiting_items(regions):
    p, _, region = make(regions)
    put(p, region, "nr", 1, ready=False)
    welcomed(p)
    p.on_frame("peer1", batch("nr", wait_s=5.0), 0.0)
    p.close()
    assert p.waiting_items == 0 and p.next_deadline() is None


def test_waiting_items_per_consumer_are_bounded(regions, monkeypatch):
    import ectransport.session.waits as pb

    monkeypatch.setattr(pb, "MAX_WAITING_PER_PEER", 3)
    p, _, region = make(regions)
    for i in range(5):
        put(p, region, f"nr{i}", 1, ready=False)
    welcomed(p)
    out = p.on_frame("peer1", batch(*[f"nr{i}" for i in range(5)], wait_s=5.0), 0.0)
    (a,) = acks(out)
    assert [it.mm_hash for it in a.items] == ["nr3", "nr4"]  # answered at once, as v1
    assert all(it.status is Status.NACK_NOT_READY for it in a.items) and p.waiting_items == 3
    (pk,) = parked(out)
    assert pk.items == ["nr0", "nr1", "nr2"]  # only what really waits is named parked


def test_an_oversized_grant_in_a_batch_is_revoked_and_nacked(regions):
    from ectransport.protocol.messages import MAX_GRANT_BYTES

    store = BlockStore(64, BLOCK)
    p = ProducerSession(producer_config(versions=V), store,
                        {"nixl": PlaneFacts(lambda runs, n: b"x" * (MAX_GRANT_BYTES + 1))})
    store.alloc("a", BLOCK)
    store.mark_ready("a")
    welcomed(p)
    out = p.on_frame("peer1", batch("a"), 0.0)
    assert isinstance(out[0], Revoke)
    (a,) = acks(out[1:])
    assert a.items[0].status is Status.NACK_INTERNAL and store.get("a").pins == 0


def test_observer_and_counters(regions):
    events = []
    p, _, region = make(regions)
    p.observer = lambda ev, f: events.append((ev, f.get("status")))
    put(p, region, "a", 1)
    welcomed(p)
    p.on_frame("peer1", batch("a", "zz", inline_max=1024), 0.0)
    assert ("nack_sent", "NACK_MISSING") in events
    assert p.stats["batches"] == 1 and p.stats["inline"] == 1 and p.stats["grants"] == 0
    assert p.stats["parked_frames"] == 0


# -- Parked (ECTP v2 §4.3): every item answered or named parked in the step that received it ------


def test_nothing_waits_nothing_is_parked(regions):
    """A batch answered in full at once, one with wait 0, and one at a producer that never waits
    get no Parked frame."""
    p, _, region = make(regions)
    put(p, region, "a", 1)
    put(p, region, "nr", 1, ready=False)
    welcomed(p)
    assert parked(p.on_frame("peer1", batch("a", "zz", batch_id=1, wait_s=5.0), 0.0)) == []
    assert parked(p.on_frame("peer1", batch("nr", batch_id=2, wait_s=0.0), 0.1)) == []
    p0, _, region0 = make(regions, max_wait_s=0.0)
    put(p0, region0, "nr", 1, ready=False)
    welcomed(p0)
    assert parked(p0.on_frame("peer1", batch("nr", wait_s=5.0), 0.0)) == []
    assert p.stats["parked_frames"] == p0.stats["parked_frames"] == 0


def test_one_parked_frame_per_batch_in_request_order_never_again(regions):
    p, store, region = make(regions, max_wait_s=4.0)
    for m in ("w1", "w2", "w3"):
        put(p, region, m, 1, ready=False)
    put(p, region, "a", 1)
    welcomed(p)
    out = p.on_frame("peer1", batch("w2", "a", "w1", batch_id=8, wait_s=2.5), 0.0)
    assert [type(m) for m in frames(out)] == [AckBatch, Parked]
    (pk,) = parked(out)
    assert pk.items == ["w2", "w1"] and pk.wait_s == 2.5 and pk.batch_id == 8
    # another batch of the session parks on its own; answers and sweeps never park again
    (pk2,) = frames(p.on_frame("peer1", batch("w3", "w1", batch_id=9, wait_s=10.0), 0.1))
    assert isinstance(pk2, Parked) and pk2.items == ["w3", "w1"] and pk2.wait_s == 4.0
    store.mark_ready("w1")
    assert parked(p.on_entries_changed(["w1"], 0.2)) == []
    assert parked(p.poll(5.0)) == [] and p.waiting_items == 0
    assert p.stats["parked_frames"] == 2 and p.stats["waited"] == 4
    p.check_invariants()


def test_a_parked_frame_from_a_consumer_is_unexpected(regions):
    """Parked goes producer → consumer only: a producer receiving one answers a Nack and keeps
    serving."""
    p, _, region = make(regions)
    put(p, region, "a", 1)
    welcomed(p)
    (n,) = frames(p.on_frame("peer1", encode(Parked(v=2, session_id=SID, batch_id=1,
                                                    items=["a"], wait_s=1.0)), 0.0))
    assert isinstance(n, Nack) and n.status is Status.NACK_BAD_REQUEST
    assert items(p.on_frame("peer1", batch("a"), 0.1))["a"].status is Status.OK
