"""ECTP v2 §10, sans-I/O with a fake clock: a producer's announcement holds (cap, pending holds,
renewal, end at the deadline with a grace pin, never earlier), ``Sync``/``Offer``, and a consumer
reading on a ticket with no request — and every case where it must not (foreign anchor, another
mm_hash, another producer, a window too short, a READ finished after the window)."""

from __future__ import annotations

import random

import pytest

from ectransport.protocol import (
    FEATURE_DONES,
    FEATURE_OFFERS,
    Grant,
    Hello,
    Nack,
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
from ectransport.session import (
    ConsumerConfig,
    ConsumerSession,
    Landed,
    Miss,
    MissReason,
    PostRead,
    ProducerSession,
    Report,
    Revoke,
    Send,
)
from ectransport.session.consumer_offers import MIN_OFFER_LEFT_S, SYNC_INTERVAL_S
from ectransport.session.grants import PlaneFacts
from ectransport.session.holds import HOLD_IDENTITY
from ectransport.settings_schema import ConsumerSettings
from ectransport.store import BlockStore

from .helpers import BLOCK, COMPAT, DONE_S, bound, describe, producer_config, put

SID = "of" * 16
V = (1, 2)


def producer(num_blocks=64, planes=("nixl",), offerable=("nixl",), **kw):
    store = BlockStore(num_blocks, BLOCK)
    cfg = producer_config(versions=V, planes=planes, **kw)
    p = ProducerSession(cfg, store, {n: PlaneFacts(describe, offerable=n in offerable)
                                     for n in planes}, rng=random.Random(7))
    return p, store


def hello(features=(FEATURE_OFFERS,), versions=V, sid=SID, planes=("nixl",)):
    return encode(Hello(v=max(versions), session_id=sid, node_id="c", versions=list(versions),
                        planes=list(planes), compat_hash=COMPAT, mem_kinds=["DRAM"],
                        features=list(features)))


def frames(cmds, versions=V):
    return [decode(c.data, versions=versions) for c in cmds if isinstance(c, Send)]


def welcomed(p, peer="peer", t_sync=None, now=0.0, **kw):
    """A session that said Hello (and, with ``t_sync``, its first Sync); returns the Welcome."""
    (w,) = frames(p.on_frame(peer, hello(**kw), now))
    assert isinstance(w, Welcome) and w.status is Status.OK
    if t_sync is not None:
        assert frames(p.on_frame(peer, encode(Sync(v=2, session_id=kw.get("sid", SID),
                                                   t=t_sync)), now)) == []
    return w


# -- producer --------------------------------------------------------------------------------------
def test_offers_are_granted_only_to_v2_sessions_of_the_hold_plane_that_ask():
    p, _ = producer(planes=("nixl", "tcp"))
    assert welcomed(p, "a").features == [FEATURE_DONES, FEATURE_OFFERS]
    assert welcomed(p, "b", sid="b" * 8, features=()).features == [FEATURE_DONES]
    assert welcomed(p, "c", sid="c" * 8, versions=(1,)).features == []  # v1: no DoneBatch
    assert welcomed(p, "d", sid="d" * 8, planes=("tcp",)).features == [FEATURE_DONES]  # push
    # a Sync on a session not granted offers is refused, and changes nothing
    (n,) = frames(p.on_frame("b", encode(Sync(v=2, session_id="b" * 8, t=1.0)), 0.0))
    assert isinstance(n, Nack) and n.status is Status.NACK_BAD_REQUEST


def test_announce_holds_offers_and_ends_at_the_deadline_never_at_a_served_read():
    p, store = producer(hold_s=10.0, grace_s=5.0)
    welcomed(p, t_sync=500.0, now=2.0)  # anchor: consumer t 500 received at producer t 2
    e = put(store, "a", 3)
    ticket, cmds = p.announce("a", now=4.0)
    assert ticket == Ticket(producer="p", hold_id=ticket.hold_id, mm_hash="a") and ticket.hold_id
    (o,) = frames(cmds)
    assert isinstance(o, Offer) and o.anchor == 500.0 and o.session_id == SID
    (it,) = o.items
    # the hold ends at 14; the anchoring Sync was received at 2: valid 12 s after it
    assert it.mm_hash == "a" and it.valid_s == pytest.approx(12.0)
    assert it.grant.grant_id == ticket.hold_id and it.grant.lease_s == 10.0
    assert it.grant.plane_grant == describe(e.runs, 3 * BLOCK)
    assert store.get("a").pins == 1 and p.held_bytes() == 3 * BLOCK
    p.check_invariants()
    # a served read is counted; the hold stays (another session may read until 14)
    done = encode(XferDone(v=2, session_id=SID, mm_hash="a", grant_id=ticket.hold_id, ok=True))
    assert p.on_frame("peer", done, 5.0) == []
    assert p.stats["hold_reads"] == 1 and store.get("a").pins == 1 and p.active_holds == 1
    assert p.poll(13.9) == []
    (rv,) = p.poll(14.0)
    assert isinstance(rv, Revoke) and rv.plane_grant == it.grant.plane_grant
    # the pin stays for the grace period, still charged to the holds' cap
    assert store.get("a").pins == 1 and p.pinned_bytes(HOLD_IDENTITY) == 3 * BLOCK
    p.check_invariants()
    p.poll(18.9)
    assert store.get("a").pins == 1
    p.poll(19.0)
    assert store.get("a").pins == 0 and p.held_bytes() == 0
    p.check_invariants()


def test_first_sync_replays_live_holds_and_later_syncs_do_not():
    p, store = producer(hold_s=10.0)
    put(store, "a", 1)
    put(store, "b", 2)
    ta, _ = p.announce("a", 0.0)
    tb, _ = p.announce("b", 1.0)
    welcomed(p, now=3.0)
    (o,) = frames(p.on_frame("peer", encode(Sync(v=2, session_id=SID, t=7.0)), 3.0))
    assert isinstance(o, Offer) and o.anchor == 7.0
    assert {(i.grant.grant_id, i.valid_s) for i in o.items} == {(ta.hold_id, 7.0),
                                                                  (tb.hold_id, 8.0)}
    assert frames(p.on_frame("peer", encode(Sync(v=2, session_id=SID, t=37.0)), 33.0)) == []
    p.check_invariants()


def test_nothing_is_pinned_for_nobody_until_a_session_takes_offers():
    """An announcement while no session could be offered it (none granted, or no Sync yet)
    pins nothing; the first Sync takes the hold and offers it; past its time it is dropped."""
    p, store = producer(hold_s=10.0)
    welcomed(p)  # granted, no Sync yet
    put(store, "a", 1)
    put(store, "late", 1)
    tl, _ = p.announce("late", 0.0)
    ticket, cmds = p.announce("a", 6.0)
    assert ticket.hold_id and cmds == [] and store.get("a").pins == 0
    p.poll(10.0)  # "late"'s time is over before anyone took offers
    (o,) = frames(p.on_frame("peer", encode(Sync(v=2, session_id=SID, t=50.0)), 11.0))
    assert [i.grant.grant_id for i in o.items] == [ticket.hold_id]
    assert store.get("a").pins == 1 and store.get("late").pins == 0
    p.check_invariants()


def test_a_new_welcome_on_the_connection_replays_the_offers():
    """A quarantine probe re-Hellos on the same connection: the consumer forgot its offers, so
    the producer forgets the anchor and the next first Sync replays every live hold."""
    p, store = producer()
    welcomed(p, t_sync=1.0)
    put(store, "a", 1)
    ticket, _ = p.announce("a", 0.0)
    welcomed(p)  # the same peer and session id say Hello again
    (o,) = frames(p.on_frame("peer", encode(Sync(v=2, session_id=SID, t=9.0)), 2.0))
    assert o.anchor == 9.0 and [i.grant.grant_id for i in o.items] == [ticket.hold_id]


def test_the_cap_turns_holds_into_plain_announcements():
    p, store = producer(num_blocks=64, hold_share=0.25)  # 16 blocks
    welcomed(p, t_sync=0.0)
    put(store, "a", 10)
    put(store, "b", 10)
    ta, _ = p.announce("a", 0.0)
    tb, cmds = p.announce("b", 0.0)
    assert ta.hold_id and tb.hold_id == 0 and cmds == []
    assert p.stats["hold_refused"] == 1 and store.get("b").pins == 0
    p.check_invariants()


def test_renewal_extends_the_window_and_offers_it_again():
    p, store = producer(hold_s=10.0)
    welcomed(p, t_sync=0.0)
    put(store, "a", 1)
    t1, _ = p.announce("a", 0.0)
    t2, cmds = p.announce("a", 6.0)
    assert t2.hold_id == t1.hold_id and store.get("a").pins == 1
    (o,) = frames(cmds)
    assert o.items[0].valid_s == pytest.approx(16.0)
    assert p.poll(15.0) == [] and p.active_holds == 1
    assert len(p.poll(16.0)) == 1 and p.active_holds == 0


def test_an_entry_announced_before_it_is_ready_is_held_at_its_commit():
    p, store = producer()
    welcomed(p, t_sync=0.0)
    put(store, "a", 2, ready=False)
    ticket, cmds = p.announce("a", 0.0)
    assert ticket.hold_id and cmds == [] and p.waits_for("a") and store.get("a").pins == 0
    store.mark_ready("a")
    (o,) = frames(p.on_entries_changed(["a"], 1.0))
    assert o.items[0].grant.grant_id == ticket.hold_id and store.get("a").pins == 1
    assert not p.waits_for("a")
    # an aborted save drops its pending hold
    put(store, "b", 1, ready=False)
    tb, _ = p.announce("b", 2.0)
    store.discard("b")
    assert p.on_entries_changed(["b"], 3.0) == [] and not p.waits_for("b")
    assert p.announce("nothing", 3.0) == (None, [])
    p.check_invariants()


def test_no_hold_without_a_plane_consumers_read_one_sidedly():
    p, store = producer(planes=("tcp",), offerable=())
    put(store, "a", 1)
    ticket, cmds = p.announce("a", 0.0)
    assert ticket.hold_id == 0 and cmds == [] and store.get("a").pins == 0


def test_close_releases_every_hold():
    p, store = producer()
    welcomed(p, t_sync=0.0)
    put(store, "a", 1)
    p.announce("a", 0.0)
    assert store.get("a").pins == 1
    assert [type(c) for c in p.close()] == [Revoke]
    assert store.get("a").pins == 0 and p.held_bytes() == 0


# -- consumer --------------------------------------------------------------------------------------
def consumer(now=0.0, **kw):
    cfg = ConsumerConfig(node_id="c", compat_hash=COMPAT, versions=V,
                         settings=ConsumerSettings(**kw))
    return ConsumerSession(cfg, "conn", BlockStore(64, BLOCK), now, session_id=SID)


def consumer_ready(now=0.0, features=(FEATURE_OFFERS,), **kw):
    """A consumer whose Hello asked for offers, welcomed at v2; returns it and what it sent once
    bound (its first Sync when offers were granted)."""
    c = consumer(now, **kw)
    (h,) = frames(c.on_up(now))
    assert h.features == ([FEATURE_OFFERS] if kw.get("offers", True) else []) + ["renew_ack"]
    w = Welcome(v=2, session_id=SID, node_id="p", status=Status.OK, version=2, plane="nixl",
                versions=[1, 2], planes=["nixl"], compat_hash=COMPAT, detail="", endpoint=b"e",
                features=list(features))
    return c, bound(c, c.on_frame(encode(w), now), now)


def offer(anchor, *items):
    return encode(Offer(v=2, session_id=SID, anchor=anchor, items=list(items)))


def item(mm, hold, valid_s, rows=2, lease_s=10.0, plane="nixl"):
    g = Grant(grant_id=hold, entry_bytes=rows * BLOCK, num_blocks=rows, block_bytes=BLOCK,
              lease_s=lease_s, plane=plane, plane_grant=b"h%d" % hold)
    return OfferItem(mm_hash=mm, grant=g, valid_s=valid_s)


def test_a_ticket_with_its_offer_reads_at_once_and_completes_with_xferdone():
    c, sent = consumer_ready(now=100.0)
    (s,) = frames(sent)
    assert isinstance(s, Sync) and s.t == 100.0 and c.offers_on
    assert c.on_frame(offer(100.0, item("a", 77, 9.0)), 101.0) == []
    cmds = c.fetch("a", 102.0, 130.0, ticket=Ticket(producer="p", hold_id=77, mm_hash="a"))
    (pr,) = cmds  # no request at all
    assert isinstance(pr, PostRead) and pr.plane_grant == b"h77" and pr.nbytes == 2 * BLOCK
    assert c.offer_reads == 1
    c.on_read_posted("a", "H", 102.0)
    out = c.on_read_state("a", "done", 102.5)
    (landed,) = [x.outcome for x in out if isinstance(x, Report)]
    assert isinstance(landed, Landed) and landed.grant_id == 77
    (d,) = frames(out + c.poll(102.5) + c.poll(102.5 + DONE_S))
    assert isinstance(d, XferDone) and d.grant_id == 77 and d.ok and d.mm_hash == "a"


def test_an_offered_entry_is_read_with_no_ticket_and_only_within_its_window():
    """A fetch with no ticket reads the newest usable offer of its mm_hash (a consumer the
    producer named in a targeted announcement may have been told nothing else); an item it was
    not offered, or whose window is too short, is asked for."""
    c, _ = consumer_ready(now=100.0)
    c.on_frame(offer(100.0, item("a", 77, 4.0), item("a", 78, 9.0), item("s", 79, 1.2)), 100.0)
    (pr,) = c.fetch("a", 101.0, 130.0)
    assert isinstance(pr, PostRead) and pr.plane_grant == b"h78" and c.offer_reads == 1
    (req,) = frames(c.fetch("b", 101.0, 130.0))  # never offered
    assert isinstance(req, ReqBatch) and [i.mm_hash for i in req.items] == ["b"]
    (req,) = frames(c.fetch("s", 101.0, 130.0))  # < MIN_OFFER_LEFT_S of its window left
    assert isinstance(req, ReqBatch) and c.offer_reads == 1
    c.poll(109.0)  # every window is over: dropped
    assert c.offers_held == 0


def test_the_window_is_counted_from_the_anchor_and_a_late_read_is_discarded():
    c, _ = consumer_ready(now=100.0, validity_margin_s=0.25)
    c.on_frame(offer(100.0, item("a", 77, 5.0)), 100.0)
    # usable until 100 + 5 - (0.25 + 1e-4 * 5)
    c.fetch("a", 101.0, 130.0, ticket=Ticket(producer="p", hold_id=77, mm_hash="a"))
    c.on_read_posted("a", "H", 101.0)
    out = c.on_read_state("a", "done", 104.7496)
    (miss,) = [x.outcome for x in out if isinstance(x, Report)]
    assert isinstance(miss, Miss) and miss.reason is MissReason.TIMEOUT  # never the bytes


@pytest.mark.parametrize("case", ["foreign_anchor", "other_mm", "other_producer", "short_window",
                                  "no_hold", "bad_plane"])
def test_a_ticket_without_a_usable_offer_is_fetched_with_a_request(case):
    c, _ = consumer_ready(now=100.0)
    anchor, mm, producer_id, valid = 100.0, "a", "p", 9.0
    plane = "nixl"
    if case == "foreign_anchor":
        anchor = 99.0
    if case == "other_mm":
        mm = "b"
    if case == "other_producer":
        producer_id = "q"
    if case == "short_window":
        valid = MIN_OFFER_LEFT_S  # less than MIN_OFFER_LEFT_S left once the margin is taken
    if case == "bad_plane":
        plane = "tcp"
    c.on_frame(offer(anchor, item(mm, 77, valid, plane=plane)), 100.0)
    hold = 0 if case == "no_hold" else 77
    cmds = c.fetch("a", 100.0, 130.0, ticket=Ticket(producer=producer_id, hold_id=hold,
                                                    mm_hash="a"))
    (req,) = frames(cmds)
    assert isinstance(req, ReqBatch) and c.offer_reads == 0


def test_offers_are_not_used_when_the_welcome_did_not_grant_them():
    c, sent = consumer_ready(now=0.0, features=())
    assert frames(sent) == [] and not c.offers_on
    c.on_frame(offer(0.0, item("a", 77, 9.0)), 0.0)
    assert c.ignored["offer_bad_anchor"] == 1
    (req,) = frames(c.fetch("a", 0.0, 30.0, ticket=Ticket(producer="p", hold_id=77,
                                                          mm_hash="a")))
    assert isinstance(req, ReqBatch)


def test_syncs_repeat_and_expired_offers_are_dropped():
    c, _ = consumer_ready(now=0.0)
    c.on_frame(offer(0.0, item("a", 77, 3.0)), 0.0)
    assert c.offers_held == 1
    assert frames(c.poll(3.0)) == [] and c.offers_held == 0
    (s,) = frames(c.poll(SYNC_INTERVAL_S))
    assert isinstance(s, Sync) and s.t == SYNC_INTERVAL_S
    # an offer anchored on the newer Sync is taken
    c.on_frame(offer(SYNC_INTERVAL_S, item("b", 78, 9.0)), SYNC_INTERVAL_S)
    assert c.offers_held == 1


def test_end_to_end_producer_and_consumer_sessions():
    """Both state machines wired by hand: announce → Offer → ticket → READ → XferDone."""
    p, store = producer(hold_s=10.0)
    e = put(store, "a", 2)
    c = consumer(0.0)
    out = []
    for cmd in c.on_up(0.0):
        for r in p.on_frame("peer", cmd.data, 0.0):
            out += bound(c, c.on_frame(r.data, 0.0), 0.0)
    (sync,) = out
    assert frames(p.on_frame("peer", sync.data, 0.0)) == []  # no holds yet
    ticket, cmds = p.announce("a", 1.0)
    for cmd in cmds:
        c.on_frame(cmd.data, 1.0)
    (pr,) = c.fetch("a", 1.5, 30.0, ticket=ticket)
    assert isinstance(pr, PostRead) and pr.plane_grant == describe(e.runs, 2 * BLOCK)
    c.on_read_posted("a", "H", 1.5)
    for cmd in c.on_read_state("a", "done", 1.6) + c.poll(1.6) + c.poll(1.6 + DONE_S):
        if isinstance(cmd, Send):
            assert p.on_frame("peer", cmd.data, 1.6) == []
    assert p.stats["hold_reads"] == 1 and p.stats["batches"] == 0
    p.check_invariants()


# -- hostile frames (property tests) ---------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_MM = st.sampled_from(["a", "b", "c"])
_ITEM = st.builds(
    lambda mm, hold, valid, rows, lease, plane, bb: OfferItem(
        mm_hash=mm, grant=Grant(grant_id=hold, entry_bytes=rows * bb, num_blocks=rows,
                                block_bytes=bb, lease_s=lease, plane=plane,
                                plane_grant=b"h%d" % hold), valid_s=valid),
    _MM, st.integers(1, 5), st.floats(0, 100), st.integers(1, 4),
    st.sampled_from([0.05, 1.0, 10.0, 1e6]), st.sampled_from(["nixl", "tcp"]),
    st.sampled_from([BLOCK, BLOCK * 2]))


@settings(max_examples=200, deadline=None)
@given(offers=st.lists(st.tuples(st.sampled_from([100.0, 99.0, 130.0]), st.lists(
    _ITEM, min_size=1, max_size=4)), max_size=4),
       tickets=st.lists(st.tuples(_MM, st.integers(0, 5), st.sampled_from(["p", "q"])),
                        min_size=1, max_size=3),
       at=st.floats(100.0, 200.0))
def test_hostile_offers_never_make_a_read_that_breaks_the_rules(offers, tickets, at):
    """Whatever offers a producer sends (foreign anchors, other planes or layouts, absurd leases,
    any window), a fetch reads on one only for the same mm_hash from the ticket's producer, with
    a good grant, inside its window with 1 s to spare; everything else asks. Nothing crashes."""
    c, _ = consumer_ready(now=100.0)
    good: dict[int, tuple[str, float]] = {}
    for anchor, items in offers:
        c.on_frame(offer(anchor, *items), 100.0)
        for it in items:
            g = it.grant
            ok = (anchor == 100.0 and g.plane == "nixl" and g.block_bytes == BLOCK
                  and 0.1 <= g.lease_s <= 86400.0
                  and it.valid_s <= g.lease_s + 1.0)  # no longer than its hold (+ 1 s)
            until = anchor + it.valid_s - min(0.25, g.lease_s / 4) - 1e-4 * it.valid_s
            if ok and until > 100.0:
                good[g.grant_id] = (it.mm_hash, until)
            # an expired re-offer is ignored: the earlier window stands (a hold never shortens)
    assert c.offers_held <= len(good)
    for mm, hold, prod in tickets:
        if mm in c._fetches:
            continue
        cmds = c.fetch(mm, at, at + 30.0, ticket=Ticket(producer=prod, hold_id=hold,
                                                          mm_hash=mm))
        reads = [x for x in cmds if isinstance(x, PostRead)]
        expect = (hold in good and good[hold][0] == mm and prod == "p"
                  and good[hold][1] - at >= MIN_OFFER_LEFT_S)
        assert bool(reads) == expect, (mm, hold, prod, good)
        if not reads:
            assert any(isinstance(m, ReqBatch) for m in frames(cmds))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("announce"), _MM, st.floats(0, 50)),
    st.tuples(st.just("sync"), st.floats(0, 1e6), st.floats(0, 50)),
    st.tuples(st.just("done"), _MM, st.integers(0, 1 << 62), st.booleans()),
    st.tuples(st.just("poll"), st.floats(0, 100)),
    st.tuples(st.just("ready"), _MM)), max_size=30))
