"""The state a :class:`~ectransport.session.producer.ProducerSession` keeps — peers, live grants,
pins charged per identity, pins held back for their grace period — its queries and invariants,
and how a grant ends (:meth:`ProducerState._release`). The frames and events that drive it are in
:mod:`ectransport.session.producer`.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable
from typing import Any

from ectransport.protocol import (
    FrameError,
    Nack,
    Status,
    XferAck,
    encode,
)
from ectransport.protocol.codec import peek_ids
from ectransport.session.commands import Command, Revoke, Send
from ectransport.session.grants import (
    Describe,
    GrantRecord,
    GrantView,
    PeerState,
    ProducerConfig,
)
from ectransport.store import BlockStore

log = logging.getLogger("ectransport.session.producer")


class ProducerState:
    """State and grant bookkeeping of a producer session; construct a
    :class:`~ectransport.session.producer.ProducerSession` (same arguments)."""

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
        self._peers: dict[Any, PeerState] = {}
        self._sessions: dict[str, Any] = {}  # session_id -> peer
        self._grants: dict[tuple[str, str, int], GrantRecord] = {}
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

    # -- helpers -------------------------------------------------------------------------------
    def _release(self, key: tuple[str, str, int], why: str, now: float | None) -> list[Command]:
        """End a grant exactly once and revoke it on its plane. Its pin (and the bytes charged to
        the consumer's budget) go at once after a confirmed completion or at shutdown (``now``
        None); otherwise they are held back (``ectransport.session.producer`` docstring): on a
        revocable plane until the next :meth:`poll` — after the node performed the ``Revoke``, so
        no block is re-used while the plane may still send it — and on a READ plane for the grace
        period. Unknown keys are
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
