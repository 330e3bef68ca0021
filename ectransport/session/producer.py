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
margin`` on its own clock) is the other half: ``ectransport.session.fetch``.

**ECTP v2** (``protocols/ectp-v2.md``; a session negotiates it when both sides speak it): a
``ReqBatch`` asks for several entries at once; items whose entry is reserved but not ready wait
at the producer until it is ready (no NACK_NOT_READY and retry backoff); small entries are
answered inline, with their bytes and no grant. See :mod:`.producer_batches`. An entry the producer
*announces* (:meth:`ProducerSession.announce`) is held and offered to the sessions that asked for
offers, so that they read it with no request (ECTP v2 §10): :mod:`.holds`.

The module is split by concept: :mod:`.grants` (the settings, the per-peer and per-grant records,
the notification form of a grant key), :mod:`.producer_state` (the state kept, its invariants, how
one entry is answered and how a grant ends), :mod:`.producer_batches` (v2: batches, waiting
items, inline answers), :mod:`.holds` (v2: announcement holds and offers); here: the v1 frames and
the events.
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

from ectransport.protocol import (
    FEATURE_OFFERS,
    DoneBatch,
    FrameError,
    Hello,
    Renew,
    ReqBatch,
    Status,
    Sync,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)
from ectransport.session.commands import Command, Send
from ectransport.session.grants import (
    SESSION_ID,
    Describe,
    GrantView,
    PeerState,
    ProducerConfig,
    notif_for,
    parse_notif,
)
from ectransport.session.holds import ProducerHolds

log = logging.getLogger("ectransport.session.producer")

__all__ = ["Describe", "GrantView", "ProducerConfig", "ProducerSession", "notif_for",
           "parse_notif"]


class ProducerSession(ProducerHolds):
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
        read: ``(runs, nbytes) -> bytes``: an entry's bytes, for v2 inline answers (called with
            the node's lock held, so a READY entry's blocks are stable); None: never inline.
    """

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
            case ReqBatch():
                return self._on_batch(peer, state, msg, now)
            case Sync():
                return self._on_sync(peer, state, msg, now)
            case DoneBatch():
                if state is None or msg.session_id != state.session_id:
                    return [self._nack(peer, Status.NACK_BAD_REQUEST,
                                       "DoneBatch for a foreign session")]
                cmds: list[Command] = []
                for it in msg.items:  # each exactly as an XferDone
                    if not self._hold_done(it):
                        cmds += self._release((msg.session_id, it.mm_hash, it.grant_id),
                                              "completed" if it.ok else "abandoned", now)
                return cmds
            case XferDone():
                if state is None or msg.session_id != state.session_id:
                    return [
                        self._nack(peer, Status.NACK_BAD_REQUEST, "XferDone for a foreign session")
                    ]
                if self._hold_done(msg):
                    return []
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
        """The consumer went away: release its grants at once instead of waiting for leases, and
        drop its batch items still waiting (unanswered: nobody is left to read the answer)."""
        if peer not in self._peers:
            return []
        self._drop_waiting(peer)
        state = self._peers.pop(peer)
        self._sessions.pop(state.session_id, None)
        cmds: list[Command] = []
        for key in list(state.grants):
            cmds += self._release(key, "released_peer_down", now)
        return cmds

    def poll(self, now: float) -> list[Command]:
        """Sweep every lease (an expired grant ends exactly once), every grace period (its pin
        is dropped) and every waiting batch item (answered if its entry became ready or went
        away unreported, NACK_NOT_READY once its wait is over)."""
        self._now = now
        cmds: list[Command] = self._sweep_waiting(now) if self._wait_heap else []
        if self._holds or self._pending_holds:
            cmds += self._expire_holds(now)
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
        nothing can be served from the blocks any more); waiting batch items are dropped."""
        self._clear_waiting()
        cmds: list[Command] = self._close_holds()
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
                    endpoint: bytes = b"", features: tuple[str, ...] = ()) -> Send:
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
                        features=list(features),
                    )
                ),
            )

        if not SESSION_ID.fullmatch(msg.session_id):
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
            state = PeerState(peer, msg.session_id, max(common), plane, user or msg.session_id)
            self._peers[peer] = state
            self._sessions[msg.session_id] = peer
        try:
            endpoint = self._endpoint(state.plane)
        except Exception as e:  # a plane bug must not kill the node
            log.exception("plane %s failed to declare its endpoint", state.plane)
            return [*cmds, welcome(Status.NACK_INTERNAL, detail=f"plane error: {type(e).__name__}")]
        state.offers = self._grants_offers(state, msg.features)
        state.anchor = None  # a new Welcome: the consumer forgot its offers and Sync stamps
        return [*cmds, welcome(Status.OK, state.version, state.plane, endpoint=endpoint,
                               features=(FEATURE_OFFERS,) if state.offers else ())]

    def _on_req(self, peer: Any, state: PeerState | None, msg: XferReq, now: float) -> list[Command]:
        def ack(status: Status, detail: str) -> list[Command]:
            self._count_nack(status, detail, state.identity if state else str(peer),
                             msg.session_id, msg.mm_hash)
            return [Send(peer, encode(XferAck(v=msg.v, session_id=msg.session_id,
                                              mm_hash=msg.mm_hash, status=status, grant=None,
                                              detail=detail)))]

        if state is None:
            return ack(Status.NACK_BAD_REQUEST, "send Hello first")
        if not msg.session_id:
            return ack(Status.NACK_BAD_REQUEST, "empty session id")
        if msg.session_id != state.session_id:
            return ack(Status.NACK_BAD_REQUEST, "session id is not this connection's session")
        if msg.compat_hash != self.config.compat_hash:
            return ack(Status.NACK_INCOMPAT, "compatibility hash mismatch")
        a = self._answer(peer, state, msg.mm_hash, now)
        if a.status is not Status.OK:
            return [*a.cmds, *ack(a.status, a.detail)]
        rec = a.record
        assert rec is not None and rec.grant is not None  # OK without inline: a grant
        if not rec.ack:  # a new grant, or one issued in an AckBatch: its XferAck, once
            rec.ack = encode(XferAck(v=msg.v, session_id=msg.session_id, mm_hash=msg.mm_hash,
                                     status=Status.OK, grant=rec.grant, detail=""))
        return [Send(peer, rec.ack)]