def test_producer_holds_stay_consistent_under_any_sequence(ops):
    """Announcements, Syncs, XferDone of real or invented hold ids, readiness and time in any
    order: the pins, the cap and the holds' bookkeeping stay consistent, and every hold ends."""
    p, store = producer(num_blocks=16, hold_share=0.5, hold_s=5.0, grace_s=1.0)
    welcomed(p, t_sync=1.0)
    holds: dict[str, int] = {}
    now = 0.0
    for op in ops:
        if op[0] == "announce":
            now = max(now, op[2])
            if op[1] not in store:
                put(store, op[1], 3, ready=False)
            t, _ = p.announce(op[1], now)
            if t is not None and t.hold_id:
                holds[op[1]] = t.hold_id
        elif op[0] == "sync":
            now = max(now, op[2])
            p.on_frame("peer", encode(Sync(v=2, session_id=SID, t=op[1])), now)
        elif op[0] == "done":
            gid = holds.get(op[1], op[2]) if op[2] % 2 else op[2]
            reads = p.stats["hold_reads"]
            out = p.on_frame("peer", encode(XferDone(v=2, session_id=SID, mm_hash=op[1],
                                                     grant_id=gid, ok=op[3])), now)
            assert out == []  # a hold's read is counted; an unknown grant id changes nothing
            named = p.holds.get(gid)
            assert p.stats["hold_reads"] == reads + (named is not None and
                                                     named.mm_hash == op[1] and op[3])
        elif op[0] == "ready":
            e = store.get(op[1])
            if e is not None and not e.ready:
                store.mark_ready(op[1])
                p.on_entries_changed([op[1]], now)
        else:
            now = max(now, op[1])
            p.poll(now)
        assert p.held_bytes() <= p.hold_cap_bytes
        p.check_invariants()
    p.poll(now + 1000.0)  # every hold ends ...
    assert p.active_holds == 0
    p.poll(now + 2000.0)  # ... and its grace pin goes
    assert p.held_bytes() == 0
    p.check_invariants()
