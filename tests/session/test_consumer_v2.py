"""ConsumerSession on an ECTP v2 session: ReqBatch / AckBatch, readiness wait (``Parked``: an
item must be answered or named parked within the ack timeout), inline entries, and the rules
against a hostile producer (fake clock, hand-made producer frames)."""

from __future__ import annotations

import pytest

from ectransport.protocol import (
    MAX_BATCH_ITEMS,
    MAX_WAIT_S,
    AckBatch,
    AckItem,
    DoneBatch,
    FrameError,
    Grant,
    Parked,
    ReqBatch,
    Status,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)
from ectransport.session import (
    FetchState,
    Land,
    Landed,
    Miss,
    MissReason,
    PostRead,
    Release,
    Report,
    Send,
)
from ectransport.session.fetch import parked_deadline

from .helpers import BLOCK, COMPAT, bound, make_consumer

V2 = (1, 2)


def reports(cmds):
    return [c.outcome for c in cmds if isinstance(c, Report)]


def frames(cmds):
    return [decode(c.data, versions=(1, 2)) for c in cmds if isinstance(c, Send)]


def ready_v2(c, now=0.0, version=2):
    """Say Hello and play a producer's OK Welcome at ``version``; returns what the session sent
    once bound (the requests of queued fetches)."""
    c.on_up(now)
    w = Welcome(v=version, session_id=c.session_id, node_id="p", status=Status.OK,
                version=version, plane="nixl", versions=[1, version], planes=["nixl"],
                compat_hash=COMPAT, detail="", endpoint=b"e")
    out = bound(c, c.on_frame(encode(w), now), now)
    assert c.welcomed and c.version == version
    return out


def grant(gid, rows, lease_s=30.0, plane="nixl"):
    return Grant(grant_id=gid, entry_bytes=rows * BLOCK, num_blocks=rows, block_bytes=BLOCK,
                 lease_s=lease_s, plane=plane, plane_grant=b"g%d" % gid)


def ok(mm, gid=None, rows=2, data=b"", **kw):
    return AckItem(mm_hash=mm, status=Status.OK, grant=grant(gid, rows, **kw) if gid else None,
                   data=data, detail="")


def nack(mm, status, detail=""):
    return AckItem(mm_hash=mm, status=status, grant=None, data=b"", detail=detail)


def acks(c, batch_id, *items, session_id=None):
    return encode(AckBatch(v=2, session_id=session_id or c.session_id, batch_id=batch_id,
                           items=list(items)))


def park(c, batch_id, *mms, wait_s=5.0, session_id=None):
    return encode(Parked(v=2, session_id=session_id or c.session_id, batch_id=batch_id,
                         items=list(mms), wait_s=wait_s))


def the_batch(cmds) -> ReqBatch:
    (b,) = frames(cmds)
    assert isinstance(b, ReqBatch)
    return b


# -- requests ------------------------------------------------------------------------------------


def test_a_single_fetch_is_a_one_item_batch_with_the_deadline_as_wait_and_inline_max():
    c = make_consumer(versions=V2, inline_max_bytes=4096, wait_margin_s=0.25)
    ready_v2(c)
    b = the_batch(c.fetch("a", 1.0, 11.0))
    assert b.v == 2 and b.session_id == c.session_id and b.compat_hash == COMPAT
    assert [(i.mm_hash, i.dest) for i in b.items] == [("a", b"")]
    assert b.wait_s == pytest.approx(10.0 - 0.25) and b.inline_max == 4096
    assert c.fetch_states() == {"a": FetchState.WAITING_ACK}
    # a short deadline keeps three quarters of it for the wait; a long one is capped
    assert the_batch(c.fetch("b", 1.0, 1.2)).wait_s == pytest.approx(0.15)
    assert the_batch(c.fetch("c", 1.0, 500.0)).wait_s == MAX_WAIT_S


def test_a_v1_session_keeps_sending_xferreq():
    c = make_consumer(versions=V2)
    ready_v2(c, version=1)
    (req,) = frames(c.fetch("a", 0.0, 10.0))
    assert isinstance(req, XferReq) and req.v == 1
    out = c.fetch_many(["b", "c"], 0.0, 10.0)
    assert [type(m) for m in frames(out)] == [XferReq, XferReq]


