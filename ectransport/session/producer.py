"""ProducerSession: the sans-I/O state machine that grants, pins and unpins encoder-cache entries.

One ProducerSession serves every consumer of a producer node. Feed it decoded-or-raw frames, data-
plane notifications, peer-down events and the time; it returns commands (:mod:`.commands`).

Grant lifecycle (per grant key ``(session_id, mm_hash, grant_id)``)::

    XferReq ──► [checks] ──► PINNED under lease ──► unpinned exactly once, on the first of:
                                                     data-plane notification | XferDone |
                                                     lease expiry (poll) | consumer down

Checks on an XferReq, in order (each failure is a NACK and takes no pin): Hello done for this peer
(BAD_REQUEST), frame version = negotiated (VERSION), session id non-empty and bound to this peer
(BAD_REQUEST), compatibility hash (INCOMPAT), a live grant for the same (session, mm_hash) is
answered again without a second pin, entry present (MISSING) and ready (NOT_READY), the entry
larger than the peer's whole pin budget (BAD_REQUEST: terminal, it can never be granted), the
peer's pinned-bytes budget (BUSY), a grant that fits the wire (INTERNAL).

**Grace period** (ECTP v1 §8.4). On a plane whose grants cannot be revoked (one-sided READ, e.g.
NIXL: the consumer reads the region without asking), a grant that ended other than by a confirmed
completion (lease expiry, ``XferDone(ok=False)``, consumer down) keeps its pin for ``grace_s`` more
seconds — after a consumer-down, counted from the later of now and the lease deadline, since a
consumer that has not noticed the drop (a frozen process) may still use the grant until then: its
blocks are not re-allocated while a consumer may still be reading them. On planes that serve each
transfer themselves (PUSH: tcp, ucx, shm), ``Revoke`` stops all access before it returns; their
pin is dropped at the next :meth:`ProducerSession.poll`, after the node performed the ``Revoke``.
Held-back pins stay charged to the consumer's pin budget until they are dropped, so a consumer
cannot pin more than its budget by giving grants back. Shutdown releases at once (the planes
close next). The consumer's own rule (it uses a grant only inside ``request sent + lease −
margin`` on its clock) already keeps wrong bytes from being reported; the grace period is the
producer's half of the same contract.
"""

from __future__ import annotations

import heapq
import logging
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ectransport.protocol import (
    SUPPORTED_VERSIONS,
    FrameError,
    Grant,
    Hello,
    Nack,
    Renew,
    Status,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)
from ectransport.protocol.codec import peek_ids
from ectransport.protocol.messages import MAX_GRANT_BYTES
from ectransport.session.commands import Command, Revoke, Send
from ectransport.store import BlockStore, Run

log = logging.getLogger("ectransport.session.producer")

#: Session ids are opaque to the producer but must not contain ':' (the notification separator).
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

Describe = Callable[[Sequence[Run], int], bytes]


@dataclass(frozen=True)
class ProducerConfig:
    """Producer-side settings (seconds, bytes).

    Attributes:
        node_id: this node's name, sent in Welcome.
        compat_hash: see :func:`ectransport.protocol.compat_hash`.
        planes: data planes offered, best first.
        versions: protocol versions spoken.
        lease_s: pin lease of a grant [30 s, as vLLM's ECCPUConnector].
        budget_bytes: max bytes pinned per consumer identity; None = a quarter of the region.
        grace_s: how long the blocks of a grant that ended without a confirmed completion stay
            pinned before they may be re-allocated [5 s; see the module docstring].
    """

    node_id: str
    compat_hash: str
    planes: tuple[str, ...] = ("nixl",)
    versions: tuple[int, ...] = SUPPORTED_VERSIONS
    lease_s: float = 30.0
    budget_bytes: int | None = None
    grace_s: float = 5.0


@dataclass
class _Peer:
    peer: Any
    session_id: str
    version: int
    plane: str
    identity: str  # budget / quarantine identity: CURVE key, else the session id
    grants: set[tuple[str, str, int]] = field(default_factory=set)
    by_gid: dict[int, tuple[str, str, int]] = field(default_factory=dict)  # for Renew


