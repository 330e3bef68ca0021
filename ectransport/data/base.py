"""The data-plane contract: how encoder-cache bytes move once the control plane granted them.

A plane has up to two halves, one per side of a grant:

* the **serving half** (:class:`ServingPlane`, the producer's): says how it is reached
  (:meth:`~ServingPlane.endpoint`) and whom it can reach (:meth:`~ServingPlane.reachable`),
  describes the granted blocks in an opaque ``plane_grant`` (:meth:`~ServingPlane.describe`),
  learns of completion (:meth:`~ServingPlane.poll_notifications`) and, when the grant ends,
  :meth:`~ServingPlane.revoke` s it;
* the **fetching half** (:class:`FetchingPlane`, the consumer's): says where it is
  (:meth:`~FetchingPlane.locality`), checks a producer's declaration once per session
  (:meth:`~FetchingPlane.bind_peer`), starts the transfer of a grant into local blocks
  (:meth:`~FetchingPlane.start`) and polls it (:meth:`~FetchingPlane.check`) until it releases it.

Both derive from :class:`PlaneBase` (``name``, :class:`Capabilities`, ``probe``,
``describe_transport``, ``close``, the constructor). A plane implements one half or both:
:class:`DataTransport` is exactly "both halves" (every built-in plane, and every plane written for
plugin API 2). Which halves a plane has is declared by the classes it derives from and read with
:func:`plane_halves`; the runtime never guesses from a plane's name, and a typed table of a
producer's planes is a ``Mapping[str, ServingPlane]``.

What differs between planes is who moves the bytes, declared as :class:`TransferModel`:

* ``READ`` (e.g. NIXL): the consumer's ``start`` posts a one-sided READ of the granted blocks.
* ``PUSH`` (e.g. TCP, UCX via ucxx, which has no one-sided RMA in Python): the consumer's ``start``
  sends a request naming the grant to the producer's plane endpoint, and the producer's plane sends
  the granted blocks straight from its region into the consumer's blocks.

Sizes are bytes; timeouts seconds. Block runs are :class:`ectransport.store.Run` (block index +
count) of the region passed to the constructor, whose ``block_bytes`` both sides share (the
compatibility hash guarantees it). Methods never block longer than the deadline they are given;
none raise for an expected transfer failure: :meth:`~FetchingPlane.check` reports ``ERR`` instead.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ectransport.store import Run

#: Version of this contract. A plane declares the version it implements; the registry loads
#: planes that declare it, and planes of :data:`SUPPORTED_API_VERSIONS` through an adapter.
#: Version 2 added the ``identity`` constructor argument and the session-binding methods; version
#: 3 split the contract into :class:`ServingPlane` and :class:`FetchingPlane` (``DataTransport``,
#: both halves, keeps every API-2 method with its signature and meaning).
PLUGIN_API_VERSION = 3
#: The plugin API versions the registry loads: 3, and 2 (a ``DataTransport``, loaded as a plane
#: with both halves).
SUPPORTED_API_VERSIONS: tuple[int, ...] = (2, 3)

#: Upper bounds of what the session-binding methods may return (they travel in Hello/Welcome).
MAX_LOCALITY_BYTES = 256
MAX_ENDPOINT_BYTES = 64 << 10

#: The names :func:`plane_halves` gives the two halves.
SERVE = "serve"
FETCH = "fetch"


class TransferModel(enum.Enum):
    READ = "read"  #: one-sided READ by the consumer
    PUSH = "push"  #: the producer's plane sends the granted blocks on the consumer's request


class XferState(enum.Enum):
    PROC = "proc"  #: in flight
    DONE = "done"  #: all bytes landed
    ERR = "err"  #: failed; nothing more will land once released


@dataclass(frozen=True)
class Capabilities:
    """What a plane can do (both halves of a plane of one name declare the same).

    Attributes:
        transfer_model: READ or PUSH. It decides the producer's grace rule: a grant on a PUSH
            plane is over once ``revoke`` returned; a READ plane's blocks stay pinned for the
            grace period after a grant ended without a confirmed completion.
        mem_kinds: memory kinds the plane can move (``"DRAM"``, ``"VRAM"``).
        max_transfer_bytes: largest single transfer, bytes; None = unbounded.
        notifications: whether the producer learns of completion from the plane itself (else it
            relies on the consumer's ``XferDone`` or the lease).
        address_options: which of the constructor options ``host`` (the address it binds and,
            unless ``advertise_host`` is accepted too, names in its endpoint) and
            ``advertise_host`` (the address it names when bound to a wildcard) the serving half
            takes: a plane with ``host`` listens on an address of its own, and the producer node
            passes its control-plane address (or ``advertise_host``) there. Empty for planes that
            need no address (NIXL, shm).
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


class PlaneBase(ABC):
    """What both halves share: declarations, construction and teardown.

    Construct with ``Plane(node_id=..., region=..., identity=..., **options)``. The region is
    registered with the plane for the plane's lifetime; :meth:`close` deregisters it and releases
    every handle. ``identity`` is the node's authenticated identity on the control plane (a
    fingerprint of its CURVE public key, see :func:`identity_of`; ``""`` in insecure mode): a
    producer's plane embeds it in what it declares (:meth:`ServingPlane.endpoint`) so that a
    consumer can check that a declaration really comes from the producer it authenticated.

    A plane declares ``name`` (what nodes negotiate: the serving and the fetching half of one
    plane share it), ``capabilities`` and ``plugin_api_version`` (in its own class, not inherited
    from here: the registry checks it).

    Raises (constructor): ``PlaneUnavailable`` if the plane's dependency or backend cannot run here;
    ``ConfigError`` for unknown or invalid options.
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

    @abstractmethod
    def close(self) -> None:
        """Release every handle and deregister the region; idempotent."""


class ServingPlane(PlaneBase):
    """The producer's half: describe granted blocks, serve or expose them, learn of completion.

    **Binding** (API 2): the producer's negotiated plane declares once per consumer session how it
    is reached (:meth:`endpoint`, sent in ``Welcome`` over the authenticated control plane), and a
    consumer's grants may name nothing else; :meth:`reachable` keeps a plane from being
    negotiated where it cannot work. The defaults declare nothing and reach everyone, which is
    right only for a plane whose grants name nothing.
    """

    def endpoint(self) -> bytes:
        """How this plane is reached, declared once per consumer session in ``Welcome`` (at most
        :data:`MAX_ENDPOINT_BYTES`). Grants of the session may name nothing else. Default ``b""``
        (nothing declared)."""
        return b""

    def reachable(self, locality: bytes) -> bool:
        """Whether a consumer whose plane sent ``locality`` (possibly ``b""``, from an older node)
        can reach this plane. Must be cheap and never raise. Default True."""
        return True

    @abstractmethod
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """The ``plane_grant`` for exactly these blocks (and nothing else of the region).

        Pure computation on cached state; called on the producer's hot path.

        Raises:
            DataPlaneError: runs outside the region, empty runs, ``nbytes`` larger than the runs,
                or the plane is closed.
        """

    def revoke(self, plane_grant: bytes) -> None:
        """The grant ended (unpinned): stop serving it. Planes whose consumers read the region
        directly (NIXL) cannot revoke and inherit this no-op; planes that serve requests (TCP, UCX,
        shm) must refuse a revoked grant from now on. The socket-serving planes (TCP, shm:
        ``SocketServingPlane``) also stop a send in progress before returning, so no byte of the
        grant is read afterwards; UCX lets a send already posted complete. Malformed grants are a
        no-op."""

    def poll_notifications(self) -> list[bytes]:
        """Each consumer ``notif`` once, after the plane stopped reading the region for it
        (planes whose :attr:`Capabilities.notifications` is True). Default: none."""
        return []


class FetchingPlane(PlaneBase):
    """The consumer's half: bind a producer's declaration, move granted bytes into local blocks.

    **Binding grants to the producer that issued them** (API 2). A grant is only as trustworthy as
    the producer that sent it, and a compromised producer must not be able to point a consumer at
    another producer's memory or endpoint. So:

    1. this half says where it is (:meth:`locality`, sent in ``Hello``); the producer's serving
       half says whether it can reach it (:meth:`ServingPlane.reachable`); an unreachable plane is
       never negotiated (the next common one is);
    2. the producer declares once per session how it is reached (:meth:`ServingPlane.endpoint`);
    3. this half validates that declaration against what it knows of the producer
       (:meth:`bind_peer`: the CURVE identity, the host it dialed) and returns a *binding*;
    4. every grant of that session is started with the binding (``start(binding, ...)``), and the
       plane refuses, before any I/O, a grant that names anything the declaration does not
       (another agent, endpoint, address range): ``DataPlaneError``.

    A failure of a transfer must only affect the producer it came from (e.g. drop and re-establish
    that producer's connection state), never another producer's.
    """

    def locality(self) -> bytes:
        """Where this node is, as the producer's plane needs it to judge reachability (at most
        :data:`MAX_LOCALITY_BYTES`; sent in ``Hello``). Default ``b""``."""
        return b""

    def bind_peer(self, endpoint: bytes, *, peer: str, host: str, identity: str) -> Any:
        """Validate a producer's :meth:`ServingPlane.endpoint` declaration; return the binding
        that :meth:`start` receives for every grant of that session.

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
        """The session of ``binding`` ended; drop what only it used. Never raises."""

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

        ``prepared`` is the session's :meth:`bind_peer` result (the binding; None if the plane
        binds nothing); a grant naming anything the binding does not allow is refused before any
        I/O. ``notif`` is delivered to the producer's :meth:`ServingPlane.poll_notifications` on
        completion if the plane has notifications.

        Raises:
            DataPlaneError: the grant is malformed, does not match ``runs``/``nbytes``, or is not
                covered by the binding.
        """

    @abstractmethod
    def check(self, handle: Handle) -> XferState:
        """Non-blocking state of a transfer handle."""

    def error_detail(self, handle: Handle) -> str:
        """Why a transfer whose :meth:`check` said ``ERR`` failed, one line ("" if unknown); it
        ends up in the consumer's ``Miss``. Never raises."""
        return str(getattr(handle, "detail", "") or "")

    @abstractmethod
    def release(self, handle: Handle) -> None:
        """Release a handle, cancelling it if the plane can; idempotent, never raises."""

    def forget_peer(self, peer: str) -> None:
        """Drop cached state about a remote peer (e.g. a producer that restarted)."""


