"""A consumer session's completions: ``XferDone`` (a grant completed, or given back).

On ECTP v1 each leaves at once. On v2 the completions of one step are queued and leave together
(:meth:`Completions.flush`: one ``XferDone`` for one, a ``DoneBatch`` per 64 for more — or one
``XferDone`` each to a producer whose Welcome did not say it takes ``DoneBatch``) — always
before a request of the same step, since a grant given back must reach the producer before a
request for the same entry (else the producer would answer that live grant again, whose lease
began before this request, and the validity window would not hold).
"""

from __future__ import annotations

from ectransport.protocol import MAX_BATCH_ITEMS, DoneBatch, DoneItem, XferDone, encode
from ectransport.session.commands import Command, Send


class Completions:
    """Completions of one consumer session on connection ``conn`` (module docstring)."""

    def __init__(self, conn: str, session_id: str):
        self.conn = conn
        self.session_id = session_id
        #: the producer takes DoneBatch frames (its Welcome said ``"dones"``)
        self.batched = False
        self._queued: list[DoneItem] = []

    def add(self, mm_hash: str, grant_id: int, ok: bool, version: int) -> list[Command]:
        """Complete (``ok``) or give back a grant on a session at ``version``: the frame now
        (v1), or nothing until :meth:`flush` (v2)."""
        if version >= 2:
            self._queued.append(DoneItem(mm_hash=mm_hash, grant_id=grant_id, ok=ok))
            return []
        return [Send(self.conn, encode(XferDone(v=version, session_id=self.session_id,
                                                mm_hash=mm_hash, grant_id=grant_id, ok=ok)))]

    def flush(self, version: int | None) -> list[Command]:
        """The queued completions as frames; dropped when ``version`` is None (the session is no
        longer welcomed: the producer released them itself)."""
        items, self._queued = self._queued, []
        if not items or version is None:
            return []
        if len(items) == 1 or not self.batched:
            return [Send(self.conn, encode(XferDone(v=version, session_id=self.session_id,
                                                    mm_hash=it.mm_hash, grant_id=it.grant_id,
                                                    ok=it.ok))) for it in items]
        return [Send(self.conn, encode(DoneBatch(v=version, session_id=self.session_id,
                                                 items=items[i:i + MAX_BATCH_ITEMS])))
                for i in range(0, len(items), MAX_BATCH_ITEMS)]
