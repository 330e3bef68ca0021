"""The producer's pin ledger: bytes pinned per consumer identity (the pin budget), and the pins of
ended grants and holds held back for their grace period.

**Grace period** (ECTP v1 §8.4). On a plane whose grants cannot be revoked (one-sided READ, e.g.
NIXL: the consumer reads the region without asking), a grant that ended other than by a confirmed
completion keeps its pin for ``grace_s`` more seconds: its blocks are not re-allocated while a
consumer may still be reading them. Held-back pins stay charged to their identity until they are
dropped, so a consumer cannot pin more than its budget by giving grants back. The consumer's own
half of the rule (it uses a grant only inside ``request sent + lease − margin`` on its own clock)
is in :mod:`ectransport.session.fetch`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from ectransport.store import BlockStore


class PinLedger:
    """Pins charged per identity, and pins held back until a moment (session clock, seconds).

    Every pin a grant or a hold takes is charged here (:meth:`charge`) and leaves exactly once:
    :meth:`unpin` at once, or :meth:`hold_back` then :meth:`release_due` (or :meth:`release_all`
    at shutdown).
    """

    def __init__(self, store: BlockStore):
        self.store = store
        self._by: dict[str, int] = {}
        #: (until, mm_hash, entry_id, identity, bytes) of pins held back
        self._grace: list[tuple[float, str, int, str, int]] = []

    def charged(self, identity: str) -> int:
        """Bytes pinned for ``identity`` now, held-back pins included."""
        return self._by.get(identity, 0)

    def total(self) -> int:
        return sum(self._by.values())

    def by_identity(self) -> dict[str, int]:
        """Pinned bytes per identity; a copy."""
        return dict(self._by)

    @property
    def held_back(self) -> int:
        """Pins held back for their grace period now."""
        return len(self._grace)

    def held_back_pins(self) -> Iterator[tuple[str, int, str, int]]:
        """``(mm_hash, entry_id, identity, bytes)`` of every pin held back (for invariants)."""
        for _, mm_hash, entry_id, identity, nbytes in self._grace:
            yield mm_hash, entry_id, identity, nbytes

    def charge(self, identity: str, nbytes: int) -> None:
        """A pin of ``nbytes`` (whole blocks) was taken for ``identity``."""
        self._by[identity] = self._by.get(identity, 0) + nbytes

    def unpin(self, mm_hash: str, entry_id: int, identity: str, nbytes: int) -> None:
        """Drop a pin now and its charge."""
        self.store.unpin(mm_hash, entry_id)
        left = self._by.get(identity, 0) - nbytes
        if left > 0:
            self._by[identity] = left
        else:
            self._by.pop(identity, None)

    def hold_back(self, until: float, mm_hash: str, entry_id: int, identity: str,
                  nbytes: int) -> None:
        """Keep a pin (and its charge) until ``until``; :meth:`release_due` drops it then."""
        heapq.heappush(self._grace, (until, mm_hash, entry_id, identity, nbytes))

    def release_due(self, now: float) -> None:
        """Drop the held-back pins whose time has come."""
        while self._grace and self._grace[0][0] <= now:
            _, mm_hash, entry_id, identity, nbytes = heapq.heappop(self._grace)
            self.unpin(mm_hash, entry_id, identity, nbytes)

    def release_all(self) -> None:
        """Shutdown: every held-back pin goes now (the planes close next)."""
        grace, self._grace = self._grace, []
        for _, mm_hash, entry_id, identity, nbytes in grace:
            self.unpin(mm_hash, entry_id, identity, nbytes)
