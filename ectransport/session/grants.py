"""The producer's grants: its settings and per-plane facts, the record of each live grant, and
:class:`GrantTable` — how one entry is answered (a grant, inline bytes, or a refusal) and how a
grant ends, exactly once. Also the grant key's wire form in data-plane notifications
(:func:`notif_for` / :func:`parse_notif`).

Grant lifecycle (per key ``(session_id, mm_hash, grant_id)``)::

    request ──► [checks] ──► PINNED under lease ──► ended exactly once, on the first of:
                                                     data-plane notification | XferDone |
                                                     lease expiry (poll) | consumer down

An ended grant is revoked on its plane; its pin goes at once after a confirmed completion, else
it is held back (:mod:`ectransport.session.pins`): on a revocable plane until the next poll (the
node performed the ``Revoke`` first: no block is re-used while the plane may still send it), on
a READ plane for ``grace_s`` — after a consumer-down counted from the later of now and the lease
deadline, since a consumer that has not noticed the drop (a frozen process) may read until then.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ectransport.protocol import (
    FEATURE_DONES,
    FEATURE_OFFERS,
    FEATURE_RENEW_ACK,
    AckItem,
    Grant,
    Renew,
    RenewAck,
    Status,
    encode,
)
from ectransport.protocol.messages import MAX_GRANT_BYTES
from ectransport.session.commands import Command, Revoke, Send
from ectransport.session.pins import PinLedger
from ectransport.settings_schema import API, ProducerSettings
from ectransport.store import BlockStore, Run

log = logging.getLogger("ectransport.session.producer")

#: Session ids are opaque to the producer but must not contain ':' (the notification separator).
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

#: ``(runs, nbytes) -> plane_grant``: a plane's description of exactly these blocks.
Describe = Callable[[Sequence[Run], int], bytes]
#: ``(runs, nbytes) -> bytes``: the first ``nbytes`` bytes of an entry's blocks (inline
#: answers); the caller holds whatever lock keeps a READY entry's blocks stable.
ReadBytes = Callable[[tuple[Run, ...], int], bytes]
#: What the producer session tells its observer: ``(event, fields)``.
Emit = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class ProducerConfig:
    """What a producer session says of itself in Welcome, and its settings.

    Attributes:
        node_id: this node's name. compat_hash: see :func:`ectransport.protocol.compat_hash`.
        planes: data planes offered, best first. versions: ECTP versions spoken.
        settings: the producer section of the settings schema (lease, budget, grace, waits,
            inline, holds; units in the names).
    """

    node_id: str
    compat_hash: str
    planes: tuple[str, ...] = API.node.planes
    versions: tuple[int, ...] = API.node.versions
    settings: ProducerSettings = API.producer


def _always(locality: bytes) -> bool:
    return True


@dataclass(frozen=True)
class PlaneFacts:
    """What a producer session needs to know of one of its planes, fixed for the plane's life.

    Attributes:
        describe: the ``plane_grant`` of exactly some blocks (``DataTransport.describe``).
        revocable: revoking a grant stops every access to its blocks before it returns
            (producer-served PUSH planes): no grace period needed.
        offerable: consumers read it one-sidedly: announced entries can be offered on it.
        max_bytes: the largest transfer, bytes (None: no limit); a larger entry is refused with
            the terminal NACK_BAD_REQUEST.
        endpoint: the plane's declaration for Welcome (``DataTransport.endpoint()``).
        reachable: whether a consumer whose Hello carried ``locality`` for this plane can reach
            it (``DataTransport.reachable``); must be cheap.
    """

    describe: Describe
    revocable: bool = False
    offerable: bool = False
    max_bytes: int | None = None
    endpoint: bytes = b""
    reachable: Callable[[bytes], bool] = _always


@dataclass
class PeerState:
    """One consumer connection that said Hello: its session, negotiated version and plane, and
    the identity its pins are charged to (CURVE key, else the session id). ECTP v2 §10:
    ``offers`` (granted in the Welcome) and ``anchor`` (the ``t`` of its newest ``Sync`` and when
    it was received); ``node_id``: the consumer's ``Hello.node_id`` (an announcement may name
    it, or ``identity``, as the one session to offer to). ECTP v2 §11: ``renew_ack`` (granted:
    every ``Renew`` is answered with a ``RenewAck``)."""

    peer: Any
    session_id: str
    version: int
    plane: str
    identity: str
    offers: bool = False
    anchor: tuple[float, float] | None = None
    node_id: str = ""
    renew_ack: bool = False

    def features(self) -> tuple[str, ...]:
        """``Welcome.features`` of the session: ``DoneBatch`` taken (v2), offers and confirmed
        renewals if granted."""
        return tuple(f for f, on in ((FEATURE_DONES, self.version >= 2),
                                     (FEATURE_OFFERS, self.offers),
                                     (FEATURE_RENEW_ACK, self.renew_ack)) if on)


@dataclass
class GrantRecord:
    """One live grant: who holds it, what it pins and charges, its lease deadline, the grant and
    its ack (answered again byte for byte to a duplicate request; ``b""`` until one asks)."""

    key: tuple[str, str, int]
    peer: Any
    identity: str
    entry_id: int
    runs: tuple[Run, ...]
    nbytes: int
    pinned_bytes: int
    deadline: float
    plane: str
    grant: Grant
    issued: float
    ack: bytes = b""


@dataclass(frozen=True)
class GrantView:
    """A live grant as :meth:`ProducerSession.grants` reports it: a read-only copy (``key``,
    ``peer``, charged ``identity``, ``entry_id``, ``nbytes``, ``pinned_bytes``, lease
    ``deadline`` in session seconds, ``plane`` and ``plane_grant``)."""

    key: tuple[str, str, int]
    peer: Any
    identity: str
    entry_id: int
    nbytes: int
    pinned_bytes: int
    deadline: float
    plane: str
    plane_grant: bytes


@dataclass(frozen=True)
class Answer:
    """How one entry is answered: ``status`` with ``detail``; on OK either ``grant`` (pinned under
    a lease; ``record`` is its :class:`GrantRecord`, possibly a live one answered again) or
    ``data`` (inline: no pin). ``cmds``: effects to perform before the answer is sent."""

    status: Status
    detail: str = ""
    grant: Grant | None = None
    data: bytes = b""
    record: GrantRecord | None = None
    cmds: tuple[Command, ...] = ()

    def item(self, mm_hash: str) -> AckItem:
        return AckItem(mm_hash=mm_hash, status=self.status, grant=self.grant, data=self.data,
                       detail=self.detail[:1000])


@dataclass
class GrantTable:
    """The live grants of a producer session (module docstring) and how one entry is answered.

    Args:
        settings: lease_s, budget_bytes (None: a quarter of the region), grace_s,
            inline_max_bytes.
        store: the producer's block store. ledger: where pins are charged.
        planes: the plane facts by name. rng: source of grant ids. read: inline bytes (None:
            never inline). stats / emit: the session's counters and observer.
    """

    settings: ProducerSettings
    store: BlockStore
    ledger: PinLedger
    planes: dict[str, PlaneFacts]
    rng: random.Random
    read: ReadBytes | None
    stats: dict[str, int]
    emit: Emit
    _grants: dict[tuple[str, str, int], GrantRecord] = field(default_factory=dict)
    _live: dict[tuple[str, str], int] = field(default_factory=dict)  # (session, mm) -> grant id
    _by_session: dict[str, dict[int, tuple[str, str, int]]] = field(default_factory=dict)

    @property
    def budget_bytes(self) -> int:
        b = self.settings.budget_bytes
        return b if b is not None else self.store.region_bytes // 4

    def __len__(self) -> int:
        return len(self._grants)

    def __iter__(self) -> Iterator[GrantRecord]:
        return iter(list(self._grants.values()))

    def keys_of(self, session_id: str) -> list[tuple[str, str, int]]:
        return list(self._by_session.get(session_id, {}).values())

    def live_key(self, session_id: str, mm_hash: str) -> int | None:
        return self._live.get((session_id, mm_hash))

    def renew(self, session_id: str, grant_ids: Sequence[int], extend_s: float,
              now: float) -> tuple[list[int], float]:
        """Extend the leases of ``session_id``'s grants ``grant_ids`` to at least ``now +
        extend_s`` (at most ``lease_s`` from now, never shorter than they were; other grant ids
        are ignored).

        Returns:
            The grant ids renewed (live grants of the session, in the order named, each once)
            and the extension applied, seconds: what a ``RenewAck`` states (ECTP v2 §11: each
            named lease now runs at least that long past ``now``, the moment the ``Renew`` was
            received).
        """
        ext = max(0.0, min(float(extend_s), self.settings.lease_s))  # NaN: 0
        mine = self._by_session.get(session_id, {})
        renewed: dict[int, None] = {}
        for gid in grant_ids[:4096]:
            key = mine.get(gid)
            if key is not None and gid not in renewed:
                g = self._grants[key]
                g.deadline = max(g.deadline, now + ext)
                renewed[gid] = None
        return list(renewed), ext

    def on_renew(self, state: PeerState, msg: Renew, now: float) -> list[Command]:
        """A ``Renew`` of ``state``'s session (:meth:`renew`), answered by a ``RenewAck`` when
        the session was granted ``"renew_ack"`` (ECTP v2 §11), else unanswered (v1 §4.6)."""
        renewed, ext = self.renew(state.session_id, msg.grant_ids, msg.extend_s, now)
        if not state.renew_ack:
            return []
        return [Send(state.peer, encode(RenewAck(v=state.version, session_id=state.session_id,
                                                 grant_ids=renewed, extend_s=ext)))]

    def expired(self, now: float) -> list[GrantRecord]:
        return [g for g in self._grants.values() if g.deadline <= now]

    # -- answering one entry -------------------------------------------------------------------
    def answer(self, peer: Any, state: PeerState, mm_hash: str, now: float, *,
               inline_max: int = 0) -> Answer:
        """Answer a request of ``state``'s session for ``mm_hash`` (its frame checks passed).

        In order (ECTP v1 §8.2; v2 adds inline): a live grant for the same (session, mm_hash)
        is answered again (no second pin); entry present (MISSING) and ready (NOT_READY); an
        entry of at most ``min(inline_max, inline_max_bytes)`` bytes is answered inline; the
        entry larger than the whole pin budget or the plane's largest transfer (BAD_REQUEST,
        terminal); the budget (BUSY); a plane able to describe the blocks within the wire limit
        (INTERNAL). Otherwise the entry is pinned under a lease of ``lease_s`` from ``now``.
        """
        sid, plane = state.session_id, state.plane
        live = self._live.get((sid, mm_hash))
        if live is not None:  # duplicate request: same grant, no second pin
            rec = self._grants[(sid, mm_hash, live)]
            return Answer(Status.OK, grant=rec.grant, record=rec)
        entry = self.store.get(mm_hash)
        if entry is None:
            return Answer(Status.NACK_MISSING, "not in this producer's cache")
        if not entry.ready:
            return Answer(Status.NACK_NOT_READY, "entry allocated, save not landed yet")
        limit_inline = min(inline_max, self.settings.inline_max_bytes)  # 0 (v1): never
        if self.read is not None and limit_inline > 0 and entry.nbytes <= limit_inline:
            data = self._read_inline(mm_hash, entry.runs, entry.nbytes)
            if data is not None:
                self.stats["inline"] += 1
                return Answer(Status.OK, data=data)
        pinned = entry.num_blocks * self.store.block_bytes
        budget = self.budget_bytes
        if pinned > budget:  # terminal: waiting cannot help
            return Answer(Status.NACK_BAD_REQUEST, f"entry needs {pinned} bytes pinned, more "
                          f"than this consumer's whole pin budget of {budget} bytes: it can "
                          f"never be granted (raise the producer's budget_bytes)")
        facts = self.planes.get(plane)
        if facts is None:
            return Answer(Status.NACK_INTERNAL, f"plane {plane} not available")
        if facts.max_bytes is not None and entry.nbytes > facts.max_bytes:  # terminal as well
            return Answer(Status.NACK_BAD_REQUEST, f"entry of {entry.nbytes} bytes exceeds the "
                          f"{plane} plane's largest transfer ({facts.max_bytes} bytes)")
        used = self.ledger.charged(state.identity)
        if used + pinned > budget:
            return Answer(Status.NACK_BUSY, f"pin budget: {used}+{pinned} > {budget} bytes")
        entry = self.store.pin_if_ready(mm_hash)
        assert entry is not None
        try:
            plane_grant = facts.describe(entry.runs, entry.nbytes)
        except Exception as e:  # a plane bug must not leak a pin or kill the node
            self.store.unpin(entry.mm_hash, entry.entry_id)
            log.exception("plane %s failed to describe a grant", plane)
            return Answer(Status.NACK_INTERNAL, f"plane error: {type(e).__name__}")
        if len(plane_grant) > MAX_GRANT_BYTES:  # the consumer could not decode it
            self.store.unpin(entry.mm_hash, entry.entry_id)
            log.error("plane %s described a grant of %d bytes (limit %d) for %d runs", plane,
                      len(plane_grant), MAX_GRANT_BYTES, len(entry.runs))
            return Answer(Status.NACK_INTERNAL, f"grant of {len(plane_grant)} bytes for "
                          f"{len(entry.runs)} runs exceeds the wire limit of {MAX_GRANT_BYTES} "
                          f"bytes", cmds=(Revoke(plane, plane_grant),))
        gid = self.rng.getrandbits(63)
        key = (sid, mm_hash, gid)
        grant = Grant(grant_id=gid, entry_bytes=entry.nbytes, num_blocks=entry.num_blocks,
                      block_bytes=self.store.block_bytes, lease_s=float(self.settings.lease_s),
                      plane=plane, plane_grant=plane_grant)
        rec = GrantRecord(key, peer, state.identity, entry.entry_id, entry.runs, entry.nbytes,
                          pinned, now + self.settings.lease_s, plane, grant, now)
        self._grants[key] = rec
        self._live[(sid, mm_hash)] = gid
        self._by_session.setdefault(sid, {})[gid] = key
        self.ledger.charge(state.identity, pinned)
        self.stats["grants"] += 1
        fields = self._fields(rec)
        log.debug("grant issued: %d bytes in %d runs over %s", entry.nbytes, len(entry.runs),
                  plane, extra=fields)
        self.emit("grant_issued", {**fields, "nbytes": entry.nbytes, "plane": plane,
                                   "descriptors": len(entry.runs)})
        return Answer(Status.OK, grant=grant, record=rec)

    def _read_inline(self, mm_hash: str, runs: tuple[Run, ...], nbytes: int) -> bytes | None:
        assert self.read is not None
        try:
            data = self.read(runs, nbytes)
        except Exception:  # a region bug must not kill the node: answer with a grant
            log.exception("reading %d bytes of %s for an inline answer failed", nbytes,
                          mm_hash[:12])
            return None
        if len(data) != nbytes:
            log.error("inline read of %s returned %d bytes, expected %d", mm_hash[:12],
                      len(data), nbytes)
            return None
        return data

    # -- ending a grant --------------------------------------------------------------------------
    def end(self, key: tuple[str, str, int], why: str, now: float | None) -> list[Command]:
        """End a grant exactly once and revoke it on its plane; ``why`` is ``completed``,
        ``abandoned``, ``expired`` or ``released_peer_down``; ``now`` None at shutdown (pins go
        at once). Unknown keys are counted (``late_signals``) and change nothing."""
        g = self._grants.pop(key, None)
        if g is None:
            self.stats["late_signals"] += 1
            return []
        self._live.pop(key[:2], None)
        mine = self._by_session.get(key[0])
        if mine is not None:
            mine.pop(key[2], None)
            if not mine:
                del self._by_session[key[0]]
        if why == "completed" or now is None:
            self.ledger.unpin(key[1], g.entry_id, g.identity, g.pinned_bytes)
        else:
            facts = self.planes.get(g.plane)
            if facts is not None and facts.revocable:
                until = now
            else:  # a consumer that missed a drop (a frozen process) may read until the lease
                start = max(now, g.deadline) if why == "released_peer_down" else now
                until = start + max(0.0, self.settings.grace_s)
            self.ledger.hold_back(until, key[1], g.entry_id, g.identity, g.pinned_bytes)
        self.stats[why] += 1
        fields = self._fields(g)
        log.debug("grant ended: %s", why, extra=fields)
        self.emit("grant_ended", {**fields, "why": why, "nbytes": g.nbytes, "plane": g.plane,
                                  "held_s": None if now is None else max(0.0, now - g.issued)})
        return [Revoke(g.plane, g.grant.plane_grant)]

    @staticmethod
    def _fields(g: GrantRecord) -> dict[str, Any]:
        return {"peer": g.identity, "session_id": g.key[0], "mm_hash": g.key[1][:12],
                "grant_id": g.key[2]}

    def views(self) -> list[GrantView]:
        return [GrantView(g.key, g.peer, g.identity, g.entry_id, g.nbytes, g.pinned_bytes,
                          g.deadline, g.plane, g.grant.plane_grant)
                for g in self._grants.values()]

    def check(self, peers: dict[str, Any]) -> dict[tuple[str, int], int]:
        """Assert the table's indices agree (``peers``: session id → peer); returns the pins it
        holds per ``(mm_hash, entry_id)``."""
        pins: dict[tuple[str, int], int] = {}
        for key, g in self._grants.items():
            assert self._live.get(key[:2]) == key[2], f"grant {key} not live"
            assert self._by_session.get(key[0], {}).get(key[2]) == key, f"grant {key} unindexed"
            assert peers.get(key[0]) == g.peer, f"grant {key} has no peer"
            pins[(key[1], g.entry_id)] = pins.get((key[1], g.entry_id), 0) + 1
        assert len(self._live) == len(self._grants), f"{len(self._live)} live index entries"
        indexed = sum(len(v) for v in self._by_session.values())
        assert indexed == len(self._grants), f"{indexed} grants indexed by session"
        return pins


def notif_for(key: tuple[str, str, int]) -> bytes:
    """Completion notification for a grant: ``b"<grant_id>:<session_id>:<mm_hash>"`` (ASCII)."""
    return f"{key[2]}:{key[0]}:{key[1]}".encode()


def parse_notif(notif: bytes) -> tuple[str, str, int] | None:
    """Inverse of :func:`notif_for`; None for anything malformed."""
    try:
        gid, sid, mm = notif.decode("utf-8").split(":", 2)
    except (UnicodeDecodeError, ValueError):
        return None
    if not (gid.isascii() and gid.isdigit()) or not SESSION_ID.fullmatch(sid):
        return None
    return (sid, mm, int(gid))
