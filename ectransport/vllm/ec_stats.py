"""The connector's fleet metrics on vLLM's own ``/metrics`` and stats log, through vLLM's EC
connector stats path (the one its KV connectors use for their transfer metrics).

Each scheduler step vLLM asks the scheduler-side connector for the stats of the last interval
(``get_ec_connector_stats``); the scheduler sends the :class:`ECTransportStats` ``data`` with its
scheduler stats to the front end, which rebuilds it there (``build_ec_connector_stats``), logs a
summary with its periodic stats line and records it in Prometheus
(``build_prom_metrics`` → :class:`ECTransportPromMetrics`). Families, one series per engine:

| metric | type | labels | meaning |
|---|---|---|---|
| ``vllm:ec_fleet_lookup_items`` | counter | ``outcome`` (hit, miss) | items looked up in the fleet directory: held by a usable holder, or not |
| ``vllm:ec_fleet_unavailable`` | counter | | lookups the directory could not answer (down, slow, backoff) |
| ``vllm:ec_fleet_claims`` | counter | ``outcome`` (won, lost, waited, expired, wait_timeout, released) | claims to encode a cold item |
| ``vllm:ec_fleet_decisions`` | counter | ``outcome`` (found, found_after_wait, claimed, fetched, fetch_missed, claims_abandoned, offered_waiters, local:<why>) | what the scheduler did with the items it looked up |
| ``vllm:ec_fleet_lookup_seconds`` | histogram | | directory round-trip time; buckets of ``ectransport.fleet.stats.LOOKUP_BUCKETS_S`` (each lookup is counted in its bucket exactly; the sum counts it at its bucket's upper bound) |

The data is computed from the counters the directory and the fleet side keep
(:meth:`FleetSide.interval_stats <ectransport.vllm.fleet.FleetSide.interval_stats>`), at most once
a second. This module imports vLLM; a vLLM without the EC stats path gets none of it (the
``metrics_port`` exporter, :mod:`ectransport.vllm.metrics`, works with any).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from ectransport.fleet.stats import LOOKUP_BUCKETS_S

_CLAIMS = ("won", "lost", "waited", "expired", "wait_timeout", "released")


class ECTransportStats(ECConnectorStats):
    """One interval's fleet counters (``data``: see
    :meth:`~ectransport.vllm.fleet.FleetSide.interval_stats`); plain ints, floats and lists, as
    vLLM serialises it between processes."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: ECConnectorStats) -> ECTransportStats:
        mine, theirs = self.data or {}, other.data or {}
        counts = dict(mine.get("counts", {}))
        for k, n in theirs.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + n
        a, b = list(mine.get("lookup_buckets", [])), list(theirs.get("lookup_buckets", []))
        width = max(len(a), len(b))
        buckets = [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(width)]
        return ECTransportStats(
            data={
                "counts": counts,
                "lookup_buckets": buckets,
                "lookup_sum_s": float(mine.get("lookup_sum_s", 0.0))
                + float(theirs.get("lookup_sum_s", 0.0)),
            }
        )

    def reduce(self) -> dict[str, int | float]:
        """The stats line's summary: hits, misses, hit rate, claims, lookups and their mean
        round trip (ms)."""
        counts = (self.data or {}).get("counts", {})
        hits, misses = int(counts.get("hits", 0)), int(counts.get("misses", 0))
        lookups = sum((self.data or {}).get("lookup_buckets", []))
        out: dict[str, int | float] = {
            "fleet_hits": hits,
            "fleet_misses": misses,
            "fleet_hit_rate": round(hits / (hits + misses), 3) if hits + misses else 0.0,
            "claims_won": int(counts.get("claims_won", 0)),
            "claims_waited": int(counts.get("claims_waited", 0)),
            "claims_expired": int(counts.get("claims_expired", 0)),
            "lookups": lookups,
        }
        if lookups:
            out["lookup_mean_ms"] = round(
                1e3 * float(self.data.get("lookup_sum_s", 0.0)) / lookups, 3
            )
        return out

    def is_empty(self) -> bool:
        d = self.data or {}
        return not d.get("counts") and not any(d.get("lookup_buckets", []))


class ECTransportPromMetrics(ECConnectorPromMetrics):
    """The ``vllm:ec_fleet_*`` families (module docstring), created with the metric classes
    vLLM hands over (its multiprocess-aware ones) and one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        outcome = [*labelnames, "outcome"]
        self._items = self._counter_cls(
            name="vllm:ec_fleet_lookup_items",
            labelnames=outcome,
            documentation="Items looked up in the fleet directory, by outcome (hit: a usable "
            "holder)",
        )
        self._unavailable = self._counter_cls(
            name="vllm:ec_fleet_unavailable",
            labelnames=labelnames,
            documentation="Fleet directory lookups that could not be answered",
        )
        self._claims = self._counter_cls(
            name="vllm:ec_fleet_claims",
            labelnames=outcome,
            documentation="Claims to encode a cold item, by outcome",
        )
        self._decisions = self._counter_cls(
            name="vllm:ec_fleet_decisions",
            labelnames=outcome,
            documentation="What the scheduler did with items it looked up in the fleet",
        )
        self._lookup_s = self._histogram_cls(
            name="vllm:ec_fleet_lookup_seconds",
            labelnames=labelnames,
            buckets=list(LOOKUP_BUCKETS_S),
            documentation="Fleet directory lookup round-trip time, s",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues.get(engine_idx, [])
        counts = transfer_stats_data.get("counts", {})
        for outcome, key in (("hit", "hits"), ("miss", "misses")):
            if counts.get(key):
                self._items.labels(*engine, outcome).inc(counts[key])
        if counts.get("unavailable"):
            self._unavailable.labels(*engine).inc(counts["unavailable"])
        for outcome in _CLAIMS:
            if counts.get("claims_" + outcome):
                self._claims.labels(*engine, outcome).inc(counts["claims_" + outcome])
        for key, n in counts.items():
            if key.startswith("decision:") and n:
                self._decisions.labels(*engine, key.removeprefix("decision:")).inc(n)
        hist = self._lookup_s.labels(*engine)
        bounds = (*LOOKUP_BUCKETS_S, 2 * LOOKUP_BUCKETS_S[-1])
        for bound, n in zip(bounds, transfer_stats_data.get("lookup_buckets", [])):
            for _ in range(max(0, int(n))):
                hist.observe(bound)
