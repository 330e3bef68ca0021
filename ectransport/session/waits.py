"""ECTP v2 readiness waits at the producer: batch items whose entry is reserved but not ready,
parked until it becomes ready, goes away, or their wait is over (``protocols/ectp-v2.md`` §6).

:class:`WaitQueue` is owned by a :class:`~ectransport.session.producer.ProducerSession`; a
parked item holds no pin and charges nothing. The session answers what the queue hands back:
:meth:`WaitQueue.take` (the entry changed) and :meth:`WaitQueue.due` (the wait is over:
NACK_NOT_READY). At most :data:`MAX_WAITING_PER_PEER` items wait per consumer connection; beyond
it an item is answered NACK_NOT_READY at once, as in v1 (bounds the producer's memory whatever a
consumer sends: 64 items per frame, frames rate-limited, waits up to 60 s).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

MAX_WAITING_PER_PEER = 1024


@dataclass(eq=False)
class WaitingItem:
    """One parked item of ``batch_id`` from ``peer``: answered in an ``AckBatch`` of that batch
    (``v``, ``inline_max`` as the batch asked) once the entry changes or at ``until`` (session
    clock, seconds; it was received at ``received``)."""

    peer: Any
    session_id: str
    batch_id: int
    mm_hash: str
    v: int
    inline_max: int
    received: float
    until: float
    answered: bool = False


class WaitQueue:
    """The parked items, by mm_hash in arrival order, with their deadlines (module docstring)."""

    def __init__(self) -> None:
        self._by_mm: dict[str, list[WaitingItem]] = {}
        self._heap: list[tuple[float, int, WaitingItem]] = []  # answered ones leave lazily
        self._seq = 0
        self._per_batch: dict[tuple[Any, int], int] = {}  # (peer, batch id) -> items waiting

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_mm.values())

    def mm_hashes(self) -> list[str]:
        return list(self._by_mm)

    def waits_for(self, mm_hash: str) -> bool:
        return mm_hash in self._by_mm

    def waiting_in(self, peer: Any, batch_id: int) -> int:
        """Items of ``peer``'s batch ``batch_id`` still waiting (its id must not be re-used)."""
        return self._per_batch.get((peer, batch_id), 0)

    def count(self, peer: Any) -> int:
        return sum(n for (p, _), n in self._per_batch.items() if p == peer)

    def has_room(self, peer: Any) -> bool:
        return self.count(peer) < MAX_WAITING_PER_PEER

    def next_deadline(self) -> float | None:
        """When the next parked item's wait is over (session clock), or None."""
        while self._heap and self._heap[0][2].answered:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def park(self, w: WaitingItem) -> None:
        self._by_mm.setdefault(w.mm_hash, []).append(w)
        self._seq += 1
        heapq.heappush(self._heap, (w.until, self._seq, w))
        key = (w.peer, w.batch_id)
        self._per_batch[key] = self._per_batch.get(key, 0) + 1

    def take(self, mm_hash: str) -> list[WaitingItem]:
        """Every item waiting for ``mm_hash``, in arrival order, now answered (removed)."""
        items = self._by_mm.pop(mm_hash, [])
        for w in items:
            self._answered(w)
        return items

    def due(self, now: float) -> list[WaitingItem]:
        """The items whose wait is over at ``now``, now answered (removed)."""
        out: list[WaitingItem] = []
        while self._heap and (self._heap[0][2].answered or self._heap[0][0] <= now):
            _, _, w = heapq.heappop(self._heap)
            if w.answered:
                continue
            items = self._by_mm[w.mm_hash]
            items.remove(w)
            if not items:
                del self._by_mm[w.mm_hash]
            self._answered(w)
            out.append(w)
        return out

    def drop_peer(self, peer: Any) -> None:
        """``peer`` went away (or its session was replaced): its items are dropped unanswered."""
        for mm in list(self._by_mm):
            keep = []
            for w in self._by_mm[mm]:
                if w.peer == peer:
                    w.answered = True
                else:
                    keep.append(w)
            if keep:
                self._by_mm[mm] = keep
            else:
                del self._by_mm[mm]
        for key in [k for k in self._per_batch if k[0] == peer]:
            del self._per_batch[key]

    def clear(self) -> None:
        for items in self._by_mm.values():
            for w in items:
                w.answered = True
        self._by_mm.clear()
        self._heap.clear()
        self._per_batch.clear()

    def _answered(self, w: WaitingItem) -> None:
        w.answered = True
        key = (w.peer, w.batch_id)
        left = self._per_batch.get(key, 0) - 1
        if left > 0:
            self._per_batch[key] = left
        else:
            self._per_batch.pop(key, None)

    def check(self, sessions: dict[Any, tuple[str, int]]) -> None:
        """Assert every item is indexed once and belongs to a live v2 session (``sessions``:
        peer → (session id, version))."""
        counted: dict[tuple[Any, int], int] = {}
        for mm, items in self._by_mm.items():
            assert items, f"empty waiting list for {mm[:12]}"
            for w in items:
                assert not w.answered and w.mm_hash == mm, f"waiting item {w} answered"
                sid, v = sessions.get(w.peer, ("", 0))
                assert sid == w.session_id and v >= 2, f"waiting item {w} has no v2 session"
                counted[(w.peer, w.batch_id)] = counted.get((w.peer, w.batch_id), 0) + 1
        assert counted == self._per_batch, f"waiting items {counted} != {self._per_batch}"
        live = {id(w) for _, _, w in self._heap if not w.answered}
        assert live == {id(w) for items in self._by_mm.values() for w in items}, (
            "a waiting item without its deadline")
