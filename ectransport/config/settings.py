"""The settings object: every timeout, budget, size and path of ectransport in one typed place.

Each field has its default, its unit (in the name: ``_s`` seconds, ``_bytes`` bytes; and in the
description) and its meaning; ``ectransport config show`` prints them with where each value came
from. Values are read from (later wins): the defaults here, a TOML file, ``ECTRANSPORT_…``
environment variables, CLI flags — see :mod:`ectransport.config.load`.

The defaults are the ones the nodes use without settings (``docs/operations.md``), except
``producer.region_bytes`` (1 GiB: what ``ectransport serve`` always used; the Python API's
``ProducerNode`` default is 256 MiB).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

MiB = 1 << 20

Seconds = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]


def doc(text: str, **constraints: Any) -> Meta:
    """``Meta(description=text, ...)``, a field's ``Annotated`` metadata: its description says
    unit + meaning."""
    return Meta(description=text, **constraints)


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class LayoutSettings(_Section, frozen=True):
    """What an entry's bytes mean (both sides must agree: compatibility hash)."""

    hidden: Annotated[int, doc(
        "row width of an encoder output, elements (3584 = Qwen2-VL-7B)", ge=1
    )] = 3584
    dtype: Annotated[Literal["bfloat16", "float16", "float32"], doc(
        "element dtype of encoder outputs"
    )] = "bfloat16"
    seed: Annotated[int, doc(
        "weight seed of the reference encoder (part of the model id)", ge=0
    )] = 0


class NodeSettings(_Section, frozen=True):
    planes: Annotated[list[str], doc(
        "data planes offered/used, best first (see `ectransport planes`)"
    )] = msgspec.field(default_factory=lambda: ["nixl"])
    node_id: Annotated[str | None, doc(
        "name in logs and the NIXL agent; unset = '<role>-<random>'"
    )] = None


class SecuritySettings(_Section, frozen=True):
    key_file: Annotated[str | None, doc(
        "path: this node's CURVE secret key file (`ectransport keys generate`); must be mode 0600"
    )] = None
    allow_dir: Annotated[str | None, doc(
        "path, producer: directory of allowed consumer public keys (required for a non-loopback "
        "bind)"
    )] = None
    server_key: Annotated[str | None, doc(
        "consumer: the producer's public key (Z85 text or a public key file path)"
    )] = None
    insecure: Annotated[bool, doc(
        "plain ZMQ without CURVE: no authentication, no encryption"
    )] = False


class ProducerSettings(_Section, frozen=True):
    host: Annotated[str, doc("control-plane bind address")] = "127.0.0.1"
    advertise_host: Annotated[str | None, doc(
        "address consumers reach this host at (required with a wildcard host for the tcp/ucx "
        "planes)"
    )] = None
    port: Annotated[Port, doc("control-plane port, 0 = any free port")] = 5601
    region_bytes: Annotated[int, doc(
        "host region for cached entries, bytes (whole blocks)", ge=1
    )] = 1 << 30
    lease_s: Annotated[float, doc(
        "pin lease of a grant, s (as vLLM's ECCPUConnector)", ge=0.1
    )] = 30.0
    budget_bytes: Annotated[PosInt | None, doc(
        "most bytes one consumer may have pinned, bytes; unset = a quarter of the region"
    )] = None
    grace_s: Annotated[float, doc(
        "blocks of a grant that ended unconfirmed stay pinned this long more (READ planes), s", ge=0
    )] = 5.0
    images: Annotated[str | None, doc(
        "path: images `serve` encodes at start-up; unset = bundled ones"
    )] = None


class ConsumerSettings(_Section, frozen=True):
    region_bytes: Annotated[int, doc("landing region, bytes", ge=1)] = 256 * MiB
    fetch_timeout_s: Annotated[float, doc("overall deadline of one fetch, s", ge=0.1)] = 30.0
    connect_timeout_s: Annotated[Seconds, doc(
        "deadline of an explicit connect (CLI `fetch`), s"
    )] = 10.0
    ack_timeout_s: Annotated[Seconds, doc("XferReq -> XferAck deadline, s")] = 2.0
    read_timeout_s: Annotated[Seconds, doc("data-plane transfer deadline after the ack, s")] = 20.0
    quarantine_s: Annotated[Seconds, doc(
        "a timed-out transfer keeps its landing blocks this long, s"
    )] = 60.0
    hello_timeout_s: Annotated[Seconds, doc("connection + Hello -> Welcome deadline, s")] = 5.0
    retry_backoff_s: Annotated[Seconds, doc(
        "first wait before re-sending after NACK_NOT_READY/BUSY, s"
    )] = 0.02
    retry_backoff_max_s: Annotated[Seconds, doc("largest such wait (doubling), s")] = 0.5
    peer_backoff_s: Annotated[Seconds, doc("first peer quarantine after a failure, s")] = 1.0
    peer_backoff_max_s: Annotated[Seconds, doc("longest peer quarantine (doubling), s")] = 60.0


