"""Prometheus metrics of fleet directories (``pip install 'ectransport[metrics]'``).

    from ectransport.fleet.prom import FleetCollector
    FleetCollector(registry).attach(directory)        # several directories are summed

The same pattern as ``ectransport.metrics.prom``: the directory keeps its counters
(:meth:`Directory.stats`) and the collector reads them at scrape time, so nothing is counted
twice. Families (``ectransport_fleet_*``): ``lookups``, ``lookup_items{outcome=hit|miss}``,
``unavailable``, ``dropped{reason}``, ``claims{outcome=won|lost|waited|expired|taken_over|
wait_timeout|released|renewed|renewal_lost|hold_expired}``, ``published``, ``unpublished``, ``resyncs``, ``heartbeat_failures``,
``publish_queue`` (gauge), ``directory_down`` (gauge), ``lookup_seconds`` (histogram).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from ectransport.errors import ConfigError

_DROPS = (
    "malformed",
    "version",
    "dead",
    "stale",
    "mismatch",
    "bad_key",
    "incompatible",
    "size",
    "untrusted",
    "bad_reply",
)
_CLAIMS = (
    "won",
    "lost",
    "waited",
    "expired",
    "taken_over",
    "wait_timeout",
    "released",
    "renewed",
    "renewal_lost",
    "hold_expired",
)


class FleetCollector:
    """Reads attached directories' counters at scrape time.

    Args:
        registry: a ``prometheus_client.CollectorRegistry``; default the global ``REGISTRY``.

    Raises:
        ConfigError: prometheus_client is not installed.
    """

    def __init__(self, registry: Any = None):
        try:
            import prometheus_client
        except ImportError as e:
            raise ConfigError(
                "metrics need prometheus_client: pip install 'ectransport[metrics]'"
            ) from e
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        self._dirs: list[weakref.ref[Any]] = []
        self._lock = threading.Lock()
        self.registry.register(self)

    def attach(self, directory: Any) -> Any:
        """Collect ``directory``'s metrics; returns it."""
        with self._lock:
            self._dirs.append(weakref.ref(directory))
        return directory

    def _alive(self) -> list[Any]:
        with self._lock:
            alive = [d for ref in self._dirs if (d := ref()) is not None]
            self._dirs = [weakref.ref(d) for d in alive]
        return alive

    def describe(self) -> list[Any]:
        return list(self._families([]))

    def collect(self) -> list[Any]:
        return list(self._families(self._alive()))

    @staticmethod
    def _families(dirs: list[Any]) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        stats = [d.stats() for d in dirs]

        def total(key: str) -> float:
            return sum(float(s.get(key, 0)) for s in stats)

        c = CounterMetricFamily("ectransport_fleet_lookups", "Directory lookups (round trips)")
        c.add_metric([], total("lookups"))
        yield c
        c = CounterMetricFamily(
            "ectransport_fleet_lookup_items",
            "Items looked up, by outcome (hit: a usable holder)",
            labels=["outcome"],
        )
        c.add_metric(["hit"], total("hits"))
        c.add_metric(["miss"], total("misses"))
        yield c
        c = CounterMetricFamily(
            "ectransport_fleet_unavailable",
            "Lookups the directory could not answer (down, timeout, auth, backoff)",
        )
        c.add_metric([], total("unavailable"))
        yield c
        c = CounterMetricFamily(
            "ectransport_fleet_dropped",
            "Holder records dropped by lookups, by reason",
            labels=["reason"],
        )
        for r in _DROPS:
            c.add_metric([r], total("dropped_" + r))
        yield c
        c = CounterMetricFamily(
            "ectransport_fleet_claims", "Claims, by outcome", labels=["outcome"]
        )
        for o in _CLAIMS:
            c.add_metric([o], total("claims_" + o))
        yield c
        for name, key, text in (
            ("published", "published", "Holder records written"),
            ("unpublished", "unpublished", "Holder records withdrawn"),
            ("resyncs", "resyncs", "Full re-publications (after an outage or a restart)"),
            ("heartbeat_failures", "heartbeat_failures", "Failed liveness renewals"),
        ):
            c = CounterMetricFamily("ectransport_fleet_" + name, text)
            c.add_metric([], total(key))
            yield c
        g = GaugeMetricFamily(
            "ectransport_fleet_publish_queue", "Publish/unpublish operations not yet written"
        )
        g.add_metric([], total("publish_queue"))
        yield g
        g = GaugeMetricFamily(
            "ectransport_fleet_directory_down", "Directories in their outage backoff now"
        )
        g.add_metric([], total("directory_down"))
        yield g
        buckets: dict[float, float] = {}
        sum_s = 0.0
        for d in dirs:
            hist, s = d.stats_.histogram()
            sum_s += s
            for bound, n in hist:
                buckets[bound] = buckets.get(bound, 0) + n
        h = HistogramMetricFamily("ectransport_fleet_lookup_seconds", "Lookup round-trip time, s")
        if buckets:
            h.add_metric([], [(_le(b), n) for b, n in sorted(buckets.items())], sum_s)
        yield h


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
