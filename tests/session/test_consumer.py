"""ConsumerSession: fetch lifecycle, deadlines, quarantine, NACK mapping (fake clock).

These are the ECTP v1 exchange's tests (XferReq/XferAck): the consumers here are configured
``versions=(1,)``, which a v1-and-v2 producer serves at v1. The v2 exchange (ReqBatch/AckBatch)
is tested in ``test_consumer_v2.py``."""

from __future__ import annotations

import msgspec
import pytest

from ectransport.protocol import (
    Hello,
    Renew,
    Status,
    XferAck,
    XferDone,
    XferReq,
    compat_hash,
    decode,
    encode,
)
from ectransport.session import FetchState, Landed, Miss, MissReason, PostRead, Release, Report

from .helpers import BLOCK, bound, make_producer, msgs, pump, put
from .helpers import make_consumer as _make_consumer


def make_consumer(*args, **kw):
    """A consumer of the v1 exchange (see the module docstring)."""
    kw.setdefault("versions", (1,))
    return _make_consumer(*args, **kw)


def reports(cmds):
    return [c.outcome for c in cmds if isinstance(c, Report)]


def connected(p, c, now=0.0, user=""):
    rest = pump(p, c, c.on_up(now), now, user=user)
    assert c.welcomed and rest == []
    return rest


def test_hello_then_request_then_read_lands():
    p, pstore = make_producer()
    put(pstore, "a", 5)
    c = make_consumer()
    assert c.fetch("a", 0.0, 10.0) == []  # queued until Welcome
    (hello,) = msgs(c.on_up(0.0))
    assert isinstance(hello, Hello) and hello.session_id == c.session_id
    cmds = pump(p, c, c.on_up(0.0), 0.0)
    # the Welcome released the queued request: pump it too
    cmds = pump(p, c, cmds, 0.1) if any(not isinstance(x, PostRead) for x in cmds) else cmds
    (post,) = [x for x in cmds if isinstance(x, PostRead)]
    assert post.nbytes == 5 * BLOCK and sum(r.count for r in post.runs) == 5
    assert c.store.get(f"a#{c.session_id}.1").ready is False  # local blocks reserved, not ready
    assert c.on_read_posted("a", "H", 0.2) == []
    assert c.reading() == [("a", "H")]
    assert c.on_read_state("a", "proc", 0.3) == []
    out = c.on_read_state("a", "done", 0.4)
    assert Release("H") in out
    (done,) = [m for m in msgs(out) if isinstance(m, XferDone)]
    assert done.ok and done.mm_hash == "a"
    (landed,) = reports(out)
    assert isinstance(landed, Landed) and landed.entry.ready and c.store.get(f"a#{c.session_id}.1").ready
    p.on_frame("peer1", encode(done), 0.5)
    assert pstore.get("a").pins == 0
    assert c.in_flight() == 0


def test_nacks_map_to_typed_misses():
    p, pstore = make_producer()
    put(pstore, "nr", 1, ready=False)
    c = make_consumer()
    connected(p, c)
    (m,) = reports(pump(p, c, c.fetch("x", 0.0, 10.0), 0.0))
    assert m == Miss("x", MissReason.MISSING, m.detail) and "NACK_MISSING" in m.detail
    assert reports(pump(p, c, c.fetch("nr", 0.0, 10.0), 0.0)) == []  # NOT_READY: retried
    assert c.fetch_states() == {"nr": FetchState.BACKOFF}


def test_not_ready_is_retried_with_backoff_until_it_lands():
    p, pstore = make_producer()
    put(pstore, "nr", 2, ready=False)
    c = make_consumer(retry_backoff_s=0.02, retry_backoff_max_s=0.5)
    connected(p, c)
    pump(p, c, c.fetch("nr", 0.0, 10.0), 0.0)
    assert pump(p, c, c.poll(0.01), 0.01) == []  # not yet due
    assert pump(p, c, c.poll(0.02), 0.02) == []  # retried, NOT_READY again (backoff 0.04)
    assert c.fetch_states() == {"nr": FetchState.BACKOFF}
    pstore.mark_ready("nr")  # the save landed
    out = pump(p, c, c.poll(0.06), 0.06)
    assert [type(x) for x in out] == [PostRead]


