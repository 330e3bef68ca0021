"""ECTP v2 at the consumer: answers to batches, parked items, inline entries
(``protocols/ectp-v2.md``), and the answer to one request that v1's ``XferAck`` shares.

:class:`ConsumerBatches` sits between :class:`~ectransport.session.consumer_state.ConsumerState`
(the state kept, how a fetch ends) and :class:`~ectransport.session.consumer.ConsumerSession` (the
events, Welcome and binding, v1's ``XferAck``), which derives from it.

**ECTP v2** (negotiated in Hello; a v1 session behaves exactly as the docstring of
:mod:`ectransport.session.consumer` says). Every request is a ``ReqBatch`` — one item for
:meth:`~ectransport.session.consumer.ConsumerSession.fetch`, several for
:meth:`~ectransport.session.consumer.ConsumerSession.fetch_many` and for the fetches queued before
the Welcome — and is answered item by item in ``AckBatch`` frames of its
``batch_id``:

* ``wait_s`` is the fetch's remaining time minus a margin: the producer parks an entry that is
  reserved but not ready and answers when it is (or NACK_NOT_READY at the end of the wait), so
  there is no NOT_READY polling; a NOT_READY after a real wait is asked again at once, one that
  came back sooner backs off as in v1;
* every item must be answered or named in a ``Parked`` frame within ``ack_timeout_s`` of the
  send, as an ``XferReq`` in v1: otherwise it misses (TIMEOUT) and the producer is quarantined
  — a stopped or hung producer is found in the ack timeout, not at the end of the wait. A
  parked item's answer is due by ``sent + min(Parked.wait_s, wait_s) + ack_timeout_s`` (never
  after the fetch's deadline);
* an OK item with ``data`` (no grant) is an *inline* entry: its bytes are copied into local
  blocks (:class:`Land`, then the :class:`Report`) — no READ, no XferDone, no lease;
* a grant follows v1's rules: validity window from when the ReqBatch was sent, XferDone after
  the READ, Renew, quarantine; the READs of one AckBatch are posted together;
* hostile answers are never a success with wrong bytes: an AckBatch of another session or for a
  batch never sent, an item not named by its batch, a second answer for an item, a ``Parked``
  naming such an item, one already answered or parked → ignored (logged, counted in
  :attr:`ignored`); inline data larger than the batch's ``inline_max``, not a whole
  number of rows, of a size other than expected, or next to a grant → that fetch misses
  (INTERNAL). State stays bounded: one :class:`~ectransport.session.fetch.Batch` per waiting
  request at most, the abandoned-request memory capped at 1024.
"""

from __future__ import annotations

import collections
import logging

from ectransport.protocol import RETRYABLE, AckBatch, Grant, Parked, Status
from ectransport.session.commands import (
    Command,
    Land,
    Landed,
    Miss,
    MissReason,
    PostRead,
    Report,
)
from ectransport.session.consumer_state import ConsumerState
from ectransport.session.fetch import (
    MAX_LATE_GRANTS,
    NACK_REASON,
    Batch,
    Fetch,
    FetchState,
    grant_problem,
    inline_problem,
    parked_deadline,
    valid_until,
)
from ectransport.session.grants import notif_for
from ectransport.store import AllocFailed

log = logging.getLogger("ectransport.session.consumer")


