"""The settings schema: every timeout, budget, size and path of ectransport, declared once.

Each setting is one field of a frozen msgspec Struct below: its name (unit in the name: ``_s``
seconds, ``_bytes`` bytes), its type and range, its default and its description (unit again,
and meaning). Everything else is generated from these fields:

- the Python API's defaults: ``ProducerNode(lease_s=API.producer.lease_s, ...)`` — this module
  sits just above ``ectransport.protocol`` so that every layer may read it;
- ``ectransport.config``: the TOML file, the ``ECTRANSPORT_SECTION__KEY`` variables and
  ``ectransport config show`` (one key per field);
- ``ectransport.cli``: the flags of ``serve``, ``fetch``, ``demo`` (type, range, default, help);
- ``ectransport.vllm.settings``: the ``ec_connector_extra_config`` keys (public names mapped to
  fields here; the vLLM-only ones are :class:`VllmSettings`).

A front end that deliberately uses another default says so at the field, once, with the reason:
``doc(..., cli=Differs(1 << 30, "why"))``. :func:`defaults` applies them; :data:`DIFFERENCES`
lists them (``docs/configuration.md`` prints that list).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

import msgspec
from msgspec import Meta
from msgspec import inspect as mi

from ectransport.errors import ConfigError
from ectransport.protocol import SUPPORTED_VERSIONS

MiB = 1 << 20
GiB = 1 << 30

#: The front ends: ``api`` (ProducerNode/ConsumerNode built in Python: the fields' own
#: defaults), ``cli`` (the ``ectransport`` commands and :func:`ectransport.config.load_settings`),
#: ``vllm`` (ECTransportConnector's ``ec_connector_extra_config``).
FrontEnd = Literal["api", "cli", "vllm"]
FRONT_ENDS: tuple[FrontEnd, ...] = ("api", "cli", "vllm")

Seconds = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Text = Annotated[str, Meta(min_length=1)]


class Differs(NamedTuple):
    """A front end's deliberate default for one setting, and why it differs."""

    value: Any
    reason: str


def doc(text: str, *, flag: str | None = None, path: bool = False, cli: Differs | None = None,
        vllm: Differs | None = None, **constraints: Any) -> Meta:
    """A field's ``Annotated`` metadata.

    Args:
        text: unit + meaning (``"pin lease of a grant, s"``); the first word is capitalised for
            ``--help``.
        flag: the CLI flag when it is not ``--<key-with-dashes>`` (``--key`` for ``key_file``).
        path: the value is a file system path (the CLI completes it as one).
        cli / vllm: that front end's deliberate default, with the reason.
        constraints: msgspec range constraints (``ge=0.1``, ``le=1000``, ``min_length=1``).
    """
    extra: dict[str, Any] = {}
    if flag is not None:
        extra["flag"] = flag
    if path:
        extra["path"] = True
    if cli is not None:
        extra["cli"] = cli
    if vllm is not None:
        extra["vllm"] = vllm
    return Meta(description=text, extra=extra or None, **constraints)


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    def options(self) -> dict[str, Any]:
        """The fields as keyword arguments (unset values and empty maps left out)."""
        d = msgspec.structs.asdict(self)
        return {k: v for k, v in d.items() if v is not None and v != {}}


S = TypeVar("S", bound=_Section)


def checked(section: S) -> S:
    """``section`` if every field is of its type and within its range (msgspec checks ranges
    only when decoding, not when a Struct is built in Python).

    Raises:
        ConfigError: naming the first field that is not, and what it must be.
    """
    try:
        return msgspec.convert(msgspec.to_builtins(section), type(section))
    except (msgspec.ValidationError, TypeError) as e:
        raise ConfigError(f"{type(section).__name__}: {e}") from None


