"""The directory's counters and its lookup-latency histogram (``Directory.stats()``)."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Mapping

#: Lookup latency buckets, s: a loopback round trip (~0.1 ms) up to the largest timeout.
LOOKUP_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)

#: Every counter :meth:`FleetStats.snapshot` reports (0 until it moves).
COUNTERS = (
    "lookups",
    "lookup_items",
    "hits",
    "misses",
    "unavailable",
    "dropped_malformed",
    "dropped_version",
    "dropped_dead",
    "dropped_stale",
    "dropped_mismatch",
    "dropped_bad_key",
    "dropped_incompatible",
    "dropped_size",
    "dropped_untrusted",
    "dropped_bad_reply",
    "skipped_self",
    "cleaned",
    "claims_won",
    "claims_lost",
    "claims_waited",
    "claims_expired",
    "claims_wait_timeout",
    "claims_released",
    "claims_renewed",
    "claims_taken_over",
    "claims_renewal_lost",
    "claims_hold_expired",
    "published",
    "unpublished",
    "publish_dropped",
    "resyncs",
    "republished",
    "heartbeats",
    "heartbeat_failures",
    "reconnects",
    "name_conflicts",
    "gc_instances",
)


class FleetStats:
    """Thread-safe counters plus the lookup-latency histogram."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._buckets = [0] * (len(LOOKUP_BUCKETS_S) + 1)
        self._sum_s = 0.0
        self._recent: list[float] = []

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def add_many(self, counts: Mapping[str, int], prefix: str = "") -> None:
        with self._lock:
            for k, n in counts.items():
                self._c[prefix + k] += n

    def lookup_latency(self, seconds: float) -> None:
        with self._lock:
            self._buckets[bisect.bisect_left(LOOKUP_BUCKETS_S, seconds)] += 1
            self._sum_s += seconds
            self._recent.append(seconds)
            if len(self._recent) > 4096:
                del self._recent[:2048]

    def snapshot(self) -> dict[str, float]:
        """Every counter, plus ``lookup_seconds_count`` / ``_sum`` and ``lookup_p50_s`` /
        ``lookup_p99_s`` over the last (up to 4096) lookups that reached Redis."""
        with self._lock:
            out: dict[str, float] = {k: self._c.get(k, 0) for k in COUNTERS}
            out.update({k: v for k, v in self._c.items() if k not in out})
            out["lookup_seconds_count"] = sum(self._buckets)
            out["lookup_seconds_sum"] = self._sum_s
            recent = sorted(self._recent)
        out["lookup_p50_s"] = recent[len(recent) // 2] if recent else 0.0
        out["lookup_p99_s"] = (
            recent[min(len(recent) - 1, int(len(recent) * 0.99))] if recent else 0.0
        )
        return out

    def histogram(self) -> tuple[list[tuple[float, int]], float]:
        """Cumulative ``(upper bound s, count)`` per bucket (``inf`` last) and the sum, s."""
        with self._lock:
            counts, total = list(self._buckets), self._sum_s
        acc, out = 0, []
        for bound, n in zip((*LOOKUP_BUCKETS_S, float("inf")), counts):
            acc += n
            out.append((bound, acc))
        return out, total
