"""Prometheus metrics of producer and consumer nodes (``pip install 'ectransport[metrics]'``).

    from prometheus_client import CollectorRegistry
    from ectransport.metrics import Metrics

    metrics = Metrics(registry=CollectorRegistry())   # default: prometheus_client.REGISTRY
    metrics.attach(producer_node)                      # and/or consumer nodes
    metrics.serve(port=9464)                           # or scrape the registry yourself

Two sources, so nothing is counted twice: counters and gauges the nodes already keep
(``ProducerNode.snapshot()``, ``ConsumerNode.stats()``) are read at scrape time by a collector;
per-event distributions (fetch latency, transfer time, bytes, descriptors, grant hold time) come
from the nodes' ``observer`` hook. Several nodes may be attached to one ``Metrics``: their values
are summed (``ectransport_plane_info`` lists each plane once per role).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ectransport.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

#: Fetch latency: from sub-millisecond (a hot entry on loopback) to the 30 s default deadline.
LATENCY_BUCKETS_S = (
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
    5.0,
    10.0,
    30.0,
)
#: Entry sizes: 0.5 MiB (small images) ... 256 MiB (long videos), doubling.
BYTES_BUCKETS = tuple(float(1 << k) for k in range(19, 29))
#: Descriptors (contiguous block runs) per transfer: 1 for a fresh region, more when fragmented.
DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0)


def _prom() -> ModuleType:
    """The ``prometheus_client`` module (an optional dependency, imported on first use)."""
    try:
        import prometheus_client
    except ImportError as e:
        raise ConfigError(
            "metrics need prometheus_client: pip install 'ectransport[metrics]'"
        ) from e
    return prometheus_client


class Metrics:
    """Node metrics in a Prometheus registry (see module docstring).

    Args:
        registry: a ``prometheus_client.CollectorRegistry``; default the global ``REGISTRY``.

    Raises:
        ConfigError: prometheus_client is not installed.
        ValueError: (from prometheus_client) the registry already holds ectransport metrics.
    """

    def __init__(self, registry: Any = None):
        pc = _prom()
        self.registry = registry if registry is not None else pc.REGISTRY
        self._nodes: list[weakref.ref[Any]] = []
        self._lock = threading.Lock()
        self._server: Any = None
        self._fleet: Any = None  # the FleetCollector, once a fleet directory is attached
        r = self.registry
        self.fetch_total = pc.Counter(
            "ectransport_fetch",
            "Fetch outcomes (consumer): outcome ok|miss, reason = MissReason",
            ["outcome", "reason"],
            registry=r,
        )
        self.fetch_seconds = pc.Histogram(
            "ectransport_fetch_seconds",
            "Fetch latency from the request to the outcome (consumer)",
            ["outcome"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.transfer_seconds = pc.Histogram(
            "ectransport_transfer_seconds",
            "Data-plane transfer time, posted to landed (consumer)",
            ["plane"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.transferred_bytes = pc.Counter(
            "ectransport_transferred_bytes",
            "Bytes landed by successful fetches (consumer)",
            ["plane"],
            registry=r,
        )
        self.transfer_bytes = pc.Histogram(
            "ectransport_transfer_bytes",
            "Size of each landed entry, bytes (consumer)",
            ["plane"],
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.descriptors = pc.Histogram(
            "ectransport_descriptors_per_transfer",
            "Contiguous block runs per transfer (consumer: landing runs; producer: granted runs)",
            ["side"],
            buckets=DESCRIPTOR_BUCKETS,
            registry=r,
        )
        self.peer_quarantines = pc.Counter(
            "ectransport_peer_quarantines",
            "Times a producer was put in quarantine (consumer)",
            ["reason"],
            registry=r,
        )
        self.transfer_quarantines = pc.Counter(
            "ectransport_transfer_quarantines",
            "Timed-out transfers whose landing blocks were quarantined (consumer)",
            registry=r,
        )
        self.grant_seconds = pc.Histogram(
            "ectransport_grant_seconds",
            "How long grants held their pin (producer)",
            ["why"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.granted_bytes = pc.Counter(
            "ectransport_granted_bytes", "Bytes granted to consumers (producer)", registry=r
        )
        self.trust_admissions = pc.Counter(
            "ectransport_trust_admissions",
            "Fleet trust: peers admitted (outcome admitted, reason = by: certificate|allow_list|"
            "both) or refused (outcome refused, reason = the refusal reason; when = hello|"
            "welcome for a new session, handshake for a key the allow-list refused at the "
            "handshake, recheck for a live one ended), by peer_role (the role "
            "wanted of the peer: consumer on a producer, producer on a consumer)",
            ["outcome", "reason", "when", "peer_role"],
            registry=r,
        )
        r.register(_SnapshotCollector(self))

    # -- nodes ---------------------------------------------------------------------------------
    def attach(self, node: Any) -> Any:
        """Collect the metrics of ``node`` (a ProducerNode or ConsumerNode); returns the node."""
        if not hasattr(node, "snapshot") or not hasattr(node, "add_observer"):
            raise ConfigError(
                f"cannot collect metrics of a {type(node).__name__}: expected a "
                "ProducerNode or ConsumerNode"
            )
        node.add_observer(self.observe)
        with self._lock:
            self._nodes.append(weakref.ref(node))
        fleet = getattr(node, "fleet", None)  # a producer node in the fleet directory
        if fleet is not None:
            self.attach_fleet(fleet.directory)
        return node

    def attach_fleet(self, directory: Any) -> Any:
        """Also export the ``ectransport_fleet_*`` families of a fleet directory (hits, misses,
        claims won/lost/waited/expired, lookup latency: ``ectransport.fleet.prom``); returns
        it. Several directories are summed."""
        from ectransport.fleet.prom import FleetCollector

        with self._lock:
            if self._fleet is None:
                self._fleet = FleetCollector(self.registry)
            collector = self._fleet
        return collector.attach(directory)

    def nodes(self) -> list[Any]:
        with self._lock:
            alive = [n for ref in self._nodes if (n := ref()) is not None]
            self._nodes = [weakref.ref(n) for n in alive]
        return alive

    def observe(self, event: str, f: dict[str, Any]) -> None:
        """The node observer hook (``observer=metrics.observe``)."""
        if event == "fetch":
            ok = f.get("outcome") == "ok"
            self.fetch_total.labels("ok" if ok else "miss", f.get("reason") or "").inc()
            if f.get("seconds") is not None:
                self.fetch_seconds.labels("ok" if ok else "miss").observe(f["seconds"])
            if ok:
                plane = f.get("plane") or ""
                if f.get("transfer_s") is not None:
                    self.transfer_seconds.labels(plane).observe(f["transfer_s"])
                self.transferred_bytes.labels(plane).inc(f.get("nbytes") or 0)
                self.transfer_bytes.labels(plane).observe(f.get("nbytes") or 0)
                if f.get("descriptors") is not None:
                    self.descriptors.labels("consumer").observe(f["descriptors"])
        elif event == "grant_issued":
            self.granted_bytes.inc(f.get("nbytes") or 0)
            if f.get("descriptors") is not None:
                self.descriptors.labels("producer").observe(f["descriptors"])
        elif event == "grant_ended":
            if f.get("held_s") is not None:
                self.grant_seconds.labels(f.get("why", "")).observe(f["held_s"])
        elif event == "peer_quarantined":
            self.peer_quarantines.labels(_short_reason(f.get("why", ""))).inc()
        elif event == "transfer_quarantined":
            self.transfer_quarantines.inc()
        elif event == "peer_admitted":
            self.trust_admissions.labels(
                "admitted", f.get("by", ""), "new", f.get("peer_role", "")
            ).inc()
        elif event == "peer_refused":
            self.trust_admissions.labels(
                "refused", f.get("reason", ""), f.get("when", ""), f.get("peer_role", "")
            ).inc()

    # -- HTTP ----------------------------------------------------------------------------------
    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose the registry over HTTP at ``http://host:port/metrics`` (a daemon thread);
        returns the port (useful with ``port=0``).

        Raises:
            ConfigError: the port cannot be bound.
        """
        pc = _prom()
        try:
            server, _thread = pc.start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from e
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        """Stop the HTTP server, if :meth:`serve` started one."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _short_reason(why: str) -> str:
    """Bounded label values for quarantine reasons (the detail text goes to the logs)."""
    for key in ("read deadline", "no ack", "no Welcome", "NACK_INTERNAL", "went away", "down"):
        if key.lower() in why.lower():
            return key.lower().replace(" ", "_")
    return "other"


class _SnapshotCollector:
    """Reads the nodes' own counters and gauges at scrape time."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return list(self._families([], []))

    def collect(self) -> list[Metric]:
        producers: list[dict[str, Any]] = []
        consumers: list[dict[str, Any]] = []
        for node in self._metrics.nodes():
            try:
                snap = node.snapshot()
            except Exception:  # a node closing mid-scrape: skip it this time
                continue
            (producers if snap.get("role") == "producer" else consumers).append(snap)
        return list(self._families(producers, consumers))

    @staticmethod
    def _families(
        producers: list[dict[str, Any]], consumers: list[dict[str, Any]]
    ) -> Iterator[Metric]:
        """Every family, from the nodes' snapshots (``ProducerNode.snapshot()`` dicts)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def total(snaps: Iterable[dict[str, Any]], *keys: str) -> int:
            """Sum over ``snaps`` of ``snap[keys[0]][keys[1]]...`` (missing: 0)."""
            out = 0
            for s in snaps:
                v: Any = s
                for k in keys:
                    v = v.get(k, 0) if isinstance(v, dict) else 0
                out += int(v or 0)
            return out

        producers = producers or []
        consumers = consumers or []
        c = CounterMetricFamily("ectransport_grants", "Grants issued (producer)")
        c.add_metric([], total(producers, "stats", "grants"))
        yield c
        c = CounterMetricFamily(
            "ectransport_grants_ended", "Grants ended, by why (producer)", labels=["why"]
        )
        for why in ("completed", "expired", "released_peer_down"):
            c.add_metric([why], total(producers, "stats", why))
        yield c
        g = GaugeMetricFamily("ectransport_grants_active", "Grants holding a pin now (producer)")
        g.add_metric([], total(producers, "stats", "active_grants"))
        yield g
        g = GaugeMetricFamily(
            "ectransport_pinned_bytes",
            "Bytes pinned by grants, per consumer identity (producer)",
            labels=["peer"],
        )
        per: dict[str, int] = {}
        for s in producers:
            for peer, n in s.get("pinned_by_peer", {}).items():
                per[peer] = per.get(peer, 0) + int(n)
        for peer, n in sorted(per.items()):
            g.add_metric([peer], n)
        yield g
        g = GaugeMetricFamily(
            "ectransport_region_pinned_bytes", "Bytes pinned by grants, all consumers (producer)"
        )
        g.add_metric([], total(producers, "stats", "pinned_bytes"))
        yield g
        g = GaugeMetricFamily("ectransport_region_bytes", "Size of the host region (producer)")
        g.add_metric([], total(producers, "region_bytes"))
        yield g
        g = GaugeMetricFamily("ectransport_entries", "Entries held (producer)")
        g.add_metric([], total(producers, "stats", "entries"))
        yield g
        g = GaugeMetricFamily(
            "ectransport_region_free_blocks", "Free blocks in the region", labels=["role"]
        )
        g.add_metric(["producer"], total(producers, "stats", "free_blocks"))
        g.add_metric(["consumer"], total(consumers, "stats", "free_blocks"))
        yield g
        c = CounterMetricFamily(
            "ectransport_lease_expiries", "Grants whose lease ran out before completion (producer)"
        )
        c.add_metric([], total(producers, "stats", "expired"))
        yield c
        c = CounterMetricFamily(
            "ectransport_nacks_sent", "NACKs sent, by status (producer)", labels=["status"]
        )
        nacks: dict[str, int] = {}
        for s in producers:
            for st, n in s.get("nacks", {}).items():
                nacks[st] = nacks.get(st, 0) + int(n)
        for st, n in sorted(nacks.items()):
            c.add_metric([st], n)
        yield c
        c = CounterMetricFamily(
            "ectransport_auth_rejections",
            "Control-plane clients refused: kind allow_list (ZAP: key not allowed) or handshake "
            "(CURVE handshake failed) (producer)",
            labels=["kind"],
        )
        c.add_metric(["allow_list"], total(producers, "control", "reject_count"))
        c.add_metric(["handshake"], total(producers, "control", "handshake_failures"))
        yield c
        c = CounterMetricFamily(
            "ectransport_dropped_frames",
            "Control frames dropped: rate limit, malformed, undecodable (producer)",
            labels=["why"],
        )
        c.add_metric(["rate"], total(producers, "control", "rate_dropped"))
        c.add_metric(["malformed"], total(producers, "control", "malformed_dropped"))
        c.add_metric(["bad_frame"], total(producers, "stats", "bad_frames"))
        yield c
        g = GaugeMetricFamily(
            "ectransport_quarantined_peers", "Producers in their quarantine backoff now (consumer)"
        )
        g.add_metric([], total(consumers, "stats", "quarantined_peers"))
        yield g
        g = GaugeMetricFamily(
            "ectransport_quarantined_transfers",
            "Timed-out transfers holding their landing blocks (consumer)",
        )
        g.add_metric([], total(consumers, "stats", "quarantined_transfers"))
        yield g
        g = GaugeMetricFamily("ectransport_fetches_in_flight", "Fetches in flight (consumer)")
        g.add_metric([], total(consumers, "stats", "in_flight"))
        yield g
        g = GaugeMetricFamily(
            "ectransport_plane_info",
            "Data planes in use and what runs underneath (e.g. UCX transports)",
            labels=["role", "plane", "transport"],
        )
        seen: set[tuple[str, str, str]] = set()
        for s in (*producers, *consumers):
            for plane, transport in s.get("planes", {}).items():
                key = (s["role"], plane, transport)
                if key not in seen:
                    seen.add(key)
                    g.add_metric(list(key), 1)
        yield g
