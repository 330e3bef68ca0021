"""When a v2 consumer session's completions leave (``done_delay_s``, ECTP v2 §4.4): together,
at a poll once due, at once when a ``DoneBatch`` is full, and always before the session's next
request or at close (fake clock; a real ProducerSession where the producer's side matters)."""

from __future__ import annotations

from ectransport.protocol import (
    MAX_BATCH_ITEMS,
    AckBatch,
    AckItem,
    DoneBatch,
    Grant,
    ReqBatch,
    Status,
    Welcome,
    XferDone,
    decode,
    encode,
)
from ectransport.session import FetchState, PostRead, Send

from .helpers import BLOCK, COMPAT, DONE_S, bound, make_consumer, make_producer, pump, put

V2 = (1, 2)


def frames(cmds):
    return [decode(c.data, versions=V2) for c in cmds if isinstance(c, Send)]


def welcomed(**kw):
    """A v2 consumer session welcomed by a producer that takes DoneBatch."""
    c = make_consumer(versions=V2, inline_max_bytes=0, **kw)
    c.on_up(0.0)
    w = Welcome(v=2, session_id=c.session_id, node_id="p", status=Status.OK, version=2,
                plane="nixl", versions=[1, 2], planes=["nixl"], compat_hash=COMPAT, detail="",
                endpoint=b"e", features=["dones"])
    bound(c, c.on_frame(encode(w), 0.0), 0.0)
    return c


def granted(c, names, t):
    """Ask for ``names`` at ``t`` and have each granted (one row)."""
    (b,) = frames(c.fetch_many(list(names), t, t + 10.0))
    assert isinstance(b, ReqBatch)
    items = [AckItem(mm_hash=mm, status=Status.OK, data=b"", detail="",
                     grant=Grant(grant_id=i + 1, entry_bytes=BLOCK, num_blocks=1,
                                 block_bytes=BLOCK, lease_s=30.0, plane="nixl",
                                 plane_grant=b"g"))
             for i, mm in enumerate(names)]
    assert [type(x) for x in c.on_frame(encode(AckBatch(
        v=2, session_id=c.session_id, batch_id=b.batch_id, items=items)), t)] == \
        [PostRead] * len(names)
    for mm in names:
        c.on_read_posted(mm, f"H{mm}", t)


def land(c, names, t):
    """The READs of ``names`` complete at ``t``: nothing is sent yet."""
    for mm in names:
        assert frames(c.on_read_state(mm, "done", t)) == []


def landed(c, names, t):
    granted(c, names, t)
    land(c, names, t)


def test_completions_wait_until_due_then_leave_together():
    c = welcomed()
    granted(c, ["a", "b"], 1.0)
    land(c, ["a"], 1.0)
    assert frames(c.poll(1.0)) == []  # this poll saw it queued: due DONE_S later
    assert c.next_deadline() == 1.0 + DONE_S  # the driver wakes for it
    land(c, ["b"], 1.0 + DONE_S / 2)
    assert frames(c.poll(1.0 + DONE_S / 2)) == []
    (db,) = frames(c.poll(1.0 + DONE_S))
    assert isinstance(db, DoneBatch) and [i.mm_hash for i in db.items] == ["a", "b"]
    assert all(i.ok for i in db.items)
    assert frames(c.poll(2.0)) == [] and c.next_deadline() is None  # sent once


def test_a_request_takes_the_queued_completions_first():
    """ECTP v2 §4.4: every queued completion leaves before a later request of the session."""
    c = welcomed()
    landed(c, ["a"], 1.0)
    assert frames(c.poll(1.0)) == []
    done, req = frames(c.fetch("x", 1.001, 10.0))
    assert isinstance(done, XferDone) and done.mm_hash == "a" and done.ok
    assert isinstance(req, ReqBatch) and [i.mm_hash for i in req.items] == ["x"]
    assert frames(c.poll(1.0 + DONE_S)) == []


def test_a_full_donebatch_leaves_at_once():
    c = welcomed(num_blocks=2 * MAX_BATCH_ITEMS)
    names = [f"e{i}" for i in range(MAX_BATCH_ITEMS)]
    landed(c, names, 1.0)
    (db,) = frames(c.poll(1.0))
    assert isinstance(db, DoneBatch) and len(db.items) == MAX_BATCH_ITEMS


def test_close_sends_the_queued_completions():
    c = welcomed()
    landed(c, ["a"], 1.0)
    assert frames(c.poll(1.0)) == []
    (done,) = frames(c.close())
    assert isinstance(done, XferDone) and done.mm_hash == "a" and done.ok


def test_with_no_delay_they_leave_at_the_poll_of_the_step():
    c = welcomed(done_delay_s=0.0)
    landed(c, ["a"], 1.0)
    (done,) = frames(c.poll(1.0))
    assert isinstance(done, XferDone) and done.mm_hash == "a"


def test_a_busy_fetch_hurried_by_an_ended_grant_is_asked_after_its_completion():
    """NACK_BUSY (our pin budget at the producer is full): when one of our grants ends, the
    waiting fetch is asked again at the next poll — with the completion, not yet due, sent
    first, so the producer has unpinned and grants it."""
    p, pstore = make_producer(budget_bytes=2 * BLOCK)
    put(pstore, "a", 2)
    put(pstore, "b", 2)
    c = make_consumer(versions=V2, inline_max_bytes=0, retry_backoff_s=10.0,
                      retry_backoff_max_s=10.0)
    assert pump(p, c, c.on_up(0.0), 0.0) == [] and c.version == 2
    assert [type(x) for x in pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)] == [PostRead]
    assert pump(p, c, c.fetch("b", 0.0, 100.0), 0.0) == []  # NACK_BUSY
    assert c.fetch_states()["b"] is FetchState.BACKOFF
    c.on_read_posted("a", "H", 0.1)
    assert frames(c.on_read_state("a", "done", 0.2)) == []  # queued
    assert c.next_deadline() <= 0.2  # b is due now, not in 10 s
    out = c.poll(0.2)
    done, req = frames(out)
    assert isinstance(done, XferDone) and done.mm_hash == "a"
    assert isinstance(req, ReqBatch) and [i.mm_hash for i in req.items] == ["b"]
    (post,) = [x for x in pump(p, c, out, 0.2) if isinstance(x, PostRead)]
    assert post.key == "b" and pstore.get("a").pins == 0