class ConsumerBatches(ConsumerState):
    """The v2 frames of a consumer session and the answer to a request (see the module
    docstring); the other events are in :class:`~ectransport.session.consumer.ConsumerSession`,
    which derives from this."""

    def _on_acks(self, msg: AckBatch, now: float) -> list[Command]:
        """ECTP v2: answers to items of one of our ReqBatch frames (see the module docstring for
        what is ignored and what misses)."""
        if msg.session_id != self.session_id:
            return self._ignore("foreign_session", f"an AckBatch for session "
                                f"{msg.session_id[:32]!r}, not ours")
        b = self._batches.get(msg.batch_id)
        cmds: list[Command] = []
        inline: list[str] = []  # local keys of the inline entries landed by this frame
        for it in msg.items:
            f = self._fetches.get(it.mm_hash)
            if (b is None or it.mm_hash not in b.waiting or f is None
                    or f.state is not FetchState.WAITING_ACK or f.batch_id != msg.batch_id):
                cmds += self._stray(b, msg.batch_id, it.mm_hash, it.status, it.grant)
                continue
            b.waiting.discard(it.mm_hash)
            cmds += self._on_answer(f, it.status, it.grant, it.detail, now, it.data, b, inline)
        if b is not None and not b.waiting:
            del self._batches[msg.batch_id]
            self._answered[msg.batch_id] = None
            while len(self._answered) > 256:
                self._answered.popitem(last=False)
        # inline entries become READY (evictable until the node pins them for the caller) only
        # now: a later item's allocation above must not evict blocks whose Land is still to come
        for key in inline:
            self.store.mark_ready(key)
        return cmds

    def _on_parked(self, msg: Parked, now: float) -> list[Command]:
        """ECTP v2: the producer parked these items of one of our batches (their entries are
        reserved, not ready): each one's answer is now due by the end of the wait the producer
        honours (:func:`~ectransport.session.fetch.parked_deadline`) instead of within the ack
        timeout. Items of another session or of a batch not waiting, not named by the batch,
        already answered (or given up on), or parked already are ignored and counted
        (``parked_*`` in :attr:`ignored`; one warning per reason and frame); nothing is ever
        answered, and nothing is kept but the item's mark in its batch (at most 64)."""
        if msg.session_id != self.session_id:
            return self._ignore("parked_foreign_session", f"a Parked frame for session "
                                f"{msg.session_id[:32]!r}, not ours", len(msg.items))
        b = self._batches.get(msg.batch_id)
        if b is None:
            why = "parked_answered" if msg.batch_id in self._answered else "parked_unknown_batch"
            return self._ignore(why, f"a Parked frame for batch {msg.batch_id}, which is not one "
                                f"of ours waiting for answers", len(msg.items))
        strays: collections.Counter[str] = collections.Counter()
        for mm in msg.items:
            f = self._fetches.get(mm)
            if mm not in b.items:
                strays["parked_not_in_batch"] += 1
            elif (mm not in b.waiting or f is None or f.state is not FetchState.WAITING_ACK
                  or f.batch_id != msg.batch_id):  # answered, or given up on (timed out)
                strays["parked_answered"] += 1
            elif mm in b.parked:
                strays["parked_twice"] += 1
            else:
                b.parked.add(mm)
                f.deadline = parked_deadline(b.sent, b.wait_s, msg.wait_s,
                                             self.config.ack_timeout_s, f.final_deadline)
        for why, n in strays.items():
            self._ignore(why, f"{n} item(s) of a Parked frame for batch {msg.batch_id}", n)
        return []

    def _stray(self, b: Batch | None, batch_id: int, mm_hash: str, status: Status,
               grant: Grant | None) -> list[Command]:
        """An AckBatch item no fetch waits for: the late grant of a request we gave up on is
        given back (once); anything else is ignored and counted, never answered (no
        reflection)."""
        key = (batch_id, mm_hash)
        if key in self._abandoned:
            del self._abandoned[key]
            if status is Status.OK and grant is not None:
                return self._done(mm_hash, grant.grant_id, ok=False)
            return []
        if b is None and batch_id in self._answered:
            return self._ignore("second_answer", f"an answer for {mm_hash[:12]!r} in batch "
                                f"{batch_id}, answered in full already")
        if b is None:
            return self._ignore("unknown_batch", f"an answer for batch {batch_id}, which is not "
                                "one of ours waiting for answers")
        if mm_hash in b.items and mm_hash not in b.waiting:
            return self._ignore("second_answer", f"a second answer for {mm_hash[:12]!r} in batch "
                                f"{batch_id}")
        return self._ignore("not_in_batch", f"an answer for {mm_hash[:12]!r}, which batch "
                            f"{batch_id} does not name")

    def _ignore(self, why: str, detail: str, n: int = 1) -> list[Command]:
        self.ignored[why] += n
        log.warning("producer %s: ignored %s", self.conn, detail,
                    extra={"peer": self.conn, "session_id": self.session_id})
        return []

    def _on_answer(self, f: Fetch, status: Status, g: Grant | None, detail: str, now: float,
                   data: bytes = b"", batch: Batch | None = None,
                   inline: list[str] | None = None) -> list[Command]:
        """The answer for a waiting fetch (an XferAck, or an AckBatch item of ``batch``; the
        local keys of inline entries it lands are appended to ``inline``, for the caller to
        mark READY once the whole frame is handled)."""
        f.timings["ack"] = now
        if status in RETRYABLE:
            f.last_nack = status
            f.retry_s = min(
                max(f.retry_s * 2, self.config.retry_backoff_s), self.config.retry_backoff_max_s
            )
            f.state = FetchState.BACKOFF
            # v2: a NOT_READY after the producer really waited is asked again at once (a new
            # wait, not a poll); one that came back sooner (a producer that does not wait) backs
            # off as in v1, so the frame rate stays bounded
            waited = (batch is not None and status is Status.NACK_NOT_READY
                      and now - f.req_sent >= self.config.retry_backoff_max_s)
            f.deadline = min(f.final_deadline, now if waited else now + f.retry_s)
            return []
        if status is not Status.OK:
            del self._fetches[f.mm_hash]
            if status is Status.NACK_INTERNAL:
                self._penalize(now, f"NACK_INTERNAL: {detail}")
            reason = NACK_REASON.get(status, MissReason.INTERNAL)
            why = f"{status.name}: {detail}" if detail else status.name
            return [Report(Miss(f.mm_hash, reason, why))]
        if batch is not None and inline is not None and (
                data or (g is None and batch.inline_max > 0)):
            return self._land_inline(f, g, data, batch, now, inline)
        bad = grant_problem(g, self.plane, self.store)
        if bad:  # refused, never clamped: a producer that sends this is broken or hostile
            del self._fetches[f.mm_hash]
            cmds: list[Command] = [Report(Miss(f.mm_hash, MissReason.INTERNAL, f"bad grant: {bad}"))]
            if g is not None:
                cmds += self._done(f.mm_hash, g.grant_id, ok=False)
            return cmds
        assert g is not None
        window_end = valid_until(f.req_sent, g.lease_s, self.config.validity_margin_s)
        if now >= window_end:  # the lease may be over already: never use this grant (§6.3)
            cmds = self._done(f.mm_hash, g.grant_id, ok=False)
            late = now - window_end
            f.late_grants += 1
            if f.late_grants <= MAX_LATE_GRANTS and now + self.config.ack_timeout_s < f.final_deadline:
                log.warning("grant for %s handled %.3f s after its validity window; asking again",
                            f.mm_hash[:12], late, extra={"peer": self.conn})
                return cmds + self._send_req(f, now)
            del self._fetches[f.mm_hash]
            return cmds + [Report(Miss(
                f.mm_hash, MissReason.TIMEOUT,
                f"grant handled {late:.3f} s after its validity window (lease {g.lease_s} s from "
                f"the request); not used"))]
        return self._use_grant(f, g, window_end, now)

    def _use_grant(self, f: Fetch, g: Grant, window_end: float, now: float) -> list[Command]:
        """Read the usable grant ``g`` for ``f`` (WAITING_ACK) until ``window_end`` (consumer
        clock): allocate its landing blocks and post the READ (an answered request, or an offer:
        :mod:`ectransport.session.consumer_offers`)."""
        f.grant_id, f.lease_s, f.valid_until = g.grant_id, g.lease_s, window_end
        self._seq += 1
        # landing keys are unique per consumer node: the session id is (UUID4), the sequence
        # is per session — fetches of one mm_hash from several producers never collide
        entry = self.store.alloc(f"{f.mm_hash}#{self.session_id}.{self._seq}", g.entry_bytes)
        if isinstance(entry, AllocFailed):
            del self._fetches[f.mm_hash]
            return [
                *self._done(f.mm_hash, g.grant_id, ok=False),
                Report(
                    Miss(
                        f.mm_hash,
                        MissReason.NO_SPACE,
                        f"local region cannot hold {g.entry_bytes} bytes ({entry.reason})",
                    )
                ),
            ]
        f.entry = entry
        f.state = FetchState.READING
        f.deadline = min(f.final_deadline, now + self.config.read_timeout_s, window_end)
        if not any(x.state is FetchState.READING and x is not f for x in self._fetches.values()):
            self._next_renew = now + f.lease_s / 6
        notif = (notif_for((self.session_id, f.mm_hash, g.grant_id))
                 if self.config.request_notifications else b"")
        return [PostRead(f.mm_hash, g.plane_grant, entry.runs, g.entry_bytes, notif,
                         self.binding)]

    def _land_inline(self, f: Fetch, g: Grant | None, data: bytes, batch: Batch,
                     now: float, inline: list[str]) -> list[Command]:
        """An OK AckBatch item carrying the entry itself: checked, copied into local blocks
        (:class:`Land`), reported landed; its local key goes to ``inline`` (see
        :meth:`_on_answer`). Nothing of the producer is held, so there is nothing to complete."""
        bad = inline_problem(data, batch.inline_max, self.store.block_bytes, f.expected_bytes)
        if g is not None:
            bad = "an answer with both a grant and inline data"
        if bad:  # refused, never landed: the producer is broken or hostile
            del self._fetches[f.mm_hash]
            self.ignored["bad_inline"] += 1
            log.warning("producer %s: %s for %s; refused", self.conn, bad, f.mm_hash[:12],
                        extra={"peer": self.conn, "session_id": self.session_id})
            cmds: list[Command] = [Report(Miss(f.mm_hash, MissReason.INTERNAL,
                                              f"bad inline answer: {bad}"))]
            if g is not None:
                cmds += self._done(f.mm_hash, g.grant_id, ok=False)
            return cmds
        self._seq += 1
        entry = self.store.alloc(f"{f.mm_hash}#{self.session_id}.{self._seq}", len(data))
        del self._fetches[f.mm_hash]
        if isinstance(entry, AllocFailed):
            return [Report(Miss(f.mm_hash, MissReason.NO_SPACE,
                                f"local region cannot hold {len(data)} bytes ({entry.reason})"))]
        inline.append(entry.mm_hash)
        f.timings["landed"] = now
        self._backoff = self.config.peer_backoff_s
        return [Land(entry.runs, data),
                Report(Landed(f.mm_hash, entry, self.plane or "",
                              {k: v - f.started for k, v in f.timings.items()}, -1))]
