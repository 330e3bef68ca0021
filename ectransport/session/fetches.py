"""The fetches of one consumer session: :class:`FetchTable`, owned by a
:class:`~ectransport.session.consumer.ConsumerSession`, is the one place where a fetch changes
state (each change through :meth:`Fetch.go <ectransport.session.fetch.Fetch.go>` and its table).

It asks (an ``XferReq`` on v1, one ``ReqBatch`` per 64 on v2: :meth:`FetchTable.ask`), applies
the verdict on each answer (:func:`~ectransport.session.answers.judge`), reads usable grants
(:meth:`FetchTable.read`), follows the plane's progress, applies deadlines, renews leases
(:mod:`.renewals`: counted only when the producer confirms them, ECTP v2 §11) and quarantines
reads given up while their DMA may still land. What it needs of the connection is the narrow
:class:`~ectransport.session.link.Connection` view.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ectransport.protocol import (
    MAX_BATCH_ITEMS,
    MAX_INLINE_BYTES,
    MAX_WAIT_S,
    AckBatch,
    Grant,
    Parked,
    RenewAck,
    ReqBatch,
    ReqItem,
    Status,
    XferAck,
    XferReq,
    encode,
)
from ectransport.session.answers import Inline, Late, Refuse, Retry, judge
from ectransport.session.batches import BatchTable
from ectransport.session.commands import (
    Command,
    Land,
    Landed,
    Miss,
    MissReason,
    PostRead,
    Release,
    Report,
    Send,
)
from ectransport.session.completions import Completions
from ectransport.session.fetch import (
    NACK_REASON,
    Asked,
    Backoff,
    Batch,
    Fetch,
    FetchState,
    Quarantined,
    Reading,
    parked_deadline,
)
from ectransport.session.grants import notif_for
from ectransport.session.link import Connection
from ectransport.session.renewals import Renewals
from ectransport.settings_schema import ConsumerSettings
from ectransport.store import AllocFailed, BlockStore

log = logging.getLogger("ectransport.session.consumer")


class FetchTable:
    """Fetches in flight and transfers in quarantine, keyed by mm_hash (module docstring)."""

    def __init__(self, link: Connection, settings: ConsumerSettings, store: BlockStore):
        self.link = link
        self.settings = settings
        self.store = store
        self.fetches: dict[str, Fetch] = {}
        self.quarantine: dict[str, Fetch] = {}
        self.batches = BatchTable()
        self.completions = Completions(link.conn, link.session_id, settings.done_delay_s)
        self.renewals = Renewals()
        self._seq = 0

    # -- queries -------------------------------------------------------------------------------
    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self.fetches or mm_hash in self.quarantine

    def in_flight(self) -> int:
        return len(self.fetches) + len(self.quarantine)

    def queued(self) -> list[Fetch]:
        return [f for f in self.fetches.values() if f.kind is FetchState.QUEUED]

    def states(self) -> dict[str, FetchState]:
        return {k: f.kind for d in (self.fetches, self.quarantine) for k, f in d.items()}

    def reading(self) -> list[tuple[str, Any]]:
        """(mm_hash, handle) of every transfer whose data-plane state the node must poll."""
        return [(f.mm_hash, f.state.handle) for d in (self.fetches, self.quarantine)
                for f in d.values()
                if isinstance(f.state, (Reading, Quarantined)) and f.state.handle is not None]

    def deadlines(self) -> list[float]:
        ds = [f.due for d in (self.fetches, self.quarantine) for f in d.values()]
        if self.renewals.due is not None and self.reads(offers=True):
            ds.append(self.renewals.due)
        if self.completions.due is not None:
            ds.append(self.completions.due)
        return ds

    def reads(self, *, offers: bool) -> list[Reading]:
        """The reads in flight (``offers``: those started on an offer too)."""
        return [st for f in self.fetches.values() if isinstance(st := f.state, Reading)
                and (offers or not st.offer)]

    def asked(self, mm_hash: str, batch_id: int | None) -> Asked | None:
        """The ``Asked`` state of the fetch of ``mm_hash`` if it waits for that request
        (``batch_id`` None: an ``XferReq``)."""
        f = self.fetches.get(mm_hash)
        st = f.state if f is not None else None
        return st if isinstance(st, Asked) and st.batch_id == batch_id else None

    # -- starting ------------------------------------------------------------------------------
    def add(self, mm_hash: str, now: float, deadline: float, nbytes: int | None) -> Fetch:
        f = Fetch(mm_hash, deadline, now, expected_bytes=nbytes)
        self.fetches[mm_hash] = f
        return f

    def ask(self, fs: list[Fetch], now: float) -> list[Command]:
        """Ask for ``fs`` (each now ``Asked``; the validity window counts from now): one
        ``XferReq`` each on v1; on v2 one ``ReqBatch`` per :data:`MAX_BATCH_ITEMS`, asking the
        producer to wait for entries not yet ready until shortly before the earliest deadline
        and accepting entries up to ``inline_max_bytes`` inline. Queued completions go first
        (:mod:`.completions`)."""
        s, c = self.settings, self.link
        cmds = self.flush()
        for f in fs:
            f.timings.setdefault("req", now)
        if (c.version or 0) < 2:
            for f in fs:
                f.go("ask", Asked(now, min(f.final_deadline, now + s.ack_timeout_s)))
                cmds.append(Send(c.conn, encode(XferReq(
                    v=c.version or 0, session_id=c.session_id, mm_hash=f.mm_hash,
                    compat_hash=c.compat_hash, dest=b""))))
            return cmds
        inline_max = max(0, min(s.inline_max_bytes, MAX_INLINE_BYTES))
        for i in range(0, len(fs), MAX_BATCH_ITEMS):
            chunk = fs[i:i + MAX_BATCH_ITEMS]
            left = max(0.0, min(f.final_deadline for f in chunk) - now)
            wait_s = min(MAX_WAIT_S, max(0.0, left - min(s.wait_margin_s, left / 4)))
            names = [f.mm_hash for f in chunk]
            bid = self.batches.open(names, inline_max, now, wait_s)
            for f in chunk:  # answered, or named Parked, within the ack timeout (as in v1)
                f.go("ask", Asked(now, min(f.final_deadline, now + s.ack_timeout_s), bid))
            cmds.append(Send(c.conn, encode(ReqBatch(
                v=c.version or 2, session_id=c.session_id, batch_id=bid, compat_hash=c.compat_hash,
                wait_s=wait_s, inline_max=inline_max,
                items=[ReqItem(mm_hash=m, dest=b"") for m in names]))))
        return cmds

    def read(self, f: Fetch, g: Grant, now: float, window_end: float, *,
             offer: bool = False) -> list[Command]:
        """Read the usable grant ``g`` for ``f`` until ``window_end`` (consumer clock): allocate
        its landing blocks and post the READ. Landing keys ``<mm_hash>#<session_id>.<n>`` are
        unique per node: fetches of one mm_hash from several producers never collide."""
        self._seq += 1
        entry = self.store.alloc(f"{f.mm_hash}#{self.link.session_id}.{self._seq}",
                                 g.entry_bytes)
        if isinstance(entry, AllocFailed):
            del self.fetches[f.mm_hash]
            return [*self.done(f.mm_hash, g.grant_id, ok=False),
                    Report(Miss(f.mm_hash, MissReason.NO_SPACE, f"local region cannot hold "
                                f"{g.entry_bytes} bytes ({entry.reason})"))]
        self.renewals.read_started(now, g.lease_s, not self.reads(offers=True))
        read_by = now + self.settings.read_timeout_s
        due = min(f.final_deadline, read_by, window_end)
        f.go("offer" if offer else "grant",
             Reading(g.grant_id, g.lease_s, entry, window_end, due, offer, read_by=read_by))
        notif = (notif_for((self.link.session_id, f.mm_hash, g.grant_id))
                 if self.settings.request_notifications else b"")
        return [PostRead(f.mm_hash, g.plane_grant, entry.runs, g.entry_bytes, notif,
                         self.link.binding)]

    # -- answers -------------------------------------------------------------------------------
    def on_ack(self, msg: XferAck, now: float) -> list[Command]:
        """v1: the answer to one ``XferReq`` (its session id already checked)."""
        f = self.fetches.get(msg.mm_hash)
        if f is None or self.asked(msg.mm_hash, None) is None:
            # the late grant of a request given up on: let the producer unpin now — once, and
            # only for a request really sent (never a reflection of unsolicited acks)
            if (f is None and msg.status is Status.OK and msg.grant is not None
                    and self.batches.take_abandoned(None, msg.mm_hash)):
                return self.done(msg.mm_hash, msg.grant.grant_id, ok=False)
            return []
        return self._on_answer(f, msg.status, msg.grant, msg.detail, now)

    def on_acks(self, msg: AckBatch, now: float) -> list[Command]:
        """v2: answers to items of one of our ``ReqBatch`` frames (its session id checked)."""
        b = self.batches.get(msg.batch_id)
        cmds: list[Command] = []
        inline: list[str] = []  # local keys of the inline entries landed by this frame
        for it in msg.items:
            f = self.fetches.get(it.mm_hash)
            if b is None or it.mm_hash not in b.waiting or f is None or \
                    self.asked(it.mm_hash, msg.batch_id) is None:
                if self.batches.take_abandoned(msg.batch_id, it.mm_hash):
                    if it.status is Status.OK and it.grant is not None:
                        cmds += self.done(it.mm_hash, it.grant.grant_id, ok=False)
                    continue
                why = self.batches.stray_reason(b, msg.batch_id, it.mm_hash)
                self.link.ignore(why, f"an answer for {it.mm_hash[:12]!r} in batch "
                                 f"{msg.batch_id}")
                continue
            b.waiting.discard(it.mm_hash)
            cmds += self._on_answer(f, it.status, it.grant, it.detail, now, it.data, b, inline)
        self.batches.close_if_answered(msg.batch_id)
        # inline entries become READY (evictable until the node pins them) only now: a later
        # item's allocation above must not evict blocks whose Land is still to come
        for key in inline:
            self.store.mark_ready(key)
        return cmds

    def on_parked(self, msg: Parked, now: float) -> list[Command]:
        """v2: the producer parked these items (reserved, not ready): each one's answer is now
        due by :func:`~ectransport.session.fetch.parked_deadline`. Items of another batch, not
        named, answered (or given up on) or parked already are ignored and counted."""
        b = self.batches.get(msg.batch_id)
        if b is None:
            why = "parked_answered" if self.batches.was_answered(msg.batch_id) \
                else "parked_unknown_batch"
            self.link.ignore(why, f"a Parked frame for batch {msg.batch_id}, not waiting",
                             len(msg.items))
            return []
        ok, strays = self.batches.parked(
            b, msg.items, lambda mm: self.asked(mm, msg.batch_id) is not None)
        for mm in ok:
            f, st = self.fetches[mm], self.asked(mm, msg.batch_id)
            assert st is not None
            due = parked_deadline(b.sent, b.wait_s, msg.wait_s, self.settings.ack_timeout_s,
                                  f.final_deadline)
            f.go("parked", replace(st, due=due, parked=True))
        for why, k in strays.items():
            self.link.ignore(why, f"{k} item(s) of a Parked frame for batch {msg.batch_id}", k)
        return []

    def on_renew_ack(self, msg: RenewAck, now: float) -> list[Command]:
        """ECTP v2 §11 (:meth:`.Renewals.confirm`): the windows of the reads a confirmed Renew
        names end at ``(Renew sent) + extend_s − margin`` (the grant's margin) if that is later,
        their deadlines too (never past their own read deadline). An ack of no outstanding Renew
        is ignored and counted (``renew_ack_unmatched``); one naming no grant changes nothing."""
        m = self.renewals.confirm(msg) if msg.grant_ids else None
        if m is None:
            if msg.grant_ids:
                self.link.ignore("renew_ack_unmatched", "a RenewAck of no outstanding Renew")
            return []
        for f in self.fetches.values():
            if isinstance(st := f.state, Reading) and not st.offer and st.grant_id in m.grant_ids:
                until = m.sent + m.extend_s - min(self.settings.validity_margin_s, st.lease_s / 4)
                if until > st.valid_until:
                    f.go("renewed", replace(st, valid_until=until,
                                            due=min(f.final_deadline, st.read_by, until)))
        return []

    def _on_answer(self, f: Fetch, status: Status, g: Grant | None, detail: str, now: float,
                   data: bytes = b"", batch: Batch | None = None,
                   inline: list[str] | None = None) -> list[Command]:
        """Apply the verdict on the answer for the asked fetch ``f`` (an ``XferAck``, or an item
        of ``batch``: the local keys of inline entries it lands go to ``inline``)."""
        st = f.state
        assert isinstance(st, Asked)
        f.timings["ack"] = now
        v = judge(f, st, status, g, detail, now, data=data, batch=batch, settings=self.settings,
                  plane=self.link.plane, store=self.store)
        match v:
            case Retry(state=backoff, retry_s=retry_s):
                f.last_nack, f.retry_s = status, retry_s
                f.go("retryable", backoff)
                return []
            case Refuse(miss=miss, give_back=gid, penalize=why, bad_inline=bad):
                del self.fetches[f.mm_hash]
                if why:
                    self.link.penalize(now, why)
                if bad:
                    self.link.ignore("bad_inline", f"{miss.detail} for {f.mm_hash[:12]}")
                out: list[Command] = [Report(miss)]
                return out + (self.done(f.mm_hash, gid, ok=False) if gid is not None else [])
            case Inline(data=data):
                assert inline is not None
                return self._land_inline(f, data, now, inline)
            case Late(grant_id=gid, again=again, miss=miss, late_s=late):
                cmds = self.done(f.mm_hash, gid, ok=False)
                if again:
                    log.warning("grant for %s handled %.3f s after its validity window; asking "
                                "again", f.mm_hash[:12], late, extra={"peer": self.link.conn})
                    return cmds + self.ask([f], now)
                del self.fetches[f.mm_hash]
                return cmds + [Report(miss)]
        return self.read(f, v.grant, now, v.window_end)

    def _land_inline(self, f: Fetch, data: bytes, now: float,
                     inline: list[str]) -> list[Command]:
        """An OK item carrying the (checked) entry itself: copied into local blocks
        (:class:`Land`) and reported landed; nothing of the producer is held."""
        del self.fetches[f.mm_hash]
        self._seq += 1
        entry = self.store.alloc(f"{f.mm_hash}#{self.link.session_id}.{self._seq}", len(data))
        if isinstance(entry, AllocFailed):
            return [Report(Miss(f.mm_hash, MissReason.NO_SPACE,
                                f"local region cannot hold {len(data)} bytes ({entry.reason})"))]
        inline.append(entry.mm_hash)
        f.timings["landed"] = now
        self.link.landed()
        return [Land(entry.runs, data), Report(Landed(
            f.mm_hash, entry, self.link.plane or "", f.relative_timings(), -1))]

    # -- the plane's progress ------------------------------------------------------------------
    def on_read_posted(self, mm_hash: str, handle: Any, now: float) -> list[Command]:
        f = self.fetches.get(mm_hash)
        if f is None or not isinstance(f.state, Reading):
            return [Release(handle)]
        f.go("posted", replace(f.state, handle=handle))
        f.timings["posted"] = now
        return []

    def on_read_failed(self, mm_hash: str, detail: str, now: float) -> list[Command]:
        f = self.fetches.get(mm_hash)
        if f is None or not isinstance(f.state, Reading):
            return []
        return self._finish(f, Miss(mm_hash, MissReason.INTERNAL, detail), now)

    def on_read_state(self, mm_hash: str, state: str, now: float,
                      detail: str = "") -> list[Command]:
        q = self.quarantine.get(mm_hash)
        if q is not None:
            return [] if state == "proc" else self._settle(q)
        f = self.fetches.get(mm_hash)
        if f is None or not isinstance(st := f.state, Reading) or state == "proc":
            return []
        if state != "done":
            why = f"data-plane transfer failed: {detail[:300]}" if detail else \
                "data-plane transfer failed"
            return self._finish(f, Miss(mm_hash, MissReason.INTERNAL, why), now)
        if now >= st.valid_until:
            # the bytes may postdate the lease: never report them (§6.3); on an offer the
            # consumer chose to start with the window it had: not the producer's fault
            if not st.offer:
                self.link.penalize(now, "transfer completed after its grant's validity window")
            return self._quarantine(f, now, MissReason.TIMEOUT, f"transfer completed "
                                    f"{now - st.valid_until:.3f} s after its grant's validity "
                                    f"window; bytes discarded")
        self.store.mark_ready(st.entry.mm_hash)
        f.timings["landed"] = now
        self.link.landed()
        return self._finish(f, Landed(mm_hash, st.entry, self.link.plane or "",
                                      f.relative_timings(), st.grant_id), now)

    # -- time ----------------------------------------------------------------------------------
    def poll(self, now: float) -> list[Command]:
        """Deadlines (answers, retries, reads → quarantine, quarantine → settled) and
        renewals."""
        cmds: list[Command] = []
        for f in [f for f in self.fetches.values() if now >= f.due]:
            cmds += self._expire(f, now)
        c = self.link  # a hold's pin is not extended by Renew (§10): offers' reads are not
        cmds += self.renewals.poll(c.conn, c.version, c.session_id,
                                   [(r.grant_id, r.lease_s) for r in self.reads(offers=False)],
                                   now)
        for q in [q for q in self.quarantine.values() if now >= q.due]:
            cmds += self._settle(q)
        if len(self.batches):
            self.batches.prune(lambda mm, bid: self.asked(mm, bid) is not None)
        return cmds

    def _expire(self, f: Fetch, now: float) -> list[Command]:
        """``f``'s state deadline (or the caller's) passed."""
        st = f.state
        final = now >= f.final_deadline
        if isinstance(st, Backoff) and not final:
            return self.ask([f], now)
        # the caller's deadline came first, or an offer's window (a read started on the
        # consumer's own judgement of the time left): not the producer's fault
        own = final and now < getattr(st, "due", f.final_deadline)
        if isinstance(st, Reading):
            if not (own or (st.offer and st.due >= st.valid_until)):
                self.link.penalize(now, "read deadline passed")
            return self._quarantine(f, now, MissReason.TIMEOUT, "read deadline passed")
        del self.fetches[f.mm_hash]
        if isinstance(st, Asked):
            self.batches.abandon(st.batch_id, f.mm_hash)
        if f.last_nack is not None and (isinstance(st, Backoff) or final):
            return [Report(Miss(f.mm_hash, NACK_REASON.get(f.last_nack, MissReason.INTERNAL),
                                f"still {f.last_nack.name} at the deadline"))]
        if isinstance(st, Asked):
            why = "parked, but no ack by the end of the producer's wait" if st.parked \
                else "no ack before the deadline"
            if not own:
                self.link.penalize(now, why)
            return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, why))]
        return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, "not connected before the deadline"))]

    # -- how a fetch ends ----------------------------------------------------------------------
    def _finish(self, f: Fetch, outcome: Landed | Miss, now: float) -> list[Command]:
        """End a read: the caller's report first (the release and the completion, which wakes
        ZeroMQ's I/O thread, follow it); then its grant is completed (or given back)."""
        st = f.state
        assert isinstance(st, Reading)
        del self.fetches[f.mm_hash]
        if not outcome.ok:
            self.store.discard(st.entry.mm_hash)
        cmds: list[Command] = [Report(outcome)]
        if st.handle is not None:
            cmds.append(Release(st.handle))
        if self.link.version is not None:
            cmds += self.done(f.mm_hash, st.grant_id, ok=outcome.ok, hold=st.offer)
            if not st.offer:  # a hold is not charged to our pin budget: nothing freed
                self._hurry_busy(now)
        return cmds

    def _hurry_busy(self, now: float) -> None:
        """A grant of ours just ended: the oldest fetch backing off after NACK_BUSY (our pin
        budget at this producer) is asked again at the next poll, after the completion on the
        same ordered connection. One per ended grant: the freed budget fits about one more."""
        busy = [g for g in self.fetches.values() if isinstance(g.state, Backoff)
                and g.state.nack is Status.NACK_BUSY and not g.state.hurried]
        if busy:
            g = min(busy, key=lambda x: x.started)
            st = g.state
            assert isinstance(st, Backoff)
            g.go("hurry", replace(st, retry_at=now, hurried=True))

    def _quarantine(self, f: Fetch, now: float, reason: MissReason,
                    detail: str) -> list[Command]:
        """Give up a read: reported now; its landing blocks kept (``Quarantined``) while the DMA
        may still land, freed at once if nothing was posted."""
        st = f.state
        assert isinstance(st, Reading)
        del self.fetches[f.mm_hash]
        cmds: list[Command] = [Report(Miss(f.mm_hash, reason, detail + "; transfer quarantined"))]
        if st.handle is None:  # nothing in flight on the data plane
            self.store.discard(st.entry.mm_hash)
            return cmds
        f.go("quarantine", Quarantined(st.entry, st.handle, now + self.settings.quarantine_s,
                                       st.grant_id))
        self.quarantine[f.mm_hash] = f
        c = self.link
        log.info("transfer quarantined for %.0f s: %s", self.settings.quarantine_s, detail,
                 extra={"peer": c.conn, "session_id": c.session_id, "mm_hash": f.mm_hash[:12],
                        "grant_id": st.grant_id})
        c.emit("transfer_quarantined", mm_hash=f.mm_hash[:12], grant_id=st.grant_id,
               reason=reason.value)
        if c.live:
            cmds += self.done(f.mm_hash, st.grant_id, ok=False, hold=st.offer)
            self._hurry_busy(now)
        return cmds

    def _settle(self, q: Fetch) -> list[Command]:
        """A quarantined transfer is over: release its handle, free its blocks."""
        st = q.state
        assert isinstance(st, Quarantined)
        del self.quarantine[q.mm_hash]
        if st.entry is not None:
            self.store.discard(st.entry.mm_hash)
        return [Release(st.handle)]

    def fail_all(self, miss: Miss) -> list[Command]:
        """The session failed: every fetch misses with ``miss`` (reads are quarantined from
        their read deadline, their grants given back while the connection is up)."""
        return self._end_all(miss, None, miss.detail)

    def peer_down(self, now: float, why: str) -> list[Command]:
        """The producer went away (the link is down already: no completion is sent): waiting
        fetches miss (retryable), reads are quarantined from ``now``."""
        miss = Miss("", MissReason.PEER_DOWN, why + " (retryable)")
        return self._end_all(miss, now, "producer went away mid-read")

    def _end_all(self, miss: Miss, at: float | None, read_detail: str) -> list[Command]:
        cmds: list[Command] = []
        for f in list(self.fetches.values()):
            if isinstance(f.state, Reading):
                cmds += self._quarantine(f, f.state.due if at is None else at, miss.reason,
                                         read_detail)
            else:
                del self.fetches[f.mm_hash]
                cmds.append(Report(replace(miss, mm_hash=f.mm_hash)))
        self.batches.clear()  # their answers can no longer come
        self.renewals.reset()
        return cmds

    def settle_all(self) -> list[Command]:  # shutdown
        return [c for q in list(self.quarantine.values()) for c in self._settle(q)]

    def done(self, mm_hash: str, grant_id: int, ok: bool, *, hold: bool = False) -> list[Command]:
        """Complete (``ok``) or give back a grant, or a hold read on an offer (``hold``)
        (:class:`.Completions`)."""
        return self.completions.add(mm_hash, grant_id, ok,
                                    self.link.version or self.link.max_version, hold=hold)

    def flush(self, now: float | None = None) -> list[Command]:
        """The queued completions (v2: together): with ``now`` only once due (a poll), else at
        once (:meth:`.Completions.flush`)."""
        return self.completions.flush(self.link.version, now)