class ControlServerSettings(_Section, frozen=True):
    heartbeat_ivl_s: Annotated[Seconds, doc("ZMTP heartbeat interval, s")] = 2.0
    heartbeat_timeout_s: Annotated[Seconds, doc("a consumer silent this long is dropped, s")] = 4.0
    handshake_timeout_s: Annotated[Seconds, doc(
        "half-open CURVE handshakes are dropped after, s"
    )] = 10.0
    max_frame_bytes: Annotated[PosInt, doc("largest control frame, bytes")] = 8 * MiB
    max_msgs_per_poll: Annotated[PosInt, doc("frames read per loop iteration at most")] = 256
    peer_rate_per_s: Annotated[float, doc("per-consumer frame rate, frames/s", gt=0)] = 2000.0
    peer_burst: Annotated[PosInt, doc("per-consumer burst, frames")] = 500
    sndhwm: Annotated[PosInt, doc("per-connection send queue, frames")] = 1000
    rcvhwm: Annotated[PosInt, doc("per-connection receive queue, frames")] = 1000


class ControlClientSettings(_Section, frozen=True):
    handshake_timeout_s: Annotated[Seconds, doc("TCP connect + CURVE handshake deadline, s")] = 1.5
    heartbeat_ivl_s: Annotated[Seconds, doc("ZMTP heartbeat interval, s")] = 2.0
    heartbeat_timeout_s: Annotated[Seconds, doc(
        "a producer silent this long is reported down, s"
    )] = 4.0
    max_frame_bytes: Annotated[PosInt, doc("largest control frame, bytes")] = 8 * MiB
    max_msgs_per_poll: Annotated[PosInt, doc("frames read per loop iteration at most")] = 256
    sndhwm: Annotated[PosInt, doc("per-connection send queue, frames")] = 1000
    rcvhwm: Annotated[PosInt, doc("per-connection receive queue, frames")] = 1000
    reconnect_ivl_s: Annotated[Seconds, doc("first ZeroMQ reconnect wait, s")] = 0.1
    reconnect_ivl_max_s: Annotated[Seconds, doc("largest ZeroMQ reconnect wait, s")] = 2.0


class ControlSettings(_Section, frozen=True):
    server: ControlServerSettings = msgspec.field(default_factory=ControlServerSettings)
    client: ControlClientSettings = msgspec.field(default_factory=ControlClientSettings)


class TcpPlaneSettings(_Section, frozen=True):
    host: Annotated[str | None, doc("listener bind address; unset = the control plane's")] = None
    port: Annotated[Port, doc("listener port, 0 = any free port")] = 0
    advertise_host: Annotated[str | None, doc(
        "address put in grants (required for a wildcard host)"
    )] = None
    connect_timeout_s: Annotated[Seconds, doc("consumer connect deadline, s")] = 5.0
    io_timeout_s: Annotated[Seconds, doc("longest stall of one socket operation, s")] = 10.0
    idle_timeout_s: Annotated[Seconds, doc("producer: idle connections are closed after, s")] = 60.0
    max_connections: Annotated[PosInt, doc("producer: concurrent connections served")] = 64
    max_inflight: Annotated[PosInt, doc("consumer: concurrent receives")] = 64
    max_idle_per_peer: Annotated[NonNegInt, doc(
        "consumer: pooled idle connections per producer"
    )] = 8


class UcxPlaneSettings(_Section, frozen=True):
    host: Annotated[str | None, doc("address put in grants; unset = the control plane's")] = None
    port: Annotated[Port, doc("UCX listener port, 0 = any free port")] = 0
    peer_error_handling: Annotated[bool, doc(
        "UCX endpoint error handling (forces TCP intra-node)"
    )] = False
    transfer_timeout_s: Annotated[Seconds, doc(
        "a consumer transfer still in flight after this is ERR, s"
    )] = 30.0
    ucx_options: Annotated[dict[str, str], doc(
        "extra UCX options, e.g. {TLS = \"tcp,cma,self\"}"
    )] = msgspec.field(default_factory=dict)


class NixlPlaneSettings(_Section, frozen=True):
    num_threads: Annotated[NonNegInt, doc(
        "NIXL UCX backend worker threads, 0 = NIXL's default"
    )] = 0
    prog_thread: Annotated[bool, doc("NIXL progress thread")] = True
    grant_scope: Annotated[Literal["grant", "region"], doc(
        "what a grant exposes: a registration of only its blocks, or the whole region (vLLM's "
        "behaviour)"
    )] = "grant"


