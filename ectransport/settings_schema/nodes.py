"""The node sections: what entries mean (layout), who a node is (node, security, trust) and
what the producer and consumer do (leases, budgets, deadlines, retries)."""

from __future__ import annotations

from typing import Annotated, Literal

from ectransport.protocol import SUPPORTED_VERSIONS
from ectransport.settings_schema.fields import (
    Differs,
    GiB,
    MiB,
    Port,
    PosInt,
    Seconds,
    Section,
    Text,
    doc,
)


class LayoutSettings(Section, frozen=True):
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


class NodeSettings(Section, frozen=True):
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


class SecuritySettings(Section, frozen=True):
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


class TrustSettings(Section, frozen=True):
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


class ProducerSettings(Section, frozen=True):
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


class ConsumerSettings(Section, frozen=True):
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
    done_delay_s: Annotated[float, doc(
        "ECTP v2: the completion of a read on an offer (a hold's: it releases nothing at the "
        "producer) may wait this long to leave with later ones, s (a grant's leaves at the end "
        "of its step; all leave before the session's next request); 0 = at the end of its step",
        ge=0, le=1,
    )] = 0.005


