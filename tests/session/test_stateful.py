"""Stateful model test: one ProducerSession, several ConsumerSessions, a hostile network.

A hypothesis ``RuleBasedStateMachine`` wires the sans-I/O sessions by hand (as the node would) and
drives them through random interleavings on a fake clock that only moves forward:

* frames travel through explicit in-flight queues per direction, so rules deliver them in order or
  out of order, drop them, duplicate them, or replay an old consumer frame to the producer;
* the data plane is a dict of fake handles: a ``PostRead`` creates one (or fails to post), rules
  complete it (``done``/``err``), feed its state to the consumer, and send the producer its
  completion notification zero, one or two times; like NIXL on one host, a plane cannot refuse a
  revoked grant: its READ may still complete ``done`` — and if the producer no longer pins the
  entry's blocks at that moment, the bytes may be another entry's (the handle is *stale*, and no
  ``Landed`` may ever come from it: the validity-window rule of issue 13);
* connections die (the producer notices at once, later or never) and come back (``on_up``), the
  producer restarts over a fresh store, its plane sometimes fails to describe a grant, its cache
  gains, loses and readies entries, and garbage bytes arrive from consumers and from a stranger.

The commands the sessions return are executed faithfully (Send → queue, Release → handle released,
Report → outcome recorded, Revoke → grant revoked), and after every step the invariants of both
sides are checked (see ``Model.invariants``). ``teardown`` then lets every deadline pass and checks
that everything drains: no grant, no pin, no open fetch, no live handle, no NOT_READY block.

ECTP v2 (issue 16): where this build speaks v2, consumers 0 and 2 negotiate it with the producer
(batched requests, readiness waited for at the producer; consumer 0 accepts entries of up to 3
blocks inline, consumer 2 none) while consumers 1 and 3 are configured ``versions=(1,)`` — both
paths against one producer, under the same faults and invariants.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ectransport.protocol import SUPPORTED_VERSIONS
from ectransport.session import (
    Bind,
    ConsumerConfig,
    ConsumerSession,
    FetchState,
    Land,
    Landed,
    Miss,
    MissReason,
    PostRead,
    ProducerConfig,
    ProducerSession,
    Release,
    Report,
    Send,
)
from ectransport.session.commands import Revoke
from ectransport.session.fetches import FetchTable
from ectransport.session.grants import GrantTable, PlaneFacts
from ectransport.settings_schema import ConsumerSettings, ProducerSettings
from ectransport.store import AllocFailed, BlockStore

from .helpers import BLOCK, COMPAT

LEASE_S = 5.0
GRACE_S = 1.0
BUDGET_BLOCKS = 10
PRODUCER_BLOCKS = 64
CONSUMER_BLOCKS = 16
#: (mm_hash, blocks, ready) of a fresh producer's cache; "d" is larger than the budget (always BUSY)
INITIAL_ENTRIES = (("a", 1, True), ("b", 3, True), ("c", 6, True), ("d", 12, True),
                   ("e", 4, False), ("f", 2, False))
NAMES = ("a", "b", "c", "d", "e", "f", "g", "h")
#: what consumers ask for: cached names, unknown ones, and one longer than the wire allows
FETCHABLE = ("a", "b", "c", *NAMES, "zz", "x" * 300)
USERS = ("K1", "K1", "K2", "")  # CURVE-like identities; "" = no CURVE (identity = session id)
#: misses an honest cluster (same compat hash, same versions, CURVE ok) must never produce
NEVER = {MissReason.INCOMPATIBLE, MissReason.AUTH}


SMALL_DT = st.sampled_from((0.0, 0.05, 0.2, 0.5, 1.0))


#: This build speaks ECTP v2: consumers 0 and 2 use it, 1 and 3 are configured v1-only.
V2 = 2 in SUPPORTED_VERSIONS


#: consumer 2 keeps its completions for the default time (ECTP v2 §4.4), 0 sends them each poll
DONE_DELAY_S = (0.0, 0.0, ConsumerSettings().done_delay_s, 0.0)


def consumer_config(i: int) -> ConsumerConfig:
    versions = (1,) if V2 and i % 2 else ConsumerConfig.versions
    inline = (3 * BLOCK if i == 0 else 0) if V2 and not i % 2 else \
        ConsumerSettings().inline_max_bytes
    return ConsumerConfig(node_id=f"c{i}", compat_hash=COMPAT, versions=versions,
                          settings=ConsumerSettings(
                              ack_timeout_s=2.0, read_timeout_s=8.0, quarantine_s=15.0,
                              hello_timeout_s=5.0, retry_backoff_s=0.02, retry_backoff_max_s=0.5,
                              peer_backoff_s=0.25, peer_backoff_max_s=4.0,
                              inline_max_bytes=inline, done_delay_s=DONE_DELAY_S[i]))


@dataclass
class Conn:
    """One consumer node and its control connection."""

    idx: int
    user: str
    session: ConsumerSession
    epoch: int = 0
    up: bool = False

    @property
    def peer(self) -> str:  # the producer's name for this connection (a ZMQ routing id)
        return f"c{self.idx}#{self.epoch}"


@dataclass
class Handle:
    """A fake data-plane transfer."""

    conn: int
    mm_hash: str
    plane_grant: bytes
    notif: bytes
    state: str = "proc"  # proc | done | err
    released: bool = False
    stale: bool = False  # completed after the producer stopped pinning the granted blocks


@dataclass
class OpenFetch:
    fid: int
    deadline: float
    poll_seq: int  # how many poll rounds had happened when the fetch started


@dataclass
class GrantInfo:
    incarnation: int
    mm_hash: str
    nbytes: int
    entry_id: int = -1


@dataclass
class Stats:
    rules: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)


#: how often each rule/event fired and each outcome was reported in this process: read it after a
#: run (debugger, script) to check the machine still reaches grants, landings and notifications
STATS = Stats()


class Model(RuleBasedStateMachine):
    #: Miss(VERSION) is impossible between nodes that speak the same versions. On e45a4a1 a bug
    #: (see test_backoff_retry_after_penalty_keeps_the_version) produced Miss(VERSION, "frame
    #: version 0 ..."); set to True to tolerate exactly that signature when bisecting old code.
    TOLERATE_V0_BUG = False

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.poll_seq = 0
        self.last_poll = 0.0
        self.conns: list[Conn] = []
        self.c2p: list[tuple[int, bytes]] = []  # (conn idx, frame); only live connections
        self.p2c: list[tuple[int, bytes]] = []
        self.history: list[tuple[int, bytes]] = []  # every frame a consumer ever sent
        self.stale_peers: list[str] = []  # dead connections the producer has not noticed yet
        self.handles: dict[int, Handle] = {}
        self.notifs: list[bytes] = []
        self.revoked: set[bytes] = set()
        self.grants: dict[bytes, GrantInfo] = {}  # plane_grant -> what it was for
        self.open: dict[tuple[int, str], OpenFetch] = {}
        self.reported: set[int] = set()
        self.fids = 0
        self.incarnation = 0
        self.plane_broken = False
        self.rng = random.Random(0)
        self.feeding: Handle | None = None

    # -- wiring --------------------------------------------------------------------------------
    def _new_producer(self, seed: int) -> None:
        self.incarnation += 1
        inc = self.incarnation
        counter = iter(range(1 << 62))

        def describe(runs, nbytes):
            if self.plane_broken:  # one failure, then the plane works again
                self.plane_broken = False
                raise RuntimeError("plane cannot describe")
            # unique per grant, so a Revoke names exactly one grant
            return f"{inc}:{next(counter)}:{[(r.start, r.count) for r in runs]}".encode()

        self.pstore = BlockStore(PRODUCER_BLOCKS, BLOCK)
        for name, blocks, ready in INITIAL_ENTRIES:
            self.pstore.alloc(name, blocks * BLOCK - (blocks > 1))  # some sizes not block-aligned
            if ready:
                self.pstore.mark_ready(name)
        cfg = ProducerConfig(node_id=f"p{inc}", compat_hash=COMPAT, settings=ProducerSettings(
            lease_s=LEASE_S, budget_bytes=BUDGET_BLOCKS * BLOCK, grace_s=GRACE_S))
        self.producer = ProducerSession(cfg, self.pstore, {"nixl": PlaneFacts(describe)},
                                        rng=random.Random(seed * 1000 + inc))

    def _count(self, what: str) -> None:
        STATS.rules[what] = STATS.rules.get(what, 0) + 1

    def _conn_of_peer(self, peer) -> Conn | None:
        for c in self.conns:
            if c.up and c.peer == peer:
                return c
        return None

    def _from_producer(self, cmds) -> None:
        for g in self.producer.grants():
            self.grants.setdefault(g.plane_grant,
                                   GrantInfo(self.incarnation, g.key[1], g.nbytes, g.entry_id))
        for cmd in cmds:
            match cmd:
                case Send(peer=peer, data=data):
                    c = self._conn_of_peer(peer)
                    if c is not None:  # else: a dead connection or the stranger; dropped
                        self.p2c.append((c.idx, data))
                case Revoke(plane_grant=pg):
                    assert pg in self.grants, "Revoke of a grant never handed out"
                    self.revoked.add(pg)
                case _:
                    raise AssertionError(f"unexpected producer command {cmd!r}")

    def _from_consumer(self, c: Conn, cmds) -> None:
        s = c.session
        for cmd in cmds:
            match cmd:
                case Send(peer=peer, data=data):
                    assert peer == s.conn
                    if c.up:  # a send on a dead connection is lost
                        self.c2p.append((c.idx, data))
                        self.history.append((c.idx, data))
                case PostRead():
                    info = self.grants.get(cmd.plane_grant)
                    assert info is not None, "PostRead of a grant no producer handed out"
                    assert info.mm_hash == cmd.key and info.nbytes == cmd.nbytes, (info, cmd)
                    assert sum(r.count for r in cmd.runs) == s.store.blocks_for(cmd.nbytes)
                    if self.rng.random() < 0.1:  # the node could not post it
                        self._from_consumer(c, s.on_read_failed(cmd.key, "post failed", self.now))
                        continue
                    hid = len(self.handles) + 1
                    self.handles[hid] = Handle(c.idx, cmd.key, cmd.plane_grant, cmd.notif)
                    self._from_consumer(c, s.on_read_posted(cmd.key, hid, self.now))
                case Release(handle=hid):
                    h = self.handles.get(hid)
                    assert h is not None, f"Release of unknown handle {hid!r}"
                    assert h.conn == c.idx, "Release of another consumer's handle"
                    assert not h.released, f"handle {hid} released twice"
                    h.released = True
                case Report(outcome=outcome):
                    self._report(c, outcome)
                case Land(runs=runs, data=data):  # an inline entry (v2): its Report follows
                    assert c.session.version == 2, "a Land on a v1 session"
                    assert sum(r.count for r in runs) == s.store.blocks_for(len(data))
                    assert len(data) <= 3 * BLOCK and c.idx == 0, (c.idx, len(data))
                    self._count("inline")
                case Bind():  # the node's plane accepts the producer's endpoint
                    self._from_consumer(c, s.on_bound(None, self.now))
                case _:
                    raise AssertionError(f"unexpected consumer command {cmd!r}")

    def _report(self, c: Conn, outcome) -> None:
        of = self.open.pop((c.idx, outcome.mm_hash), None)
        assert of is not None, f"Report without an open fetch (a second report?): {outcome}"
        assert of.fid not in self.reported
        self.reported.add(of.fid)
        self._check_outcome(c, outcome)

    def _check_outcome(self, c: Conn, outcome) -> None:
        if isinstance(outcome, Landed):
            assert not (self.feeding is not None and self.feeding.stale), (
                f"wrong bytes reported as success: {outcome.mm_hash} landed from a READ that "
                "completed after the producer stopped pinning its blocks")
            e = c.session.store.get(outcome.entry.mm_hash)
            assert e is outcome.entry and e.ready
            assert outcome.entry.mm_hash.split("#")[0] == outcome.mm_hash
            key = "landed"
        else:
            assert isinstance(outcome, Miss)
            assert outcome.reason not in NEVER, outcome
            if outcome.reason is MissReason.VERSION:
                assert self.TOLERATE_V0_BUG and "frame version 0" in outcome.detail, outcome
            key = outcome.reason.value
        STATS.outcomes[key] = STATS.outcomes.get(key, 0) + 1

    def _link_down(self, c: Conn, producer_notices: bool) -> None:
        c.up = False  # first: whatever the session sends now is lost
        self.c2p = [x for x in self.c2p if x[0] != c.idx]
        self.p2c = [x for x in self.p2c if x[0] != c.idx]
        self._from_consumer(c, c.session.on_peer_down(self.now))
        if producer_notices:
            self._from_producer(self.producer.on_peer_down(c.peer, self.now))
        else:
            self.stale_peers.append(c.peer)

    def _reconnect(self, c: Conn) -> None:
        c.epoch += 1
        c.up = True
        self._from_consumer(c, c.session.on_up(self.now))

    # -- set-up --------------------------------------------------------------------------------
    @initialize(n=st.integers(2, 4), seed=st.integers(0, 2**16))
    def setup(self, n, seed):
        self.rng = random.Random(seed)
        self._new_producer(seed)
        for i in range(n):
            store = BlockStore(CONSUMER_BLOCKS, BLOCK)
            sess = ConsumerSession(consumer_config(i), f"prod-conn-{i}", store, self.now,
                                   session_id=f"sess{i}x{seed}")
            c = Conn(i, USERS[i], sess, up=True)
            self.conns.append(c)
            self._from_consumer(c, sess.on_up(self.now))

    # -- consumers ---------------------------------------------------------------------------------
    @rule(i=st.integers(0, 3), mm=st.sampled_from(FETCHABLE),
          dl=st.one_of(*[st.floats(0.5, 30.0)] * 4, st.just(0.0)))
    def fetch(self, i, mm, dl):
        c = self.conns[i % len(self.conns)]
        self._count("fetch")
        if (c.idx, mm) in self.open:  # a second fetch of the same mm_hash is refused at once
            out = c.session.fetch(mm, self.now, self.now + dl)
            assert len(out) == 1 and isinstance(out[0], Report), out
            assert isinstance(out[0].outcome, Miss) and out[0].outcome.mm_hash == mm
            self._check_outcome(c, out[0].outcome)
            return
        self.fids += 1
        self.open[(c.idx, mm)] = OpenFetch(self.fids, self.now + dl, self.poll_seq)
        self._from_consumer(c, c.session.fetch(mm, self.now, self.now + dl))

    @precondition(lambda self: self.c2p)
    @rule(k=st.one_of(st.just(0), st.integers(0, 64)))
    def deliver_to_producer(self, k):
        """Deliver the next (k=0) or an out-of-order consumer frame."""
        idx, data = self.c2p.pop(k % len(self.c2p))
        c = self.conns[idx]
        self._count("deliver_c2p")
        self._from_producer(self.producer.on_frame(c.peer, data, self.now, user=c.user))

    @precondition(lambda self: self.p2c)
    @rule(k=st.one_of(st.just(0), st.integers(0, 64)))
    def deliver_to_consumer(self, k):
        idx, data = self.p2c.pop(k % len(self.p2c))
        c = self.conns[idx]
        self._count("deliver_p2c")
        self._from_consumer(c, c.session.on_frame(data, self.now))

    @rule(rounds=st.integers(1, 8))
    def pump(self, rounds):
        """A healthy network for a moment: deliver everything queued, in order, both ways."""
        for _ in range(rounds):
            if not (self.c2p or self.p2c):
                break
            while self.c2p:
                self.deliver_to_producer(0)
            while self.p2c:
                self.deliver_to_consumer(0)

    @rule(fault=st.sampled_from(("drop_c2p", "drop_p2c", "dup_p2c", "replay", "garbage")),
          k=st.integers(0, 1 << 16), i=st.integers(0, 4), junk=st.binary(max_size=64))
    def network_fault(self, fault, k, i, junk):
        """Drop or duplicate an in-flight frame, replay a consumer's old frame (from any earlier
        connection) on its live connection, or send garbage from a consumer or a stranger (i=4)."""
        self._count(fault)
        if fault == "drop_c2p" and self.c2p:
            self.c2p.pop(k % len(self.c2p))
        elif fault == "drop_p2c" and self.p2c:
            self.p2c.pop(k % len(self.p2c))
        elif fault == "dup_p2c" and self.p2c:
            self.p2c.insert(k % len(self.p2c), self.p2c[k % len(self.p2c)])
        elif fault == "replay" and self.history:
            idx, data = self.history[k % len(self.history)]
            c = self.conns[idx]
            if c.up:
                self._from_producer(self.producer.on_frame(c.peer, data, self.now, user=c.user))
        elif fault == "garbage":
            if i < len(self.conns) and self.conns[i].up:
                c = self.conns[i]
                self._from_producer(self.producer.on_frame(c.peer, junk, self.now, user=c.user))
            else:
                self._from_producer(self.producer.on_frame("stranger", junk, self.now,
                                                           user="mallory"))

    # -- data plane ----------------------------------------------------------------------------
    def _live_handles(self, state=None):
        return [h for h, v in sorted(self.handles.items())
                if not v.released and (state is None or v.state == state)]

    @precondition(lambda self: self._live_handles("proc"))
    @rule(k=st.integers(0, 64), ok=st.sampled_from((True, True, True, False)),
          notifs=st.integers(0, 2))
    def complete_transfer(self, k, ok, notifs):
        """A transfer finishes on the plane: done (unless its grant was revoked) or err; the
        producer's notification is sent 0, 1 or 2 times."""
        live = self._live_handles("proc")
        h = self.handles[live[k % len(live)]]
        info = self.grants[h.plane_grant]
        if ok and info.incarnation == self.incarnation:  # a restarted producer's memory is gone
            e = self.pstore.get(info.mm_hash)
            h.stale = e is None or e.entry_id != info.entry_id or e.pins == 0
            h.state = "done"
        else:
            h.state = "err"
        if h.state == "done":
            self.notifs += [h.notif] * notifs
        self._count(f"complete_{h.state}")

    @precondition(lambda self: self._live_handles())
    @rule(k=st.integers(0, 64))
    def poll_transfer(self, k):
        """The node polls a transfer's state and feeds it to its consumer."""
        live = self._live_handles()
        h = self.handles[live[k % len(live)]]
        self._count("read_state")
        self._feed(self.conns[h.conn], h)

    def _feed(self, c: Conn, h: Handle) -> None:
        """Tell a consumer a transfer's state (the node's poll), remembering which handle it is."""
        self.feeding = h
        try:
            self._from_consumer(c, c.session.on_read_state(h.mm_hash, h.state, self.now))
        finally:
            self.feeding = None

    @precondition(lambda self: self.notifs)
    @rule(k=st.one_of(st.just(0), st.integers(0, 64)))
    def deliver_notification(self, k):
        notif = self.notifs.pop(k % len(self.notifs))
        self._count("notif")
        self._from_producer(self.producer.on_notification(notif, self.now))

    # -- producer cache and plane ---------------------------------------------------------------
    @rule(event=st.sampled_from(("ready", "ready", "save", "discard", "plane_fault")),
          name=st.sampled_from(NAMES), blocks=st.integers(1, 14), ready=st.booleans())
    def producer_cache_event(self, event, name, blocks, ready):
        """A save lands (NOT_READY → READY), the encoder saves a new entry (evicting old unpinned
        ones if needed), the node drops an unpinned entry, or the plane starts/stops failing."""
        e = self.pstore.get(name)
        if event == "ready" and e is not None and not e.ready:
            self.pstore.mark_ready(name)
        elif event == "save":
            e = self.pstore.alloc(name, blocks * BLOCK)
            if not isinstance(e, AllocFailed) and ready:
                self.pstore.mark_ready(name)
        elif event == "discard" and e is not None and e.pins == 0:
            self.pstore.discard(name)
        elif event == "plane_fault":
            self.plane_broken = True
        else:
            return
        self._count(event)

    # -- connections ---------------------------------------------------------------------------
    @rule(event=st.sampled_from(("die", "die_unnoticed", "notice_late", "reconnect", "reconnect",
                                 "restart")),
          i=st.integers(0, 3), seed=st.integers(0, 2**16))
    def connection_event(self, event, i, seed):
        """A connection dies (the producer notices at once, or later, or never), the producer
        notices a dead one late, a consumer reconnects (on_up → Hello), or the producer process
        restarts over a new store (consumers see peer-down first)."""
        c = self.conns[i % len(self.conns)]
        if event in ("die", "die_unnoticed") and c.up:
            self._link_down(c, producer_notices=event == "die")
        elif event == "notice_late" and self.stale_peers:
            peer = self.stale_peers.pop(i % len(self.stale_peers))
            self._from_producer(self.producer.on_peer_down(peer, self.now))
        elif event == "reconnect" and not c.up:
            self._reconnect(c)
        elif event == "restart":
            for x in self.conns:
                if x.up:
                    self._link_down(x, producer_notices=False)
            self.stale_peers.clear()
            old = self.incarnation
            self.revoked |= {pg for pg, g in self.grants.items() if g.incarnation == old}
            self._new_producer(seed)
        else:
            return
        self._count(event)

    # -- time ------------------------------------------------------------------------------------
    @rule(dt=st.one_of(SMALL_DT, SMALL_DT, SMALL_DT, st.floats(0.0, 10.0)),
          deliver_first=st.booleans(), feed_reads=st.booleans(), reconnect=st.booleans())
    def advance(self, dt, deliver_first=False, feed_reads=False, reconnect=False):
        """The node's loop: maybe reconnect dead connections, deliver what is queued and poll
        every transfer, then move the clock forward by ``dt`` and poll the producer and every
        consumer."""
        if reconnect:
            for c in self.conns:
                if not c.up:
                    self._reconnect(c)
        if deliver_first:
            self.pump(1)
        if feed_reads:
            for c in self.conns:
                for _, h in c.session.reading():
                    self._feed(c, self.handles[h])
        self.now += dt
        self._from_producer(self.producer.poll(self.now))
        for c in self.conns:
            self._from_consumer(c, c.session.poll(self.now))
        self.poll_seq += 1
        self.last_poll = self.now
        self._count("advance")

    @precondition(lambda self: self._live_handles("proc"))
    @rule(dt=st.floats(LEASE_S, 2 * LEASE_S))
    def consumers_stalled(self, dt):
        """Every consumer process is stopped (SIGSTOP, a stalled loop) for ``dt`` seconds while the
        producer runs on: its leases expire, grace periods end, blocks get re-used. On resume a
        consumer's node handles what queued — acks, READs that complete now — in its own order
        (frames and transfer states before its deadlines), which the following rules model."""
        for step in (dt, GRACE_S):  # the producer polls more than once meanwhile
            self.now += step
            self._from_producer(self.producer.poll(self.now))
        self._count("stall")

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def producer_pins_match_grants(self):
        if not hasattr(self, "producer"):
            return
        p, store = self.producer, self.pstore
        store.check_invariants()
        # the session's own bookkeeping (indexes, budgets, one pin of its live entry per grant
        # and per grace pin) ...
        p.check_invariants()
        # ... and nothing else pins: exactly one pin per grant or grace pin
        assert sum(e.pins for e in store.entries()) == p.active_grants + p.grace_pins
        for g in p.grants():
            e = store.get(g.key[1])
            assert e is not None and e.entry_id == g.entry_id and e.ready, (g.key, e)
            assert g.deadline <= self.now + LEASE_S + 1e-9, "a lease longer than lease_s"
        per_id = p.pinned_by_identity()  # grace pins stay on the budget
        assert all(v <= BUDGET_BLOCKS * BLOCK for v in per_id.values()), per_id

    @invariant()
    def consumers_consistent(self):
        for c in self.conns:
            s = c.session
            s.store.check_invariants()
            mine = {mm for (i, mm) in self.open if i == c.idx}
            assert set(s._fetches) == mine, (set(s._fetches), mine)
            assert not set(s._fetches) & set(s._quarantine)
            held: dict[str, int] = {}
            for f in (*s._fetches.values(), *s._quarantine.values()):
                entry = getattr(f.state, "entry", None)
                if entry is not None:
                    assert f.kind in (FetchState.READING, FetchState.QUARANTINED)
                    e = s.store.get(entry.mm_hash)
                    assert e is entry and not e.ready, "landing blocks lost or ready early"
                    held[e.mm_hash] = e.entry_id
            for e in s.store.entries():
                assert e.pins == 0
                if not e.ready:
                    assert held.get(e.mm_hash) == e.entry_id, f"leaked NOT_READY entry {e.mm_hash}"
            if s.in_flight() == 0:
                assert all(e.ready for e in s.store.entries())

    @invariant()
    def handles_accounted(self):
        reading = set()
        for c in self.conns:
            for _, h in c.session.reading():
                assert self.handles[h].conn == c.idx
                reading.add(h)
        live = {h for h, v in self.handles.items() if not v.released}
        assert reading == live, f"leaked {live - reading}, released but held {reading - live}"

    @invariant()
    def overdue_fetches_reported(self):
        for (i, mm), of in self.open.items():
            assert not (of.poll_seq < self.poll_seq and of.deadline <= self.last_poll), (
                f"fetch of {mm!r} by c{i} past its deadline {of.deadline} at {self.last_poll} "
                "and not reported")

    def teardown(self):
        if not self.conns:
            return
        # let every deadline pass three times (read deadline → quarantine → settle; on v2 a
        # parked item whose wait ends is answered then, with a grant whose lease and grace period
        # need a further round): everything drains
        for _ in range(3):
            self.advance(1000.0)
        assert not self.open, f"unreported fetches {self.open}"
        assert not self._live_handles(), "handles never released"
        assert self.producer.active_grants == 0 and self.producer.pinned_bytes() == 0
        assert all(e.pins == 0 for e in self.pstore.entries())
        for c in self.conns:
            assert c.session.in_flight() == 0
            assert all(e.ready for e in c.session.store.entries())
        self.producer_pins_match_grants()
        self.consumers_consistent()


