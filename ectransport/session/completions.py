"""A consumer session's completions: ``XferDone`` (a grant completed, or given back).

On ECTP v1 each leaves at once. On v2 completions are queued and leave together
(:meth:`Completions.flush`: one ``XferDone`` for one, a ``DoneBatch`` per 64 for more — or one
``XferDone`` each to a producer whose Welcome did not say it takes ``DoneBatch``), always before
a request of the session, since a grant given back must reach the producer before a request for
the same entry (else the producer would answer that live grant again, whose lease began before
this request, and the validity window would not hold). When they leave:

- a grant's completion (it unpins blocks at the producer and frees our pin budget there) at the
  end of the step that queued it;
- a *hold's* (a read on an offer, ECTP v2 §10: it releases nothing, the producer only counts it)
  at the latest ``done_delay_s`` after the session's poll first saw it queued, at once when 64
  are queued, or with a grant's or a request. Each completion frame wakes ZeroMQ's I/O thread
  and the producer, which then compete for the cores with the consumer's next fetch: announced
  64 KiB fetches back to back on 2 vCPUs (``benchmarks/profile_fetch.py --announced``) took
  p50 ~250 → ~190 µs, and the producer's CPU per fetch ~75 → ~15 µs.

A grant's completion is not held back the same way: the next request would then carry it, and the
producer handles it before that request, on the next fetch's critical path (1 MiB requests back
to back: p50 ~570 → ~680 µs when tried).
"""

from __future__ import annotations

from ectransport.protocol import MAX_BATCH_ITEMS, DoneBatch, DoneItem, XferDone, encode
from ectransport.session.commands import Command, Send


class Completions:
    """Completions of one consumer session on connection ``conn`` (module docstring)."""

    def __init__(self, conn: str, session_id: str, delay_s: float = 0.0):
        self.conn = conn
        self.session_id = session_id
        self.delay_s = delay_s
        #: the producer takes DoneBatch frames (its Welcome said ``"dones"``)
        self.batched = False
        #: when the queued completions leave (consumer clock, s); None until a poll saw them
        self.due: float | None = None
        self._queued: list[DoneItem] = []
        self._urgent = False  # a grant's completion is queued: they all leave at the next poll

    def add(self, mm_hash: str, grant_id: int, ok: bool, version: int, *,
            hold: bool = False) -> list[Command]:
        """Complete (``ok``) or give back a grant (``hold``: a hold's, read on an offer) on a
        session at ``version``: the frame now (v1), or nothing until :meth:`flush` (v2)."""
        if version >= 2:
            self._queued.append(DoneItem(mm_hash=mm_hash, grant_id=grant_id, ok=ok))
            self._urgent = self._urgent or not hold
            return []
        return [Send(self.conn, encode(XferDone(v=version, session_id=self.session_id,
                                                mm_hash=mm_hash, grant_id=grant_id, ok=ok)))]

    def flush(self, version: int | None, now: float | None = None) -> list[Command]:
        """The queued completions as frames; dropped when ``version`` is None (the session is no
        longer welcomed: the producer released them itself). With ``now`` (a poll) only once
        they are due (module docstring: a grant's at once; holds' once the first such poll's
        :attr:`due` came, or a ``DoneBatch`` is full); without it (before a request, at close)
        at once."""
        if now is not None and self._queued and version is not None and not self._urgent \
                and len(self._queued) < MAX_BATCH_ITEMS:
            if self.due is None:
                self.due = now + self.delay_s
            if now < self.due:
                return []
        items, self._queued, self.due, self._urgent = self._queued, [], None, False
        if not items or version is None:
            return []
        if len(items) == 1 or not self.batched:
            return [Send(self.conn, encode(XferDone(v=version, session_id=self.session_id,
                                                    mm_hash=it.mm_hash, grant_id=it.grant_id,
                                                    ok=it.ok))) for it in items]
        return [Send(self.conn, encode(DoneBatch(v=version, session_id=self.session_id,
                                                 items=items[i:i + MAX_BATCH_ITEMS])))
                for i in range(0, len(items), MAX_BATCH_ITEMS)]
