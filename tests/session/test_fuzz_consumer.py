"""Fuzzing ``ConsumerSession`` with random and mutated producer frames and every other event.

The counterpart of ``test_fuzz_producer.py``. Two consumer sessions share one local
:class:`BlockStore`, as in :class:`~ectransport.node.ConsumerNode` (one session per producer
connection). A seeded ``random.Random`` drives them with a monotonic fake clock through:

* frames from "the producer" (``on_frame``): valid and mutated ``Welcome`` and ``XferAck`` frames
  (with and without grants, every status, replays of earlier grants, wrong session ids, unknown
  mm_hashes, grants with wrong layouts, huge numbers, NaN/inf/negative ``lease_s``), frames of the
  wrong kind, random msgpack, bit flips, truncations, splices and random bytes;
* ``fetch`` of known, unknown, duplicate and malformed mm_hashes with short and long deadlines;
* ``Bind`` answered with ``on_bound`` / ``on_bind_failed`` (at once or later, or stale);
* ``poll``, the data plane (``on_read_posted`` / ``on_read_failed`` / ``on_read_state`` for the
  transfers in ``reading()``, stale handles, unknown keys), ``on_peer_down``, ``on_up``,
  ``on_auth_failed``, ``close``;
* the caller, which drops a landed entry at once or holds it (pinned, like the node) for a while.

A session that failed for good (a refused Welcome or binding, failed authentication) is replaced
by a fresh one once nothing is in flight, as the node does. Every few thousand steps an epoch ends:
the clock jumps past every fetch deadline and the quarantine after it, and both sessions are
replaced by fresh ones on the same store. Checked throughout:

* no exception escapes, and every method returns a list of commands;
* every ``Send`` goes to the session's connection and decodes as a valid frame of this session;
  every ``XferDone`` names a grant the producer really gave (right session, mm_hash and grant id);
  every ``Renew`` asks for a finite, positive extension;
* every fetch call ends in exactly one ``Report``, by its deadline (checked after each ``poll``);
* every ``PostRead`` is for a fetch in flight and carries a binding the node gave in answer to one
  of the session's ``Bind`` commands (never a stale ``on_bound``'s); every
  ``Landed`` entry is READY in the store, under a landing key of its mm_hash, names a real grant,
  and completed inside that grant's validity window: before (the latest ``XferReq`` for it was
  sent) + ``lease_s``, on the consumer's clock (DESIGN.md: wrong bytes are never reported as a
  successful fetch);
* every ``Release`` releases a handle the plane handed out, exactly once;
* the store's invariants hold after every step;

and at the end of each epoch: nothing is in flight, every handle was released, the store is empty
and all its blocks are free.

The test runs twice: on ECTP v1 sessions, and on v2 sessions (issue 16: the Welcome offers
[1, 2]; requests are ``ReqBatch`` frames, answers ``AckBatch`` frames answering some items of a
real or invented batch — subsets, items never asked, second answers, another session's — with
grants, NACKs and *inline* entries of good, oversized and ragged sizes, inline data next to a
grant — and ``Parked`` frames naming some items of a real or invented batch, items never asked,
twice, or already answered, with any wait). On v2, additionally: every ``Land`` is followed by the ``Report(Landed)`` of its entry,
whose bytes it copies; an inline landing has no grant, at most the batch's ``inline_max`` bytes,
a whole number of rows; nothing else lands without a grant.

``ECT_FUZZ_FRAMES`` (frames fed to ``on_frame``) and ``ECT_FUZZ_SEED`` work as in the producer
fuzz test; see docs/security.md, "Fuzzing the sessions".
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import msgspec  # noqa: E402
import pytest

from ectransport.protocol import (
    AckBatch,
    DoneBatch,
    FrameError,
    Hello,
    Parked,
    Renew,
    ReqBatch,
    XferAck,
    XferDone,
    XferReq,
    decode,
)
from ectransport.session import (  # noqa: E402 - binding (issue 17)
    Bind,
    ConsumerConfig,
    ConsumerSession,
    IllegalTransition,
    Land,
    Landed,
    Link,
    Miss,
    PostRead,
    Release,
    Report,
    Send,
)
from ectransport.settings_schema import ConsumerSettings  # noqa: E402
from ectransport.store import BlockStore

from .helpers import BLOCK, COMPAT
from .test_fuzz_producer import ENC, base_frames, fuzz_frames, fuzz_seed, mutate, random_value

NUM_BLOCKS = 48
CONNS = ("c1", "c2")  # two producer connections, one shared landing store (as in the node)
MM = ("a", "b", "c", "d", "e", "f", "g")  # what the caller fetches
ODD_MM = ("", "x" * 300, "a#1", "zz", "\u00e9\u0000")  # malformed or never granted
CONFIG = ConsumerConfig(  # the v1 exchange (versions=(1,)); CONFIG_V2: the v2 one
    node_id="c", compat_hash=COMPAT, versions=(1,), settings=ConsumerSettings(
        ack_timeout_s=1.0, read_timeout_s=3.0, quarantine_s=6.0, hello_timeout_s=2.0,
        retry_backoff_s=0.05, retry_backoff_max_s=0.4, peer_backoff_s=0.2,
        peer_backoff_max_s=1.0),
)
#: The same on v2 sessions; entries up to 4 rows come inline.
CONFIG_V2 = dataclasses.replace(CONFIG, versions=(1, 2), settings=msgspec.structs.replace(
    CONFIG.settings, inline_max_bytes=4 * BLOCK))
INLINE_SIZES = (0, BLOCK, 3 * BLOCK, 4 * BLOCK, 5 * BLOCK, BLOCK + 1, 7)
NAN, INF = float("nan"), float("inf")
LEASES = (5.0, 0.5, 30.0, 0.0, -1.0, -1e308, 1e-300, 1e308, NAN, INF, -INF)
ENTRY_BYTES = (0, 1, BLOCK, 5 * BLOCK + 3, NUM_BLOCKS * BLOCK, (NUM_BLOCKS + 1) * BLOCK,
               (1 << 62) - 1)
HOSTILE = (-1, 1 << 62, 1 << 63, 2**64 - 1, -(2**63), NAN, INF, -INF, -0.0, 1e308, "", None)


pytestmark = pytest.mark.usefixtures("quiet_session_logs")


# -- frames from the producer ------------------------------------------------------------------
def welcome(rng: random.Random, sid: str, v2: bool = False) -> dict:
    ok = rng.random() < 0.95
    version = 2 if v2 else 1
    return {"k": "welcome", "v": 1, "session_id": sid, "node_id": "p",
            "status": 0 if ok else rng.randrange(1, 8),
            "version": version if rng.random() < 0.98 else rng.choice((0, 1, 2, 3, 65535)),
            "plane": "nixl" if rng.random() < 0.98 else "tcp",
            "versions": [1, 2] if v2 else [1], "planes": ["nixl"],
            "compat_hash": COMPAT, "detail": "" if ok else "no",
            **({"endpoint": rng.randbytes(rng.randrange(0, 24))} if rng.random() < 0.5 else {})}


def grant(rng: random.Random, good: bool = False) -> dict:
    """A grant for our layout; unless ``good``, now and then a wrong or hostile one."""
    nbytes = rng.randrange(0, 12 * BLOCK)
    g = {"grant_id": rng.choice((0, 1, 2, rng.randrange(1 << 63))), "entry_bytes": nbytes,
         "num_blocks": max(1, -(-nbytes // BLOCK)), "block_bytes": BLOCK,
         "lease_s": rng.uniform(1.0, 10.0), "plane": "nixl",
         "plane_grant": rng.randbytes(rng.randrange(0, 16))}
    if good:
        return g
    if rng.random() < 0.2:
        g["entry_bytes"] = rng.choice(ENTRY_BYTES)
        g["num_blocks"] = max(1, -(-g["entry_bytes"] // BLOCK))
    if rng.random() < 0.3:
        g["lease_s"] = rng.choice(LEASES)
    if rng.random() < 0.1:  # a layout that does not match ours
        key = rng.choice(("num_blocks", "block_bytes", "plane"))
        g[key] = "tcp" if key == "plane" else g[key] + rng.choice((-1, 1, BLOCK))
    if rng.random() < 0.05:  # out-of-range numbers (the decoder must refuse them)
        g[rng.choice(("grant_id", "entry_bytes", "num_blocks", "block_bytes"))] = \
            rng.choice(HOSTILE)
    return g


def ack(rng: random.Random, sid: str, mm_hash: str, good: bool = False) -> dict:
    """An ack; ``good``: an OK one with a usable grant, as a well-behaved producer sends."""
    status = 0 if good or rng.random() < 0.6 else rng.randrange(1, 8)
    # now and then: OK without a grant, a NACK with one
    with_grant = good or (status == 0) == (rng.random() < 0.92)
    return {"k": "ack", "v": 1, "session_id": sid, "mm_hash": mm_hash, "status": status,
            "grant": grant(rng, good) if with_grant else None, "detail": ""}


def ack_item(rng: random.Random, mm_hash: str, good: bool = False) -> dict:
    """v2: one AckBatch item: as :func:`ack`, or now and then an inline entry (of a good,
    oversized or ragged size, sometimes next to a grant)."""
    a = ack(rng, "", mm_hash, good)
    item = {"mm_hash": mm_hash, "status": a["status"], "grant": a["grant"], "data": b"",
            "detail": ""}
    if rng.random() < 0.3:
        item["data"] = rng.randbytes(rng.choice(INLINE_SIZES))
        if item["status"] == 0 and rng.random() < 0.85:
            item["grant"] = None
    return item


def batch_names(rng: random.Random, batches: list[tuple[int, list[str]]], *, real: float,
                keep: float) -> tuple[int, list[str]]:
    """A batch id and item names for a v2 answer: with probability ``real`` a sent batch and each
    of its items with probability ``keep`` (at least one), else an id never sent; now and then an
    item the batch never named, or one twice."""
    if batches and rng.random() < real:
        bid, items = rng.choice(batches)
        names = [m for m in items if rng.random() < keep] or items[:1]
    else:
        bid, names = rng.choice((0, 1, 99, rng.randrange(1 << 63))), [rng.choice(MM)]
    if rng.random() < 0.1:
        names.append(rng.choice(MM + ODD_MM[1:]))
    if rng.random() < 0.05:
        names.append(names[0])
    return bid, names


def ack_batch(rng: random.Random, sid: str, batches: list[tuple[int, list[str]]],
              good: bool = False) -> dict:
    """v2: an AckBatch for a real batch (mostly), some of its items (now and then one it never
    named, or one twice), or for a batch id never sent."""
    bid, names = batch_names(rng, batches, real=0.9, keep=0.7)
    return {"k": "acks", "v": 2, "session_id": sid, "batch_id": bid,
            "items": [ack_item(rng, m, good) for m in names[:64]]}


def park_frame(rng: random.Random, sid: str, batches: list[tuple[int, list[str]]]) -> dict:
    """v2: a Parked for a real batch (mostly), some of its items (now and then one it never
    named, or one twice), or for a batch id never sent; any wait within the bounds."""
    bid, names = batch_names(rng, batches, real=0.85, keep=0.6)
    wait_s = rng.choice((0.0, 0.5, 5.0, 60.0, rng.random() * 60.0))
    return {"k": "park", "v": 2, "session_id": sid, "batch_id": bid, "items": names[:64],
            "wait_s": wait_s}


@dataclass
class Peer:
    """What "the producer" of one connection knows: the session id, what was asked, what it sent."""

    sid: str
    old_sids: list[str]
    v2: bool = False
    requested: list[str] = field(default_factory=list)  # mm_hashes of recent XferReqs
    sent: list[bytes] = field(default_factory=list)  # recent valid acks, for replays
    batches: list[tuple[int, list[str]]] = field(default_factory=list)  # recent ReqBatch frames

    def frame(self, rng: random.Random) -> bytes:
        op = rng.randrange(12)
        sid = self.sid if rng.random() < 0.9 else rng.choice((*self.old_sids, "", "other"))
        if self.v2 and op <= 3 and rng.random() < 0.25:  # a Parked (v2): never answered
            return ENC(park_frame(rng, sid, self.batches))
        if self.v2 and op <= 3:  # an AckBatch (v2)
            data = ENC(ack_batch(rng, sid, self.batches, good=rng.random() < 0.5))
            if len(self.sent) >= 32:
                del self.sent[:16]
            self.sent.append(data)
            return data
        if op <= 3:  # an answer to something we were asked (or to something we were not)
            answer = bool(self.requested) and rng.random() < 0.85
            if answer:  # mostly the oldest request not yet answered, as a producer would
                i = 0 if rng.random() < 0.7 else rng.randrange(len(self.requested))
                mm = self.requested.pop(i) if rng.random() < 0.9 else self.requested[i]
            else:
                mm = rng.choice(MM + ODD_MM)
            data = ENC(ack(rng, sid, mm, good=answer and rng.random() < 0.5))
            if len(self.sent) >= 32:
                del self.sent[:16]
            self.sent.append(data)
            return data
        if op == 4:
            return ENC(welcome(rng, sid, self.v2))
        if op == 5 and self.sent:  # a replay: duplicate or late grant
            return rng.choice(self.sent)
        if op in (6, 7):  # a valid frame with fields replaced by random or hostile values
            m = rng.choice((welcome(rng, sid, self.v2), ack(rng, sid, rng.choice(MM)),
                            ack_batch(rng, sid, self.batches),
                            park_frame(rng, sid, self.batches)))
            if m["k"] == "acks" and rng.random() < 0.5:
                m = m["items"][0]  # a field of an item (inside a batch frame below)
                m = {"k": "acks", "v": 2, "session_id": sid, "batch_id": 1, "items": [m]}
                target = m["items"][0]
            else:
                target = m["grant"] if isinstance(m.get("grant"), dict) and rng.random() < 0.5 \
                    else m
            for _ in range(rng.randrange(1, 3)):
                target[rng.choice(list(target))] = \
                    rng.choice(HOSTILE) if rng.random() < 0.5 else random_value(rng)
            try:
                return ENC(m)
            except (TypeError, OverflowError, ValueError):
                return b"\x80"
        if op == 8:  # random msgpack
            try:
                return ENC(random_value(rng))
            except (TypeError, OverflowError, ValueError):
                return b"\xc1"
        # byte-level mutations of valid frames of every kind (see test_fuzz_producer.mutate)
        frames = [welcome(rng, sid, self.v2), ack(rng, sid, rng.choice(MM)),
                  *([ack_batch(rng, sid, self.batches), park_frame(rng, sid, self.batches)]
                    if self.v2 else []), *base_frames(sid)]
        return mutate(rng, frames, [ENC(f) for f in frames])


# -- the harness: a node that executes commands and checks them ---------------------------------
@dataclass(eq=False)
class Binding:
    """What the node's plane returns for a bound endpoint (``stale``: given to no Bind)."""

    stale: bool = False