def test_fetch_many_is_one_frame_and_its_grants_post_reads_together():
    c = make_consumer(versions=V2)
    ready_v2(c)
    b = the_batch(c.fetch_many(["a", "b", "c"], 0.0, 10.0))
    assert [i.mm_hash for i in b.items] == ["a", "b", "c"]
    out = c.on_frame(acks(c, b.batch_id, ok("a", 11), ok("b", 12, rows=3), ok("c", 13)), 0.01)
    posts = [x for x in out if isinstance(x, PostRead)]
    assert [p.key for p in posts] == ["a", "b", "c"] and posts[1].nbytes == 3 * BLOCK
    assert all(p.prepared == "binding" for p in posts)
    for mm in "abc":
        c.on_read_posted(mm, f"H{mm}", 0.02)
    out = c.on_read_state("b", "done", 0.03)
    (landed,) = reports(out)
    assert isinstance(landed, Landed) and landed.grant_id == 12 and Release("Hb") in out
    assert frames(out) == []  # v2: the step's completions leave together, at its poll
    (done,) = frames(c.poll(0.03))
    assert isinstance(done, XferDone) and done.ok and done.grant_id == 12 and done.v == 2


def test_fetches_queued_before_the_welcome_leave_in_one_batch():
    c = make_consumer(versions=V2)
    assert c.fetch("a", 0.0, 10.0) == [] and c.fetch_many(["b", "c"], 0.0, 10.0) == []
    b = the_batch(ready_v2(c))
    assert sorted(i.mm_hash for i in b.items) == ["a", "b", "c"]


def test_more_than_max_batch_items_are_split_into_frames():
    c = make_consumer(versions=V2)
    ready_v2(c)
    names = [f"m{i}" for i in range(MAX_BATCH_ITEMS + 3)]
    bs = frames(c.fetch_many(names, 0.0, 10.0))
    assert [len(b.items) for b in bs] == [MAX_BATCH_ITEMS, 3]
    assert len({b.batch_id for b in bs}) == 2


def test_fetch_many_refuses_duplicates_and_bad_names_one_by_one():
    c = make_consumer(versions=V2)
    ready_v2(c)
    out = c.fetch_many(["a", "a", "", "b"], 0.0, 10.0)
    assert sorted((m.mm_hash, m.reason) for m in reports(out)) == [
        ("", MissReason.INTERNAL), ("a", MissReason.INTERNAL)]
    assert [i.mm_hash for i in the_batch([x for x in out if isinstance(x, Send)]).items] == \
        ["a", "b"]


# -- answers -------------------------------------------------------------------------------------


def test_ready_items_first_then_a_parked_one_in_a_later_frame_of_the_same_batch():
    c = make_consumer(versions=V2)
    ready_v2(c)
    b = the_batch(c.fetch_many(["ready", "parked"], 0.0, 10.0))
    out = c.on_frame(acks(c, b.batch_id, ok("ready", 1)), 0.01)
    assert [x.key for x in out if isinstance(x, PostRead)] == ["ready"]
    assert c.on_frame(park(c, b.batch_id, "parked", wait_s=b.wait_s), 0.01) == []
    assert c.fetch_states()["parked"] is FetchState.WAITING_ACK
    assert reports(c.poll(5.0)) == []  # parked at the producer: no timeout, no re-send
    assert frames(c.poll(5.0)) == [] and c.ignored == {}
    out = c.on_frame(acks(c, b.batch_id, ok("parked", 2)), 6.0)
    assert [x.key for x in out if isinstance(x, PostRead)] == ["parked"]
    assert len(c.batches) == 0  # every item answered: the batch is forgotten


def test_not_ready_after_a_real_wait_is_asked_again_at_once_in_a_new_batch():
    c = make_consumer(versions=V2, retry_backoff_max_s=0.5)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 30.0))
    assert c.on_frame(acks(c, b.batch_id, nack("a", Status.NACK_NOT_READY)), 5.0) == []
    b2 = the_batch(c.poll(5.0))  # the producer capped its wait at 5 s: wait again, no backoff
    assert b2.batch_id != b.batch_id and b2.wait_s == pytest.approx(25.0 - 0.25)