def test_retryable_nack_until_deadline_is_a_typed_miss():
    p, pstore = make_producer(budget_bytes=3 * BLOCK)
    put(pstore, "hold", 2)
    put(pstore, "big", 2)
    c = make_consumer()
    connected(p, c)
    (post,) = pump(p, c, c.fetch("hold", 0.0, 5.0), 0.0)  # pins 2 of our 3 budget blocks
    c.on_read_posted("hold", "H", 0.0)
    pump(p, c, c.fetch("big", 0.0, 1.0), 0.0)
    t, got = 0.0, []
    while not got and t < 2.0:
        t += 0.01
        got = [r for r in reports(pump(p, c, c.poll(t), t)) if r.mm_hash == "big"]
    (m,) = got
    assert (
        m.reason is MissReason.BUSY
        and "NACK_BUSY" in m.detail
        and t == pytest.approx(1.0, abs=0.02)
    )
    assert c.blocked_until == 0.0  # BUSY does not quarantine the producer


def test_incompatible_producer_fails_whole_session():
    p, pstore = make_producer()
    c = make_consumer(compat=compat_hash("m", "float32", 8))
    c.fetch("a", 0.0, 10.0)
    (m,) = reports(pump(p, c, c.on_up(0.0), 0.0))
    assert m.reason is MissReason.INCOMPATIBLE and c.failed is not None
    (m2,) = reports(c.fetch("b", 0.1, 10.0))
    assert m2.reason is MissReason.INCOMPATIBLE  # fails fast afterwards


def test_version_mismatch_is_a_typed_miss():
    p, _ = make_producer(versions=(1,))
    c = make_consumer(versions=(2,))
    c.fetch("a", 0.0, 10.0)
    (m,) = reports(pump(p, c, c.on_up(0.0), 0.0))
    assert m.reason is MissReason.VERSION and "[1]" in m.detail


def test_ack_timeout_and_late_grant_released():
    p, pstore = make_producer()
    put(pstore, "a", 1)
    c = make_consumer(ack_timeout_s=2.0)
    connected(p, c)
    (req,) = [x for x in c.fetch("a", 0.0, 10.0)]
    assert reports(c.poll(1.9)) == []
    (m,) = reports(c.poll(2.0))
    assert m.reason is MissReason.TIMEOUT
    # the ack arrives late: the consumer returns the grant at once
    (ack,) = p.on_frame("peer1", req.data, 2.1)
    out = c.on_frame(ack.data, 2.2)
    (done,) = msgs(out)
    assert isinstance(done, XferDone) and not done.ok
    p.on_frame("peer1", out[0].data, 2.3)
    assert pstore.get("a").pins == 1 and p.active_grants == 0  # ended; the grace pin holds
    p.poll(2.3 + p.settings.grace_s)
    assert pstore.get("a").pins == 0


def test_read_deadline_quarantines_until_settled():
    p, pstore = make_producer()
    put(pstore, "a", 3)
    c = make_consumer(read_timeout_s=20.0, quarantine_s=60.0)
    connected(p, c)
    (post,) = pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    assert reports(c.poll(19.9)) == []
    out = c.poll(20.0)
    (m,) = reports(out)
    assert m.reason is MissReason.TIMEOUT and "quarantined" in m.detail
    assert [x for x in msgs(out) if isinstance(x, XferDone)][0].ok is False
    # blocks stay reserved while the DMA may still land
    assert c.store.get(f"a#{c.session_id}.1") is not None and c.reading() == [("a", "H")]
    assert c.on_read_state("a", "proc", 30.0) == []
    assert c.store.get(f"a#{c.session_id}.1") is not None
    out = c.poll(80.0)  # quarantine deadline: release exactly once, free the blocks
    assert out == [Release("H")]
    assert c.store.get(f"a#{c.session_id}.1") is None and c.in_flight() == 0
    assert c.poll(200.0) == [] and c.on_read_state("a", "done", 201.0) == []
    c.store.check_invariants()


