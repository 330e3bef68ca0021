"""The state a :class:`~ectransport.session.consumer.ConsumerSession` keeps, and how a fetch
ends: the link state, the peer quarantine, the fetch table (fetches in flight, transfers in
quarantine), their deadlines, and the ways out — landed, missed, quarantined, settled, the whole
session failed. The events and frames that drive it are in :mod:`ectransport.session.consumer`
and (ECTP v2's batches, and the answer to a request) :mod:`ectransport.session.consumer_batches`.
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Callable
from typing import Any

from ectransport.protocol import (
    FEATURE_OFFERS,
    MAX_BATCH_ITEMS,
    MAX_INLINE_BYTES,
    MAX_WAIT_S,
    DoneBatch,
    DoneItem,
    Hello,
    ReqBatch,
    ReqItem,
    Status,
    Welcome,
    XferDone,
    XferReq,
    encode,
)
from ectransport.session.commands import (
    Command,
    Landed,
    Miss,
    MissReason,
    Release,
    Report,
    Send,
)
from ectransport.session.fetch import (
    NACK_REASON,
    Batch,
    ConsumerConfig,
    Fetch,
    FetchState,
)
from ectransport.session.link import LINK_TRANSITIONS, IllegalTransition, Link
from ectransport.store import BlockStore

log = logging.getLogger("ectransport.session.consumer")


class ConsumerState:
    """State and internal transitions of a consumer session; construct a
    :class:`~ectransport.session.consumer.ConsumerSession` (same arguments)."""

    def __init__(
        self,
        config: ConsumerConfig,
        conn: str,
        store: BlockStore,
        now: float,
        *,
        session_id: str | None = None,
        observer: Callable[[str, dict[str, Any]], None] | None = None,
    ):
        self.config = config
        self.conn = conn
        self.store = store
        self.session_id = session_id or uuid.uuid4().hex
        self.version: int | None = None
        self.plane: str | None = None
        self.producer_id = ""
        self.failed: Miss | None = None  # terminal session failure (auth, version, incompat)
        self.blocked_until = 0.0  # peer quarantine
        self.blocked_reason = ""
        self._backoff = config.peer_backoff_s
        self.link = Link.DOWN
        self._probe_due = False  # re-Hello before the next fetch (quarantine ended)
        self._hello_deadline = float("inf")  # set while a Hello is unanswered
        self._next_renew = float("inf")
        self._fetches: dict[str, Fetch] = {}
        self._quarantine: dict[str, Fetch] = {}
        self._seq = 0
        self._welcome: Welcome | None = None  # an OK Welcome whose endpoint is being bound
        self.binding: Any = None  # the plane's binding of this producer (PostRead.prepared)
        #: (batch id, mm_hash) of requests that timed out unanswered (batch id -1: an XferReq):
        #: a late OK grant is given back with an XferDone; bounded, so unsolicited acks are never
        #: reflected one for one.
        self._abandoned: collections.OrderedDict[tuple[int, str], None] = \
            collections.OrderedDict()
        #: ECTP v2: ReqBatch frames not wholly answered, by batch id (at most one per fetch
        #: waiting for its answer; pruned in :meth:`_prune_batches`).
        self._batches: dict[int, Batch] = {}
        self._batch_seq = 0
        #: ids of batches answered in full lately (bounded): a later answer for one of them is
        #: counted as a second answer, not as a batch never sent
        self._answered: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: answers ignored, by why: ``foreign_session``, ``unknown_batch``, ``not_in_batch``,
        #: ``second_answer``, ``bad_inline``; items of ``Parked`` frames ignored:
        #: ``parked_foreign_session``, ``parked_unknown_batch``, ``parked_not_in_batch``,
        #: ``parked_twice``, ``parked_answered`` (a hostile or confused producer; see the v2
        #: rules)
        self.ignored: collections.Counter[str] = collections.Counter()
        self.observer = observer
        # ECTP v2 §10 offers (:mod:`ectransport.session.consumer_offers`)
        self.offers_on = False  # the Welcome granted offers on this connection
        self._next_sync = float("inf")
        #: ECTP v2: completions queued this step (:meth:`_done`), sent by :meth:`_flush_dones`
        self._dones: list[DoneItem] = []

    # -- queries -------------------------------------------------------------------------------
    @property
    def welcomed(self) -> bool:
        """A protocol version was negotiated on the current connection (READY, or a probe)."""
        return self.version is not None

    @property
    def _connected(self) -> bool:
        return self.link in (Link.GREETING, Link.BINDING, Link.READY)

    def _go(self, event: str) -> None:
        """Apply ``event`` to :attr:`link` per :data:`LINK_TRANSITIONS`.

        Raises:
            IllegalTransition: the pair is not in the table.
        """
        nxt = LINK_TRANSITIONS.get((self.link, event))
        if nxt is None:
            raise IllegalTransition(self.link, event)
        self.link = nxt

    def in_flight(self) -> int:
        return len(self._fetches) + len(self._quarantine)

    def fetch_states(self) -> dict[str, FetchState]:
        return {
            **{k: f.state for k, f in self._fetches.items()},
            **{k: f.state for k, f in self._quarantine.items()},
        }

    def reading(self) -> list[tuple[str, Any]]:
        """(mm_hash, handle) of every transfer whose data-plane state the node must poll."""
        return [
            (f.mm_hash, f.handle)
            for f in (*self._fetches.values(), *self._quarantine.values())
            if f.handle is not None
        ]

    def next_deadline(self) -> float | None:
        ds = [f.deadline for f in (*self._fetches.values(), *self._quarantine.values())]
        if self._fetches and self.failed is None:
            ds.append(self._hello_deadline)
        if any(f.state is FetchState.READING for f in self._fetches.values()):
            ds.append(self._next_renew)
        if self._next_sync != float("inf"):
            ds.append(self._next_sync)
        return min(ds) if ds else None


    # -- internals -----------------------------------------------------------------------------
    def _probe(self, now: float) -> list[Command]:
        self._go("probe")
        return self._hello(now)

    def _hello(self, now: float) -> list[Command]:
        self._hello_deadline = now + self.config.hello_timeout_s  # inf again once answered
        hello = Hello(
            v=max(self.config.versions),
            session_id=self.session_id,
            node_id=self.config.node_id,
            versions=list(self.config.versions),
            planes=list(self.config.planes),
            compat_hash=self.config.compat_hash,
            mem_kinds=list(self.config.mem_kinds),
            localities=dict(self.config.localities),
            features=self._wants_offers(),
        )
        return [Send(self.conn, encode(hello))]

    def _wants_offers(self) -> list[str]:
        """``Hello.features``: offers (ECTP v2 §10) when configured and v2 is spoken."""
        return [FEATURE_OFFERS] if self.config.offers and max(self.config.versions) >= 2 else []

    def _penalize(self, now: float, why: str) -> None:
        self.blocked_until = now + self._backoff
        self.blocked_reason = why
        self._backoff = min(self._backoff * 2, self.config.peer_backoff_max_s)
        self._probe_due = True  # the next fetch after the backoff probes with Hello first
        log.warning(
            "producer %s quarantined for %.1f s: %s",
            self.conn,
            self.blocked_until - now,
            why,
            extra={"peer": self.conn, "session_id": self.session_id},
        )
        self._emit("peer_quarantined", seconds=self.blocked_until - now, why=why)

    def _expire(self, f: Fetch, now: float) -> list[Command]:
        final = now >= f.final_deadline
        # the caller's deadline came first, or an offer's window (a read started on the
        # consumer's own judgement of the time left): not the producer's fault
        own = (final and now < f.deadline) or (f.offer and f.deadline >= f.valid_until)
        if f.state is FetchState.READING:
            if not own:
                self._penalize(now, "read deadline passed")
            return self._quarantine_fetch(f, now, MissReason.TIMEOUT, "read deadline passed")
        if f.state is FetchState.BACKOFF and not final:
            return self._send_req(f, now)
        del self._fetches[f.mm_hash]
        if f.last_nack is not None and (f.state is FetchState.BACKOFF or final):
            reason = NACK_REASON.get(f.last_nack, MissReason.INTERNAL)
            return [Report(Miss(f.mm_hash, reason, f"still {f.last_nack.name} at the deadline"))]
        if f.state is FetchState.WAITING_ACK:
            self._abandon(f.batch_id, f.mm_hash)
            b = self._batches.get(f.batch_id) if f.batch_id >= 0 else None
            why = ("parked, but no ack by the end of the producer's wait"
                   if b is not None and f.mm_hash in b.parked else "no ack before the deadline")
            if not own:
                self._penalize(now, why)
            return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, why))]
        return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, "not connected before the deadline"))]

    def _abandon(self, batch_id: int, mm_hash: str) -> None:
        key = (batch_id, mm_hash)
        self._abandoned[key] = None
        self._abandoned.move_to_end(key)
        while len(self._abandoned) > 1024:
            self._abandoned.popitem(last=False)

    def _send_req(self, f: Fetch, now: float) -> list[Command]:
        return self._send_reqs([f], now)

    def _send_reqs(self, fs: list[Fetch], now: float) -> list[Command]:
        """Ask for ``fs`` (now WAITING_ACK; the validity window counts from now): one XferReq
        each on a v1 session; on v2, one ReqBatch per :data:`MAX_BATCH_ITEMS` of them, asking the
        producer to wait for entries not yet ready until shortly before the earliest deadline
        (``wait_s``; no NOT_READY polling) and accepting entries up to ``inline_max_bytes``
        inline."""
        for f in fs:
            f.state = FetchState.WAITING_ACK
            f.req_sent = now
            f.timings.setdefault("req", now)
        # completions queued first: a grant given back must reach the producer before a request
        # for the same entry (else it would answer that live grant again, whose lease began
        # before this request: the validity window would not hold)
        cmds: list[Command] = self._flush_dones()
        if (self.version or 0) < 2:
            for f in fs:
                f.batch_id = -1
                f.deadline = min(f.final_deadline, now + self.config.ack_timeout_s)
                cmds.append(Send(self.conn, encode(XferReq(
                    v=self.version or 0, session_id=self.session_id, mm_hash=f.mm_hash,
                    compat_hash=self.config.compat_hash, dest=b""))))
            return cmds
        inline_max = max(0, min(self.config.inline_max_bytes, MAX_INLINE_BYTES))
        for i in range(0, len(fs), MAX_BATCH_ITEMS):
            chunk = fs[i:i + MAX_BATCH_ITEMS]
            left = max(0.0, min(f.final_deadline for f in chunk) - now)
            wait_s = min(MAX_WAIT_S, max(0.0, left - min(self.config.wait_margin_s, left / 4)))
            self._batch_seq += 1
            bid = self._batch_seq
            names = [f.mm_hash for f in chunk]
            self._batches[bid] = Batch(frozenset(names), set(names), inline_max, now, wait_s)
            for f in chunk:
                f.batch_id = bid
                # answered or named in a Parked frame within the ack timeout, as in v1; a
                # Parked moves the deadline to the end of the producer's wait (_on_parked)
                f.deadline = min(f.final_deadline, now + self.config.ack_timeout_s)
            cmds.append(Send(self.conn, encode(ReqBatch(
                v=self.version or 0, session_id=self.session_id, batch_id=bid,
                compat_hash=self.config.compat_hash, wait_s=wait_s, inline_max=inline_max,
                items=[ReqItem(mm_hash=m, dest=b"") for m in names]))))
        return cmds

    def _prune_batches(self) -> None:
        """Forget the items of sent batches whose fetch no longer waits for that batch's answer
        (ended, or asked again in another batch), and batches left with none: the table stays
        bounded by the fetches in flight. A late answer for a forgotten item is then ignored
        (or, for a request given up on, its grant given back: see ``_abandoned``)."""
        for bid, b in list(self._batches.items()):
            b.waiting = {m for m in b.waiting if (f := self._fetches.get(m)) is not None
                         and f.state is FetchState.WAITING_ACK and f.batch_id == bid}
            if not b.waiting:
                del self._batches[bid]


    def _done(self, mm_hash: str, grant_id: int, ok: bool) -> list[Command]:
        """Complete (``ok``) or give back a grant: an ``XferDone`` now on v1; on v2 queued, and
        the step's completions leave together (:meth:`_flush_dones`: one ``DoneBatch``)."""
        if (self.version or 0) >= 2:
            self._dones.append(DoneItem(mm_hash=mm_hash, grant_id=grant_id, ok=ok))
            return []
        return [Send(self.conn, encode(XferDone(
            v=self.version or max(self.config.versions), session_id=self.session_id,
            mm_hash=mm_hash, grant_id=grant_id, ok=ok)))]

    def _flush_dones(self) -> list[Command]:
        """The queued completions (v2): one ``XferDone`` for one, a ``DoneBatch`` per 64 for
        more; dropped when the session is no longer welcomed (the producer went away and
        released them itself)."""
        items, self._dones = self._dones, []
        if not items or not self.welcomed:
            return []
        v = self.version or 2
        if len(items) == 1:
            it = items[0]
            return [Send(self.conn, encode(XferDone(v=v, session_id=self.session_id,
                                                    mm_hash=it.mm_hash, grant_id=it.grant_id,
                                                    ok=it.ok)))]
        return [Send(self.conn, encode(DoneBatch(v=v, session_id=self.session_id,
                                                 items=items[i:i + MAX_BATCH_ITEMS])))
                for i in range(0, len(items), MAX_BATCH_ITEMS)]

    def _finish(self, f: Fetch, outcome: Landed | Miss, ok: bool) -> list[Command]:
        del self._fetches[f.mm_hash]
        if not ok and f.entry is not None:
            self.store.discard(f.entry.mm_hash)
        # the caller first: the release and the XferDone send (which wakes ZeroMQ's I/O thread)
        # follow, instead of delaying the outcome by a thread switch (measured ~1.5 ms on 2 cores)
        cmds: list[Command] = [Report(outcome)]
        if f.handle is not None:
            cmds.append(Release(f.handle))
            f.handle = None
        if f.grant_id >= 0 and self.welcomed:
            cmds += self._done(f.mm_hash, f.grant_id, ok=ok)
            if not f.offer:  # a hold is not charged to our pin budget: nothing freed
                self._retry_busy_now()
        return cmds

    def _retry_busy_now(self) -> None:
        """A grant of ours just ended (its XferDone is on the way): the oldest fetch backing off
        after a NACK_BUSY — our pin budget at this producer — retries at the next :meth:`poll`
        instead of after its backoff; the retry leaves after the XferDone on the same ordered
        connection, so the producer has unpinned first. One retry per ended grant (the freed
        budget fits about one more entry; the others keep their backoff rather than flooding the
        producer, whose per-consumer frame rate is limited)."""
        busy = [g for g in self._fetches.values() if g.state is FetchState.BACKOFF
                and g.last_nack is Status.NACK_BUSY and g.deadline != float("-inf")]
        if busy:
            min(busy, key=lambda g: g.started).deadline = float("-inf")  # poll() re-sends it

    def _quarantine_fetch(
        self, f: Fetch, now: float, reason: MissReason, detail: str
    ) -> list[Command]:
        del self._fetches[f.mm_hash]
        cmds: list[Command] = [Report(Miss(f.mm_hash, reason, detail + "; transfer quarantined"))]
        if f.handle is None:  # nothing in flight on the data plane: free at once
            if f.entry is not None:
                self.store.discard(f.entry.mm_hash)
            return cmds
        f.state = FetchState.QUARANTINED
        f.deadline = now + self.config.quarantine_s
        log.info(
            "transfer quarantined for %.0f s: %s",
            self.config.quarantine_s,
            detail,
            extra={
                "peer": self.conn,
                "session_id": self.session_id,
                "mm_hash": f.mm_hash[:12],
                "grant_id": f.grant_id,
            },
        )
        self._emit(
            "transfer_quarantined", mm_hash=f.mm_hash[:12], grant_id=f.grant_id, reason=reason.value
        )
        self._quarantine[f.mm_hash] = f
        if f.grant_id >= 0 and self._connected:
            cmds += self._done(f.mm_hash, f.grant_id, ok=False)
            self._retry_busy_now()
        return cmds

    def _settle(self, q: Fetch) -> list[Command]:
        del self._quarantine[q.mm_hash]
        cmds: list[Command] = []
        if q.handle is not None:
            cmds.append(Release(q.handle))
            q.handle = None
        if q.entry is not None:
            self.store.discard(q.entry.mm_hash)
        return cmds

    def _emit(self, event: str, **fields: Any) -> None:
        if self.observer is not None:
            self.observer(event, {"peer": self.conn, "session_id": self.session_id, **fields})

    def _fail_session(self, miss: Miss) -> list[Command]:
        """Terminal: every fetch misses (reading ones are quarantined, their grants given back
        while the connection is up), then the session is FAILED."""
        self.failed = miss
        cmds: list[Command] = []
        for f in list(self._fetches.values()):
            if f.state is FetchState.READING:
                cmds += self._quarantine_fetch(f, f.deadline, miss.reason, miss.detail)
            else:
                del self._fetches[f.mm_hash]
                cmds.append(Report(Miss(f.mm_hash, miss.reason, miss.detail)))
        self._welcome = None
        self._batches.clear()
        self.offers_on, self._next_sync = False, float("inf")
        self._go("fail")
        return cmds