# -- the sections ---------------------------------------------------------------------------------


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
    planes: Annotated[tuple[Text, ...], doc(
        "data planes offered/used, best first (see `ectransport planes`)", flag="--plane",
        min_length=1,
    )] = ("nixl",)
    node_id: Annotated[Text | None, doc(
        "name in logs and the NIXL agent; unset = '<role>-<random>'"
    )] = None
    versions: Annotated[tuple[int, ...], doc(
        "ECTP protocol versions spoken (override only to emulate older/newer nodes)",
        min_length=1,
    )] = SUPPORTED_VERSIONS

    def __post_init__(self) -> None:
        bad = [v for v in self.versions if v not in SUPPORTED_VERSIONS]
        if bad:
            raise ValueError(f"unsupported version(s) {bad}; supported: "
                             f"{list(SUPPORTED_VERSIONS)}")


class SecuritySettings(_Section, frozen=True):
    key_file: Annotated[Text | None, doc(
        "this node's CURVE secret key file (`ectransport keys generate`); must be mode 0600",
        flag="--key", path=True,
    )] = None
    allow_dir: Annotated[Text | None, doc(
        "producer: directory of allowed consumer public keys, reloaded on change and on "
        "SIGHUP (required for a non-loopback bind unless [trust] admits by certificate)",
        path=True,
    )] = None
    server_key: Annotated[Text | None, doc(
        "consumer: the producer's public key (Z85 text or a public key file path)"
    )] = None
    insecure: Annotated[bool, doc(
        "plain ZMQ without CURVE: no authentication, no encryption (anyone who reaches the port "
        "can pin and read entries); both sides must agree"
    )] = False


class TrustSettings(_Section, frozen=True):
    """Fleet trust: node certificates from a deployment CA (``ectransport.trust``,
    ``docs/fleet-trust.md``), alone or with the allow-lists of ``[security]``."""

    trust_ca: Annotated[tuple[Text, ...], doc(
        "CA public key files (`ectransport keys ca init` writes ca-public.pem) whose node "
        "certificates this node accepts; several during a CA rotation; re-read on change",
        path=True,
    )] = ()
    cert_file: Annotated[Text | None, doc(
        "this node's certificate (`ectransport keys issue`), shown to peers in Hello/Welcome; "
        "it must be for this node's CURVE key", path=True, flag="--cert",
    )] = None
    revocation_file: Annotated[tuple[Text, ...], doc(
        "signed revocation list files (`ectransport keys revoke`; one per CA, or several lists "
        "in one file), re-read within revocation_reload_s", path=True,
    )] = ()
    admission: Annotated[Literal["allow_list", "certificate", "either", "both"], doc(
        "how peers are admitted: the allow-list only, a valid certificate only, either of "
        "them, or both (certificate modes need trust_ca)"
    )] = "allow_list"
    clock_skew_s: Annotated[float, doc(
        "a certificate is accepted this long before its not_before and after its not_after "
        "(clocks of CA and nodes differ), s", ge=0, le=3600,
    )] = 300.0
    revocation_reload_s: Annotated[float, doc(
        "the CA and revocation list files are checked for changes this often; a revoked "
        "node's live sessions end at the next check, s", gt=0, le=3600,
    )] = 2.0
    expiry_check_s: Annotated[float, doc(
        "live sessions' certificates are re-checked (expiry, revocation) this often, s",
        gt=0, le=3600,
    )] = 30.0

    def __post_init__(self) -> None:
        if self.admission != "allow_list" and not self.trust_ca:
            raise ValueError(f"admission {self.admission!r} needs trust_ca (the CA public key "
                             "files that certificates are checked against)")