def test_quarantine_settles_early_when_plane_reports_over():
    p, pstore = make_producer()
    put(pstore, "a", 3)
    c = make_consumer(read_timeout_s=1.0)
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    c.poll(1.0)
    assert c.on_read_state("a", "err", 2.0) == [Release("H")]
    assert c.store.get(f"a#{c.session_id}.1") is None


def test_read_error_frees_blocks_and_tells_producer():
    p, pstore = make_producer()
    put(pstore, "a", 2)
    c = make_consumer()
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.1)
    out = c.on_read_state("a", "err", 0.2)
    assert Release("H") in out and reports(out)[0].reason is MissReason.INTERNAL
    assert c.store.get(f"a#{c.session_id}.1") is None
    for s in msgs(out):
        p.on_frame("peer1", encode(s), 0.3)
    assert p.active_grants == 0 and pstore.get("a").pins == 1  # abandoned: grace pin
    p.poll(0.3 + p.settings.grace_s)
    assert pstore.get("a").pins == 0


def test_peer_down_waiting_miss_reading_quarantined():
    p, pstore = make_producer()
    put(pstore, "a", 2)
    c = make_consumer()
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    c.fetch("b", 0.0, 100.0)
    out = c.on_peer_down(1.0)
    got = {m.mm_hash: m.reason for m in reports(out)}
    assert got == {"a": MissReason.PEER_DOWN, "b": MissReason.PEER_DOWN}
    assert c.reading() == [("a", "H")]  # a's DMA may still land: quarantined
    assert not c.welcomed


def test_no_space_locally_returns_grant():
    p, pstore = make_producer()
    put(pstore, "big", 10)
    c = make_consumer(num_blocks=4)
    connected(p, c)
    out = pump(p, c, c.fetch("big", 0.0, 100.0), 0.0)
    (m,) = reports(out)
    assert m.reason is MissReason.NO_SPACE
    for s in msgs(out):
        p.on_frame("peer1", encode(s), 0.1)
    assert p.active_grants == 0
    p.poll(0.1 + p.settings.grace_s)
    assert pstore.get("big").pins == 0


def test_grant_with_wrong_layout_refused():
    p, pstore = make_producer()
    c = make_consumer()
    connected(p, c)
    c.fetch("a", 0.0, 10.0)
    from ectransport.protocol import Grant

    bad = XferAck(
        v=1,
        session_id=c.session_id,
        mm_hash="a",
        status=Status.OK,
        detail="",
        grant=Grant(
            grant_id=1,
            entry_bytes=100,
            num_blocks=1,
            block_bytes=BLOCK * 2,
            lease_s=30,
            plane="nixl",
            plane_grant=b"",
        ),
    )
    out = c.on_frame(encode(bad), 0.1)
    assert reports(out)[0].reason is MissReason.INTERNAL
    assert c.store.free_blocks == c.store.num_blocks


def test_every_fetch_ends_by_its_deadline_without_welcome():
    c = make_consumer()
    c.fetch("a", 0.0, 3.0)
    assert reports(c.poll(2.9)) == []
    (m,) = reports(c.poll(3.0))
    assert m.reason is MissReason.TIMEOUT


def test_duplicate_fetch_refused_and_foreign_ack_ignored():
    p, pstore = make_producer()
    put(pstore, "a", 1)
    c = make_consumer()
    connected(p, c)
    c.fetch("a", 0.0, 10.0)
    (m,) = reports(c.fetch("a", 0.0, 10.0))
    assert m.reason is MissReason.INTERNAL
    foreign = XferAck(
        v=1, session_id="x" * 32, mm_hash="a", status=Status.NACK_MISSING, grant=None, detail=""
    )
    assert c.on_frame(encode(foreign), 0.1) == []
    assert c.on_frame(b"\xc1garbage", 0.1) == []
    _ = XferReq  # the request is still pending
    assert c.in_flight() == 1