class PlanesSettings(_Section, frozen=True):
    plugins: Annotated[dict[str, dict[str, Any]], doc(
        "plugin plane name -> its constructor options (free-form; checked by the plugin)"
    )] = msgspec.field(default_factory=dict)
    tcp: TcpPlaneSettings = msgspec.field(default_factory=TcpPlaneSettings)
    ucx: UcxPlaneSettings = msgspec.field(default_factory=UcxPlaneSettings)
    nixl: NixlPlaneSettings = msgspec.field(default_factory=NixlPlaneSettings)


class MetricsSettings(_Section, frozen=True):
    port: Annotated[Port | None, doc(
        "`serve`: expose Prometheus metrics over HTTP on this port; unset = off"
    )] = None
    host: Annotated[str, doc(
        "metrics HTTP bind address (0.0.0.0 to let a remote Prometheus scrape)"
    )] = "127.0.0.1"


class LogSettings(_Section, frozen=True):
    level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], doc(
        "level of the ectransport loggers"
    )] = "WARNING"
    format: Annotated[Literal["text", "json"], doc(
        "text, or one JSON object per line for log shippers"
    )] = "text"


class DemoSettings(_Section, frozen=True):
    repeats: Annotated[int, doc("`demo`: fetches per item", ge=1, le=1000)] = 5
    producer_start_timeout_s: Annotated[Seconds, doc(
        "`demo`: wait for the producer to serve, s"
    )] = 600.0
    producer_stop_timeout_s: Annotated[Seconds, doc(
        "`demo`: SIGTERM -> SIGKILL of the producer, s"
    )] = 15.0


class Settings(_Section, frozen=True):
    """Everything configurable, by section (``[producer]``, ``[control.server]``, ...)."""

    layout: LayoutSettings = msgspec.field(default_factory=LayoutSettings)
    node: NodeSettings = msgspec.field(default_factory=NodeSettings)
    security: SecuritySettings = msgspec.field(default_factory=SecuritySettings)
    producer: ProducerSettings = msgspec.field(default_factory=ProducerSettings)
    consumer: ConsumerSettings = msgspec.field(default_factory=ConsumerSettings)
    control: ControlSettings = msgspec.field(default_factory=ControlSettings)
    planes: PlanesSettings = msgspec.field(default_factory=PlanesSettings)
    metrics: MetricsSettings = msgspec.field(default_factory=MetricsSettings)
    log: LogSettings = msgspec.field(default_factory=LogSettings)
    demo: DemoSettings = msgspec.field(default_factory=DemoSettings)

    # -- what the nodes take ------------------------------------------------------------------
    def plane_options(self) -> dict[str, dict[str, Any]]:
        """Plane name → constructor options (unset values left to the node/plane defaults)."""

        def opts(section: _Section) -> dict[str, Any]:
            d = msgspec.structs.asdict(section)
            return {k: v for k, v in d.items() if v is not None and v != {}}

        return {"tcp": opts(self.planes.tcp), "ucx": opts(self.planes.ucx),
                "nixl": opts(self.planes.nixl),
                **{k: dict(v) for k, v in self.planes.plugins.items()}}

    def producer_node_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ProducerNode`` (all but ``layout`` and ``security``)."""
        p = self.producer
        return {"region_bytes": p.region_bytes, "host": p.host, "port": p.port,
                "advertise_host": p.advertise_host,
                "planes": tuple(self.node.planes), "lease_s": p.lease_s,
                "budget_bytes": p.budget_bytes, "grace_s": p.grace_s,
                "node_id": self.node.node_id,
                "plane_options": self.plane_options(),
                "control_options": msgspec.structs.asdict(self.control.server)}

    def consumer_node_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ConsumerNode`` (all but ``layout`` and ``security``)."""
        c = self.consumer
        return {"region_bytes": c.region_bytes, "planes": tuple(self.node.planes),
                "ack_timeout_s": c.ack_timeout_s, "read_timeout_s": c.read_timeout_s,
                "quarantine_s": c.quarantine_s, "fetch_timeout_s": c.fetch_timeout_s,
                "node_id": self.node.node_id, "plane_options": self.plane_options(),
                "control_options": msgspec.structs.asdict(self.control.client),
                "session_options": {k: getattr(c, k) for k in (
                    "hello_timeout_s", "retry_backoff_s", "retry_backoff_max_s",
                    "peer_backoff_s", "peer_backoff_max_s")}}