def test_not_ready_at_once_backs_off_as_in_v1():
    c = make_consumer(versions=V2, retry_backoff_s=0.02, retry_backoff_max_s=0.5)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 30.0))
    c.on_frame(acks(c, b.batch_id, nack("a", Status.NACK_NOT_READY)), 0.001)
    assert frames(c.poll(0.01)) == []
    assert isinstance(the_batch(c.poll(0.03)), ReqBatch)


def test_not_ready_until_the_deadline_is_a_typed_miss():
    c = make_consumer(versions=V2)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 2.0))
    c.on_frame(acks(c, b.batch_id, nack("a", Status.NACK_NOT_READY)), 1.9)
    c.poll(1.9)  # asked again
    (m,) = reports(c.poll(2.0))
    assert m.reason is MissReason.MISSING and "NOT_READY" in m.detail


def test_terminal_nack_items_miss_on_their_own():
    c = make_consumer(versions=V2)
    ready_v2(c)
    b = the_batch(c.fetch_many(["a", "b"], 0.0, 10.0))
    out = c.on_frame(acks(c, b.batch_id, nack("a", Status.NACK_MISSING, "gone"), ok("b", 3)), 0.1)
    (m,) = reports(out)
    assert m == Miss("a", MissReason.MISSING, "NACK_MISSING: gone")
    assert [x.key for x in out if isinstance(x, PostRead)] == ["b"]


def test_grant_validity_window_counts_from_the_reqbatch():
    c = make_consumer(versions=V2, validity_margin_s=0.25)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 100.0))
    # lease 2 s from a ReqBatch sent at 0: the window ends at 1.75 (the producer parked it)
    out = c.on_frame(acks(c, b.batch_id, ok("a", 9, lease_s=2.0)), 1.8)
    done, again = frames(out)
    assert isinstance(done, XferDone) and not done.ok and done.grant_id == 9
    assert isinstance(again, ReqBatch) and [i.mm_hash for i in again.items] == ["a"]
    out = c.on_frame(acks(c, again.batch_id, ok("a", 10, lease_s=2.0)), 1.9)
    (post,) = [x for x in out if isinstance(x, PostRead)]
    c.on_read_posted("a", "H", 1.9)
    (m,) = reports(c.on_read_state("a", "done", 1.8 + 1.75 + 0.01))  # completion past window
    assert m.reason is MissReason.TIMEOUT


# -- inline entries ------------------------------------------------------------------------------


def test_an_inline_entry_is_copied_in_and_landed_with_no_read_and_no_done():
    c = make_consumer(versions=V2, inline_max_bytes=4 * BLOCK)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 10.0))
    data = bytes(range(3 * BLOCK))
    out = c.on_frame(acks(c, b.batch_id, ok("a", data=data)), 0.01)
    land, rep = out
    assert isinstance(land, Land) and land.data == data and isinstance(rep, Report)
    landed = rep.outcome
    assert isinstance(landed, Landed) and landed.grant_id == -1 and landed.entry.ready
    assert landed.entry.runs == land.runs and landed.entry.nbytes == 3 * BLOCK
    assert frames(out) == [] and c.in_flight() == 0 and c.reading() == []


def test_inline_and_granted_items_of_one_frame():
    c = make_consumer(versions=V2, inline_max_bytes=4 * BLOCK)
    ready_v2(c)
    b = the_batch(c.fetch_many(["small", "big"], 0.0, 10.0))
    out = c.on_frame(acks(c, b.batch_id, ok("small", data=b"x" * BLOCK), ok("big", 4, rows=8)),
                     0.01)
    assert [type(x) for x in out] == [Land, Report, PostRead]