pytestmark = pytest.mark.usefixtures("quiet_session_logs")


FAST = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)

TestProducerConsumerMachine = Model.TestCase
TestProducerConsumerMachine.settings = settings(max_examples=200, stateful_step_count=40, **FAST)


# -- the machine can fail: break the code under test and watch it notice ----------------------
def _run_broken(monkeypatch, target, name, replacement, max_examples=60):
    monkeypatch.setattr(target, name, replacement)
    with pytest.raises(Exception) as info:  # noqa: PT011 - any invariant/assertion failure
        run_state_machine_as_test(Model, settings=settings(
            max_examples=max_examples, stateful_step_count=40, derandomize=True,
            phases=[Phase.generate], **FAST))
    return info.value


def test_machine_catches_a_release_that_skips_the_unpin(monkeypatch):
    orig = GrantTable.end

    def end_without_unpin(self, key, why, now):
        # forgets the pin whichever way the grant ends: at once or after its grace period
        ledger = self.ledger
        ledger.unpin = ledger.hold_back = lambda *a: None
        try:
            return orig(self, key, why, now)
        finally:
            del ledger.unpin, ledger.hold_back

    err = _run_broken(monkeypatch, GrantTable, "end", end_without_unpin)
    assert isinstance(err, AssertionError)


def test_machine_catches_a_settle_that_forgets_the_handle(monkeypatch):
    orig = FetchTable._settle

    def settle_without_release(self, q):
        return [c for c in orig(self, q) if not isinstance(c, Release)]

    err = _run_broken(monkeypatch, FetchTable, "_settle", settle_without_release)
    assert isinstance(err, AssertionError)


