"""ECTP v2 §11: confirmed lease renewals (``RenewAck``), with a fake clock.

A consumer may count a renewal only from a moment that precedes the producer's extension: the
``Renew``'s send time, once the producer confirmed it (the stale-grant rule of ECTP v1 §8.4 with
the Renew in place of the request). The property test drives a producer and a consumer with
offset clocks, random delays and dropped frames, and checks at every step that the consumer's
window of every read never ends after the producer's lease of it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ectransport.protocol import (
    FEATURE_RENEW_ACK,
    Hello,
    Renew,
    RenewAck,
    ReqBatch,
    Status,
    Welcome,
    XferDone,
    decode,
    encode,
)
from ectransport.session import Landed, Miss, MissReason, Report, Send
from ectransport.session.fetch import Reading
from ectransport.session.renewals import MAX_OUTSTANDING, Renewals

from .helpers import COMPAT, bound, make_consumer, make_producer, put

V2 = (1, 2)


def frames(cmds):
    return [decode(c.data, versions=V2) for c in cmds if isinstance(c, Send)]


def reports(cmds):
    return [c.outcome for c in cmds if isinstance(c, Report)]


def deliver(p, c, cmds, now):
    """Consumer commands to the producer, its answers back (no delay); returns the rest."""
    rest = []
    for x in cmds:
        if isinstance(x, Send):
            for r in p.on_frame("peer1", x.data, now):
                if isinstance(r, Send):
                    rest += bound(c, c.on_frame(r.data, now), now)
        else:
            rest.append(x)
    return rest


def reading(c, mm="a") -> Reading:
    st_ = c.fetches.fetches[mm].state
    assert isinstance(st_, Reading)
    return st_


def started(lease_s=3.0, read_timeout_s=60.0, versions=V2, **pkw):
    """A v2 producer (lease ``lease_s``) holding "a", and a consumer reading it from t = 0."""
    p, store = make_producer(lease_s=lease_s, versions=versions, **pkw)
    put(store, "a", 2)
    c = make_consumer(read_timeout_s=read_timeout_s, versions=versions)
    deliver(p, c, c.on_up(0.0), 0.0)
    rest = deliver(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    assert c.on_read_posted("a", "H", 0.0) == [] and rest
    return p, store, c


def test_renew_ack_is_negotiated_on_v2_only():
    p, _ = make_producer()
    c = make_consumer()
    (hello,) = frames(c.on_up(0.0))
    assert isinstance(hello, Hello) and FEATURE_RENEW_ACK in hello.features
    (w,) = frames(p.on_frame("peer1", encode(hello), 0.0))
    assert isinstance(w, Welcome) and FEATURE_RENEW_ACK in w.features
    bound(c, c.on_frame(encode(w), 0.0), 0.0)
    assert c.fetches.renewals.confirmed
    v1 = make_consumer(versions=(1,))
    (h1,) = frames(v1.on_up(0.0))
    assert h1.features == []  # a v1-only consumer asks for nothing
    old = Hello(v=2, session_id="b" * 32, node_id="old", versions=[1, 2], planes=["nixl"],
                compat_hash=COMPAT, mem_kinds=["DRAM"])  # an earlier v2 build: no features
    (w2,) = frames(p.on_frame("peer2", encode(old), 0.0))
    assert FEATURE_RENEW_ACK not in w2.features


def test_a_confirmed_renewal_moves_the_window_from_when_the_renew_was_sent():
    p, store, c = started(lease_s=3.0)
    assert reading(c).valid_until == 3.0 - 0.25  # request sent at 0: lease − margin
    cmds = c.poll(0.5)  # lease / 6: the first Renew, asking for 2/3 lease = 2 s
    (r,) = frames(cmds)
    assert isinstance(r, Renew) and r.extend_s == 2.0
    for t in (1.0, 1.5):
        (r,) = frames(c.poll(t))
    # the producer receives the t = 1.5 Renew late (at 2.0) and its ack comes later still
    (ack,) = frames(p.on_frame("peer1", encode(r), 2.0))
    assert isinstance(ack, RenewAck) and ack.extend_s == 2.0 and ack.grant_ids == r.grant_ids
    assert [g.deadline for g in p.grants()] == [4.0]  # received at 2.0 + 2.0
    # ...but no earlier Renew was answered: the ack is matched to the oldest one naming the
    # grant (sent at 0.5), so the window moves only to 0.5 + 2 − 0.25 (never past the lease)
    c.on_frame(encode(ack), 2.6)
    assert reading(c).valid_until == 3.0 - 0.25  # 2.25 < 2.75: not later, unchanged
    assert c.fetches.renewals.outstanding == 2  # the 1.0 and 1.5 Renews still wait
    for t in (2.0, 2.5):
        (r,) = frames(c.poll(t))
        (ack,) = frames(p.on_frame("peer1", encode(r), t))
        c.on_frame(encode(ack), t + 0.1)
    # matched to the 1.0 and 1.5 Renews: window 1.5 + 2 − 0.25 = 3.25, deadline 4.5 here
    assert reading(c).valid_until == 3.25 and reading(c).due == 3.25
    (landed,) = reports(c.on_read_state("a", "done", 3.2))
    assert isinstance(landed, Landed)  # 3.2 is after the request's window (2.75): renewed


def test_unconfirmed_renewals_are_never_counted():
    """An earlier v2 producer (no ``renew_ack`` granted) extends leases but never says so: the
    consumer renews all the same and still discards a read that completes after its request's
    window."""
    p, store = make_producer(lease_s=3.0)
    put(store, "a", 2)
    c = make_consumer(read_timeout_s=60.0)
    (hello,) = frames(c.on_up(0.0))
    old = Welcome(v=2, session_id=c.session_id, node_id="p", status=Status.OK, version=2,
                  plane="nixl", versions=[1, 2], planes=["nixl"], compat_hash=COMPAT, detail="",
                  endpoint=b"e")
    p.on_frame("peer1", encode(hello), 0.0)  # the producer knows the session (no feature: see
    p._peers["peer1"].renew_ack = False      # the Welcome the consumer is given below)
    bound(c, c.on_frame(encode(old), 0.0), 0.0)
    assert not c.fetches.renewals.confirmed
    deliver(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    for t in (0.5, 1.0, 1.5, 2.0, 2.5):
        (r,) = frames(c.poll(t))
        assert isinstance(r, Renew) and frames(p.on_frame("peer1", encode(r), t)) == []
    assert c.fetches.renewals.outstanding == 0
    assert reading(c).valid_until == 2.75
    (m,) = reports(c.on_read_state("a", "done", 2.9))
    assert isinstance(m, Miss) and m.reason is MissReason.TIMEOUT  # never reported as landed


def test_hostile_or_stray_acks_change_nothing_they_should_not():
    p, store, c = started(lease_s=3.0)
    gid = reading(c).grant_id
    (r,) = frames(c.poll(0.5))
    before = reading(c).valid_until
    # a grant the Renew did not name, another session's ack, and one naming no grant
    for bad in (RenewAck(v=2, session_id=c.session_id, grant_ids=[gid ^ 1], extend_s=2.0),
                RenewAck(v=2, session_id="x" * 32, grant_ids=[gid], extend_s=2.0),
                RenewAck(v=2, session_id=c.session_id, grant_ids=[], extend_s=2.0)):
        assert c.on_frame(encode(bad), 0.6) == []
    assert reading(c).valid_until == before and c.fetches.renewals.outstanding == 1
    assert c.ignored["renew_ack_unmatched"] == 1
    assert c.ignored["renew_ack_foreign_session"] == 1
    # an ack claiming far more than asked counts only what the consumer asked for (2 s)
    (r,) = frames(c.poll(1.0))  # 2 outstanding: 0.5 and 1.0
    c.on_frame(encode(RenewAck(v=2, session_id=c.session_id, grant_ids=[gid],
                               extend_s=3600.0)), 1.1)
    assert reading(c).valid_until == 3.0 - 0.25  # matched to 0.5: 0.5 + 2 − 0.25 < 2.75
    c.on_frame(encode(RenewAck(v=2, session_id=c.session_id, grant_ids=[gid],
                               extend_s=3600.0)), 1.2)
    assert reading(c).valid_until == 2.75  # matched to 1.0: 1.0 + 2 − 0.25, not 1.0 + 3600
    assert c.fetches.renewals.outstanding == 0


def test_the_producer_confirms_only_live_grants_and_never_shortens():
    p, store, c = started(lease_s=3.0)
    gid = reading(c).grant_id
    sid = c.session_id
    (a,) = frames(p.on_frame("peer1", encode(Renew(v=2, session_id=sid,
                                                   grant_ids=[gid, gid, 12345], extend_s=60.0)),
                             1.0))
    assert a.grant_ids == [gid] and a.extend_s == 3.0  # capped at the lease, each grant once
    assert [g.deadline for g in p.grants()] == [4.0]
    (a,) = frames(p.on_frame("peer1", encode(Renew(v=2, session_id=sid, grant_ids=[gid],
                                                   extend_s=0.5)), 1.5))
    assert [g.deadline for g in p.grants()] == [4.0]  # never shortened
    p.on_frame("peer1", encode(XferDone(v=2, session_id=sid, mm_hash="a", grant_id=gid, ok=True)),
               1.6)
    (a,) = frames(p.on_frame("peer1", encode(Renew(v=2, session_id=sid, grant_ids=[gid],
                                                   extend_s=2.0)), 1.7))
    assert a.grant_ids == []  # ended: answered all the same, naming nothing


def test_renews_awaiting_their_ack_are_bounded():
    """Unanswered Renews are kept (a late ack must match the oldest), at most MAX_OUTSTANDING:
    beyond, no Renew is sent (one forgotten could let a late ack match a later Renew)."""
    r = Renewals()
    r.reset(confirmed=True)
    r.read_started(0.0, 6.0, first=True)
    sent = sum(len(r.poll("c", 2, "s", [(7, 6.0)], float(t))) for t in range(1, 40))
    assert sent == MAX_OUTSTANDING and r.outstanding == MAX_OUTSTANDING
    got = r.confirm(RenewAck(v=2, session_id="s", grant_ids=[7], extend_s=4.0))
    assert got is not None and got.sent == 1.0 and r.outstanding == MAX_OUTSTANDING - 1
    assert r.poll("c", 2, "s", [(7, 6.0)], 41.0)  # room again: renewing resumes
    unconfirmed = Renewals()
    unconfirmed.read_started(0.0, 6.0, first=True)
    assert sum(len(unconfirmed.poll("c", 2, "s", [(7, 6.0)], float(t)))
               for t in range(1, 40)) == 39 and unconfirmed.outstanding == 0


def test_a_reconnect_forgets_the_renews_of_the_old_connection():
    p, store, c = started(lease_s=3.0)
    gid = reading(c).grant_id
    frames(c.poll(0.5))
    assert c.fetches.renewals.outstanding == 1
    c.on_peer_down(0.6)  # the read is quarantined; acks still queued from before are stray
    assert c.fetches.renewals.outstanding == 0
    assert c.on_frame(encode(RenewAck(v=2, session_id=c.session_id, grant_ids=[gid],
                                      extend_s=2.0)), 0.7) == []


# -- the property: a consumer's window never outlives the producer's lease -----------------------

_EVENTS = st.lists(st.tuples(st.sampled_from(("tick", "deliver_c2p", "deliver_p2c", "drop")),
                             st.floats(0.01, 0.6)), min_size=5, max_size=80)


@settings(max_examples=150, deadline=None)
@given(events=_EVENTS, offset=st.floats(-1000.0, 1000.0), lease=st.sampled_from((1.0, 3.0, 5.0)))
def test_the_window_never_ends_after_the_producer_lease(events, offset, lease):
    """Producer clock = consumer clock + ``offset``; frames in each direction are delivered in
    order, late or dropped. Whatever happens, the end of the consumer's window (its clock,
    converted) is never after the producer's deadline for that grant — so a read the consumer
    reports as landed was read while the producer surely pinned it."""
    p, store = make_producer(lease_s=lease, versions=V2)
    put(store, "a", 2)
    c = make_consumer(read_timeout_s=1000.0, versions=V2)
    deliver(p, c, c.on_up(0.0), offset)  # negotiation: instantaneous, whatever the offsets
    rest = [x for x in c.fetch("a", 0.0, 1000.0)]
    req = [x for x in rest if isinstance(x, Send)]
    assert len(req) == 1 and isinstance(decode(req[0].data, versions=V2), ReqBatch)
    now = 0.0
    for x in p.on_frame("peer1", req[0].data, now + offset):
        c.on_frame(x.data, now)
    c.on_read_posted("a", "H", now)
    last = lease + offset  # the grant's deadline, producer clock
    c2p: list[bytes] = []  # in flight, in order
    p2c: list[bytes] = []
    for kind, dt in events:
        now += dt
        if kind == "tick":
            c2p += [x.data for x in c.poll(now) if isinstance(x, Send)]
            p.poll(now + offset)
        elif kind == "deliver_c2p" and c2p:
            p2c += [x.data for x in p.on_frame("peer1", c2p.pop(0), now + offset)
                    if isinstance(x, Send)]
        elif kind == "deliver_p2c" and p2c:
            c.on_frame(p2c.pop(0), now)
        elif kind == "drop" and c2p:
            c2p.pop(0)  # e.g. the producer's frame-rate limit
        f = c.fetches.fetches.get("a")
        if f is None or not isinstance(f.state, Reading):
            break
        live = [g for g in p.grants() if g.key[1] == "a"]
        deadline = live[0].deadline if live else last
        assert f.state.valid_until + offset <= deadline + 1e-9
        if not live:  # the lease ran out (at or after the window's end, just checked)
            break
        last = deadline