class ProducerSettings(_Section, frozen=True):
    host: Annotated[Text, doc("control-plane bind address")] = "127.0.0.1"
    advertise_host: Annotated[Text | None, doc(
        "address consumers reach this host at (required with a wildcard host such as 0.0.0.0 "
        "for the tcp/ucx planes, which put it in their grants)"
    )] = None
    port: Annotated[Port, doc(
        "control-plane port, 0 = any free port",
        cli=Differs(5601, "`serve` is started by hand and consumers are pointed at it: a "
                          "well-known port (the Python API and vLLM bind any free port and "
                          "report or announce it)"),
    )] = 0
    region_bytes: Annotated[int, doc(
        "host region for cached entries, bytes (whole blocks)", ge=1,
        cli=Differs(GiB, "`serve` encodes and holds a whole image folder; what it always used"),
    )] = 256 * MiB
    lease_s: Annotated[float, doc(
        "pin lease of a grant, s; consumers renew it while a read is in flight (ECTP v2 "
        "RenewAck), so a dead consumer's pins return within lease + grace", ge=0.1
    )] = 5.0
    budget_bytes: Annotated[PosInt | None, doc(
        "most bytes one consumer may have pinned, bytes; unset = a quarter of the region"
    )] = None
    grace_s: Annotated[float, doc(
        "blocks of a grant that ended unconfirmed stay pinned this long more (READ planes), s", ge=0
    )] = 2.0
    max_wait_s: Annotated[float, doc(
        "ECTP v2: a batched request for a reserved entry waits this long at most for its commit "
        "before NACK_NOT_READY (caps the consumer's wait), s; 0 = never wait", ge=0, le=60,
    )] = 5.0
    inline_max_bytes: Annotated[int, doc(
        "ECTP v2: entries up to this size travel inside the answer (no grant, READ, XferDone) "
        "when the consumer accepts it, bytes; 0 = never", ge=0, le=MiB,
    )] = 64 << 10
    hold_s: Annotated[float, doc(
        "ECTP v2: an announced entry is held (pinned, offered to consumer sessions to read "
        "with no request) for this long after its latest announcement, s (a consumer starts a "
        "read on an offer only with at least 1 s of it left)", ge=2, le=3600,
    )] = 10.0
    hold_share: Annotated[float, doc(
        "ECTP v2: most of the region that announcement holds may pin, a fraction; beyond it "
        "an entry is announced without a hold and fetched with a request; 0 = never hold",
        ge=0, le=1,
    )] = 0.25
    broadcast_offers: Annotated[bool, doc(
        "ECTP v2: an announcement that names no consumer is offered to every consumer session "
        "that takes offers; false: only to the consumers announcements name "
        "(ProducerNode.announce(to=...)), the others fetch with a request"
    )] = True
    images: Annotated[Text | None, doc(
        "folder or file of images `serve`/`demo` encode at start-up; unset = the six "
        "bundled public-domain photographs", path=True,
    )] = None


class ConsumerSettings(_Section, frozen=True):
    region_bytes: Annotated[int, doc("landing region, bytes", ge=1)] = 256 * MiB
    fetch_timeout_s: Annotated[float, doc(
        "overall deadline of one fetch, s", ge=0.1, flag="--timeout-s",
        vllm=Differs(10.0, "a vLLM request waits in the scheduler until its items are fetched; "
                           "after 10 s encoding the item locally is the faster way out"),
    )] = 30.0
    connect_timeout_s: Annotated[Seconds, doc(
        "deadline of an explicit connect (CLI `fetch`: min(this, --timeout-s)), s"
    )] = 10.0
    ack_timeout_s: Annotated[Seconds, doc(
        "XferReq -> XferAck deadline, s (ECTP v2: also ReqBatch -> each item's answer or "
        "its Parked)"
    )] = 2.0
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
    inline_max_bytes: Annotated[int, doc(
        "ECTP v2: the largest entry accepted inline in the producer's answer (copied in; no "
        "READ, no XferDone), bytes; 0 = never", ge=0, le=MiB,
    )] = 64 << 10
    validity_margin_s: Annotated[float, doc(
        "a grant is used only until request sent + lease - this margin (at most a quarter of "
        "the lease), s (ECTP v1 6.3)", ge=0,
    )] = 0.25
    wait_margin_s: Annotated[float, doc(
        "ECTP v2: a batched request asks the producer to wait for entries not yet ready for the "
        "fetch's remaining time minus this margin (at most a quarter of it), s", ge=0,
    )] = 0.25
    request_notifications: Annotated[bool, doc(
        "ask the data plane to notify the producer of completion too (a backstop for a "
        "consumer that dies between READ and XferDone; +0.15 ms per small NIXL fetch)"
    )] = False
    offers: Annotated[bool, doc(
        "ECTP v2: ask producers for offers of the entries they announce, so that a fetch given "
        "their ticket reads with no request"
    )] = True