def test_leases_renewed_every_sixth_while_reading():
    p, pstore = make_producer(lease_s=30.0)
    put(pstore, "a", 1)
    c = make_consumer(read_timeout_s=100.0)
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 200.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    assert msgs(c.poll(4.9)) == []
    (r,) = msgs(c.poll(5.0))
    assert isinstance(r, Renew) and r.extend_s == pytest.approx(20.0) and len(r.grant_ids) == 1
    p.on_frame("peer1", encode(r), 25.0)  # extends the producer's lease to 45 s
    assert msgs(c.poll(9.9)) == []
    assert isinstance(msgs(c.poll(10.0))[0], Renew)
    p.poll(40.0)
    assert pstore.get("a").pins == 1  # renewed: not expired at 30 s


def test_peer_quarantine_fails_fast_then_probe_lifts_it():
    p, pstore = make_producer()
    put(pstore, "a", 1)
    c = make_consumer(ack_timeout_s=1.0, peer_backoff_s=1.0, peer_backoff_max_s=4.0)
    connected(p, c)
    c.fetch("a", 0.0, 10.0)  # the producer never answers
    (m,) = reports(c.poll(1.0))
    assert m.reason is MissReason.TIMEOUT
    (m,) = reports(c.fetch("a", 1.5, 10.0))
    assert m.reason is MissReason.QUARANTINED and "no ack" in m.detail
    # after the backoff, the next fetch probes with Hello; the Welcome lifts the quarantine
    out = c.fetch("a", 2.0, 10.0)
    assert [type(x).__name__ for x in msgs(out)] == ["Hello"]
    out = pump(p, c, out, 2.0)
    out = pump(p, c, out, 2.0)
    assert [type(x) for x in out] == [PostRead] and c.blocked_until == 0.0


def test_peer_backoff_doubles_and_is_capped_and_welcome_resets_it():
    p, _ = make_producer()
    c = make_consumer(ack_timeout_s=1.0, peer_backoff_s=1.0, peer_backoff_max_s=4.0)
    connected(p, c)
    ends = []
    for t0 in (0.0, 10.0, 20.0, 30.0, 40.0):
        c.fetch("a", t0, t0 + 5.0)  # the producer never answers: ack timeout at t0 + 1
        c.poll(t0 + 1.0)
        ends.append(round(c.blocked_until - (t0 + 1.0), 3))
        # the probe after the backoff: answered, so the next round is a fresh failure
        pump(p, c, c.fetch_probe(t0 + 9.0), t0 + 9.0)
        assert c.blocked_until == 0.0 or t0 == 40.0
    assert ends == [1.0, 1.0, 1.0, 1.0, 1.0]  # each Welcome resets the backoff
    c2 = make_consumer(ack_timeout_s=1.0, peer_backoff_s=1.0, peer_backoff_max_s=4.0)
    durations = []
    for t in (0.0, 10.0, 20.0, 30.0, 40.0):  # consecutive failures without a Welcome
        c2.penalize(t, "test")
        durations.append(c2.blocked_until - t)
    assert durations == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_nack_internal_quarantines_producer():
    p, pstore = make_producer()
    c = make_consumer()
    connected(p, c)
    c.fetch("a", 0.0, 10.0)
    bad = XferAck(
        v=1,
        session_id=c.session_id,
        mm_hash="a",
        status=Status.NACK_INTERNAL,
        grant=None,
        detail="boom",
    )
    (m,) = reports(c.on_frame(encode(bad), 0.1))
    assert m.reason is MissReason.INTERNAL
    assert reports(c.fetch("b", 0.2, 10.0))[0].reason is MissReason.QUARANTINED


