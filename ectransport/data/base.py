"""The data-plane contract: how encoder-cache bytes move once the control plane granted them.

A plane is a :class:`DataTransport` subclass that *declares* what it can do (:class:`Capabilities`)
instead of making callers probe with try/except. One instance serves one node and one host region.

The flow is the same for every plane: the producer describes the granted blocks in an opaque
``plane_grant`` (:meth:`describe`); the consumer starts the transfer with it (:meth:`start`) and
polls the handle (:meth:`check`); the producer learns of completion (:meth:`poll_notifications`)
and, when the grant ends, :meth:`revoke` s it. What differs is who moves the bytes, declared as
:class:`TransferModel`:

* ``READ`` (e.g. NIXL): the consumer's ``start`` posts a one-sided READ of the granted blocks.
* ``PUSH`` (e.g. TCP, UCX via ucxx, which has no one-sided RMA in Python): the consumer's ``start``
  sends a request naming the grant to the producer's plane endpoint, and the producer's plane sends
  the granted blocks straight from its region into the consumer's blocks.

Sizes are bytes; timeouts seconds. Block runs are :class:`ectransport.store.Run` (block index +
count) of the region passed to the constructor, whose ``block_bytes`` both sides share (the
compatibility hash guarantees it). Methods never block longer than the deadline they are given;
none raise for an expected transfer failure: :meth:`check` reports ``ERR`` instead.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ectransport.store import Run

#: Version of this contract. A plugin declares the version it implements; the registry loads only
#: planes whose ``plugin_api_version`` equals it. Version 2 added the ``identity`` constructor
#: argument and the session-binding methods (:meth:`DataTransport.locality`,
#: :meth:`~DataTransport.reachable`, :meth:`~DataTransport.endpoint`,
#: :meth:`~DataTransport.bind_peer`); ``start``'s ``prepared`` became the peer binding.
PLUGIN_API_VERSION = 2

#: Upper bounds of what the session-binding methods may return (they travel in Hello/Welcome).
MAX_LOCALITY_BYTES = 256
MAX_ENDPOINT_BYTES = 64 << 10


class TransferModel(enum.Enum):
    READ = "read"  #: one-sided READ by the consumer
    PUSH = "push"  #: the producer's plane sends the granted blocks on the consumer's request


class XferState(enum.Enum):
    PROC = "proc"  #: in flight
    DONE = "done"  #: all bytes landed
    ERR = "err"  #: failed; nothing more will land once released


@dataclass(frozen=True)
class Capabilities:
    """What a plane can do.

    Attributes:
        transfer_model: READ or PUSH.
        mem_kinds: memory kinds the plane can move (``"DRAM"``, ``"VRAM"``).
        max_transfer_bytes: largest single transfer, bytes; None = unbounded.
        notifications: whether the producer learns of completion from the plane itself (else it
            relies on the consumer's ``XferDone`` or the lease).
        address_options: which of the constructor options ``host`` (the address it binds and,
            unless ``advertise_host`` is accepted too, names in its endpoint) and
            ``advertise_host`` (the address it names when bound to a wildcard) the plane takes:
            a plane with ``host`` listens on an address of its own, and the producer node passes
            its control-plane address (or ``advertise_host``) there. Empty for planes that need no
            address (NIXL, shm).
    """

    transfer_model: TransferModel
    mem_kinds: frozenset[str]
    max_transfer_bytes: int | None
    notifications: bool
    address_options: frozenset[str] = frozenset()


class RegionLike(Protocol):
    """What a plane needs of the node's region (``ectransport.store.HostRegion`` satisfies it)."""

    addr: int  # base address
    nbytes: int
    block_bytes: int
    mem_kind: str


Handle = Any  # plane-specific transfer handle; opaque to callers


class DataTransport(ABC):
    """Base class of every data plane (built-in or plugin).

    Construct with ``Plane(node_id=..., region=..., identity=..., **options)``. The region is
    registered with the plane for the plane's lifetime; :meth:`close` deregisters it and releases
    every handle. ``identity`` is the node's authenticated identity on the control plane (a
    fingerprint of its CURVE public key, see :func:`ectransport.data.base.identity_of`; ``""`` in
    insecure mode): a producer's plane embeds it in what it declares (:meth:`endpoint`) so that a
    consumer can check that a declaration really comes from the producer it authenticated.

    **Binding grants to the producer that issued them** (API 2). A grant is only as trustworthy as
    the producer that sent it, and a compromised producer must not be able to point a consumer at
    another producer's memory or endpoint. So:

    1. the consumer's plane says where it is (:meth:`locality`, sent in ``Hello``); the producer's
       plane says whether it can reach it (:meth:`reachable`); an unreachable plane is never
       negotiated (the next common one is);
    2. the producer's negotiated plane declares once per session how it is reached
       (:meth:`endpoint`, sent in ``Welcome`` over the authenticated control plane);
    3. the consumer's plane validates that declaration against what it knows of the producer
       (:meth:`bind_peer`: the CURVE identity, the host it dialed) and returns a *binding*;
    4. every grant of that session is started with the binding (``start(prepared=binding, ...)``),
       and the plane refuses, before any I/O, a grant that names anything the declaration does not
       (another agent, endpoint, address range): ``DataPlaneError``.

    A failure of a transfer must only affect the producer it came from (e.g. drop and re-establish
    that producer's connection state), never another producer's.

    Raises (constructor): ``PlaneUnavailable`` if the plane's dependency or backend cannot run here.
    """

    name: ClassVar[str]
    plugin_api_version: ClassVar[int] = PLUGIN_API_VERSION
    capabilities: ClassVar[Capabilities]

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """Whether the plane can run on this machine, and why not (cheap; no region needed)."""
        return True, "ok"

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        """See the class docstring; subclasses define their own constructor."""

    def describe_transport(self) -> str:
        """What the plane actually uses underneath (e.g. UCX transports ``"cma,tcp"``), for logs."""
        return self.name

    # -- session binding (API 2; the defaults bind nothing) ----------------------------------------
    def locality(self) -> bytes:
        """Consumer side: where this node is, as the producer's plane needs it to judge
        reachability (at most :data:`MAX_LOCALITY_BYTES`; sent in ``Hello``). Default ``b""``."""
        return b""

    def reachable(self, locality: bytes) -> bool:
        """Producer side: whether a consumer whose plane sent ``locality`` (possibly ``b""``, from
        an older node) can reach this plane. Must be cheap and never raise. Default True."""
        return True

    def endpoint(self) -> bytes:
        """Producer side: how this plane is reached, declared once per consumer session in
        ``Welcome`` (at most :data:`MAX_ENDPOINT_BYTES`). Grants of the session may name nothing
        else. Default ``b""`` (nothing declared)."""
        return b""

    def bind_peer(self, endpoint: bytes, *, peer: str, host: str, identity: str) -> Any:
        """Consumer side: validate a producer's :meth:`endpoint` declaration; return the binding
        that :meth:`start` receives as ``prepared`` for every grant of that session.

        Args:
            endpoint: the declaration from ``Welcome`` (``b""`` from a node that declares none).
            peer: the control connection (``"host:port"``), unique per producer session.
            host: the host the consumer dialed for the control plane.
            identity: the producer's authenticated identity (:func:`identity_of` of the CURVE
                server key the consumer connected with; ``""`` in insecure mode).

        Raises:
            DataPlaneError: the declaration is malformed or names something this producer cannot
                own (another identity's agent, another host). The session then fails with a typed
                miss; other producers are unaffected.
        """
        return None

    def unbind_peer(self, binding: Any) -> None:
        """Consumer side: the session of ``binding`` ended; drop what only it used. Never raises."""

    # -- producer side --------------------------------------------------------------------------
    @abstractmethod
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """The ``plane_grant`` for exactly these blocks (and nothing else of the region).

        Pure computation on cached state; called on the producer's hot path.
        """

    def revoke(self, plane_grant: bytes) -> None:
        """The grant ended (unpinned): stop serving it. Planes whose consumers read the region
        directly (NIXL) cannot revoke and inherit this no-op; planes that serve requests (TCP, UCX,
        shm) must refuse a revoked grant from now on. The socket-serving planes (TCP, shm:
        ``SocketServingPlane``) also stop a send in progress before returning, so no byte of the
        grant is read afterwards; UCX lets a send already posted complete. Malformed grants are a
        no-op."""

    def poll_notifications(self) -> list[bytes]:
        """Completion notifications received since the last call (producer side)."""
        return []

    # -- consumer side --------------------------------------------------------------------------
    @abstractmethod
    def start(
        self,
        prepared: Handle | None,
        plane_grant: bytes,
        runs: Sequence[Run],
        nbytes: int,
        notif: bytes,
    ) -> Handle:
        """After an OK ack: start the transfer of the granted blocks into local ``runs``.

        ``prepared`` is the session's :meth:`bind_peer` result (None if the plane binds nothing);
        a grant naming anything the binding does not allow is refused before any I/O.

        ``notif`` is delivered to the producer's :meth:`poll_notifications` on completion if the
        plane has notifications.

        Raises:
            DataPlaneError: the grant is malformed, does not match ``runs``/``nbytes``, or is not
                covered by the binding.
        """

    @abstractmethod
    def check(self, handle: Handle) -> XferState:
        """Non-blocking state of a transfer handle (either side)."""

    def error_detail(self, handle: Handle) -> str:
        """Why a transfer whose :meth:`check` said ``ERR`` failed, one line ("" if unknown); it
        ends up in the consumer's ``Miss``. Never raises."""
        return str(getattr(handle, "detail", "") or "")

    @abstractmethod
    def release(self, handle: Handle) -> None:
        """Release a handle, cancelling it if the plane can; idempotent, never raises."""

    def forget_peer(self, peer: str) -> None:
        """Drop cached state about a remote peer (e.g. a producer that restarted)."""

    @abstractmethod
    def close(self) -> None:
        """Release every handle and deregister the region; idempotent."""


def identity_of(public_key: str | bytes | None) -> str:
    """The identity planes embed and check: the first 16 hex digits of SHA-256 over a Z85 CURVE
    public key (40 characters); ``""`` for None (insecure mode)."""
    if not public_key:
        return ""
    import hashlib

    key = public_key.encode() if isinstance(public_key, str) else bytes(public_key)
    return hashlib.sha256(key).hexdigest()[:16]