class _ControlSocketSettings(_Section, frozen=True):
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


class ControlSettings(_Section, frozen=True):
    server: ControlServerSettings = msgspec.field(default_factory=ControlServerSettings)
    client: ControlClientSettings = msgspec.field(default_factory=ControlClientSettings)


class TcpPlaneSettings(_Section, frozen=True):
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


class UcxPlaneSettings(_Section, frozen=True):
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

    def options(self) -> dict[str, dict[str, Any]]:
        """Plane name → constructor options (unset values left to the plane's defaults)."""
        return {"tcp": self.tcp.options(), "ucx": self.ucx.options(),
                "nixl": self.nixl.options(), **{k: dict(v) for k, v in self.plugins.items()}}


class MetricsSettings(_Section, frozen=True):
    port: Annotated[Port | None, doc(
        "`serve`: expose Prometheus metrics at http://[metrics.host]:PORT/metrics (needs the "
        "`metrics` extra; 0 = any free port); unset = off", flag="--metrics-port",
    )] = None
    host: Annotated[Text, doc(
        "metrics HTTP bind address (0.0.0.0 to let a remote Prometheus scrape)"
    )] = "127.0.0.1"


class LogSettings(_Section, frozen=True):
    level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], doc(
        "level of the ectransport loggers", flag="--log-level",
    )] = "WARNING"
    format: Annotated[Literal["text", "json"], doc(
        "text, or one JSON object per line (with peer, session_id, mm_hash, grant_id) for log "
        "shippers", flag="--log-format",
    )] = "text"


class DemoSettings(_Section, frozen=True):
    repeats: Annotated[int, doc(
        "`demo`: fetches per item (the table shows the median)", ge=1, le=1000
    )] = 5
    producer_start_timeout_s: Annotated[Seconds, doc(
        "`demo`: wait for the producer to serve, s"
    )] = 600.0
    producer_stop_timeout_s: Annotated[Seconds, doc(
        "`demo`: SIGTERM -> SIGKILL of the producer, s"
    )] = 15.0