@pytest.mark.parametrize("request_notifications", [False, True])
def test_data_plane_notification_only_when_requested(request_notifications):
    """The consumer always sends XferDone; the data-plane notification (a second NIXL message per
    READ) is requested only when configured. Either signal completes the grant at the producer."""
    from ectransport.session.producer import notif_for

    p, pstore = make_producer()
    put(pstore, "a", 2)
    c = make_consumer(request_notifications=request_notifications)
    connected(p, c)
    (post,) = [x for x in pump(p, c, c.fetch("a", 0.0, 100.0), 0.0) if isinstance(x, PostRead)]
    ((sid, mm, gid),) = p.grant_keys()
    assert post.notif == (notif_for((sid, mm, gid)) if request_notifications else b"")
    c.on_read_posted("a", "H", 0.1)
    (done,) = [m for m in msgs(c.on_read_state("a", "done", 0.2)) if isinstance(m, XferDone)]
    assert done.ok
    p.on_frame("peer1", encode(done), 0.3)
    assert pstore.get("a").pins == 0


def test_busy_fetch_retries_as_soon_as_one_of_our_grants_ends():
    """NACK_BUSY (our pin budget is full): the fetch backs off, but when another of our grants
    at that producer ends, it retries at the next poll — after that grant's XferDone — instead of
    waiting out the backoff."""
    p, pstore = make_producer(budget_bytes=2 * BLOCK)
    put(pstore, "a", 2)
    put(pstore, "b", 2)
    c = make_consumer(retry_backoff_s=10.0, retry_backoff_max_s=10.0)
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)  # granted: the budget is full
    assert pump(p, c, c.fetch("b", 0.0, 100.0), 0.0) == []  # NACK_BUSY
    assert c.fetch_states()["b"] is FetchState.BACKOFF
    c.on_read_posted("a", "H", 0.1)
    out = c.on_read_state("a", "done", 0.2)
    assert [m for m in msgs(out) if isinstance(m, XferDone)], out
    assert c.next_deadline() <= 0.2  # b is due now, not at 10 s
    for cmd in out:  # the XferDone reaches the producer first ...
        if hasattr(cmd, "data"):
            p.on_frame("peer1", cmd.data, 0.2)
    retry = c.poll(0.21)  # ... then the retry, which is granted
    assert [m for m in msgs(retry) if isinstance(m, XferReq) and m.mm_hash == "b"]
    (post,) = [x for x in pump(p, c, retry, 0.21) if isinstance(x, PostRead)]
    assert post.key == "b" and c.fetch_states()["b"] is FetchState.READING


def test_one_busy_retry_per_ended_grant_not_a_herd():
    """Several fetches backing off on NACK_BUSY: each ended grant lets only the oldest retry at
    once (the freed budget fits about one entry); the rest keep their backoff."""
    p, pstore = make_producer(budget_bytes=2 * BLOCK)
    for k in "abcd":
        put(pstore, k, 2)
    c = make_consumer(retry_backoff_s=10.0, retry_backoff_max_s=10.0)
    connected(p, c)
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)  # granted: the budget is full
    for t, k in ((0.01, "b"), (0.02, "c"), (0.03, "d")):
        assert pump(p, c, c.fetch(k, t, 100.0), t) == []  # NACK_BUSY
    c.on_read_posted("a", "H", 0.1)
    out = c.on_read_state("a", "done", 0.2)
    for cmd in out:
        if hasattr(cmd, "data"):
            p.on_frame("peer1", cmd.data, 0.2)
    reqs = [m for m in msgs(c.poll(0.21)) if isinstance(m, XferReq)]
    assert [m.mm_hash for m in reqs] == ["b"]  # the oldest only
    assert c.fetch_states()["c"] is FetchState.BACKOFF
    assert c.fetch_states()["d"] is FetchState.BACKOFF


def test_entry_larger_than_the_whole_budget_is_a_terminal_refusal():
    """Waiting can never help: one answer, not retries until the deadline (issue 13)."""
    p, pstore = make_producer(budget_bytes=BLOCK)
    put(pstore, "big", 2)
    c = make_consumer()
    connected(p, c)
    (m,) = reports(pump(p, c, c.fetch("big", 0.0, 10.0), 0.0))
    assert m.reason is MissReason.INTERNAL and "NACK_BAD_REQUEST" in m.detail
    assert f"{2 * BLOCK} bytes" in m.detail and f"{BLOCK} bytes" in m.detail
    assert c.in_flight() == 0 and pstore.get("big").pins == 0


