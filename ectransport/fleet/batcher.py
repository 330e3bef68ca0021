"""``LookupBatcher``: a scheduler's directory lookups, one round trip per step, never blocking.

    batcher = LookupBatcher(directory)
    # each scheduler step:
    for item in items_without_params:
        holders = batcher.result(item.mm_hash)      # None: not answered yet
        if holders is None:
            batcher.want(item.mm_hash, nbytes=item.nbytes)
        elif holders:
            fetch_from(holders)                      # best first; next holder on a miss
        else:
            encode_locally(item)                     # [] = nobody holds it (or no directory)
    batcher.flush()                                  # one pipeline for every new want

``flush`` submits the step's wants as one :meth:`Directory.submit_lookup` (the lookup thread
runs it); answers arrive on that thread and are kept for ``answer_ttl_s`` for :meth:`result`.
During an outage every want is answered ``[]`` at once (the directory's backoff) and
:attr:`last_unavailable` says why.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ectransport.fleet.outcomes import DirectoryUnavailable, Holder, Lookup


class LookupBatcher:
    """Batch and cache lookups for a caller that must never block (see module docstring).

    Args:
        directory: a :class:`~ectransport.fleet.Directory` with a trust predicate.
        max_batch: items per round trip at most (the rest wait for the next flush).
        answer_ttl_s: how long an answer is reused, s.
        max_answers: answers kept at most (oldest dropped first).
        clock: monotonic seconds.
    """

    def __init__(self, directory: Any, *, max_batch: int = 256, answer_ttl_s: float = 1.0,
                 max_answers: int = 65536, clock: Callable[[], float] = time.monotonic):
        self.directory = directory
        self.max_batch = max_batch
        self.answer_ttl_s = answer_ttl_s
        self.max_answers = max_answers
        self.clock = clock
        self._lock = threading.Lock()
        self._wanted: OrderedDict[str, int | None] = OrderedDict()
        self._in_flight: set[str] = set()
        self._answers: OrderedDict[str, tuple[list[Holder], float]] = OrderedDict()
        self.last_unavailable: DirectoryUnavailable | None = None
        self.round_trips = 0

    def want(self, mm_hash: str, nbytes: int | None = None) -> None:
        """Ask for ``mm_hash`` at the next :meth:`flush` (no-op if answered or in flight)."""
        with self._lock:
            if mm_hash in self._in_flight or self._fresh(mm_hash) is not None:
                return
            self._wanted[mm_hash] = nbytes

    def flush(self) -> int:
        """Submit the wants since the last flush as one lookup; returns how many items."""
        with self._lock:
            batch: dict[str, int | None] = {}
            while self._wanted and len(batch) < self.max_batch:
                mm_hash, nbytes = self._wanted.popitem(last=False)
                batch[mm_hash] = nbytes
            self._in_flight |= set(batch)
        if not batch:
            return 0
        sizes = {m: n for m, n in batch.items() if n is not None}
        self.round_trips += 1
        self.directory.submit_lookup(list(batch), nbytes=sizes or None,
                                     callback=lambda found: self._answered(list(batch), found))
        return len(batch)

    def _answered(self, asked: list[str], found: Lookup) -> None:
        now = self.clock()
        with self._lock:
            self.last_unavailable = found.unavailable
            for mm_hash in asked:
                self._in_flight.discard(mm_hash)
                self._answers.pop(mm_hash, None)
                self._answers[mm_hash] = (list(found.get(mm_hash, [])), now)
            while len(self._answers) > self.max_answers:
                self._answers.popitem(last=False)

    def result(self, mm_hash: str) -> list[Holder] | None:
        """The holders of ``mm_hash`` (best first; ``[]`` = miss), or None if not answered."""
        with self._lock:
            return self._fresh(mm_hash)

    def pending(self, mm_hash: str) -> bool:
        """True while ``mm_hash`` is wanted or in flight."""
        with self._lock:
            return mm_hash in self._wanted or mm_hash in self._in_flight

    def forget(self, mm_hash: str) -> None:
        """Drop the answer for ``mm_hash`` (e.g. every holder failed: ask again next step)."""
        with self._lock:
            self._answers.pop(mm_hash, None)
            self._wanted.pop(mm_hash, None)

    def _fresh(self, mm_hash: str) -> list[Holder] | None:
        hit = self._answers.get(mm_hash)
        if hit is None:
            return None
        if self.clock() - hit[1] > self.answer_ttl_s:
            del self._answers[mm_hash]
            return None
        return hit[0]