class FleetSettings(_Section, frozen=True):
    """The fleet-wide encoder-cache directory on Redis/Valkey (``ectransport.fleet``,
    ``docs/fleet.md``): who holds which mm_hash, instance liveness, claims."""

    url: Annotated[Text | None, doc(
        "the directory's Redis/Valkey server, redis://[user@]host:port[/db] (rediss:// = TLS); "
        "a password goes in password_file, never in the URL; unset = no directory",
        flag="--redis-url",
    )] = None
    username: Annotated[Text | None, doc(
        "Redis ACL user (AUTH user password); unset = the URL's, or the default user",
        flag="--redis-username",
    )] = None
    password_file: Annotated[Text | None, doc(
        "file holding the Redis password (AUTH), trailing newline stripped; unset = no AUTH",
        flag="--redis-password-file", path=True,
    )] = None
    tls: Annotated[bool, doc(
        "TLS to Redis (also implied by a rediss:// URL)", flag="--redis-tls",
    )] = False
    tls_ca_file: Annotated[Text | None, doc(
        "CA bundle that verifies the Redis server certificate; unset = the system's",
        flag="--redis-tls-ca-file", path=True,
    )] = None
    tls_cert_file: Annotated[Text | None, doc(
        "client certificate for Redis TLS (mutual TLS); unset = none",
        flag="--redis-tls-cert-file", path=True,
    )] = None
    tls_key_file: Annotated[Text | None, doc(
        "private key of tls_cert_file", flag="--redis-tls-key-file", path=True,
    )] = None
    tls_check_hostname: Annotated[bool, doc(
        "check that the Redis server certificate names the URL's host",
        flag="--redis-tls-check-hostname",
    )] = True
    namespace: Annotated[Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], doc(
        "prefix of every directory key (one namespace per fleet sharing a Redis)",
        flag="--fleet-namespace",
    )] = "ect"
    instance: Annotated[Text | None, doc(
        "this instance's name in the directory (unique in the fleet); unset = the node id",
        flag="--fleet-instance",
    )] = None
    liveness_ttl_s: Annotated[float, doc(
        "an instance's liveness record lasts this long unless renewed (every third of it); its "
        "entries are no longer returned once it lapses, s", ge=0.5, le=300,
        flag="--fleet-ttl-s",
    )] = 3.0
    lookup_timeout_s: Annotated[float, doc(
        "deadline of one lookup round trip (a lookup that runs out is a miss), s", gt=0, le=10,
        flag="--fleet-lookup-timeout-s",
    )] = 0.1
    op_timeout_s: Annotated[float, doc(
        "deadline of one background directory operation (publish, liveness renewal, claim), s",
        gt=0, le=60, flag="--redis-timeout-s",
    )] = 1.0
    connect_timeout_s: Annotated[float, doc(
        "deadline of a TCP (+TLS, AUTH) connection to Redis, s", gt=0, le=60,
        flag="--redis-connect-timeout-s",
    )] = 0.5
    retry_backoff_s: Annotated[float, doc(
        "after a failed directory call, calls answer 'unavailable' at once for this long before "
        "Redis is tried again, s (doubling)", gt=0, le=60, flag="--fleet-retry-backoff-s",
    )] = 0.1
    retry_backoff_max_s: Annotated[float, doc(
        "longest such wait, s", gt=0, le=600, flag="--fleet-retry-backoff-max-s",
    )] = 2.0
    claim_ttl_s: Annotated[float, doc(
        "a claim to encode an item expires this long after it was taken unless renewed or "
        "released (a claimant that dies releases it so), s", ge=0.1, le=600,
        flag="--fleet-claim-ttl-s",
    )] = 10.0
    claim_wait_s: Annotated[float, doc(
        "an instance that lost the claim waits this long at most for the claimant's entry, "
        "then encodes itself, s; 0 = never wait", ge=0, le=600, flag="--fleet-claim-wait-s",
    )] = 5.0
    claim_poll_max_s: Annotated[float, doc(
        "longest pause between two polls of a claimed item while waiting (the first is 5 ms, "
        "doubling), s", gt=0, le=5, flag="--fleet-claim-poll-max-s",
    )] = 0.05
    max_holders: Annotated[int, doc(
        "holders read per mm_hash in one lookup (a random sample when more hold it)",
        ge=1, le=1024, flag="--fleet-max-holders",
    )] = 16
    max_entry_bytes: Annotated[int, doc(
        "holder records announcing a larger entry are dropped as hostile, bytes", ge=1,
        flag="--fleet-max-entry-bytes",
    )] = 4 * GiB
    publish_queue_max: Annotated[int, doc(
        "publish/unpublish operations queued while Redis is unreachable; beyond it the queue is "
        "dropped and the instance re-publishes everything it holds on reconnect", ge=1,
        flag="--fleet-publish-queue-max",
    )] = 65536
    gc_after_s: Annotated[float, doc(
        "an instance whose liveness lapsed this long ago is removed from the directory with its "
        "entries, by whichever live instance notices, s", ge=1, flag="--fleet-gc-after-s",
    )] = 60.0


