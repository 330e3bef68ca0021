"""A consumer session's completions: ``XferDone`` (a grant completed, or given back).

On ECTP v1 each leaves at once. On v2 completions are queued and leave together
(:meth:`Completions.flush`: one ``XferDone`` for one, a ``DoneBatch`` per 64 for more — or one
``XferDone`` each to a producer whose Welcome did not say it takes ``DoneBatch``): at the latest
``done_delay_s`` after the session's poll first saw them queued, at once when 64 are queued, and
always before a request of the session, since a grant given back must reach the producer before
a request for the same entry (else the producer would answer that live grant again, whose lease
began before this request, and the validity window would not hold).

Why wait at all: every completion frame wakes ZeroMQ's I/O thread and, behind it, the producer,
which then compete for the cores with the consumer's next fetch. On a 2-vCPU host, sending each
announced 64 KiB read's ``XferDone`` at once doubled its latency (p50 ~110 → ~210 µs, fetches
back to back in one process); a few milliseconds more of pin at the producer (whose lease is
seconds) costs nothing.
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

    def add(self, mm_hash: str, grant_id: int, ok: bool, version: int) -> list[Command]:
        """Complete (``ok``) or give back a grant on a session at ``version``: the frame now
        (v1), or nothing until :meth:`flush` (v2)."""
        if version >= 2:
            self._queued.append(DoneItem(mm_hash=mm_hash, grant_id=grant_id, ok=ok))
            return []
        return [Send(self.conn, encode(XferDone(v=version, session_id=self.session_id,
                                                mm_hash=mm_hash, grant_id=grant_id, ok=ok)))]

    def flush(self, version: int | None, now: float | None = None) -> list[Command]:
        """The queued completions as frames; dropped when ``version`` is None (the session is no
        longer welcomed: the producer released them itself). With ``now`` (a poll) only once
        they are due (module docstring: the first such poll sets :attr:`due`) or a
        ``DoneBatch`` is full; without it (before a request, at close) at once."""
        if now is not None and self._queued and version is not None \
                and len(self._queued) < MAX_BATCH_ITEMS:
            if self.due is None:
                self.due = now + self.delay_s
            if now < self.due:
                return []
        items, self._queued, self.due = self._queued, [], None
        if not items or version is None:
            return []
        if len(items) == 1 or not self.batched:
            return [Send(self.conn, encode(XferDone(v=version, session_id=self.session_id,
                                                    mm_hash=it.mm_hash, grant_id=it.grant_id,
                                                    ok=it.ok))) for it in items]
        return [Send(self.conn, encode(DoneBatch(v=version, session_id=self.session_id,
                                                 items=items[i:i + MAX_BATCH_ITEMS])))
                for i in range(0, len(items), MAX_BATCH_ITEMS)]