def test_an_inline_entry_is_not_evicted_by_the_next_items_allocation():
    # 4 local blocks: the inline entry takes 2; the granted item needs 3. Were the inline
    # entry READY (evictable) before its Land ran, the grant's blocks would overwrite it.
    c = make_consumer(versions=V2, num_blocks=4)
    ready_v2(c)
    b = the_batch(c.fetch_many(["small", "big"], 0.0, 10.0))
    out = c.on_frame(acks(c, b.batch_id, ok("small", data=b"y" * 2 * BLOCK),
                          ok("big", 4, rows=3)), 0.01)
    land = next(x for x in out if isinstance(x, Land))
    got = {r.mm_hash: r for r in reports(out)}
    assert isinstance(got["small"], Landed) and got["small"].entry.runs == land.runs
    assert got["big"].reason is MissReason.NO_SPACE
    (done,) = frames(out + c.poll(0.01))
    assert isinstance(done, XferDone) and done.grant_id == 4 and not done.ok


@pytest.mark.parametrize("data, why", [
    (b"z" * (4 * BLOCK + BLOCK), "more than"),  # larger than the batch's inline_max
    (b"z" * (BLOCK + 1), "whole number"),  # not a whole number of rows
])
def test_bad_inline_data_is_refused_never_landed(data, why):
    c = make_consumer(versions=V2, inline_max_bytes=4 * BLOCK)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 10.0))
    out = c.on_frame(acks(c, b.batch_id, ok("a", data=data)), 0.01)
    (m,) = reports(out)
    assert m.reason is MissReason.INTERNAL and why in m.detail
    assert not any(isinstance(x, Land) for x in out) and c.ignored["bad_inline"] == 1
    assert len(c.store) == 0


def test_inline_data_of_another_size_than_expected_is_refused():
    c = make_consumer(versions=V2)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 10.0, nbytes=2 * BLOCK))
    (m,) = reports(c.on_frame(acks(c, b.batch_id, ok("a", data=b"z" * BLOCK)), 0.01))
    assert m.reason is MissReason.INTERNAL and "expected" in m.detail


def test_inline_data_with_a_grant_is_refused_and_the_grant_given_back():
    c = make_consumer(versions=V2)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 10.0))
    out = c.on_frame(acks(c, b.batch_id, ok("a", 5, data=b"z" * BLOCK)), 0.01)
    (m,) = reports(out)
    assert m.reason is MissReason.INTERNAL and "both" in m.detail
    (done,) = frames(out + c.poll(0.01))
    assert isinstance(done, XferDone) and done.grant_id == 5 and not done.ok


def test_inline_off_means_an_ok_without_grant_is_a_bad_grant():
    c = make_consumer(versions=V2, inline_max_bytes=0)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 10.0))
    assert b.inline_max == 0
    (m,) = reports(c.on_frame(acks(c, b.batch_id, ok("a")), 0.01))
    assert m.reason is MissReason.INTERNAL


# -- a hostile producer --------------------------------------------------------------------------


def test_answers_for_a_batch_never_sent_are_ignored_and_counted():
    c = make_consumer(versions=V2)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 10.0))
    assert c.on_frame(acks(c, b.batch_id + 7, ok("a", 1), ok("a2", data=b"q" * BLOCK)), 0.1) == []
    assert c.ignored["unknown_batch"] == 2 and c.fetch_states() == {"a": FetchState.WAITING_ACK}
    assert c.on_frame(acks(c, b.batch_id, ok("a", 1), session_id="f" * 32), 0.1) == []
    assert c.ignored["foreign_session"] == 1


def test_an_item_not_in_its_batch_and_a_second_answer_are_ignored():
    c = make_consumer(versions=V2)
    ready_v2(c)
    b1 = the_batch(c.fetch("a", 0.0, 10.0))
    b2 = the_batch(c.fetch("b", 0.0, 10.0))
    # "b" is ours, but batch b1 never named it: not its answer (b2's item stays waiting)
    assert c.on_frame(acks(c, b1.batch_id, ok("b", 1)), 0.1) == []
    assert c.ignored["not_in_batch"] == 1 and c.fetch_states()["b"] is FetchState.WAITING_ACK
    out = c.on_frame(acks(c, b2.batch_id, ok("b", 2), ok("b", 3)), 0.1)  # twice in one frame
    assert [x.key for x in out if isinstance(x, PostRead)] == ["b"]
    assert c.ignored["second_answer"] == 1
    c.on_read_posted("b", "H", 0.1)
    assert c.on_frame(acks(c, b1.batch_id, ok("a", 4), ok("a", 5)), 0.2) != []
    assert c.ignored["second_answer"] == 2
    assert c.on_frame(acks(c, b1.batch_id, ok("a", 6)), 0.3) == []  # b1 answered in full
    assert c.ignored["second_answer"] == 3 and c.ignored["unknown_batch"] == 0
    assert c.fetch_states() == {"a": FetchState.READING, "b": FetchState.READING}