class VllmSettings(_Section, frozen=True):
    """ECTransportConnector only (``ec_connector_extra_config``; not in the TOML file). The
    connector's other keys are fields of :class:`Settings` (``ectransport.vllm.settings``)."""

    region_bytes: Annotated[int, doc(
        "the shared host region (/dev/shm), bytes, rounded down to whole rows; an ec_both node "
        "gives half to served entries and half to fetched ones", ge=1,
    )] = GiB
    producer_keys: Annotated[tuple[Text, ...], doc(
        "consumer: trusted producer public keys, each a Z85 key, a .key file or a directory of "
        "them; or \"announced\" to trust the public_key carried in ec_transfer_params"
    )] = ()
    save_timeout_s: Annotated[Seconds, doc(
        "producer: a reserved save not reported by the worker by then is given up, s"
    )] = 60.0
    load_timeout_s: Annotated[Seconds, doc(
        "consumer: a load pin not released by every rank by then is released anyway, s"
    )] = 60.0
    model_id: Annotated[Text | None, doc(
        "overrides the model id of the compatibility hash; unset = from the model config"
    )] = None
    dtype: Annotated[Text | None, doc(
        "overrides the element dtype (torch name, 'torch.' optional); unset = from the model "
        "config"
    )] = None
    hidden: Annotated[PosInt | None, doc(
        "overrides the row width, elements; unset = the model's inputs-embeds width"
    )] = None
    shm_dir: Annotated[Text, doc("directory of the shared region file")] = "/dev/shm"
    local_cache: Annotated[bool, doc(
        "a saving instance (ec_producer, ec_both) takes a repeated item from its own region "
        "instead of running the encoder again"
    )] = True
    admit_wait_s: Annotated[float, doc(
        "consumer: how long the scheduler waits for a fetch it just started that is expected "
        "to land at once (read on the producer's offer, or small enough to come inline), so "
        "that the request is scheduled in this step instead of the next, s; 0 = never wait",
        ge=0, le=0.1,
    )] = 0.005


class Settings(_Section, frozen=True):
    """Everything configurable, by section (``[producer]``, ``[control.server]``, ...).

    ``Settings()`` holds the Python API's defaults; :func:`defaults` those of another front end.
    """

    layout: LayoutSettings = msgspec.field(default_factory=LayoutSettings)
    node: NodeSettings = msgspec.field(default_factory=NodeSettings)
    security: SecuritySettings = msgspec.field(default_factory=SecuritySettings)
    trust: TrustSettings = msgspec.field(default_factory=TrustSettings)
    producer: ProducerSettings = msgspec.field(default_factory=ProducerSettings)
    consumer: ConsumerSettings = msgspec.field(default_factory=ConsumerSettings)
    control: ControlSettings = msgspec.field(default_factory=ControlSettings)
    planes: PlanesSettings = msgspec.field(default_factory=PlanesSettings)
    metrics: MetricsSettings = msgspec.field(default_factory=MetricsSettings)
    log: LogSettings = msgspec.field(default_factory=LogSettings)
    demo: DemoSettings = msgspec.field(default_factory=DemoSettings)
    fleet: FleetSettings = msgspec.field(default_factory=FleetSettings)

    # -- what the nodes take ------------------------------------------------------------------
    def plane_options(self) -> dict[str, dict[str, Any]]:
        """Plane name → constructor options (unset values left to the node/plane defaults)."""
        return self.planes.options()


