"""The state a :class:`~ectransport.session.consumer.ConsumerSession` keeps, and how a fetch
ends: the link state, the peer quarantine, the fetch table (fetches in flight, transfers in
quarantine), their deadlines, and the ways out — landed, missed, quarantined, settled, the whole
session failed. The events and frames that drive it are in :mod:`ectransport.session.consumer`.
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Callable
from typing import Any

from ectransport.protocol import (
    Hello,
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
        #: mm_hashes whose XferReq timed out unanswered (a late OK ack is given back with an
        #: XferDone); bounded, so unsolicited acks are never reflected one for one.
        self._abandoned: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.observer = observer

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
        )
        return [Send(self.conn, encode(hello))]

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
        own = (
            final and now < f.deadline
        )  # the caller's deadline came first: not the producer's fault
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
            self._abandon(f.mm_hash)
            if not own:
                self._penalize(now, "no ack before the deadline")
            return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, "no ack before the deadline"))]
        return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, "not connected before the deadline"))]

    def _abandon(self, mm_hash: str) -> None:
        self._abandoned[mm_hash] = None
        self._abandoned.move_to_end(mm_hash)
        while len(self._abandoned) > 1024:
            self._abandoned.popitem(last=False)

    def _send_req(self, f: Fetch, now: float) -> list[Command]:
        f.state = FetchState.WAITING_ACK
        f.deadline = min(f.final_deadline, now + self.config.ack_timeout_s)
        f.req_sent = now
        f.timings.setdefault("req", now)
        req = XferReq(
            v=self.version or 0,
            session_id=self.session_id,
            mm_hash=f.mm_hash,
            compat_hash=self.config.compat_hash,
            dest=b"",
        )
        return [Send(self.conn, encode(req))]


    def _done(self, mm_hash: str, grant_id: int, ok: bool) -> Send:
        return Send(
            self.conn,
            encode(
                XferDone(
                    v=self.version or max(self.config.versions),
                    session_id=self.session_id,
                    mm_hash=mm_hash,
                    grant_id=grant_id,
                    ok=ok,
                )
            ),
        )

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
            cmds.append(self._done(f.mm_hash, f.grant_id, ok=ok))
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
            cmds.append(self._done(f.mm_hash, f.grant_id, ok=False))
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
        self._go("fail")
        return cmds