def test_machine_catches_a_budget_bypass(monkeypatch):
    orig = ProducerSession._on_req

    def on_req_without_budget(self, *args):
        t = self.grants_table
        settings, t.settings = t.settings, msgspec.structs.replace(t.settings,
                                                                  budget_bytes=1 << 40)
        try:
            return orig(self, *args)
        finally:
            t.settings = settings

    # 200 examples did not reach it when run after some other modules (e.g. `pytest
    # tests/session tests/node/test_driver.py tests/config`, at 50a71a3 as well): the search
    # is derandomized, the code under it is not all (session ids); 600 reach it in every order
    # tried
    err = _run_broken(monkeypatch, ProducerSession, "_on_req", on_req_without_budget,
                      max_examples=600)
    assert isinstance(err, AssertionError)


# -- bugs found by the machine, kept as regression tests ---------------------------------------
def _wired(lease_s=30.0, read_timeout_s=5.0):
    from .helpers import make_consumer, make_producer, pump, put

    p, ps = make_producer(lease_s=lease_s)
    put(ps, "a", 2)
    put(ps, "b", 2)
    put(ps, "nr", 2, ready=False)
    c = make_consumer(read_timeout_s=read_timeout_s)
    assert pump(p, c, c.on_up(0.0), 0.0) == [] and c.welcomed
    return p, c, pump