# -- the leaves: what the generators walk ---------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """One setting: its dotted path, type (``msgspec.inspect``, constraints included, the
    description unwrapped), description, default (the Python API's) and per-front-end details."""

    path: tuple[str, ...]
    type: Any
    description: str
    default: Any
    extra: dict[str, Any]

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def key(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        """The CLI flag (``--lease-s``; the field may name another one)."""
        return str(self.extra.get("flag") or "--" + self.key.replace("_", "-"))

    @property
    def meaning(self) -> str:
        """The description without its leading role (``producer: ``, ```demo`: ``), for a
        place that already says the role (a command's ``--help``, the vLLM table)."""
        m = _ROLE_PREFIX.match(self.description)
        return self.description[m.end():] if m else self.description

    @property
    def is_path(self) -> bool:
        return bool(self.extra.get("path"))

    @property
    def optional(self) -> bool:
        return isinstance(self.type, mi.UnionType) and \
            any(isinstance(t, mi.NoneType) for t in self.type.types)

    @property
    def base(self) -> Any:
        """The type without ``None`` (``int`` for ``int | None``)."""
        return strip_none(self.type)

    @property
    def is_dict(self) -> bool:
        return isinstance(self.base, mi.DictType)

    @property
    def is_list(self) -> bool:
        return isinstance(self.base, (mi.ListType, mi.VarTupleType))

    @property
    def is_str(self) -> bool:
        return isinstance(self.base, (mi.StrType, mi.LiteralType))

    def differs(self, front_end: FrontEnd) -> Differs | None:
        """This front end's deliberate default and its reason, or None."""
        d = self.extra.get(front_end)
        return d if isinstance(d, Differs) else None

    def default_for(self, front_end: FrontEnd) -> Any:
        d = self.differs(front_end)
        return self.default if d is None else d.value


_ROLE_PREFIX = re.compile(r"(producer|consumer|`serve`|`demo`): ")


def strip_none(t: Any) -> Any:
    if isinstance(t, mi.UnionType):
        rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
        return rest[0] if len(rest) == 1 else t
    return t


def leaves(cls: type = Settings, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Leaf]:
    """Every setting of ``cls`` (a section Struct), by path, in declaration order."""
    out: dict[tuple[str, ...], Leaf] = {}
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType), cls  # Settings and its sections are all Structs
    for f in info.fields:
        t, desc, extra = f.type, "", {}
        if isinstance(t, mi.Metadata):
            desc = (t.extra_json_schema or {}).get("description", "")
            extra = dict(t.extra or {})
            t = t.type
        path = (*prefix, f.name)
        if isinstance(t, mi.StructType):
            out.update(leaves(t.cls, path))
        else:
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            out[path] = Leaf(path, t, desc, default, extra)
    return out


#: Every setting of :class:`Settings`, by path.
LEAVES: dict[tuple[str, ...], Leaf] = leaves()
#: Every ECTransportConnector-only setting, by path (``("vllm", key)``).
VLLM_LEAVES: dict[tuple[str, ...], Leaf] = leaves(VllmSettings, ("vllm",))
#: Every deliberate difference: (front end, setting, its default there, the reason).
DIFFERENCES: tuple[tuple[FrontEnd, str, Any, str], ...] = tuple(
    (fe, leaf.name, d.value, d.reason)
    for leaf in LEAVES.values() for fe in FRONT_ENDS if (d := leaf.differs(fe)) is not None)


def replace_path(root: Any, path: tuple[str, ...], value: Any) -> Any:
    """``root`` (a frozen Struct) with the field at ``path`` set to ``value``."""
    if len(path) == 1:
        return msgspec.structs.replace(root, **{path[0]: value})
    return msgspec.structs.replace(
        root, **{path[0]: replace_path(getattr(root, path[0]), path[1:], value)})


def defaults(front_end: FrontEnd = "api") -> Settings:
    """The defaults of a front end: the fields' own, with that front end's differences."""
    s = Settings()
    for fe, name, value, _reason in DIFFERENCES:
        if fe == front_end:
            s = replace_path(s, tuple(name.split(".")), value)
    return s


#: The Python API's defaults: ``ProducerNode(lease_s=API.producer.lease_s, ...)``.
API: Settings = defaults("api")
#: The ``ectransport`` commands' and ``load_settings``' defaults.
CLI: Settings = defaults("cli")
#: ECTransportConnector's defaults for the keys it shares with :class:`Settings`.
VLLM: Settings = defaults("vllm")
