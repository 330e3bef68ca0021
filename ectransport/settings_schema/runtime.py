"""The sections of what a node runs on: its control sockets, its data planes, and the metrics,
logs and demo around it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ectransport.settings_schema.fields import (
    MiB,
    NonNegInt,
    Port,
    PosInt,
    Seconds,
    Section,
    Text,
    doc,
)


class _ControlSocketSettings(Section, frozen=True):
    """What the control server and client both set on their ZeroMQ sockets."""

    heartbeat_ivl_s: Annotated[Seconds, doc("ZMTP heartbeat interval, s")] = 2.0
    max_frame_bytes: Annotated[PosInt, doc("largest control frame, bytes")] = 8 * MiB
    max_msgs_per_poll: Annotated[PosInt, doc("frames read per loop iteration at most")] = 256
    sndhwm: Annotated[PosInt, doc("per-connection send queue, frames")] = 1000
    rcvhwm: Annotated[PosInt, doc("per-connection receive queue, frames")] = 1000


class ControlServerSettings(_ControlSocketSettings, frozen=True):
    heartbeat_timeout_s: Annotated[Seconds, doc("a consumer silent this long is dropped, s")] = 4.0
    handshake_timeout_s: Annotated[Seconds, doc(
        "half-open CURVE handshakes are dropped after, s"
    )] = 10.0
    peer_rate_per_s: Annotated[float, doc("per-consumer frame rate, frames/s", gt=0)] = 2000.0
    peer_burst: Annotated[PosInt, doc("per-consumer burst, frames")] = 500


class ControlClientSettings(_ControlSocketSettings, frozen=True):
    handshake_timeout_s: Annotated[Seconds, doc("TCP connect + CURVE handshake deadline, s")] = 1.5
    heartbeat_timeout_s: Annotated[Seconds, doc(
        "a producer silent this long is reported down, s"
    )] = 4.0
    reconnect_ivl_s: Annotated[Seconds, doc("first ZeroMQ reconnect wait, s")] = 0.1
    reconnect_ivl_max_s: Annotated[Seconds, doc("largest ZeroMQ reconnect wait, s")] = 2.0
    close_linger_s: Annotated[float, doc(
        "at close, frames already sent (the completions that give grants back) get this long "
        "to leave, s; unsent then, they are dropped (the producer's lease frees their pins); "
        "0 = dropped at once", ge=0, le=10,
    )] = 0.5


class ControlSettings(Section, frozen=True):
    server: ControlServerSettings = msgspec.field(default_factory=ControlServerSettings)
    client: ControlClientSettings = msgspec.field(default_factory=ControlClientSettings)


class TcpPlaneSettings(Section, frozen=True):
    host: Annotated[Text | None, doc("listener bind address; unset = the control plane's")] = None
    port: Annotated[Port, doc("listener port, 0 = any free port")] = 0
    advertise_host: Annotated[Text | None, doc(
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


class UcxPlaneSettings(Section, frozen=True):
    host: Annotated[Text | None, doc("address put in grants; unset = the control plane's")] = None
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


class NixlPlaneSettings(Section, frozen=True):
    num_threads: Annotated[NonNegInt, doc(
        "NIXL UCX backend worker threads, 0 = NIXL's default"
    )] = 0
    prog_thread: Annotated[bool, doc("NIXL progress thread")] = True
    grant_scope: Annotated[Literal["grant", "region"], doc(
        "what a grant exposes: a registration of only its blocks, or the whole region (vLLM's "
        "behaviour)"
    )] = "grant"


class PlanesSettings(Section, frozen=True):
    plugins: Annotated[dict[str, dict[str, Any]], doc(
        "plugin plane name -> its constructor options (free-form; checked by the plugin)"
    )] = msgspec.field(default_factory=dict)
    tcp: TcpPlaneSettings = msgspec.field(default_factory=TcpPlaneSettings)
    ucx: UcxPlaneSettings = msgspec.field(default_factory=UcxPlaneSettings)
    nixl: NixlPlaneSettings = msgspec.field(default_factory=NixlPlaneSettings)

    def options(self) -> dict[str, dict[str, Any]]:
        """Plane name → constructor options (unset values left to the plane's defaults)."""
        return {"tcp": self.tcp.options(), "ucx": self.ucx.options(),
                "nixl": self.nixl.options(), **{k: dict(v) for k, v in self.plugins.items()}}


class MetricsSettings(Section, frozen=True):
    port: Annotated[Port | None, doc(
        "`serve`: expose Prometheus metrics at http://[metrics.host]:PORT/metrics (needs the "
        "`metrics` extra; 0 = any free port); unset = off", flag="--metrics-port",
    )] = None
    host: Annotated[Text, doc(
        "metrics HTTP bind address (0.0.0.0 to let a remote Prometheus scrape)"
    )] = "127.0.0.1"


class LogSettings(Section, frozen=True):
    level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], doc(
        "level of the ectransport loggers", flag="--log-level",
    )] = "WARNING"
    format: Annotated[Literal["text", "json"], doc(
        "text, or one JSON object per line (with peer, session_id, mm_hash, grant_id) for log "
        "shippers", flag="--log-format",
    )] = "text"


class DemoSettings(Section, frozen=True):
    repeats: Annotated[int, doc(
        "`demo`: fetches per item (the table shows the median)", ge=1, le=1000
    )] = 5
    producer_start_timeout_s: Annotated[Seconds, doc(
        "`demo`: wait for the producer to serve, s"
    )] = 600.0
    producer_stop_timeout_s: Annotated[Seconds, doc(
        "`demo`: SIGTERM -> SIGKILL of the producer, s"
    )] = 15.0


