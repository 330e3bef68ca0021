"""ECTP v2 §10.4, sans-I/O: an announcement naming its consumer (node id or CURVE key) is
offered to that consumer's sessions only; one naming nobody is broadcast, or offered to nobody
when the producer does not broadcast; pending holds wait for the session they are for."""

from __future__ import annotations

import random

from ectransport.protocol import FEATURE_OFFERS, Hello, Offer, Sync, Welcome, decode, encode
from ectransport.session import ProducerSession, Send
from ectransport.session.grants import PlaneFacts
from ectransport.session.holds import MAX_TARGETS
from ectransport.session.offering import targets
from ectransport.store import BlockStore

from .helpers import BLOCK, COMPAT, describe, producer_config, put

V = (1, 2)
KEYS = {"pd-0": "K" * 40, "pd-1": "L" * 40, "pd-2": "M" * 40}


def producer(**kw):
    store = BlockStore(64, BLOCK)
    p = ProducerSession(producer_config(versions=V, hold_s=10.0, **kw), store,
                        {"nixl": PlaneFacts(describe, offerable=True)}, rng=random.Random(3))
    return p, store


def join(p, node_id, now=0.0, sync=True):
    """A consumer session of ``node_id`` (CURVE key ``KEYS[node_id]``) taking offers."""
    sid = (node_id.replace("-", "") * 16)[:32]
    hello = Hello(v=2, session_id=sid, node_id=node_id, versions=list(V), planes=["nixl"],
                  compat_hash=COMPAT, mem_kinds=["DRAM"], features=[FEATURE_OFFERS])
    (w,) = frames(p.on_frame(node_id, encode(hello), now, user=KEYS[node_id]))
    assert isinstance(w, Welcome) and FEATURE_OFFERS in w.features
    if sync:
        return frames(p.on_frame(node_id, encode(Sync(v=2, session_id=sid, t=100.0)), now))
    return []


def frames(cmds):
    return [decode(c.data, versions=V) for c in cmds if isinstance(c, Send)]


def offered(cmds):
    """peer -> mm_hashes offered to it by these commands."""
    out: dict[str, list[str]] = {}
    for c in cmds:
        if isinstance(c, Send):
            m = decode(c.data, versions=V)
            if isinstance(m, Offer):
                out.setdefault(c.peer, []).extend(it.mm_hash for it in m.items)
    return out


def test_a_named_consumer_alone_is_offered_the_entry():
    p, store = producer()
    for n in KEYS:
        join(p, n)
    put(store, "a", 2)
    put(store, "b", 2)
    ta, cmds = p.announce("a", 1.0, to="pd-1")  # by node id
    assert ta is not None and ta.hold_id and offered(cmds) == {"pd-1": ["a"]}
    tb, cmds = p.announce("b", 1.0, to=KEYS["pd-2"])  # by CURVE key
    assert offered(cmds) == {"pd-2": ["b"]}
    assert p.stats["offers"] == 2 and p.stats["offers_targeted"] == 2
    _, cmds = p.announce("a", 2.0, to=["pd-0"])  # renewed for another consumer: both now
    assert offered(cmds) == {"pd-0": ["a"], "pd-1": ["a"]}
    p.check_invariants()


def test_an_announcement_naming_nobody_is_broadcast_unless_switched_off():
    p, store = producer()
    for n in KEYS:
        join(p, n)
    put(store, "a", 1)
    _, cmds = p.announce("a", 1.0)
    assert offered(cmds) == {n: ["a"] for n in KEYS}
    q, qstore = producer(broadcast_offers=False)
    for n in KEYS:
        join(q, n)
    put(qstore, "a", 1)
    ticket, cmds = q.announce("a", 1.0)
    assert ticket is not None and ticket.hold_id == 0 and cmds == []  # fetched by request
    assert q.active_holds == 0 and qstore.get("a").pins == 0
    ticket, cmds = q.announce("a", 1.0, to="pd-0")
    assert ticket.hold_id and offered(cmds) == {"pd-0": ["a"]}
    assert q.announce("absent", 1.0, to="pd-0") == (None, [])


def test_a_pending_hold_waits_for_the_session_it_is_for():
    """Announced for pd-1 before pd-1 took offers: not pinned while only pd-0 could take it,
    held and offered to pd-1 alone at pd-1's first Sync."""
    p, store = producer()
    join(p, "pd-0")
    put(store, "a", 2)
    ticket, cmds = p.announce("a", 1.0, to="pd-1")
    assert ticket.hold_id and cmds == [] and store.get("a").pins == 0
    join(p, "pd-1", now=2.0, sync=False)
    assert store.get("a").pins == 0  # no anchor yet
    sid = ("pd1" * 16)[:32]
    out = p.on_frame("pd-1", encode(Sync(v=2, session_id=sid, t=100.0)), 2.0)
    assert offered(out) == {"pd-1": ["a"]} and store.get("a").pins == 1
    # a later first Sync of another consumer is not offered pd-1's hold
    assert offered(join(p, "pd-2", now=3.0)) == {}
    p.check_invariants()


def test_targets_are_bounded_and_empty_names_dropped():
    assert targets(None) is None
    assert targets("x") == frozenset({"x"})
    assert targets(["", "y"]) == frozenset({"y"})
    assert len(targets([f"n{i}" for i in range(200)])) == MAX_TARGETS
