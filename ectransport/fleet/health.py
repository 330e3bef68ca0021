"""Whether to try Redis now: after a failed call, answer "unavailable" at once for a backoff.

Sans-I/O (``now`` is an argument): a scheduler that looks up every step during an outage must
not pay a timeout per step. After a failure, calls are not tried for ``retry_backoff_s``, which
doubles on each further failure up to ``retry_backoff_max_s``; the first success resets it. The
background thread of a holder tries at its own pace (it is the probe).
"""

from __future__ import annotations

import threading

from ectransport.fleet.outcomes import DirectoryUnavailable, UnavailableReason


class Health:
    """The directory's reachability (thread-safe)."""

    def __init__(self, backoff_s: float, backoff_max_s: float):
        self._base = backoff_s
        self._max = max(backoff_max_s, backoff_s)
        self._lock = threading.Lock()
        self._wait = 0.0
        self._until = 0.0
        self.last: DirectoryUnavailable | None = None
        self.failures = 0

    def blocked(self, now: float) -> DirectoryUnavailable | None:
        """None if a call may go to Redis now, else the ``BACKOFF`` outcome to return."""
        with self._lock:
            if self.last is None or now >= self._until:
                return None
            return DirectoryUnavailable(UnavailableReason.BACKOFF,
                                        f"retrying in {self._until - now:.2f} s after "
                                        f"{self.last.reason.value}: {self.last.detail}")

    def failed(self, outcome: DirectoryUnavailable, now: float) -> None:
        with self._lock:
            self._wait = min(self._max, self._wait * 2 if self._wait else self._base)
            self._until = now + self._wait
            self.last = outcome
            self.failures += 1

    def succeeded(self) -> bool:
        """Record a success; True if it ends an outage."""
        with self._lock:
            was_down = self.last is not None
            self.last, self._wait, self._until = None, 0.0, 0.0
            return was_down

    @property
    def down(self) -> bool:
        with self._lock:
            return self.last is not None
