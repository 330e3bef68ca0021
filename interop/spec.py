"""Declarative descriptions: nodes, entries, steps, expected outcomes, cells.

Everything here is plain data (dataclasses that round-trip through JSON), so a node can be handed
to its process as one JSON document and a cell can be printed in the report.

Outcome strings (observed and expected):

* ``ok``: the fetch landed and the bytes equal the producer's (checked by SHA-256), or a connect
  succeeded;
* ``miss:<REASON>``: a :class:`~ectransport.session.MissReason` name (``miss:VERSION``);
* ``error:<Class>``: the exception class a call raised (``error:AuthError``);
* ``refused:<Class>``: a node could not be started (``refused:ConfigError``), including the
  harness's own ``refused:VectorCheckFailed``;
* vLLM's consumer session: ``vllm:completed`` / ``vllm:tombstoned`` / ``vllm:timeout``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ECTP = "ectransport"  # our node, speaking ECTP
VLLM_WIRE = "vllm-wire"  # our node, speaking vLLM's wire (ectransport.compat.vllm_wire)
VLLM_STOCK = "vllm-stock"  # vLLM 0.33.0's own session classes


@dataclass(frozen=True)
class NodeSpec:
    """One node. ``host`` names its host slot (one network namespace / address per slot).

    Attributes:
        role: ``producer`` or ``consumer``.
        impl: ECTP, VLLM_WIRE or VLLM_STOCK.
        planes: data planes, best first (ECTP nodes).
        versions: ECTP versions claimed (None: the build's own).
        emulated: the version claim is an emulation (an older/newer node made by override): its
            golden-vector check is *expected* to fail; otherwise a failing check refuses the node.
        curve: CURVE on (else plain ZMQ, ``Security(insecure=True)``).
        key: this node's key-pair name (harness key ring).
        server_key: consumer: name of the key it believes the producer has (default: the
            producer's own key; another name makes a server-key mismatch).
        allow: producer: key names on its allow-list.
        model / dtype / hidden: compatibility parameters.
        mem_kind: memory kind of the region (only DRAM runs on this machine).
        framework: the framework the node claims to be (reported and checked against the process).
        region_bytes / budget_bytes: producer region and per-consumer pin budget.
        profile: ``vllm-wire`` opt-in for VLLM_WIRE nodes (None = no opt-in).
        options: implementation-specific settings, sent as the description's ``ext.options``
            (ectransport nodes: overrides per settings section, e.g. ``{"control_client":
            {"handshake_timeout_s": 5.0}}``; vLLM-wire nodes: constructor keywords).
        adapter: the implementation that runs the node (``interop.impls``; "" = by ``impl``:
            vLLM's own classes for ``vllm-stock``, this tree otherwise).
        trust: fleet trust of the node (:class:`TrustSpec`; None: no ``[trust]``).
        bind: producer: the bind address when not the slot's own (``"0.0.0.0"``: every
            interface of the slot's network namespace, the slot's address advertised to
            consumers); "" = the slot's. Without namespaces (loopback topology) the slot's
            address is bound: a wildcard would listen on the host's interfaces.
    """

    role: str
    host: str
    impl: str = ECTP
    planes: tuple[str, ...] = ("nixl",)
    versions: tuple[int, ...] | None = None
    emulated: bool = False
    curve: bool = True
    key: str = ""
    server_key: str | None = None
    allow: tuple[str, ...] = ()
    model: str = "org/vision-encoder"
    dtype: str = "bfloat16"
    hidden: int = 1024
    mem_kind: str = "DRAM"
    framework: str = ""
    region_bytes: int = 32 << 20
    budget_bytes: int | None = None
    profile: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    adapter: str = ""
    trust: TrustSpec | None = None
    bind: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeSpec:
        d = dict(d)
        for k in ("planes", "allow"):
            d[k] = tuple(d.get(k) or ())
        if d.get("versions") is not None:
            d["versions"] = tuple(d["versions"])
        if d.get("trust") is not None:
            d["trust"] = TrustSpec.from_json(d["trust"])
        return cls(**d)

    @property
    def block_bytes(self) -> int:
        from ectransport.protocol import element_size

        return self.hidden * element_size(self.dtype)

    def brief(self) -> str:
        """A short label for the report."""
        bits = [self.adapter or (self.impl if self.impl != ECTP else "ect")]
        if self.impl == ECTP:
            bits.append("+".join(self.planes))
            if self.versions:
                star = "*" if self.emulated else ""
                bits.append("v" + ",".join(map(str, self.versions)) + star)
            bits.append("curve" if self.curve else "plain")
            if self.trust is not None:
                bits.append(self.trust.brief())
        return "/".join(bits)


@dataclass(frozen=True)
class Cert:
    """A node certificate a cell's CA issues before the cell runs (``ectransport keys issue``).

    Attributes:
        name: the certificate's name in the cell (its file, and the instance name in it).
        key: the key-pair name (harness key ring) whose CURVE public key it binds.
        role: ``producer``, ``consumer`` or ``both``.
        ca: the name of the cell CA that signs it (every CA named is made with ``keys ca
            init --no-passphrase``; nodes trust the CAs their :class:`TrustSpec` names).
        valid_days: ``--valid-days`` (from the moment of issue; 0.000012 = 1 s, to expire).
    """

    name: str
    key: str
    role: str
    ca: str = "ca"
    valid_days: float = 1.0


@dataclass(frozen=True)
class TrustSpec:
    """A node's ``[trust]`` in a cell: names that the harness resolves to the files of the
    cell's CAs and certificates (ADAPTER.md §4 ``trust``).

    Attributes:
        admission: ``allow_list``, ``certificate``, ``either`` or ``both``.
        cert: the :class:`Cert` that is this node's ``cert_file`` (None: none).
        present: a :class:`Cert` the node presents as its own *without* its start-up check
            (the adapter's ``present_cert``): what a misconfigured or hostile node sends — a
            certificate of the wrong role, or one that expired — which the node itself would
            refuse to start with.
        cas: the cell CAs whose public keys are ``trust_ca`` (their revocation lists are
            ``revocation_file``).
        clock_skew_s: ``[trust] clock_skew_s`` (None: the default, 300 s).
        revocation_reload_s: ``[trust] revocation_reload_s`` (the default is 2 s; the cells
            use less to keep the matrix short).
    """

    admission: str = "certificate"
    cert: str | None = None
    present: str | None = None
    cas: tuple[str, ...] = ("ca",)
    clock_skew_s: float | None = None
    revocation_reload_s: float = 0.5

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrustSpec:
        return cls(**{**d, "cas": tuple(d.get("cas") or ())})

    def brief(self) -> str:
        """``cert=either`` style label: the admission, and what the node shows."""
        shows = self.present or self.cert
        return f"{self.admission}" + (f"+{shows}" if shows else "+no cert")


@dataclass(frozen=True)
class Entry:
    """An entry the producer holds: ``rows`` rows of random bytes drawn from ``seed``."""

    mm_hash: str
    rows: int
    seed: int
    ready: bool = True


@dataclass(frozen=True)
class Expect:
    """Allowed outcomes of one step (any of ``outcomes``), and the plane an ``ok`` must use.

    ``loopback`` / ``loopback_plane`` replace ``outcomes`` / ``plane`` when the run had no network
    namespaces (every node in one namespace). The shm plane is the case: it reaches only a peer in
    its own network namespace, so across namespaces negotiation skips it (the next common plane is
    used, or the connect is refused with ``NoCommonPlane`` when shm was the only one), while in
    one namespace shm itself is chosen.
    """

    outcomes: tuple[str, ...]
    plane: str | None = None
    loopback: tuple[str, ...] | None = None
    loopback_plane: str | None = None
    #: the ECTP version an ``ok`` connect/fetch_many must have negotiated (None: not checked)
    version: int | None = None
    #: text a refusal's detail must contain (``"trust: missing: "``; None: not checked)
    detail: str | None = None

    def allowed(self, mode: str) -> tuple[str, ...]:
        if mode == "loopback" and self.loopback is not None:
            return self.loopback
        return self.outcomes

    def plane_for(self, mode: str) -> str | None:
        """The plane an ``ok`` must have used in this topology mode (None: not checked)."""
        if mode == "loopback" and self.loopback is not None:
            return self.loopback_plane
        return self.plane

    def label(self, mode: str) -> str:
        s = "|".join(self.allowed(mode))
        plane = self.plane_for(mode)
        s = f"{s} via {plane}" if plane else s
        s = f"{s} at v{self.version}" if self.version is not None else s
        return f"{s} [{self.detail.strip()}]" if self.detail else s


def ok(plane: str | None = None, version: int | None = None) -> Expect:
    return Expect(("ok",), plane, version=version)


@dataclass(frozen=True)
class Step:
    """One action of a cell.

    ops: ``connect`` / ``fetch`` (consumer ``who``: index, or -1 for all consumers in parallel),
    ``fetch_until_ok`` (retry up to ``timeout_s``), ``kill_producer`` (SIGKILL its process),
    ``start_producer`` (again, same port and keys), ``fetch_many`` (the consumer's
    ``fetch_many`` of several entries, ``mm_hash`` their names joined by ``,``: ok when every one
    landed byte-exact). ``mm_hash`` names an :class:`Entry` (or an unknown key for a miss).
    Fleet trust: ``revoke`` (``keys revoke --cert`` of the :class:`Cert` named ``arg``, on its
    CA's revocation list), ``wait`` (``timeout_s`` seconds: a reload period of the nodes, or a
    certificate's expiry), ``no_grants`` (the producer's ``stats``: it has issued no grant).
    """

    op: str
    who: int = 0
    mm_hash: str = ""
    expect: Expect | None = None
    timeout_s: float = 10.0
    arg: str = ""


@dataclass(frozen=True)
class Cell:
    """A producer, its consumers, the entries, the steps and what each step must give."""

    name: str
    group: str
    proves: str
    producer: NodeSpec
    consumers: tuple[NodeSpec, ...]
    entries: tuple[Entry, ...]
    steps: tuple[Step, ...]
    ci: bool = False
    producer_expect: Expect = Expect(("ok",))
    needs_vllm: bool = False
    #: fleet trust: the certificates the cell's CAs issue before it runs (in this order)
    certs: tuple[Cert, ...] = ()

    def cas(self) -> list[str]:
        """The cell CAs to create: every one a certificate or a node's trust names."""
        names = [c.ca for c in self.certs]
        for n in (self.producer, *self.consumers):
            names += list(n.trust.cas) if n.trust else []
        return list(dict.fromkeys(names))

    def hosts(self) -> list[str]:
        return [self.producer.host, *[c.host for c in self.consumers]]
