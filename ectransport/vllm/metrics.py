"""Prometheus metrics of one vLLM instance's connector (``metrics_port``; ``docs/vllm.md``).

vLLM's scheduler runs in its engine-core process, apart from the API server that serves vLLM's
own ``/metrics``, so the connector exports its metrics from the engine core, on a port of its
own, in a registry of its own (one per engine core; several in one process never collide):

- the nodes' families, as ``ectransport serve`` exports them (:class:`~ectransport.metrics.Metrics`:
  fetches, transfers, grants, quarantines, ...);
- the fleet directory's families (``ectransport_fleet_*``: ``lookup_items{outcome=hit|miss}``,
  ``claims{outcome=won|lost|waited|expired|...}``, ``lookup_seconds`` ...) of the directory this
  instance uses — the producer node's (``ec_producer``, ``ec_both``) or the lookup-only one of
  an ``ec_consumer``;
- ``ectransport_fleet_decisions_total{outcome}``: what the scheduler did with items it looked
  up (:attr:`FleetSide.outcomes <ectransport.vllm.fleet.FleetSide.outcomes>`: ``found``,
  ``found_after_wait``, ``claimed``, ``fetched``, ``fetch_missed``, ``claims_abandoned``,
  ``offered_waiters``, ``local:<why>``).

Everything is read from the counters the nodes and the directory already keep, at scrape time:
nothing is counted twice and nothing is added to the scheduler's step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ectransport.errors import ConfigError
from ectransport.metrics.prom import Metrics
from ectransport.vllm.fleet import FleetSide

log = logging.getLogger("ectransport.vllm.metrics")


class AdapterMetrics:
    """The connector's metrics in their own registry (module docstring).

    Args:
        nodes: the instance's producer and/or consumer node.
        fleet: its fleet side, or None without a fleet directory.
        port: serve ``http://host:port/metrics`` (0: any free port); None: build the registry
            only (read it with :attr:`registry`).
        host: the HTTP bind address.

    Raises:
        ConfigError: prometheus_client is not installed (``pip install 'ectransport[metrics]'``),
            or the port cannot be bound.
    """

    def __init__(
        self,
        nodes: list[Any],
        fleet: FleetSide | None,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
    ):
        try:
            from prometheus_client import CollectorRegistry
        except ImportError as e:
            raise ConfigError(
                "metrics_port needs prometheus_client: pip install 'ectransport[metrics]'"
            ) from e
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        for node in nodes:
            self.metrics.attach(node)  # a producer node in the fleet brings its directory
        if fleet is not None:
            if not any(
                getattr(getattr(n, "fleet", None), "directory", None) is fleet.directory
                for n in nodes
            ):  # e.g. the lookup-only directory of an ec_consumer
                self.metrics.attach_fleet(fleet.directory)
            self.registry.register(_Decisions(fleet))
        self.port: int | None = None
        if port is not None:
            self.port = self.metrics.serve(port, host)
            log.info("EC connector metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        """Stop the HTTP server, if one was started."""
        self.metrics.close()


class _Decisions:
    """``ectransport_fleet_decisions_total{outcome}`` from a :class:`FleetSide`'s outcomes."""

    def __init__(self, fleet: FleetSide):
        self._fleet = fleet

    def describe(self) -> list[Any]:
        return list(self._families({}))

    def collect(self) -> list[Any]:
        return list(self._families(self._fleet.outcome_counts()))

    @staticmethod
    def _families(counts: dict[str, int]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        c = CounterMetricFamily(
            "ectransport_fleet_decisions",
            "What the vLLM scheduler did with items it looked up in the fleet directory "
            "(found, found_after_wait, claimed, fetched, fetch_missed, claims_abandoned, "
            "offered_waiters, local:<why>)",
            labels=["outcome"],
        )
        for outcome, n in sorted(counts.items()):
            c.add_metric([outcome], n)
        yield c