# -- issue 13: the validity window (a grant is used only while its lease is provably alive) ---------
def _granted(lease_s=1.0, grace_s=0.5):
    """A producer with entry "a" and a welcomed consumer; the XferReq for "a" sent at t=0 and
    answered by the producer at t=0 (the ack not yet handled by the consumer)."""
    p, pstore = make_producer(lease_s=lease_s, grace_s=grace_s)
    put(pstore, "a", 2)
    c = make_consumer()
    connected(p, c)
    (req,) = c.fetch("a", 0.0, 10.0)
    (ack,) = p.on_frame("peer1", req.data, 0.0)
    return p, pstore, c, ack


def _reuse_blocks(p, pstore, now):
    """The producer's lease runs out, its grace ends, and another entry takes a's blocks."""
    old = pstore.get("a")
    p.poll(now)
    p.poll(now + p.settings.grace_s)
    assert pstore.get("a").pins == 0
    pstore.discard("a")
    new = put(pstore, "b", 2)
    assert new.runs == old.runs  # the very same blocks now hold another entry


def test_a_read_completing_after_the_window_is_never_reported_as_landed():
    """Issue 13 point 1: the consumer stalls (SIGSTOP) after posting its READ; the lease expires
    and the blocks are re-used; on resume the READ completes with the other entry's bytes. It
    must end as a miss, never as Landed."""
    p, pstore, c, ack = _granted()
    (post,) = [x for x in bound(c, c.on_frame(ack.data, 0.01), 0.01) if isinstance(x, PostRead)]
    c.on_read_posted("a", "H", 0.01)
    _reuse_blocks(p, pstore, 1.0)
    out = c.on_read_state("a", "done", 2.6)  # resumed: the node feeds the state before polling
    (m,) = reports(out)
    assert isinstance(m, Miss) and m.reason is MissReason.TIMEOUT and "validity window" in m.detail
    assert not any(isinstance(r, Landed) for r in reports(out + c.poll(2.6) + c.poll(100.0)))
    c.store.check_invariants()


def test_an_ack_handled_after_the_window_is_not_used_and_the_request_is_sent_again():
    p, pstore, c, ack = _granted()
    _reuse_blocks(p, pstore, 1.0)
    put(pstore, "a", 2)  # the producer holds "a" again, in other blocks
    out = c.on_frame(ack.data, 2.6)  # the stale grant, handled late
    assert not [x for x in out if isinstance(x, PostRead)]
    done, again = msgs(out)
    assert isinstance(done, XferDone) and not done.ok and again.mm_hash == "a"
    (post,) = [x for x in pump(p, c, out, 2.6) if isinstance(x, PostRead)]
    assert post.runs  # a fresh grant for the new blocks
    c.on_read_posted("a", "H2", 2.6)
    (landed,) = reports(c.on_read_state("a", "done", 2.7))
    assert isinstance(landed, Landed)


def test_an_ack_handled_after_the_window_near_the_deadline_is_a_miss():
    p, pstore, c, ack = _granted()
    (m,) = reports(c.on_frame(ack.data, 9.5))  # no time left for another round trip
    assert m.reason is MissReason.TIMEOUT and "validity window" in m.detail


@pytest.mark.parametrize("lease_s", [float("nan"), float("inf"), -1.0, 0.0, 1e-6, 1e308])
def test_nonsensical_lease_is_refused_not_clamped(lease_s):
    """Issue 17 point 4: a NaN/negative lease used to be clamped to 0.1 s (a Renew every 17 ms)."""
    p, pstore, c, ack = _granted()
    a = decode(ack.data, versions=(1,))
    forged = encode(msgspec.structs.replace(a, grant=msgspec.structs.replace(a.grant,
                                                                               lease_s=lease_s)))
    out = c.on_frame(forged, 0.01)
    (m,) = reports(out)
    assert m.reason is MissReason.INTERNAL and "lease_s" in m.detail
    assert [type(x) for x in msgs(out)] == [XferDone] and c.in_flight() == 0