def test_an_ackbatch_on_a_v1_session_is_refused_by_the_codec():
    c = make_consumer(versions=V2)
    ready_v2(c, version=1)
    (req,) = frames(c.fetch("a", 0.0, 10.0))
    raw = encode(AckBatch(v=1, session_id=c.session_id, batch_id=1, items=[ok("a", 1)]))
    with pytest.raises(FrameError) as e:
        decode(raw, versions=(1,))
    assert e.value.status is Status.NACK_VERSION
    assert c.on_frame(raw, 0.1) == [] and c.fetch_states() == {"a": FetchState.WAITING_ACK}


def test_the_late_grant_of_an_abandoned_item_is_given_back_once_nothing_else_reflected():
    c = make_consumer(versions=V2, ack_timeout_s=1.0)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 0.5))
    (m,) = reports(c.poll(0.5))
    assert m.reason is MissReason.TIMEOUT
    c.poll(0.6)
    assert len(c.batches) == 0
    late = acks(c, b.batch_id, ok("a", 8))
    (done,) = frames(c.on_frame(late, 0.7) + c.poll(0.7))
    assert isinstance(done, XferDone) and done.grant_id == 8 and not done.ok
    assert c.on_frame(late, 0.8) + c.poll(0.8) == []  # once


def test_state_stays_bounded_under_a_flood_of_stray_answers():
    c = make_consumer(versions=V2)
    ready_v2(c)
    for i in range(300):
        b = the_batch(c.fetch(f"m{i}", float(i), float(i) + 10.0))
        c.on_frame(acks(c, b.batch_id + 10_000, ok(f"m{i}", i + 1)), float(i))
        c.on_frame(acks(c, b.batch_id, nack(f"m{i}", Status.NACK_MISSING)), float(i))
        c.poll(float(i))
    assert c.in_flight() == 0 and len(c.batches) == 0 and c.batches.abandoned == 0
    assert c.ignored["unknown_batch"] == 300


def test_peer_down_forgets_the_batches():
    c = make_consumer(versions=V2)
    ready_v2(c)
    c.fetch_many(["a", "b"], 0.0, 10.0)
    out = c.on_peer_down(0.1)
    assert {m.mm_hash for m in reports(out)} == {"a", "b"} and len(c.batches) == 0


def test_xferack_on_a_v2_session_answers_no_batch_item():
    c = make_consumer(versions=V2)
    ready_v2(c)
    c.fetch("a", 0.0, 10.0)
    ack = XferAck(v=2, session_id=c.session_id, mm_hash="a", status=Status.OK,
                  grant=grant(1, 2), detail="")
    assert c.on_frame(encode(ack), 0.1) == []
    assert c.fetch_states() == {"a": FetchState.WAITING_ACK}


# -- with the real producer session (both default: v2 negotiated) -------------------------------


def test_with_the_producer_session_a_batch_lands_and_a_reserved_entry_is_waited_for():
    from .helpers import make_producer, pump, put

    p, pstore = make_producer()
    put(pstore, "a", 2)
    put(pstore, "b", 3)
    put(pstore, "later", 4, ready=False)
    c = make_consumer()
    pump(p, c, c.on_up(0.0), 0.0)
    assert c.version == 2
    out = pump(p, c, c.fetch_many(["a", "b", "later", "none"], 0.0, 10.0), 0.0)
    assert sorted(x.key for x in out if isinstance(x, PostRead)) == ["a", "b"]
    (m,) = reports(out)
    assert m.mm_hash == "none" and m.reason is MissReason.MISSING
    assert c.fetch_states()["later"] is FetchState.WAITING_ACK  # parked at the producer
    pstore.mark_ready("later")  # the save lands: the node tells the producer session
    out = []
    for cmd in p.on_entries_changed(["later"], 1.0):
        if isinstance(cmd, Send):
            out += c.on_frame(cmd.data, 1.0)
    assert [x.key for x in out if isinstance(x, PostRead)] == ["later"]
    for mm in ("a", "b", "later"):
        c.on_read_posted(mm, f"H{mm}", 1.1)
        done = c.on_read_state(mm, "done", 1.2)
        assert isinstance(reports(done)[0], Landed)
    # the three completions leave together: one DoneBatch
    (db,) = frames(c.poll(1.2))
    assert isinstance(db, DoneBatch) and len(db.items) == 3 and all(i.ok for i in db.items)
    pump(p, c, c.poll(1.2) or [Send(c.conn, encode(db))], 1.2)
    assert p.active_grants == 0 and c.in_flight() == 0