class DataTransport(ServingPlane, FetchingPlane):
    """A plane with both halves: what every built-in plane is, and what plugin API 2 called a
    plane (its methods, signatures and meanings are API 2's). A plane with both halves derives
    from this class (not from the two halves side by side: the registry refuses that), so that
    ``isinstance(plane, DataTransport)`` means "serves and fetches".

    Raises (constructor): ``PlaneUnavailable`` if the plane's dependency or backend cannot run here.
    """


#: The contract's own classes: a ``plugin_api_version`` found on them is the default, not a
#: plane's declaration.
CONTRACT_CLASSES: tuple[type, ...] = (PlaneBase, ServingPlane, FetchingPlane, DataTransport)


def plane_halves(plane: type | object) -> tuple[str, ...]:
    """Which halves a plane class (or instance) implements, as declared by the classes it derives
    from: ``(SERVE, FETCH)``, ``(SERVE,)``, ``(FETCH,)`` or ``()`` (not a plane)."""
    cls = plane if isinstance(plane, type) else type(plane)
    return tuple(h for h, base in ((SERVE, ServingPlane), (FETCH, FetchingPlane))
                 if issubclass(cls, base))


def identity_of(public_key: str | bytes | None) -> str:
    """The identity planes embed and check: the first 16 hex digits of SHA-256 over a Z85 CURVE
    public key (40 characters); ``""`` for None (insecure mode)."""
    if not public_key:
        return ""
    import hashlib

    key = public_key.encode() if isinstance(public_key, str) else bytes(public_key)
    return hashlib.sha256(key).hexdigest()[:16]