def test_unsolicited_acks_are_not_reflected():
    """Issue 17 point 4: only the late grant of a request we really sent gets an XferDone."""
    p, pstore, c, ack = _granted()
    a = decode(ack.data, versions=(1,))
    for i in range(50):
        forged = encode(msgspec.structs.replace(a, mm_hash=f"never-asked-{i}"))
        assert c.on_frame(forged, 0.01) == []


def test_landing_keys_do_not_collide_across_producers():
    """Issue 17 point 2: two sessions of one consumer node share its store; a fetch of the same
    mm_hash from each (and a landed result still held) must not collide."""
    from ectransport.store import BlockStore

    store = BlockStore(64, BLOCK)
    outs = []
    for conn in ("p1", "p2"):
        p, pstore = make_producer()
        put(pstore, "a", 2)
        c = make_consumer(conn=conn)
        c.store = store
        connected(p, c)
        (post,) = [x for x in pump(p, c, c.fetch("a", 0.0, 10.0), 0.0) if isinstance(x, PostRead)]
        c.on_read_posted("a", "H", 0.0)
        outs += reports(c.on_read_state("a", "done", 0.1))
    assert all(isinstance(o, Landed) for o in outs)
    assert outs[0].entry.mm_hash != outs[1].entry.mm_hash


def test_grants_that_always_arrive_late_end_in_a_miss_not_a_request_storm():
    """A producer (or a link) whose grants are always past their validity window: the consumer
    asks again a bounded number of times, then misses."""
    from ectransport.session.fetch import MAX_LATE_GRANTS

    p, pstore, c, ack = _granted(lease_s=1.0)
    t, asked = 2.0, 0
    out = c.on_frame(ack.data, t)
    while True:
        reqs = [m for m in msgs(out) if isinstance(m, XferReq)]
        if not reqs:
            break
        asked += 1
        (late,) = p.on_frame("peer1", encode(reqs[0]), t)  # answered at once...
        t += 1.5  # ...but handled by the consumer after the lease
        out = c.on_frame(late.data, t)
    assert asked == MAX_LATE_GRANTS
    (m,) = reports(out)
    assert m.reason is MissReason.TIMEOUT and "validity window" in m.detail


# -- issue 15: the connection state is an explicit enum with a transition table (h11's rule) ------
def test_connection_states_follow_the_table():
    from ectransport.session import Bind, Link

    p, pstore = make_producer()
    c = make_consumer()
    assert c.link is Link.DOWN
    (hello,) = c.on_up(0.0)
    assert c.link is Link.GREETING
    (welcome,) = p.on_frame("peer1", hello.data, 0.0)
    (bind,) = c.on_frame(welcome.data, 0.0)
    assert isinstance(bind, Bind) and c.link is Link.BINDING
    assert c.on_frame(welcome.data, 0.0) == []  # a duplicate Welcome is input, not an event
    assert c.on_bound("b", 0.0) == [] and c.link is Link.READY
    c.on_peer_down(1.0)
    assert c.link is Link.DOWN and not c.welcomed
    c.on_auth_failed("bad key", 2.0)
    assert c.link is Link.FAILED
    assert c.on_up(3.0) == [] and c.link is Link.FAILED  # terminal: no Hello any more


@pytest.mark.parametrize("event", ["on_bound", "on_bind_failed"])
def test_a_bind_answer_out_of_state_raises_naming_state_and_event(event):
    from ectransport.session import IllegalTransition, Link

    p, pstore = make_producer()
    c = make_consumer()
    connected(p, c)  # bound once: READY
    with pytest.raises(IllegalTransition) as ei:
        getattr(c, event)(*(("b", 1.0) if event == "on_bound" else ("refused", 1.0)))
    assert ei.value.state is Link.READY and "READY" in str(ei.value)
    assert ei.value.event in ("bound", "bind_failed") and c.link is Link.READY