def test_a_v1_only_consumer_and_a_default_producer_speak_v1():
    from .helpers import make_producer, pump, put

    p, pstore = make_producer()
    put(pstore, "a", 2)
    c = make_consumer(versions=(1,))
    pump(p, c, c.on_up(0.0), 0.0)
    assert c.version == 1
    (req,) = frames(c.fetch("a", 0.0, 10.0))
    assert isinstance(req, XferReq)


# -- Parked: heard from within the ack timeout (a stopped producer is found in it) ---------------


def test_an_item_neither_answered_nor_parked_times_out_in_the_ack_timeout_and_quarantines():
    """A stopped or hung producer: the ReqBatch asked for a long wait, but nothing came back —
    the fetch misses TIMEOUT after ack_timeout_s (as an XferReq in v1), not at the end of the
    wait, and the producer is quarantined: the next fetch fails fast."""
    events = []
    c = make_consumer(versions=V2, ack_timeout_s=1.0, peer_backoff_s=5.0)
    c.observer = lambda ev, f: events.append((ev, f.get("why")))
    ready_v2(c)
    b = the_batch(c.fetch_many(["a", "b"], 0.0, 60.0))
    assert b.wait_s > 50.0 and c.next_deadline() == 1.0
    assert reports(c.poll(0.99)) == []
    out = c.poll(1.0)
    assert sorted((m.mm_hash, m.reason) for m in reports(out)) == [
        ("a", MissReason.TIMEOUT), ("b", MissReason.TIMEOUT)]
    assert all("no ack" in m.detail for m in reports(out))
    assert ("peer_quarantined", "no ack before the deadline") in events
    (m,) = reports(c.fetch("c", 1.1, 60.0))
    assert m.reason is MissReason.QUARANTINED


def test_items_left_out_of_the_first_answer_and_of_any_parked_frame_time_out():
    c = make_consumer(versions=V2, ack_timeout_s=1.0)
    ready_v2(c)
    b = the_batch(c.fetch_many(["a", "b", "c"], 0.0, 60.0))
    c.on_frame(acks(c, b.batch_id, ok("a", 1)), 0.1)
    c.on_frame(park(c, b.batch_id, "b"), 0.1)  # "c": neither
    (m,) = reports(c.poll(1.0))
    assert m.mm_hash == "c" and m.reason is MissReason.TIMEOUT
    assert c.fetch_states() == {"a": FetchState.READING, "b": FetchState.WAITING_ACK}


def test_parked_then_answered_lands_after_the_ack_timeout():
    c = make_consumer(versions=V2, ack_timeout_s=1.0)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 60.0))
    c.on_frame(park(c, b.batch_id, "a", wait_s=5.0), 0.05)
    assert c.next_deadline() == pytest.approx(6.0)  # sent + parked wait + ack timeout
    assert reports(c.poll(5.9)) == [] and frames(c.poll(5.9)) == []
    (post,) = [x for x in c.on_frame(acks(c, b.batch_id, ok("a", 3)), 5.95) if
               isinstance(x, PostRead)]
    assert post.key == "a" and c.fetch_states() == {"a": FetchState.READING}