class Harness:
    """Plays the node (executes commands, answers Bind, runs the data plane), the producer's
    frames and the caller, and checks every command against the invariants above."""

    def __init__(self, rng: random.Random, v2: bool = False):
        self.rng = rng
        self.v2 = v2
        self.config = CONFIG_V2 if v2 else CONFIG
        self.landing: Land | None = None  # the Land whose Report(Landed) must come next
        self.now = 0.0
        self.store = BlockStore(NUM_BLOCKS, BLOCK)
        self.epoch = 0
        self.generation = 0
        self.sessions: dict[str, ConsumerSession] = {}
        self.peers: dict[str, Peer] = {}
        self.open: dict[tuple[str, str], list[float]] = {}  # (conn, mm_hash) -> deadlines
        self.horizon = 0.0  # the latest deadline of any fetch of this epoch, reported or not
        self.granted: set[tuple[str, str, int]] = set()  # (session_id, mm_hash, grant_id) fed
        self.issued: set[int] = set()
        self.released: set[int] = set()
        self.next_handle = 0
        self.held: list[tuple[str, int]] = []  # landed entries the caller still holds (pinned)
        self.bindings: dict[str, list[Binding]] = {}  # conn -> bindings given in answer to Bind
        self.unbound: list[str] = []  # conns whose Bind the node has not answered yet
        self.req_sent: dict[tuple[str, str], float] = {}  # (conn, mm_hash) -> latest XferReq
        self.window: dict[tuple[str, str], float] = {}  # (conn, mm_hash) -> end of grant window
        #: mm_hash -> (req_sent, lease_s) of each grant in the frame being fed (None: no frame)
        self.feeding: dict[str, tuple[float, float]] | None = None
        self.stats: Counter = Counter()
        self.trace: deque[str] = deque(maxlen=16)  # the last events, for a failure message
        self.outcomes: Counter = Counter()
        self.new_epoch()

    # sessions and epochs
    def new_session(self, conn: str) -> None:
        self.generation += 1
        sid = f"{conn}-{self.generation}"
        old = self.peers[conn].old_sids + [self.peers[conn].sid] if conn in self.peers else []
        self.peers[conn] = Peer(sid, old[-3:], self.v2)
        self.sessions[conn] = ConsumerSession(self.config, conn, self.store, self.now,
                                              session_id=sid)
        self.bindings[conn] = []
        self.unbound = [c for c in self.unbound if c != conn]
        if self.rng.random() < 0.9:
            self.run(conn, self.sessions[conn].on_up(self.now))

    def drop_if_failed(self, conn: str) -> None:
        """Like the node: a failed session with nothing in flight is replaced by a fresh one."""
        s = self.sessions[conn]
        if s.failed is not None and s.in_flight() == 0:
            assert not any(ds for (c, _), ds in self.open.items() if c == conn), self.open
            self.stats["failed_sessions"] += 1
            self.new_session(conn)

    def new_epoch(self) -> None:
        self.epoch += 1
        for conn in CONNS:
            self.new_session(conn)

    def end_epoch(self) -> None:
        """Jump past every fetch's deadline (reported or not), then past the quarantine that may
        follow it: everything must be settled by then."""
        self.unbound.clear()
        for conn, s in self.sessions.items():
            if self.rng.random() < 0.3:
                self.note(conn, "close")
                self.run(conn, s.close())
        self.advance(max(self.now, self.horizon) - self.now + 0.001)
        for conn in CONNS:
            self.note(conn, "poll (past every deadline)")
            self.poll(conn)
        assert not any(self.open.values()), f"fetches never reported: {self.open}"
        self.advance(CONFIG.settings.quarantine_s + 0.001)
        for conn in CONNS:
            self.note(conn, "poll (past every quarantine)")
            self.poll(conn)
        for conn, s in self.sessions.items():
            assert s.in_flight() == 0, (conn, s.fetch_states())
            assert s.reading() == [], (conn, s.reading())
        while self.held:
            self.release_held()
        leaked = self.issued - self.released
        assert not leaked, f"data-plane handles never released: {sorted(leaked)}"
        self.store.check_invariants()
        assert len(self.store) == 0, [e.mm_hash for e in self.store.entries()]
        assert self.store.free_blocks == NUM_BLOCKS
        self.stats["epochs"] += 1
        self.new_epoch()

    # the clock
    def advance(self, dt: float) -> None:
        assert dt >= 0
        self.now += dt

    # commands
    def run(self, conn: str, cmds, fetched: str | None = None) -> None:
        """Execute ``cmds`` as the node would; ``fetched``: they answer ``fetch(fetched)``."""
        assert isinstance(cmds, list), f"a session method returned {cmds!r}, not a list"
        sid = self.sessions[conn].session_id
        for c in cmds:
            if self.landing is not None:  # a Land is followed by its entry's Report(Landed)
                assert isinstance(c, Report) and isinstance(c.outcome, Landed), (self.landing, c)
                assert c.outcome.entry.runs == self.landing.runs, (self.landing, c)
                assert c.outcome.entry.nbytes == len(self.landing.data), (self.landing, c)
            if isinstance(c, Land):
                assert self.v2, f"a Land on a v1 session: {c}"
                self.landing = c
                self.stats["Land"] += 1
            elif isinstance(c, Send):
                assert c.peer == conn, c
                self.check_sent(conn, sid, c.data)
            elif isinstance(c, PostRead):
                assert self.open.get((conn, c.key)), f"PostRead for {c.key!r}, not in flight"
                assert sum(r.count for r in c.runs) == self.store.blocks_for(c.nbytes), c
                # the binding of this producer, never a stale one
                assert any(c.prepared is b for b in self.bindings[conn]), \
                    f"PostRead without a binding given in answer to its Bind: {c}"
                assert self.feeding is not None, f"PostRead outside an ack: {c}"
                assert c.key in self.feeding, f"PostRead for {c.key!r}, not granted in this frame"
                req, lease = self.feeding[c.key]
                assert req < INF, f"PostRead for {c.key!r}, never requested"
                self.window[(conn, c.key)] = req + lease
                self.stats["PostRead"] += 1
                self.post(conn, c)
            elif isinstance(c, Bind):
                self.bind(conn)
            elif isinstance(c, Release):
                assert c.handle in self.issued, f"Release of a handle never handed out: {c}"
                assert c.handle not in self.released, f"handle {c.handle} released twice"
                self.released.add(c.handle)
            elif isinstance(c, Report):
                # a report answering the fetch() call that returned it closes that call
                mine = c.outcome.mm_hash == fetched
                fetched = None if mine else fetched
                self.report(conn, sid, c.outcome, mine, inline=self.landing is not None)
                self.landing = None
            else:
                raise AssertionError(f"a consumer session returned {c!r}")
        assert self.landing is None, f"a Land with no Report(Landed) after it: {self.landing}"

    def check_sent(self, conn: str, sid: str, data: bytes) -> None:
        msg = decode(data, versions=(1, 2) if self.v2 else (1,))  # every frame it sends is valid
        assert isinstance(msg, (Hello, XferReq, XferDone, Renew, ReqBatch, DoneBatch)), msg
        if isinstance(msg, DoneBatch):
            assert self.v2 and msg.v == 2 and len(msg.items) >= 2, msg  # one alone: XferDone
        if isinstance(msg, ReqBatch):
            assert self.v2 and msg.v == 2, msg
            assert msg.inline_max == self.config.settings.inline_max_bytes and msg.wait_s >= 0, msg
            names = [i.mm_hash for i in msg.items]
            assert len(set(names)) == len(names), f"an mm_hash twice in one batch: {msg}"
            for m in names:
                self.req_sent[(conn, m)] = self.now
            self.peers[conn].batches.append((msg.batch_id, names))
            del self.peers[conn].batches[:-16]
        assert msg.session_id == sid, (msg, sid)
        self.stats[type(msg).__name__] += 1
        if isinstance(msg, XferReq):
            self.req_sent[(conn, msg.mm_hash)] = self.now
            self.peers[conn].requested.append(msg.mm_hash)
            del self.peers[conn].requested[:-16]
        elif isinstance(msg, XferDone):
            assert (sid, msg.mm_hash, msg.grant_id) in self.granted, f"XferDone of no grant: {msg}"
        elif isinstance(msg, DoneBatch):
            for it in msg.items:
                assert (sid, it.mm_hash, it.grant_id) in self.granted, f"a done of no grant: {it}"
        elif isinstance(msg, Renew):
            assert math.isfinite(msg.extend_s) and msg.extend_s > 0, msg

    def report(self, conn: str, sid: str, outcome, mine: bool, inline: bool = False) -> None:
        """``mine``: it answers the fetch() call that returned it, else the oldest open one;
        ``inline``: it follows a Land (an inline entry, v2)."""
        key = (conn, outcome.mm_hash)
        ds = self.open.get(key)
        assert ds, f"Report for {key} with no fetch in flight (a second report?): {outcome}"
        ds.pop(-1 if mine else 0)
        if isinstance(outcome, Landed):
            e = outcome.entry
            assert self.store.get(e.mm_hash) is e and e.ready, outcome
            assert e.mm_hash.startswith(outcome.mm_hash + "#"), outcome
            if inline:  # no grant, no window: the bytes came in the answer, checked
                assert outcome.grant_id == -1, outcome
                assert e.nbytes <= self.config.settings.inline_max_bytes and e.nbytes % BLOCK == 0, e
                self.outcomes["inline"] += 1
            else:
                assert (sid, outcome.mm_hash, outcome.grant_id) in self.granted, outcome
                end = self.window.get(key, -INF)
                assert self.now < end, f"landed at {self.now}, its grant's window ended at {end}"
            self.outcomes["landed"] += 1
            if self.rng.random() < 0.1:  # the caller keeps it a while, pinned like the node does
                self.store.pin_if_ready(e.mm_hash)
                self.held.append((e.mm_hash, e.entry_id))
            else:
                assert self.store.discard(e.mm_hash)
        else:
            assert isinstance(outcome, Miss), outcome
            self.outcomes[outcome.reason.name] += 1
            if "(exists)" in outcome.detail:
                self.stats["landing_key_collisions"] += 1

    def release_held(self) -> None:
        key, entry_id = self.held.pop(self.rng.randrange(len(self.held)))
        self.store.unpin(key, entry_id)
        assert self.store.discard(key)

    def bind(self, conn: str) -> None:
        """The node validates the Welcome's endpoint: at once, later, or it refuses it."""
        r = self.rng.random()
        if r < 0.8:
            self.note(conn, "  on_bound")
            self.answer_bind(conn, Binding())
        elif r < 0.85:
            self.note(conn, "  on_bind_failed")
            self.answer_bind(conn, None)
        else:
            self.unbound.append(conn)

    def answer_bind(self, conn: str, binding: Binding | None) -> None:
        """Answer a Bind (``None``: the plane refused the endpoint). Legal only while the session
        is BINDING; any other answer (stale, or after the session moved on) must raise
        IllegalTransition (h11's rule) and change nothing."""
        s = self.sessions[conn]
        legal = s.link is Link.BINDING
        try:
            cmds = (s.on_bound(binding, self.now) if binding is not None
                    else s.on_bind_failed("fuzz: endpoint refused", self.now))
        except IllegalTransition:
            assert not legal, f"a bind answer in state BINDING raised ({conn})"
            self.stats["illegal_bind_answers"] += 1
            return
        assert legal, f"a bind answer in state {s.link.name} was accepted ({conn})"
        if binding is not None:
            self.bindings[conn].append(binding)
        self.run(conn, cmds)

    def handle(self) -> int:
        self.next_handle += 1
        self.issued.add(self.next_handle)
        return self.next_handle

    def post(self, conn: str, c: PostRead) -> None:
        """The data plane: start the read (or fail to), maybe finish it at once (like UCX)."""
        s = self.sessions[conn]
        if self.rng.random() < 0.08:
            self.note(conn, f"  on_read_failed({c.key!r})")
            self.run(conn, s.on_read_failed(c.key, "plane error", self.now))
            return
        handle = self.handle()
        self.note(conn, f"  on_read_posted({c.key!r}, {handle})")
        self.run(conn, s.on_read_posted(c.key, handle, self.now))
        if self.rng.random() < 0.15:
            state = self.rng.choice(("done", "err"))
            self.note(conn, f"  on_read_state({c.key!r}, {state!r})")
            self.run(conn, s.on_read_state(c.key, state, self.now))

    # events
    def fetch(self, conn: str) -> None:
        rng = self.rng
        mm = rng.choice(MM) if rng.random() < 0.95 else rng.choice(ODD_MM)
        deadline = self.now + rng.choice((0.0, 0.01, 0.3, 1.5, 4.0, 10.0, 30.0))
        self.note(conn, f"fetch({mm!r}, deadline={deadline!r})")
        self.horizon = max(self.horizon, deadline)
        self.open.setdefault((conn, mm), []).append(deadline)
        self.run(conn, self.sessions[conn].fetch(mm, self.now, deadline), fetched=mm)

    def poll(self, conn: str) -> None:
        self.run(conn, self.sessions[conn].poll(self.now))
        late = {k: ds for k, ds in self.open.items() if k[0] == conn and ds and min(ds) <= self.now}
        assert not late, f"at {self.now}: fetches past their deadline and not reported: {late}"

    def read_state(self, conn: str) -> None:
        s = self.sessions[conn]
        reading = s.reading()
        if reading and self.rng.random() < 0.9:
            mm, _ = self.rng.choice(reading)
        else:
            mm = self.rng.choice(MM + ODD_MM)
        state = self.rng.choice(("proc", "proc", "done", "err"))
        self.note(conn, f"on_read_state({mm!r}, {state!r})")
        self.run(conn, s.on_read_state(mm, state, self.now))

    def note(self, conn: str, what: str) -> None:
        self.trace.append(f"t={self.now!r} {conn} {what}")

    def step(self, conn: str) -> None:
        """One random event (noted in ``self.trace`` before it runs)."""
        rng, s = self.rng, self.sessions[conn]
        r = rng.random()
        if r < 0.5:
            data = self.peers[conn].frame(rng)
            self.note(conn, f"on_frame({data!r})")
            self.feeding = {}
            parked = False
            try:
                msg = decode(data, versions=(1, 2) if self.v2 else (1,))
            except FrameError:
                pass
            else:
                parked = isinstance(msg, Parked)
                if isinstance(msg, XferAck) and msg.grant is not None:
                    self.granted.add((msg.session_id, msg.mm_hash, msg.grant.grant_id))
                    req = self.req_sent.get((conn, msg.mm_hash), INF)
                    self.feeding = {msg.mm_hash: (req, msg.grant.lease_s)}
                elif isinstance(msg, AckBatch):
                    for it in msg.items:
                        if it.grant is not None:
                            self.granted.add((msg.session_id, it.mm_hash, it.grant.grant_id))
                            req = self.req_sent.get((conn, it.mm_hash), INF)
                            # a second grant for one item in a frame: the first one is used
                            self.feeding.setdefault(it.mm_hash, (req, it.grant.lease_s))
            self.stats["frames"] += 1
            try:
                out = s.on_frame(data, self.now)
                assert not (parked and out), f"a Parked frame was answered: {out}"
                self.stats["Parked"] += parked
                self.run(conn, out)
            finally:
                self.feeding = None
        elif r < 0.62:
            self.fetch(conn)
        elif r < 0.77:
            self.note(conn, "poll")
            self.poll(conn)
        elif r < 0.88:
            self.read_state(conn)
        elif r < 0.90:  # a stale post: the fetch is over, or it never existed
            mm = rng.choice(MM + ODD_MM)
            if not any(k == mm for k, _ in s.reading()) and s.fetch_states().get(mm) is None:
                self.note(conn, f"on_read_posted({mm!r}) (stale)")
                self.run(conn, s.on_read_posted(mm, self.handle(), self.now))
        elif r < 0.905:
            self.note(conn, "on_peer_down")
            self.run(conn, s.on_peer_down(self.now))
        elif r < 0.92:
            self.note(conn, "on_up")
            self.run(conn, s.on_up(self.now))
        elif r < 0.94:  # a deferred answer to Bind, or one to no Bind at all
            stale = conn not in self.unbound
            if not stale:
                self.unbound.remove(conn)
            ok = rng.random() < 0.9
            self.note(conn, f"on_{'bound' if ok else 'bind_failed'} "
                            f"({'stale' if stale else 'deferred'})")
            self.answer_bind(conn, Binding(stale) if ok else None)
        elif r < 0.9405:
            self.note(conn, "on_auth_failed")
            self.run(conn, s.on_auth_failed("fuzz", self.now))
        elif self.held:
            self.note(conn, "caller releases a landed entry")
            self.release_held()


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_random_and_mutated_frames_and_events(v2):
    n_frames, seed = fuzz_frames(), fuzz_seed()
    rng = random.Random(seed)
    h = Harness(rng, v2)
    epoch_end = rng.randrange(500, 6000)
    step = 0
    t0 = time.perf_counter()
    try:
        while h.stats["frames"] < n_frames:
            step += 1
            r = rng.random()
            h.advance(0.0 if r < 0.5 else rng.random() * 0.05 if r < 0.99 else rng.random() * 3)
            conn = rng.choice(CONNS)
            h.step(conn)
            h.store.check_invariants()
            h.drop_if_failed(conn)
            if step >= epoch_end:
                h.end_epoch()
                epoch_end = step + rng.randrange(500, 6000)
        h.end_epoch()
    except Exception as e:
        trace = "\n  ".join(h.trace)
        pytest.fail(f"ECT_FUZZ_SEED={seed}, step {step}, epoch {h.epoch}: "
                    f"{type(e).__name__}: {e}\nlast events:\n  {trace}", pytrace=False)
    elapsed = time.perf_counter() - t0
    assert h.outcomes["landed"] > 0 and h.stats["Renew"] > 0 or n_frames < 10_000
    assert not v2 or h.outcomes["inline"] > 0 and h.stats["ReqBatch"] > 0 and \
        h.stats["Parked"] > 0 or n_frames < 10_000
    print(f"seed {seed}: {h.stats['frames']} frames, {step} steps, {h.stats['epochs']} epochs in "
          f"{elapsed:.1f} s; outcomes {dict(h.outcomes)}; sent "
          f"{ {k: h.stats[k] for k in ('Hello', 'XferReq', 'ReqBatch', 'XferDone', 'Renew', 'PostRead', 'Land')} }; "
          f"failed sessions {h.stats['failed_sessions']}; "
          f"landing-key collisions {h.stats['landing_key_collisions']}")
