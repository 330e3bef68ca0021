"""When a v2 consumer session's completions leave (ECTP v2 §4.4, ``done_delay_s``): a grant's at
the poll of its step; a hold's (a read on an offer, §10) together with later ones, at a poll
once due, at once when a ``DoneBatch`` is full, and always before the session's next request,
with a grant's, or at close (fake clock, hand-made producer frames)."""

from __future__ import annotations

from ectransport.protocol import (
    FEATURE_DONES,
    FEATURE_OFFERS,
    MAX_BATCH_ITEMS,
    AckBatch,
    AckItem,
    DoneBatch,
    Grant,
    Offer,
    OfferItem,
    ReqBatch,
    Status,
    Sync,
    Ticket,
    Welcome,
    XferDone,
    decode,
    encode,
)
from ectransport.session import PostRead, Send

from .helpers import BLOCK, COMPAT, DONE_S, bound, make_consumer

V2 = (1, 2)
T0 = 100.0


def frames(cmds):
    return [decode(c.data, versions=V2) for c in cmds if isinstance(c, Send)]


def grant(gid):
    return Grant(grant_id=gid, entry_bytes=BLOCK, num_blocks=1, block_bytes=BLOCK, lease_s=30.0,
                 plane="nixl", plane_grant=b"g%d" % gid)


def welcomed(n_offers=0, **kw):
    """A v2 session welcomed by producer ``p`` (which takes DoneBatch and offers), holding offers
    of holds ``h0``… (hold ids 1000…) for ``n_offers`` entries."""
    c = make_consumer(versions=V2, inline_max_bytes=0, num_blocks=4 * MAX_BATCH_ITEMS, **kw)
    c.on_up(T0)
    w = Welcome(v=2, session_id=c.session_id, node_id="p", status=Status.OK, version=2,
                plane="nixl", versions=[1, 2], planes=["nixl"], compat_hash=COMPAT, detail="",
                endpoint=b"e", features=[FEATURE_DONES, FEATURE_OFFERS])
    (sync,) = frames(bound(c, c.on_frame(encode(w), T0), T0))
    assert isinstance(sync, Sync)
    if n_offers:
        items = [OfferItem(mm_hash=f"h{i}", grant=grant(1000 + i), valid_s=9.0)
                 for i in range(n_offers)]
        assert c.on_frame(encode(Offer(v=2, session_id=c.session_id, anchor=sync.t,
                                       items=items)), T0) == []
    return c


def read_on_offers(c, names, t):
    """Fetch ``names`` on their tickets (no request) and land them at ``t``."""
    for mm in names:
        ticket = Ticket(producer="p", hold_id=1000 + int(mm[1:]), mm_hash=mm)
        assert [type(x) for x in c.fetch(mm, t, t + 10.0, ticket=ticket)] == [PostRead]
        c.on_read_posted(mm, f"H{mm}", t)
        assert frames(c.on_read_state(mm, "done", t)) == []


def granted(c, mm, gid, t):
    """Fetch ``mm`` with a request at ``t`` and have it granted (the READ posted)."""
    (b,) = frames(c.fetch(mm, t, t + 10.0))
    assert isinstance(b, ReqBatch)
    ack = AckItem(mm_hash=mm, status=Status.OK, grant=grant(gid), data=b"", detail="")
    assert [type(x) for x in c.on_frame(encode(AckBatch(
        v=2, session_id=c.session_id, batch_id=b.batch_id, items=[ack])), t)] == [PostRead]
    c.on_read_posted(mm, "G", t)


def read_on_a_grant(c, mm, gid, t):
    """Fetch ``mm`` with a request, have it granted and land at ``t``."""
    granted(c, mm, gid, t)
    return c.on_read_state(mm, "done", t)


def test_a_grants_completion_leaves_at_the_poll_of_its_step():
    """It unpins blocks at the producer and frees our pin budget there: no waiting."""
    c = welcomed()
    assert frames(read_on_a_grant(c, "x", 7, 101.0)) == []
    (done,) = frames(c.poll(101.0))
    assert isinstance(done, XferDone) and done.grant_id == 7 and done.ok


def test_hold_completions_wait_until_due_then_leave_together():
    c = welcomed(n_offers=2)
    read_on_offers(c, ["h0"], 101.0)
    assert frames(c.poll(101.0)) == []  # this poll saw it queued: due DONE_S later
    assert c.next_deadline() == 101.0 + DONE_S  # the driver wakes for it
    read_on_offers(c, ["h1"], 101.0 + DONE_S / 2)
    assert frames(c.poll(101.0 + DONE_S / 2)) == []
    (db,) = frames(c.poll(101.0 + DONE_S))
    assert isinstance(db, DoneBatch) and [(i.mm_hash, i.grant_id) for i in db.items] == \
        [("h0", 1000), ("h1", 1001)] and all(i.ok for i in db.items)
    assert frames(c.poll(102.0)) == []  # sent once


def test_a_request_takes_the_queued_completions_first():
    """ECTP v2 §4.4: every queued completion leaves before a later request of the session."""
    c = welcomed(n_offers=1)
    read_on_offers(c, ["h0"], 101.0)
    assert frames(c.poll(101.0)) == []
    done, req = frames(c.fetch("x", 101.001, 110.0))
    assert isinstance(done, XferDone) and done.mm_hash == "h0" and done.ok
    assert isinstance(req, ReqBatch) and [i.mm_hash for i in req.items] == ["x"]
    assert frames(c.poll(101.0 + DONE_S)) == []


def test_a_grants_completion_takes_the_queued_ones_along():
    c = welcomed(n_offers=1)
    granted(c, "x", 7, 101.0)
    read_on_offers(c, ["h0"], 101.0)
    assert frames(c.poll(101.0)) == []  # h0's: not due yet
    assert frames(c.on_read_state("x", "done", 101.001)) == []
    (db,) = frames(c.poll(101.001))  # x's leaves at the poll of its step, and h0's with it
    assert isinstance(db, DoneBatch) and [i.mm_hash for i in db.items] == ["h0", "x"]


def test_a_full_donebatch_of_hold_completions_leaves_at_once():
    c = welcomed(n_offers=MAX_BATCH_ITEMS)
    read_on_offers(c, [f"h{i}" for i in range(MAX_BATCH_ITEMS)], 101.0)
    (db,) = frames(c.poll(101.0))
    assert isinstance(db, DoneBatch) and len(db.items) == MAX_BATCH_ITEMS


def test_close_sends_the_queued_completions():
    c = welcomed(n_offers=1)
    read_on_offers(c, ["h0"], 101.0)
    assert frames(c.poll(101.0)) == []
    (done,) = frames(c.close())
    assert isinstance(done, XferDone) and done.mm_hash == "h0" and done.ok


def test_with_no_delay_hold_completions_leave_at_the_poll_of_their_step():
    c = welcomed(n_offers=1, done_delay_s=0.0)
    read_on_offers(c, ["h0"], 101.0)
    (done,) = frames(c.poll(101.0))
    assert isinstance(done, XferDone) and done.mm_hash == "h0"
