"""The state a :class:`~ectransport.session.producer.ProducerSession` keeps — peers, live grants,
pins charged per identity, pins held back for their grace period, ECTP v2 batch items waiting for
readiness — its queries and invariants, how one entry is answered (:meth:`ProducerState._answer`:
a grant, inline bytes or a NACK; shared by ``XferReq`` and ``ReqBatch``) and how a grant ends
(:meth:`ProducerState._release`). The frames and events that drive it are in
:mod:`ectransport.session.producer` and :mod:`ectransport.session.producer_batches`.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ectransport.protocol import (
    AckBatch,
    AckItem,
    FrameError,
    Grant,
    Nack,
    Status,
    XferAck,
    encode,
)
from ectransport.protocol.codec import peek_batch, peek_ids
from ectransport.protocol.messages import MAX_GRANT_BYTES
from ectransport.session.commands import Command, Revoke, Send
from ectransport.session.grants import (
    Describe,
    GrantRecord,
    GrantView,
    PeerState,
    ProducerConfig,
    WaitingItem,
)
from ectransport.store import BlockStore, Run

#: ``(runs, nbytes) -> bytes``: the first ``nbytes`` bytes of an entry's blocks (for inline
#: answers); the caller holds whatever lock keeps a READY entry's blocks stable.
ReadBytes = Callable[[tuple[Run, ...], int], bytes]


@dataclass(frozen=True)
class Answer:
    """How one entry is answered (:meth:`ProducerState._answer`): ``status`` with ``detail``; on
    OK either ``grant`` (pinned under a lease; ``record`` is its :class:`GrantRecord`, possibly a
    live one answered again) or ``data`` (inline: no pin, no grant). ``cmds``: effects to perform
    before the answer is sent (a ``Revoke`` of a grant refused at issue time)."""

    status: Status
    detail: str = ""
    grant: Grant | None = None
    data: bytes = b""
    record: GrantRecord | None = None
    duplicate: bool = False
    cmds: tuple[Command, ...] = ()

    def item(self, mm_hash: str) -> AckItem:
        return AckItem(mm_hash=mm_hash, status=self.status, grant=self.grant, data=self.data,
                       detail=self.detail[:1000])

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
        read: ReadBytes | None = None,
        offerable: Callable[[str], bool] | None = None,
    ):
        self.config = config
        self._read = read
        self._offerable = offerable or (lambda plane: False)
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
        #: ECTP v2 batch items waiting for readiness, by mm_hash (in arrival order), and their
        #: deadlines (until, seq, item); an answered item leaves the heap lazily
        self._waiting: dict[str, list[WaitingItem]] = {}
        self._wait_heap: list[tuple[float, int, WaitingItem]] = []
        self._wait_seq = 0
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
            "inline": 0,
            "batches": 0,
            "waited": 0,
            "parked_frames": 0,
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
    def waiting_items(self) -> int:
        """ECTP v2 batch items waiting for their entry to become ready (none holds a pin)."""
        return sum(len(items) for items in self._waiting.values())

    def waits_for(self, mm_hash: str) -> bool:
        """Whether a batch item waits for ``mm_hash`` to become ready (then the node reports
        the entry's change with ``on_entries_changed`` at once)."""
        return mm_hash in self._waiting

    def next_deadline(self) -> float | None:
        """The earliest moment a waiting item must be answered NACK_NOT_READY (session time), or
        None; the node sweeps (``poll``) no later than that."""
        heap = self._wait_heap
        while heap and heap[0][2].answered:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

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
        for mm_hash, entry_id, identity, nbytes in self._held_pins():
            pins[(mm_hash, entry_id)] = pins.get((mm_hash, entry_id), 0) + 1
            by_identity[identity] = by_identity.get(identity, 0) + nbytes
        for _, mm_hash, entry_id, identity, nbytes in self._grace:
            pins[(mm_hash, entry_id)] = pins.get((mm_hash, entry_id), 0) + 1
            by_identity[identity] = by_identity.get(identity, 0) + nbytes
        assert by_identity == self._pinned_by, f"budget {self._pinned_by} != {by_identity}"
        waiting: dict[tuple[Any, int], int] = {}
        for mm_hash, items in self._waiting.items():
            assert items, f"empty waiting list for {mm_hash[:12]}"
            for w in items:
                assert not w.answered and w.mm_hash == mm_hash, f"waiting item {w} answered"
                st = self._peers.get(w.peer)
                assert st is not None and st.session_id == w.session_id and st.version >= 2, (
                    f"waiting item {w} has no v2 session")
                waiting[(w.peer, w.batch_id)] = waiting.get((w.peer, w.batch_id), 0) + 1
        indexed_w = {(st.peer, b): n for st in self._peers.values() for b, n in st.waiting.items()}
        assert waiting == indexed_w, f"waiting items {waiting} != per peer {indexed_w}"
        live_w = {id(w) for _, _, w in self._wait_heap if not w.answered}
        assert live_w == {id(w) for items in self._waiting.values() for w in items}, (
            "a waiting item without its deadline")
        for (mm_hash, entry_id), n in pins.items():
            e = self.store.get(mm_hash)
            assert e is not None and e.entry_id == entry_id and e.pins >= n, (
                f"entry {mm_hash[:12]} ({entry_id}) lacks {n} pins")

    def _held_pins(self) -> list[tuple[str, int, str, int]]:
        """Pins held other than by grants and grace: ``(mm_hash, entry_id, identity, bytes)``
        (announcement holds, :mod:`ectransport.session.holds`)."""
        return []

    # -- answering one entry ---------------------------------------------------------------------
    def _answer(self, peer: Any, state: PeerState, mm_hash: str, now: float, *,
                inline_max: int = 0) -> Answer:
        """Answer a request of ``state``'s session for ``mm_hash`` (its frame checks passed).

        In order (ECTP v1 §8.2; v2 adds inline): a live grant for the same (session, mm_hash)
        is answered again (no second pin); entry present (MISSING) and ready (NOT_READY); an
        entry of at most ``min(inline_max, config.inline_max_bytes)`` bytes is answered inline
        (its bytes, no pin, no budget); the entry larger than the peer's whole pin budget or
        than the plane's largest transfer (BAD_REQUEST, terminal); the pin budget (BUSY); a
        plane able to describe the blocks within the wire limit (INTERNAL). Otherwise the entry
        is pinned under a lease of ``config.lease_s`` from ``now``.
        """
        cfg = self.config
        session_id = state.session_id
        live = self._live.get((session_id, mm_hash))
        if live is not None:  # duplicate request: same grant, no second pin
            rec = self._grants[(session_id, mm_hash, live)]
            return Answer(Status.OK, grant=rec.grant, record=rec, duplicate=True)
        entry = self.store.get(mm_hash)
        if entry is None:
            return Answer(Status.NACK_MISSING, "not in this producer's cache")
        if not entry.ready:
            return Answer(Status.NACK_NOT_READY, "entry allocated, save not landed yet")
        limit_inline = min(inline_max, cfg.inline_max_bytes)  # 0 (v1, or refused): never
        if self._read is not None and limit_inline > 0 and entry.nbytes <= limit_inline:
            try:
                data = self._read(entry.runs, entry.nbytes)
            except Exception:  # a region bug must not kill the node: answer with a grant
                log.exception("reading %d bytes of %s for an inline answer failed", entry.nbytes,
                              mm_hash[:12])
            else:
                if len(data) == entry.nbytes:
                    self.stats["inline"] += 1
                    return Answer(Status.OK, data=data)
                log.error("inline read of %s returned %d bytes, expected %d", mm_hash[:12],
                          len(data), entry.nbytes)
        pinned_bytes = entry.num_blocks * self.store.block_bytes
        if pinned_bytes > self.budget_bytes:  # terminal: waiting cannot help
            return Answer(
                Status.NACK_BAD_REQUEST,
                f"entry needs {pinned_bytes} bytes pinned, more than this consumer's whole pin "
                f"budget of {self.budget_bytes} bytes: it can never be granted (raise the "
                f"producer's budget_bytes)",
            )
        limit = self._max_bytes(state.plane)
        if limit is not None and entry.nbytes > limit:  # terminal as well
            return Answer(
                Status.NACK_BAD_REQUEST,
                f"entry of {entry.nbytes} bytes exceeds the {state.plane} plane's largest "
                f"transfer ({limit} bytes)",
            )
        used = self._pinned_by.get(state.identity, 0)
        if used + pinned_bytes > self.budget_bytes:
            return Answer(Status.NACK_BUSY,
                          f"pin budget: {used}+{pinned_bytes} > {self.budget_bytes} bytes")
        describe = self.describers.get(state.plane)
        if describe is None:
            return Answer(Status.NACK_INTERNAL, f"plane {state.plane} not available")
        entry = self.store.pin_if_ready(mm_hash)
        assert entry is not None
        try:
            plane_grant = describe(entry.runs, entry.nbytes)
        except Exception as e:  # a plane bug must not leak a pin or kill the node
            self.store.unpin(entry.mm_hash, entry.entry_id)
            log.exception("plane %s failed to describe a grant", state.plane)
            return Answer(Status.NACK_INTERNAL, f"plane error: {type(e).__name__}")
        if len(plane_grant) > MAX_GRANT_BYTES:  # the consumer could not decode it
            self.store.unpin(entry.mm_hash, entry.entry_id)
            log.error("plane %s described a grant of %d bytes (limit %d) for %d runs",
                      state.plane, len(plane_grant), MAX_GRANT_BYTES, len(entry.runs))
            return Answer(
                Status.NACK_INTERNAL,
                f"grant of {len(plane_grant)} bytes for {len(entry.runs)} runs exceeds the wire "
                f"limit of {MAX_GRANT_BYTES} bytes",
                cmds=(Revoke(state.plane, plane_grant),),
            )
        gid = self._rng.getrandbits(63)
        key = (session_id, mm_hash, gid)
        grant = Grant(
            grant_id=gid,
            entry_bytes=entry.nbytes,
            num_blocks=entry.num_blocks,
            block_bytes=self.store.block_bytes,
            lease_s=float(cfg.lease_s),
            plane=state.plane,
            plane_grant=plane_grant,
        )
        rec = GrantRecord(key, peer, state.identity, entry.entry_id, entry.runs, entry.nbytes,
                          pinned_bytes, now + cfg.lease_s, b"", state.plane, plane_grant, now,
                          grant)
        self._grants[key] = rec
        self._live[key[:2]] = gid
        state.grants.add(key)
        state.by_gid[gid] = key
        self._pinned_by[state.identity] = used + pinned_bytes
        self.stats["grants"] += 1
        fields = {"peer": state.identity, "session_id": session_id, "mm_hash": mm_hash[:12],
                  "grant_id": gid}
        log.debug("grant issued: %d bytes in %d runs over %s", entry.nbytes, len(entry.runs),
                  state.plane, extra=fields)
        self._emit("grant_issued", fields, nbytes=entry.nbytes, plane=state.plane,
                   descriptors=len(entry.runs))
        return Answer(Status.OK, grant=grant, record=rec)

    def _count_nack(self, status: Status, detail: str, peer: str, session_id: str,
                    mm_hash: str) -> None:
        """Count a NACK sent for one entry and tell the observer."""
        self.nacks[status] = self.nacks.get(status, 0) + 1
        self._emit("nack_sent", {"peer": peer, "session_id": session_id,
                                 "mm_hash": mm_hash[:12], "grant_id": -1},
                   status=status.name, detail=detail)

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
        """The ``v`` of a frame to ``peer``: its session's version; before a session, the lowest
        version this producer speaks (``Nack`` and ``XferAck`` exist in every version, so any
        consumer can read it)."""
        state = self._peers.get(peer)
        return state.version if state else min(self.config.versions)

    def _nack(self, peer: Any, status: Status, detail: str) -> Send:
        self.nacks[status] = self.nacks.get(status, 0) + 1
        return Send(peer, encode(Nack(v=self._version_for(peer), status=status, detail=detail)))

    def _reject(self, peer: Any, err: FrameError, data: bytes) -> Send:
        if err.kind == "reqs":  # v2: answer as an AckBatch when the batch can be named
            state = self._peers.get(peer)
            batch = peek_batch(data)
            if state is not None and state.version >= 2 and batch is not None and \
                    batch[1] not in state.waiting:
                sid, batch_id, mm_hashes = batch
                self.nacks[err.status] = self.nacks.get(err.status, 0) + len(mm_hashes)
                items = [AckItem(mm_hash=mm, status=err.status, grant=None, data=b"",
                                 detail=err.detail[:1000]) for mm in mm_hashes]
                return Send(peer, encode(AckBatch(v=state.version, session_id=sid,
                                                  batch_id=batch_id, items=items)))
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