@dataclass
class _Grant:
    key: tuple[str, str, int]
    peer: Any
    identity: str
    entry_id: int
    runs: tuple[Run, ...]
    nbytes: int
    pinned_bytes: int
    deadline: float
    ack: bytes
    plane: str
    plane_grant: bytes
    issued: float = 0.0  # when the grant was issued (observability only)


@dataclass(frozen=True)
class GrantView:
    """A live grant as :meth:`ProducerSession.grants` reports it: a read-only copy.

    Attributes:
        key: ``(session_id, mm_hash, grant_id)``.
        peer: the control-plane peer it was granted to.
        identity: the budget identity charged (CURVE key, else the session id).
        entry_id: the pinned entry's allocation id in the store.
        nbytes: payload bytes; ``pinned_bytes``: whole blocks charged to ``identity``.
        deadline: when the lease ends (session time, seconds; renewals move it).
        plane / plane_grant: the data plane and its grant bytes (as ``Revoke`` will name them).
    """

    key: tuple[str, str, int]
    peer: Any
    identity: str
    entry_id: int
    nbytes: int
    pinned_bytes: int
    deadline: float
    plane: str
    plane_grant: bytes


class ProducerSession:
    """Grants access to entries of ``store`` (see module docstring).

    Args:
        config: :class:`ProducerConfig`.
        store: the producer's block store (shared with the node, which serialises access).
        describers: plane name → function giving the ``plane_grant`` for a list of runs.
        rng: source of grant ids (default: the OS CSPRNG; tests pass a seeded Random).
        observer: optional ``(event, fields) -> None`` told what happened, for metrics and logs
            (called synchronously; must be cheap and must not call back into the session):
            ``grant_issued`` / ``grant_ended`` (``why``: completed, abandoned, expired,
            released_peer_down; ``held_s``) / ``nack_sent`` (``status``) / ``lease_expired``;
            fields carry ``peer``, ``session_id``, ``mm_hash``, ``grant_id``, ``nbytes``,
            ``plane`` where known.
        reachable: ``(plane, locality) -> bool``: whether that plane can reach a consumer whose
            Hello carried ``locality`` for it (``DataTransport.reachable``); default: always.
        endpoint: ``(plane) -> bytes``: the plane's declaration for Welcome
            (``DataTransport.endpoint``); default ``b""``.
        max_bytes: ``(plane) -> int | None``: the plane's ``max_transfer_bytes`` (None: no
            limit); a larger entry is refused with the terminal NACK_BAD_REQUEST.
        revocable: ``(plane) -> bool``: whether revoking a grant on that plane stops every access
            to its blocks before it returns (producer-served PUSH planes); those grants need no
            grace period. Default: no plane is (the safe assumption).
    """

    def __init__(
        self,
        config: ProducerConfig,
        store: BlockStore,
        describers: dict[str, Describe],
        *,
        rng: random.Random | None = None,
        observer: Callable[[str, dict[str, Any]], None] | None = None,
        reachable: Callable[[str, bytes], bool] | None = None,
        endpoint: Callable[[str], bytes] | None = None,
        revocable: Callable[[str], bool] | None = None,
        max_bytes: Callable[[str], int | None] | None = None,
    ):
        self.config = config
        self._max_bytes = max_bytes or (lambda plane: None)
        self._revocable = revocable or (lambda plane: False)
        self._reachable = reachable or (lambda plane, locality: True)
        self._endpoint = endpoint or (lambda plane: b"")
        #: pins of ended grants held back: (until, mm_hash, entry_id, identity, pinned_bytes);
        #: they stay charged to the identity's budget until they are dropped
        self._grace: list[tuple[float, str, int, str, int]] = []
        self.store = store
        self.describers = describers
        self._rng = rng or random.SystemRandom()
        self._peers: dict[Any, _Peer] = {}
        self._sessions: dict[str, Any] = {}  # session_id -> peer
        self._grants: dict[tuple[str, str, int], _Grant] = {}
        self._live: dict[tuple[str, str], int] = {}  # (session, mm_hash) -> grant id
        self._pinned_by: dict[str, int] = {}  # identity -> pinned bytes
        self.budget_bytes = (
            config.budget_bytes if config.budget_bytes is not None else store.region_bytes // 4
        )
        self.stats: dict[str, int] = {
            "grants": 0,
            "completed": 0,
            "abandoned": 0,
            "expired": 0,
            "released_peer_down": 0,
            "bad_frames": 0,
            "late_signals": 0,
        }
        self.nacks: dict[Status, int] = {}
        self.observer = observer
        self._now: float | None = None  # latest event time seen (observability only)

    # -- queries -------------------------------------------------------------------------------
    @property
    def active_grants(self) -> int:
        return len(self._grants)

    def pinned_bytes(self, identity: str | None = None) -> int:
        if identity is None:
            return sum(self._pinned_by.values())
        return self._pinned_by.get(identity, 0)

    def pinned_by_identity(self) -> dict[str, int]:
        """Pinned bytes per consumer identity (CURVE key, else session id); a copy."""
        return dict(self._pinned_by)

    def grant_keys(self) -> list[tuple[str, str, int]]:
        return list(self._grants)

    def grants(self) -> list[GrantView]:
        """Every live grant (not those ended and held back for their grace period), as copies."""
        return [GrantView(g.key, g.peer, g.identity, g.entry_id, g.nbytes, g.pinned_bytes,
                          g.deadline, g.plane, g.plane_grant) for g in self._grants.values()]

    @property
    def grace_pins(self) -> int:
        """Pins held back after grants that ended without a confirmed completion (module
        docstring); still charged to their consumers' budgets."""
        return len(self._grace)

    def check_invariants(self) -> None:
        """Assert the session's bookkeeping is consistent (for tests and debugging): every grant
        is indexed by its peer and its (session, mm_hash) and by nothing else, every session id
        names the peer that holds it, every pinned byte is accounted to an identity, and every
        grant and grace pin holds a pin of a live entry of the same id.

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        pins: dict[tuple[str, int], int] = {}
        by_identity: dict[str, int] = {}
        for key, g in self._grants.items():
            assert self._live.get(key[:2]) == key[2], f"grant {key} not live"
            st = self._peers.get(g.peer)
            assert st is not None and key in st.grants, f"grant {key} has no peer"
            by_identity[g.identity] = by_identity.get(g.identity, 0) + g.pinned_bytes
            pins[(key[1], g.entry_id)] = pins.get((key[1], g.entry_id), 0) + 1
        assert len(self._live) == len(self._grants), f"{len(self._live)} live index entries"
        indexed = sum(len(st.grants) for st in self._peers.values())
        assert indexed == len(self._grants), f"{indexed} grants indexed by peers"
        for sid, peer in self._sessions.items():
            st = self._peers.get(peer)
            assert st is not None and st.session_id == sid, f"session {sid} has no peer"
        assert len(self._sessions) == len(self._peers), "a peer without its session id"
        for _, mm_hash, entry_id, identity, nbytes in self._grace:
            pins[(mm_hash, entry_id)] = pins.get((mm_hash, entry_id), 0) + 1
            by_identity[identity] = by_identity.get(identity, 0) + nbytes
        assert by_identity == self._pinned_by, f"budget {self._pinned_by} != {by_identity}"
        for (mm_hash, entry_id), n in pins.items():
            e = self.store.get(mm_hash)
            assert e is not None and e.entry_id == entry_id and e.pins >= n, (
                f"entry {mm_hash[:12]} ({entry_id}) lacks {n} pins")

    # -- events --------------------------------------------------------------------------------
    def on_frame(self, peer: Any, data: bytes, now: float, user: str = "") -> list[Command]:
        """A frame from ``peer`` (``user`` = its authenticated identity, "" if none)."""
        self._now = now
        state = self._peers.get(peer)
        versions = (state.version,) if state else self.config.versions
        try:
            msg = decode(data, versions=versions)
        except FrameError as e:
            self.stats["bad_frames"] += 1
            return [self._reject(peer, e, data)]
        match msg:
            case Hello():
                return self._on_hello(peer, msg, user)
            case XferReq():
                return self._on_req(peer, state, msg, now)
            case XferDone():
                if state is None or msg.session_id != state.session_id:
                    return [
                        self._nack(peer, Status.NACK_BAD_REQUEST, "XferDone for a foreign session")
                    ]
                why = "completed" if msg.ok else "abandoned"
                return self._release((msg.session_id, msg.mm_hash, msg.grant_id), why, now)
            case Renew():
                if state is None or msg.session_id != state.session_id:
                    return [
                        self._nack(peer, Status.NACK_BAD_REQUEST, "Renew for a foreign session")
                    ]
                ext = max(0.0, min(float(msg.extend_s), self.config.lease_s))
                for gid in msg.grant_ids[:4096]:
                    key = state.by_gid.get(gid)
                    if key is not None:
                        g = self._grants[key]
                        g.deadline = max(g.deadline, now + ext)
                return []
            case _:
                return [
                    self._nack(peer, Status.NACK_BAD_REQUEST, f"unexpected {type(msg).__name__}")
                ]

    def on_notification(self, notif: bytes, now: float) -> list[Command]:
        """A data-plane completion notification (``notif`` bytes as built by :func:`notif_for`)."""
        self._now = now
        key = parse_notif(notif)
        return self._release(key, "completed", now) if key is not None else []

    def on_peer_down(self, peer: Any, now: float) -> list[Command]:
        """The consumer went away: release its grants at once instead of waiting for leases."""
        state = self._peers.pop(peer, None)
        if state is None:
            return []
        self._sessions.pop(state.session_id, None)
        cmds: list[Command] = []
        for key in list(state.grants):
            cmds += self._release(key, "released_peer_down", now)
        return cmds

    def poll(self, now: float) -> list[Command]:
        """Sweep every lease (an expired grant ends exactly once) and every grace period (its
        pin is dropped)."""
        self._now = now
        cmds: list[Command] = []
        while self._grace and self._grace[0][0] <= now:
            _, mm_hash, entry_id, identity, nbytes = heapq.heappop(self._grace)
            self.store.unpin(mm_hash, entry_id)
            self._uncharge(identity, nbytes)
        for key in [k for k, g in self._grants.items() if g.deadline <= now]:
            g = self._grants[key]
            fields = {
                "peer": g.identity,
                "session_id": key[0],
                "mm_hash": key[1][:12],
                "grant_id": key[2],
            }
            log.warning(
                "lease expired: session=%s mm_hash=%s grant=%d",
                key[0][:8],
                key[1][:12],
                key[2],
                extra=fields,
            )
            self._emit("lease_expired", fields, nbytes=g.nbytes, plane=g.plane)
            cmds += self._release(key, "expired", now)
        return cmds

    def close(self) -> list[Command]:
        """Release every grant and drop every grace pin (shutdown: the planes close next, so
        nothing can be served from the blocks any more)."""
        cmds: list[Command] = []
        for key in list(self._grants):
            cmds += self._release(key, "released_peer_down", None)
        for _, mm_hash, entry_id, identity, nbytes in self._grace:
            self.store.unpin(mm_hash, entry_id)
            self._uncharge(identity, nbytes)
        self._grace.clear()
        return cmds

    # -- handlers ------------------------------------------------------------------------------
    def _on_hello(self, peer: Any, msg: Hello, user: str) -> list[Command]:
        cfg = self.config

        def welcome(status: Status, version: int = 0, plane: str = "", detail: str = "",
                    endpoint: bytes = b"") -> Send:
            if status is not Status.OK:
                self.nacks[status] = self.nacks.get(status, 0) + 1
                self._emit(
                    "nack_sent",
                    {
                        "peer": user or msg.session_id,
                        "session_id": msg.session_id,
                        "mm_hash": "",
                        "grant_id": -1,
                    },
                    status=status.name,
                    detail=detail,
                )
            return Send(
                peer,
                encode(
                    Welcome(
                        v=max(cfg.versions),
                        session_id=msg.session_id,
                        node_id=cfg.node_id,
                        status=status,
                        version=version,
                        plane=plane,
                        versions=list(cfg.versions),
                        planes=list(cfg.planes),
                        compat_hash=cfg.compat_hash,
                        detail=detail[:1000],
                        endpoint=endpoint,
                    )
                ),
            )

        if not _SESSION_ID.fullmatch(msg.session_id):
            return [
                welcome(
                    Status.NACK_BAD_REQUEST,
                    detail="session id must be 1-128 characters of [A-Za-z0-9_-]",
                )
            ]
        owner = self._sessions.get(msg.session_id)
        # a reconnect (new route) may take its session over only with the same identity
        if (
            owner is not None
            and owner != peer
            and self._peers[owner].identity != (user or msg.session_id)
        ):
            return [welcome(Status.NACK_BAD_REQUEST, detail="session id bound to another peer")]
        if msg.compat_hash != cfg.compat_hash:
            return [
                welcome(
                    Status.NACK_INCOMPAT,
                    detail=(
                        f"compatibility hash mismatch: producer {cfg.compat_hash[:12]}, "
                        f"consumer {msg.compat_hash[:12]} (model/dtype/hidden/layout differ)"
                    ),
                )
            ]
        common = set(cfg.versions) & set(msg.versions)
        if not common:
            return [
                welcome(
                    Status.NACK_VERSION,
                    detail=(
                        f"no common protocol version: producer speaks {sorted(cfg.versions)}, "
                        f"consumer {sorted(msg.versions)}"
                    ),
                )
            ]
        common_planes = [p for p in msg.planes if p in cfg.planes]
        plane = next((p for p in common_planes if self._can_reach(p, msg.localities.get(p, b""))),
                     None)
        if plane is None and common_planes:
            return [
                welcome(
                    Status.NACK_INCOMPAT,
                    detail=(
                        f"no common data plane can reach this consumer: {common_planes} are "
                        f"common, but each is out of reach (another host or namespace); "
                        f"producer offers {list(cfg.planes)}, consumer offers {list(msg.planes)}"
                    ),
                )
            ]
        if plane is None:
            return [
                welcome(
                    Status.NACK_INCOMPAT,
                    detail=(
                        f"no common data plane: producer offers {list(cfg.planes)}, "
                        f"consumer offers {list(msg.planes)}"
                    ),
                )
            ]
        cmds: list[Command] = []
        now = self._now if self._now is not None else 0.0
        if owner is not None and owner != peer:
            cmds += self.on_peer_down(owner, now)  # reconnect: the old route's grants end
        old = self._peers.get(peer)
        if old is not None and old.session_id != msg.session_id:
            cmds += self.on_peer_down(peer, now)  # a new session on this connection supersedes
        state = self._peers.get(peer)
        if state is None:
            state = _Peer(peer, msg.session_id, max(common), plane, user or msg.session_id)
            self._peers[peer] = state
            self._sessions[msg.session_id] = peer
        try:
            endpoint = self._endpoint(state.plane)
        except Exception as e:  # a plane bug must not kill the node
            log.exception("plane %s failed to declare its endpoint", state.plane)
            return [*cmds, welcome(Status.NACK_INTERNAL, detail=f"plane error: {type(e).__name__}")]
        return [*cmds, welcome(Status.OK, state.version, state.plane, endpoint=endpoint)]

    def _on_req(self, peer: Any, state: _Peer | None, msg: XferReq, now: float) -> list[Command]:
        cfg = self.config

        def nack(status: Status, detail: str) -> list[Command]:
            self.nacks[status] = self.nacks.get(status, 0) + 1
            self._emit(
                "nack_sent",
                {
                    "peer": state.identity if state else str(peer),
                    "session_id": msg.session_id,
                    "mm_hash": msg.mm_hash[:12],
                    "grant_id": -1,
                },
                status=status.name,
                detail=detail,
            )
            ack = XferAck(
                v=msg.v,
                session_id=msg.session_id,
                mm_hash=msg.mm_hash,
                status=status,
                grant=None,
                detail=detail,
            )
            return [Send(peer, encode(ack))]

        if state is None:
            return nack(Status.NACK_BAD_REQUEST, "send Hello first")
        if not msg.session_id:
            return nack(Status.NACK_BAD_REQUEST, "empty session id")
        if msg.session_id != state.session_id:
            return nack(Status.NACK_BAD_REQUEST, "session id is not this connection's session")
        if msg.compat_hash != cfg.compat_hash:
            return nack(Status.NACK_INCOMPAT, "compatibility hash mismatch")
        live = self._live.get((msg.session_id, msg.mm_hash))
        if live is not None:  # duplicate request: same grant, no second pin
            return [Send(peer, self._grants[(msg.session_id, msg.mm_hash, live)].ack)]
        entry = self.store.get(msg.mm_hash)
        if entry is None:
            return nack(Status.NACK_MISSING, "not in this producer's cache")
        if not entry.ready:
            return nack(Status.NACK_NOT_READY, "entry allocated, save not landed yet")
        pinned_bytes = entry.num_blocks * self.store.block_bytes
        if pinned_bytes > self.budget_bytes:  # terminal: waiting cannot help
            return nack(
                Status.NACK_BAD_REQUEST,
                f"entry needs {pinned_bytes} bytes pinned, more than this consumer's whole pin "
                f"budget of {self.budget_bytes} bytes: it can never be granted (raise the "
                f"producer's budget_bytes)",
            )
        limit = self._max_bytes(state.plane)
        if limit is not None and entry.nbytes > limit:  # terminal as well
            return nack(
                Status.NACK_BAD_REQUEST,
                f"entry of {entry.nbytes} bytes exceeds the {state.plane} plane's largest "
                f"transfer ({limit} bytes)",
            )
        used = self._pinned_by.get(state.identity, 0)
        if used + pinned_bytes > self.budget_bytes:
            return nack(
                Status.NACK_BUSY, f"pin budget: {used}+{pinned_bytes} > {self.budget_bytes} bytes"
            )
        describe = self.describers.get(state.plane)
        if describe is None:
            return nack(Status.NACK_INTERNAL, f"plane {state.plane} not available")
        entry = self.store.pin_if_ready(msg.mm_hash)
        assert entry is not None
        try:
            plane_grant = describe(entry.runs, entry.nbytes)
        except Exception as e:  # a plane bug must not leak a pin or kill the node
            self.store.unpin(entry.mm_hash, entry.entry_id)
            log.exception("plane %s failed to describe a grant", state.plane)
            return nack(Status.NACK_INTERNAL, f"plane error: {type(e).__name__}")
        if len(plane_grant) > MAX_GRANT_BYTES:  # the consumer could not decode it
            self.store.unpin(entry.mm_hash, entry.entry_id)
            log.error("plane %s described a grant of %d bytes (limit %d) for %d runs",
                      state.plane, len(plane_grant), MAX_GRANT_BYTES, len(entry.runs))
            return [Revoke(state.plane, plane_grant), *nack(
                Status.NACK_INTERNAL,
                f"grant of {len(plane_grant)} bytes for {len(entry.runs)} runs exceeds the wire "
                f"limit of {MAX_GRANT_BYTES} bytes",
            )]
        gid = self._rng.getrandbits(63)
        key = (msg.session_id, msg.mm_hash, gid)
        grant = Grant(
            grant_id=gid,
            entry_bytes=entry.nbytes,
            num_blocks=entry.num_blocks,
            block_bytes=self.store.block_bytes,
            lease_s=float(cfg.lease_s),
            plane=state.plane,
            plane_grant=plane_grant,
        )
        ack = encode(
            XferAck(
                v=msg.v,
                session_id=msg.session_id,
                mm_hash=msg.mm_hash,
                status=Status.OK,
                grant=grant,
                detail="",
            )
        )
        self._grants[key] = _Grant(
            key,
            peer,
            state.identity,
            entry.entry_id,
            entry.runs,
            entry.nbytes,
            pinned_bytes,
            now + cfg.lease_s,
            ack,
            state.plane,
            plane_grant,
            now,
        )
        self._live[key[:2]] = gid
        state.grants.add(key)
        state.by_gid[gid] = key
        self._pinned_by[state.identity] = used + pinned_bytes
        self.stats["grants"] += 1
        fields = {
            "peer": state.identity,
            "session_id": msg.session_id,
            "mm_hash": msg.mm_hash[:12],
            "grant_id": gid,
        }
        log.debug(
            "grant issued: %d bytes in %d runs over %s",
            entry.nbytes,
            len(entry.runs),
            state.plane,
            extra=fields,
        )
        self._emit(
            "grant_issued",
            fields,
            nbytes=entry.nbytes,
            plane=state.plane,
            descriptors=len(entry.runs),
        )
        return [Send(peer, ack)]

    # -- helpers -------------------------------------------------------------------------------
    def _release(self, key: tuple[str, str, int], why: str, now: float | None) -> list[Command]:
        """End a grant exactly once and revoke it on its plane. Its pin (and the bytes charged to
        the consumer's budget) go at once after a confirmed completion or at shutdown (``now``
        None); otherwise they are held back (module docstring): on a revocable plane until the
        next :meth:`poll` — after the node performed the ``Revoke``, so no block is re-used while
        the plane may still send it — and on a READ plane for the grace period. Unknown keys are
        no-ops."""
        g = self._grants.pop(key, None)
        if g is None:
            self.stats["late_signals"] += 1
            return []
        self._live.pop(key[:2], None)
        st = self._peers.get(g.peer)
        if st is not None:
            st.grants.discard(key)
            st.by_gid.pop(key[2], None)
        if why == "completed" or now is None:
            self.store.unpin(key[1], g.entry_id)
            self._uncharge(g.identity, g.pinned_bytes)
        else:
            if self._revocable(g.plane):
                until = now
            else:  # a consumer that missed a drop (a frozen process) may read until the deadline
                start = max(now, g.deadline) if why == "released_peer_down" else now
                until = start + max(0.0, self.config.grace_s)
            heapq.heappush(self._grace, (until, key[1], g.entry_id, g.identity, g.pinned_bytes))
        self.stats[why] += 1
        if self.observer is not None or log.isEnabledFor(logging.DEBUG):
            fields = {
                "peer": g.identity,
                "session_id": key[0],
                "mm_hash": key[1][:12],
                "grant_id": key[2],
            }
            held_s = max(0.0, self._now - g.issued) if self._now is not None else None
            log.debug("grant ended: %s", why, extra=fields)
            self._emit(
                "grant_ended", fields, why=why, nbytes=g.nbytes, plane=g.plane, held_s=held_s
            )
        return [Revoke(g.plane, g.plane_grant)]

    def _uncharge(self, identity: str, nbytes: int) -> None:
        left = self._pinned_by.get(identity, 0) - nbytes
        if left > 0:
            self._pinned_by[identity] = left
        else:
            self._pinned_by.pop(identity, None)

    def _can_reach(self, plane: str, locality: bytes) -> bool:
        try:
            return bool(self._reachable(plane, locality))
        except Exception:  # a plane bug must not kill the node: treat it as unreachable
            log.exception("plane %s failed to judge reachability", plane)
            return False

    def _emit(self, event: str, fields: dict[str, Any], **more: Any) -> None:
        if self.observer is not None:
            self.observer(event, {**fields, **more})

    def _version_for(self, peer: Any) -> int:
        state = self._peers.get(peer)
        return state.version if state else max(self.config.versions)

    def _nack(self, peer: Any, status: Status, detail: str) -> Send:
        self.nacks[status] = self.nacks.get(status, 0) + 1
        return Send(peer, encode(Nack(v=self._version_for(peer), status=status, detail=detail)))

    def _reject(self, peer: Any, err: FrameError, data: bytes) -> Send:
        if err.kind == "req":  # answer as an ack so the consumer can attribute it to its request
            sid, mm = peek_ids(data)
            self.nacks[err.status] = self.nacks.get(err.status, 0) + 1
            return Send(
                peer,
                encode(
                    XferAck(
                        v=self._version_for(peer),
                        session_id=sid,
                        mm_hash=mm,
                        status=err.status,
                        grant=None,
                        detail=err.detail[:1000],
                    )
                ),
            )
        return self._nack(peer, err.status, err.detail[:1000])


def notif_for(key: tuple[str, str, int]) -> bytes:
    """Completion notification for a grant: ``b"<grant_id>:<session_id>:<mm_hash>"`` (ASCII)."""
    return f"{key[2]}:{key[0]}:{key[1]}".encode()


def parse_notif(notif: bytes) -> tuple[str, str, int] | None:
    """Inverse of :func:`notif_for`; None for anything malformed."""
    try:
        gid, sid, mm = notif.decode("utf-8").split(":", 2)
    except (UnicodeDecodeError, ValueError):
        return None
    if not (gid.isascii() and gid.isdigit()) or not _SESSION_ID.fullmatch(sid):
        return None
    return (sid, mm, int(gid))