def test_parked_then_silent_misses_at_the_end_of_the_wait_plus_the_ack_timeout():
    events = []
    c = make_consumer(versions=V2, ack_timeout_s=1.0)
    c.observer = lambda ev, f: events.append((ev, f.get("why")))
    ready_v2(c)
    b = the_batch(c.fetch("a", 10.0, 70.0))
    c.on_frame(park(c, b.batch_id, "a", wait_s=5.0), 10.2)  # the producer caps the wait at 5 s
    assert reports(c.poll(15.99)) == []
    (m,) = reports(c.poll(16.0))
    assert m.reason is MissReason.TIMEOUT and "parked" in m.detail and "ack" in m.detail
    assert events[-1][0] == "peer_quarantined"  # the producer did not keep its word
    late = acks(c, b.batch_id, ok("a", 4))  # its grant, after all: given back once
    (done,) = frames(c.on_frame(late, 16.5) + c.poll(16.5))
    assert isinstance(done, XferDone) and done.grant_id == 4 and not done.ok


def test_a_parked_wait_longer_than_asked_or_than_the_fetch_is_not_believed():
    c = make_consumer(versions=V2, ack_timeout_s=1.0)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 8.0))
    c.on_frame(park(c, b.batch_id, "a", wait_s=MAX_WAIT_S), 0.1)
    assert c.next_deadline() == pytest.approx(8.0)  # capped by the fetch deadline
    (m,) = reports(c.poll(8.0))
    assert m.mm_hash == "a" and m.reason is MissReason.TIMEOUT
    # a wait above what the batch asked for counts as what it asked for
    assert parked_deadline(0.0, 2.0, MAX_WAIT_S, 1.0, 100.0) == 3.0
    assert parked_deadline(0.0, 9.0, 2.5, 1.0, 100.0) == 3.5
    assert parked_deadline(0.0, 9.0, 2.5, 1.0, 3.0) == 3.0


def test_a_parked_frame_is_not_answered_and_a_v1_session_refuses_it():
    c = make_consumer(versions=V2)
    ready_v2(c, version=1)
    c.fetch("a", 0.0, 10.0)
    raw = encode(Parked(v=1, session_id=c.session_id, batch_id=1, items=["a"], wait_s=1.0))
    with pytest.raises(FrameError) as e:
        decode(raw, versions=(1,))
    assert e.value.status is Status.NACK_VERSION
    assert c.on_frame(raw, 0.1) == [] and c.on_frame(park(c, 1, "a"), 0.1) == []
    assert c._fetches["a"].due == 2.0  # the v1 ack timeout stands


@pytest.mark.parametrize("case", ["foreign_session", "unknown_batch", "not_in_batch", "twice",
                                  "answered", "batch_answered"])
def test_stray_parked_frames_are_ignored_counted_and_extend_nothing(case):
    c = make_consumer(versions=V2, ack_timeout_s=1.0)
    ready_v2(c)
    b = the_batch(c.fetch_many(["a", "b"], 0.0, 60.0))
    bid = b.batch_id
    if case == "foreign_session":
        frame, why = park(c, bid, "a", session_id="f" * 32), "parked_foreign_session"
    elif case == "unknown_batch":
        frame, why = park(c, bid + 7, "a"), "parked_unknown_batch"
    elif case == "not_in_batch":
        frame, why = park(c, bid, "zz"), "parked_not_in_batch"
    elif case == "twice":
        c.on_frame(park(c, bid, "a", wait_s=2.0), 0.1)
        frame, why = park(c, bid, "a", "b", "a", wait_s=30.0), "parked_twice"
    else:
        c.on_frame(acks(c, bid, nack("a", Status.NACK_MISSING)), 0.1)
        if case == "batch_answered":
            c.on_frame(acks(c, bid, nack("b", Status.NACK_MISSING)), 0.1)
        frame, why = park(c, bid, "a"), "parked_answered"
    assert c.on_frame(frame, 0.2) == []  # never answered
    assert c.ignored[why] >= 1 and sum(c.ignored.values()) == c.ignored[why]
    if case == "twice":  # "b" is parked by the second frame; "a" keeps its first wait
        assert c.ignored[why] == 2
        assert c._fetches["a"].due == pytest.approx(3.0)
        assert c._fetches["b"].due == pytest.approx(31.0)
        return
    if case == "batch_answered":
        assert c.in_flight() == 0
        return
    # nothing was extended: what is still waiting times out in the ack timeout
    assert {m.reason for m in reports(c.poll(1.0))} == {MissReason.TIMEOUT}
    assert c.in_flight() == 0