def test_backoff_retry_after_penalty_keeps_the_version():
    """Found by the machine on e45a4a1: _penalize cleared self.version, so a BACKOFF retry went out
    with v=0 and missed with VERSION (fixed by the _probe_due rework in consumer.py)."""
    p, c, pump = _wired()
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    assert pump(p, c, c.fetch("nr", 0.0, 100.0), 0.0) == []  # NOT_READY: BACKOFF
    out = pump(p, c, c.poll(5.0), 5.0)  # a's read deadline penalizes; nr is retried
    reasons = {r.outcome.mm_hash: r.outcome.reason for r in out if isinstance(r, Report)}
    assert reasons.get("nr") is not MissReason.VERSION, out


def test_one_read_timeout_penalizes_once():
    """On e45a4a1 the hello-deadline check in poll re-ran _penalize on every poll while another
    fetch was in flight after a read timeout (backoff doubling per poll up to the cap)."""
    p, c, pump = _wired()
    pump(p, c, c.fetch("a", 0.0, 100.0), 0.0)
    c.on_read_posted("a", "H", 0.0)
    pump(p, c, c.fetch("b", 1.0, 100.0), 1.0)
    c.on_read_posted("b", "H2", 1.0)
    c.poll(5.0)  # a's read deadline: quarantined once, backoff 1 s
    assert c.blocked_until == 6.0
    for t in (5.1, 5.2, 5.3):
        c.poll(t)  # b is still reading: nothing new happened
    assert c.blocked_until == 6.0, c.blocked_until


def test_fetch_while_disconnected_is_not_a_hello_timeout():
    p, c, pump = _wired()
    c.on_peer_down(1.0)  # backoff 1 s, blocked until 2.0; the last Hello was at t=0 (deadline 5)
    assert c.fetch("a", 10.0, 40.0) == []  # queued until the connection is back
    out = c.poll(10.01)
    assert not [r for r in out if isinstance(r, Report)
                and "no Welcome" in r.outcome.detail], out  # no Hello was ever sent for it