def test_state_stays_bounded_under_a_flood_of_stray_parked_frames():
    c = make_consumer(versions=V2, ack_timeout_s=1.0)
    ready_v2(c)
    b = the_batch(c.fetch("a", 0.0, 60.0))
    for i in range(500):
        c.on_frame(park(c, b.batch_id + 1 + i, *[f"x{j}" for j in range(MAX_BATCH_ITEMS)]), 0.1)
        c.on_frame(park(c, b.batch_id, *[f"y{i}.{j}" for j in range(MAX_BATCH_ITEMS)]), 0.1)
    assert c.ignored["parked_unknown_batch"] == 500 * MAX_BATCH_ITEMS
    assert c.ignored["parked_not_in_batch"] == 500 * MAX_BATCH_ITEMS
    assert len(c.batches) == 1 and c.batches.get(b.batch_id).parked == set()
    (m,) = reports(c.poll(1.0))  # and the flood parked nothing
    assert m.reason is MissReason.TIMEOUT and c.in_flight() == 0


def test_with_the_producer_session_a_parked_item_outlives_the_ack_timeout():
    from .helpers import make_producer, pump, put

    p, pstore = make_producer(max_wait_s=4.0)
    put(pstore, "later", 2, ready=False)
    c = make_consumer(ack_timeout_s=1.0)
    pump(p, c, c.on_up(0.0), 0.0)
    assert pump(p, c, c.fetch("later", 0.0, 30.0), 0.0) == []  # parked: the Parked is pumped
    assert reports(c.poll(2.0)) == [] and c.next_deadline() == pytest.approx(5.0)
    pstore.mark_ready("later")
    out = []
    for cmd in p.on_entries_changed(["later"], 3.0):
        out += c.on_frame(cmd.data, 3.0) if isinstance(cmd, Send) else []
    assert [x.key for x in out if isinstance(x, PostRead)] == ["later"]
    # the producer's wait runs out unanswered: NOT_READY (a real wait), asked again at once
    put(pstore, "never", 1, ready=False)
    pump(p, c, c.fetch("never", 3.0, 30.0), 3.0)
    assert c._fetches["never"].due == pytest.approx(3.0 + 4.0 + 1.0)
    for cmd in p.poll(7.0):
        if isinstance(cmd, Send):
            c.on_frame(cmd.data, 7.0)
    assert c.fetch_states()["never"] is FetchState.BACKOFF
    assert c.ignored == {}


@pytest.mark.parametrize("dones", [True, False])
def test_completions_are_batched_only_for_a_producer_that_takes_donebatch(dones):
    """A producer's Welcome says whether it takes DoneBatch (``features: ["dones"]``); to one
    that does not (the first v2 releases refused the frame, and its grants then stayed pinned to
    the end of their leases) the step's completions leave as one XferDone each."""
    c = make_consumer(versions=V2, inline_max_bytes=0)
    c.on_up(0.0)
    w = Welcome(v=2, session_id=c.session_id, node_id="p", status=Status.OK, version=2,
                plane="nixl", versions=[1, 2], planes=["nixl"], compat_hash=COMPAT, detail="",
                endpoint=b"e", features=["dones"] if dones else [])
    bound(c, c.on_frame(encode(w), 0.0), 0.0)
    b = the_batch(c.fetch_many(["a", "b", "c"], 0.0, 10.0))
    c.on_frame(acks(c, b.batch_id, ok("a", 1), ok("b", 2), ok("c", 3)), 0.01)
    for mm in ("a", "b", "c"):
        c.on_read_posted(mm, f"H{mm}", 0.02)
        c.on_read_state(mm, "done", 0.03)
    sent = frames(c.poll(0.03))
    if dones:
        (db,) = sent
        assert isinstance(db, DoneBatch) and [i.mm_hash for i in db.items] == ["a", "b", "c"]
    else:
        assert [type(x) for x in sent] == [XferDone] * 3, sent
        assert [x.mm_hash for x in sent] == ["a", "b", "c"] and all(x.ok for x in sent)
