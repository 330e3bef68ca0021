"""``MemoryPlane``: an in-memory data plane, so node logic is tested without sockets (the idea of
httpx's ``MockTransport``).

Planes of one :class:`~ectransport.testing.memory_fabric.MemoryFabric` (the ``fabric``
constructor option; default the process-wide :meth:`MemoryFabric.shared`) exchange bytes in this
process: a serving plane registers its region on the fabric under a key of its own, a fetching
plane copies granted blocks out of it. They keep the contract as the real planes do:

* ``describe`` registers exactly the granted blocks under a random token; the grant names the
  producer's key and the token, never an address;
* ``endpoint`` declares ``{fabric, key, node, identity}``; ``bind_peer`` refuses a declaration of
  another fabric, of another identity than the authenticated one, or naming a key registered by
  another producer; ``start`` refuses a grant whose key is not the binding's, an ended binding,
  and runs or sizes that do not match the grant; ``reachable`` is True for a consumer of the same
  fabric only (``b""`` is not reachable);
* READ (:class:`MemoryPlane`, name ``memory``): the source is fixed when the consumer starts;
  ``revoke`` drops the registration (later starts fail) but does not stop a READ already started,
  which copies the producer's blocks as they are when it completes — why the producer keeps a
  READ plane's blocks pinned for a grace period. PUSH (:class:`MemoryPushPlane`, ``memory-push``):
  the grant is looked up when the transfer completes, so after ``revoke`` no byte of it is read;
* notifications (``capabilities.notifications``): each completed transfer's ``notif`` once;
* ``release`` stops landing (option ``release_stops_landing=False``: a released READ stays in
  flight and lands when resumed, like a DMA that cannot be cancelled).

What a transfer does — complete, wait N checks or until the fabric's clock reads T, fail with a
detail, stall until resumed, complete out of posting order — is scripted on the fabric
(:mod:`ectransport.testing.memory_fabric`)::

    fabric = MemoryFabric(clock=ManualClock())
    fabric.stall_next()                                   # the next transfer stays PROC ...
    planes = {"memory": {"fabric": fabric}}               # plane_options of both nodes
    ...
    fabric.stalled()[0].resume(Fail("disk on fire"))     # ... until the test says otherwise

Halves: :class:`MemoryServingPlane` (producer only), :class:`MemoryFetchingPlane` (consumer only),
:class:`MemoryPlane` (both); ``X.variant(model=..., notifications=..., max_transfer_bytes=...,
name=...)`` gives a class with other capabilities. Nothing here starts a thread or sleeps;
entry points ``memory`` and ``memory-push`` make the full planes loadable by name.
"""

from __future__ import annotations

import ctypes
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from ectransport.plugin import (
    MAX_ENDPOINT_BYTES,
    PLUGIN_API_VERSION,
    Capabilities,
    ConfigError,
    DataPlaneError,
    DataTransport,
    FetchingPlane,
    PlaneBase,
    RegionLike,
    Run,
    ServingPlane,
    TransferModel,
    XferState,
    check_runs,
    payload_spans,
    reject_unknown,
)
from ectransport.testing.memory_fabric import (
    Action,
    Complete,
    Delay,
    Fail,
    ManualClock,
    MemoryFabric,
    MemoryTransfer,
    Reorder,
    Rule,
    ServedRegion,
    Stall,
)

__all__ = [
    "Action", "Complete", "Delay", "Fail", "ManualClock", "MemoryBinding", "MemoryFabric",
    "MemoryFetchingPlane", "MemoryPlane", "MemoryPushPlane", "MemoryServingPlane",
    "MemoryTransfer", "Reorder", "Rule", "Stall",
]

WIRE_VERSION = 1
MAX_NOTIF_BYTES = 2048
OPTIONS: dict[str, Any] = {"fabric": None, "release_stops_landing": True}


class MemoryGrant(msgspec.Struct, frozen=True):
    """The ``plane_grant``: which producer (its fabric key), which registration, what size."""

    v: int
    key: str
    token: bytes
    nbytes: int
    runs_bytes: int
    push: bool


class MemoryEndpoint(msgspec.Struct, frozen=True):
    """What a serving plane declares in ``Welcome``."""

    v: int
    fabric: str
    key: str
    node: str
    identity: str


_grant_decoder = msgspec.msgpack.Decoder(MemoryGrant)
_endpoint_decoder = msgspec.msgpack.Decoder(MemoryEndpoint)


def _caps(model: TransferModel, notifications: bool = True,
          max_transfer_bytes: int | None = None) -> Capabilities:
    return Capabilities(transfer_model=model, mem_kinds=frozenset({"DRAM"}),
                        max_transfer_bytes=max_transfer_bytes, notifications=notifications)


@dataclass(eq=False)
class MemoryBinding:
    """A fetching plane's binding of one producer session (``start``'s ``prepared``)."""

    owner: int  # id() of the fetching plane that made it
    key: str
    node: str
    identity: str
    peer: str
    ended: bool = False


class _MemoryBase(PlaneBase):
    """What both memory halves share: options, the region's bytes, the fabric."""

    name = "memory"
    plugin_api_version = PLUGIN_API_VERSION
    capabilities: ClassVar[Capabilities] = _caps(TransferModel.READ)
    _variants: ClassVar[dict[tuple[Any, ...], type[Any]]] = {}

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        """Options: ``fabric`` (a :class:`MemoryFabric`; default the shared one),
        ``release_stops_landing`` (fetching half, READ only; default True).

        Raises:
            ConfigError: an unknown option, a ``fabric`` that is not a MemoryFabric, or a region
                that is not DRAM.
        """
        reject_unknown(f"{self.name} plane", options, OPTIONS)
        opts = {**OPTIONS, **options}
        fabric = opts["fabric"] if opts["fabric"] is not None else MemoryFabric.shared()
        if not isinstance(fabric, MemoryFabric):
            raise ConfigError(f"{self.name} plane option fabric must be a MemoryFabric, got "
                              f"{type(fabric).__name__}")
        if getattr(region, "mem_kind", "DRAM") != "DRAM":
            raise ConfigError(f"{self.name} plane moves DRAM only, region is {region.mem_kind!r}")
        self.fabric = fabric
        self.node_id = node_id
        self.identity = str(identity)
        self._block_bytes = int(region.block_bytes)
        self._num_blocks = int(region.nbytes) // self._block_bytes
        buf = getattr(region, "buf", None)
        self._mem = memoryview(buf).cast("B") if buf is not None else memoryview(
            (ctypes.c_ubyte * int(region.nbytes)).from_address(int(region.addr))).cast("B")
        self._release_stops_landing = bool(opts["release_stops_landing"])
        self._closed = False
        self._setup()

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "in-process only: one MemoryFabric (for tests)"

    @classmethod
    def variant(cls, *, model: TransferModel | None = None, notifications: bool | None = None,
                max_transfer_bytes: int | None = None, name: str | None = None) -> type[Any]:
        """This class with other capabilities (and/or name), made once per combination. Both
        halves of a session must use the same variant (same name, same model)."""
        caps = cls.capabilities
        new = _caps(model or caps.transfer_model,
                    caps.notifications if notifications is None else notifications,
                    max_transfer_bytes)
        key = (cls, new, name or cls.name)
        if key not in cls._variants:
            label = f"{cls.__name__}[{new.transfer_model.value}" + (
                "" if new.notifications else ",no-notif") + "]"
            cls._variants[key] = type(label, (cls,), {
                "name": name or cls.name, "capabilities": new,
                "plugin_api_version": PLUGIN_API_VERSION, "__module__": cls.__module__})
        return cls._variants[key]

    @property
    def push(self) -> bool:
        return self.capabilities.transfer_model is TransferModel.PUSH

    def describe_transport(self) -> str:
        return (f"in-process memory fabric {self.fabric.id} "
                f"({self.capabilities.transfer_model.value} model)")

    def close(self) -> None:
        """Unregister from the fabric, cancel this plane's transfers; idempotent."""
        if not self._closed:
            self._closed = True
            self._teardown()

    def _setup(self) -> None:
        """Each half's own state (cooperative: call ``super()._setup()``)."""

    def _teardown(self) -> None:
        """Each half's own teardown (cooperative)."""

    def _check_runs(self, runs: Sequence[Run], nbytes: int) -> int:
        if self._closed:
            raise DataPlaneError(f"{self.name} plane is closed")
        return check_runs(runs, nbytes, self._num_blocks, self._block_bytes)


class MemoryServingPlane(_MemoryBase, ServingPlane):
    """The serving half: a region registered on the fabric, grants of exactly the granted blocks
    (see the module docstring)."""

    def _setup(self) -> None:
        super()._setup()
        self.key = f"{self.identity or 'insecure'}.{self.node_id}.{secrets.token_hex(6)}"
        self._served = ServedRegion(self.key, self.node_id, self.identity, self._mem,
                                    self.capabilities.notifications)
        self.fabric._register(self._served)

    def _teardown(self) -> None:
        self.fabric._unregister(self.key)
        super()._teardown()

    def endpoint(self) -> bytes:
        return msgspec.msgpack.encode(MemoryEndpoint(WIRE_VERSION, self.fabric.id, self.key,
                                                     self.node_id, self.identity))

    def reachable(self, locality: bytes) -> bool:
        """True for a fetching plane of the same fabric only."""
        return locality == self.fabric.locality

    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """Register exactly ``runs`` (the first ``nbytes`` bytes) under a fresh token.

        Raises:
            DataPlaneError: closed plane, bad runs/nbytes, or more than ``max_transfer_bytes``.
        """
        blocks = self._check_runs(runs, nbytes)
        limit = self.capabilities.max_transfer_bytes
        if limit is not None and nbytes > limit:
            raise DataPlaneError(f"{nbytes} bytes exceed the plane's {limit}-byte transfers")
        token = secrets.token_bytes(16)
        with self.fabric._cond:
            if self._served.closed:
                raise DataPlaneError(f"{self.name} plane is closed")
            self._served.grants[token] = (payload_spans(runs, self._block_bytes, nbytes), nbytes)
        return msgspec.msgpack.encode(MemoryGrant(WIRE_VERSION, self.key, token, nbytes,
                                                  blocks * self._block_bytes, self.push))

    def revoke(self, plane_grant: bytes) -> None:
        """Drop the grant's registration: later starts fail; a PUSH transfer not yet complete
        fails; a READ already started still completes (it was posted with the registration).
        Malformed or unknown grants: no-op."""
        try:
            token = _grant_decoder.decode(plane_grant).token
        except (msgspec.DecodeError, TypeError, ValueError):
            return
        with self.fabric._cond:
            self._served.grants.pop(token, None)

    def poll_notifications(self) -> list[bytes]:
        with self.fabric._cond:
            out, self._served.notifs[:] = list(self._served.notifs), []
        return out

    def exposed_ranges(self, plane_grant: bytes) -> list[tuple[int, int]]:
        """The ``(offset, length)`` bytes of the region a live grant exposes (for the
        conformance kit's ``granted_ranges`` hook); [] for an unknown grant."""
        token = _grant_decoder.decode(plane_grant).token
        with self.fabric._cond:
            spans, _ = self._served.grants.get(token, ([], 0))
        return list(spans)


class MemoryFetchingPlane(_MemoryBase, FetchingPlane):
    """The fetching half: binds a producer's declaration and moves granted blocks into the local
    region when the fabric says the transfer completes (see the module docstring)."""

    def _setup(self) -> None:
        super()._setup()
        self._handles: set[MemoryTransfer] = set()

    def _teardown(self) -> None:
        for xfer in list(self._handles):
            self.fabric._release(xfer, stops_landing=True)
        self._handles.clear()
        super()._teardown()

    def locality(self) -> bytes:
        return self.fabric.locality

    def bind_peer(self, endpoint: bytes, *, peer: str, host: str, identity: str) -> MemoryBinding:
        """Check a producer's declaration against the authenticated ``identity`` ("" = not
        known) and the fabric (which knows who registered each key).

        Raises:
            DataPlaneError: closed plane; empty, oversized, malformed or wrong-version
                declaration; another fabric; another identity; a key not registered by the
                declared producer.
        """
        if self._closed:
            raise DataPlaneError(f"{self.name} plane is closed")
        if not endpoint or len(endpoint) > MAX_ENDPOINT_BYTES:
            raise DataPlaneError(f"{self.name} declaration of {len(endpoint)} bytes refused")
        try:
            ep = _endpoint_decoder.decode(endpoint)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise DataPlaneError(f"malformed {self.name} declaration: {exc}") from exc
        if ep.v != WIRE_VERSION or ep.fabric != self.fabric.id:
            raise DataPlaneError(f"{self.name} declaration of version {ep.v} on fabric "
                                 f"{ep.fabric!r}: this plane is version {WIRE_VERSION} on "
                                 f"{self.fabric.id!r}")
        if identity and ep.identity != identity:
            raise DataPlaneError(f"{self.name} declaration of identity {ep.identity!r}, the "
                                 f"producer authenticated as {identity!r}")
        served = self.fabric._region(ep.key)
        if served is None or (served.identity, served.node) != (ep.identity, ep.node):
            raise DataPlaneError(f"{self.name} declaration names key {ep.key!r}, which producer "
                                 f"{ep.node!r} did not register on this fabric")
        return MemoryBinding(id(self), ep.key, ep.node, ep.identity, peer)

    def unbind_peer(self, binding: Any) -> None:
        if isinstance(binding, MemoryBinding):
            binding.ended = True

    def start(self, prepared: Any, plane_grant: bytes, runs: Sequence[Run], nbytes: int,
              notif: bytes) -> MemoryTransfer:
        """Post a transfer of the granted blocks into local ``runs``; what it does is the
        fabric's script (default: complete at the first check).

        Raises:
            DataPlaneError: closed plane; ``prepared`` not a live binding of this plane; a
                malformed grant, one of another producer or transfer model; runs/nbytes that do
                not match it; a ``notif`` over 2048 bytes.
        """
        if self._closed:
            raise DataPlaneError(f"{self.name} plane is closed")
        if not isinstance(prepared, MemoryBinding) or prepared.owner != id(self):
            raise DataPlaneError(f"{self.name} transfers need this plane's binding of the "
                                 f"producer (bind_peer), got {type(prepared).__name__}")
        if prepared.ended:
            raise DataPlaneError(f"the session with {prepared.node!r} ended (unbind_peer)")
        try:
            grant = _grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise DataPlaneError(f"malformed {self.name} grant ({len(plane_grant)} bytes): "
                                 f"{exc}") from exc
        if grant.v != WIRE_VERSION or grant.key != prepared.key or grant.push != self.push:
            raise DataPlaneError(f"{self.name} grant names {grant.key!r} (push={grant.push}), "
                                 f"the session is bound to {prepared.key!r} (push={self.push})")
        local_bytes = self._check_runs(runs, nbytes) * self._block_bytes
        if grant.runs_bytes != local_bytes or grant.nbytes != nbytes:
            raise DataPlaneError(
                f"{self.name} grant covers {grant.nbytes} bytes in {grant.runs_bytes} bytes of "
                f"blocks, the local transfer is {nbytes} bytes in {local_bytes}")
        if len(notif) > MAX_NOTIF_BYTES:
            raise DataPlaneError(f"notif is {len(notif)} bytes, at most {MAX_NOTIF_BYTES}")
        xfer = MemoryTransfer(-1, prepared.node, self.node_id, nbytes, bytes(notif),
                              self.capabilities.transfer_model, _token=grant.token,
                              _dst=self._mem,
                              _dst_spans=payload_spans(runs, self._block_bytes, nbytes))
        self.fabric._post(xfer, grant.key)
        self._handles.add(xfer)
        return xfer

    def check(self, handle: Any) -> XferState:
        """PROC, DONE or ERR; the fabric decides (a released handle keeps its last state).

        Raises:
            DataPlaneError: not a transfer of this fabric.
        """
        if not isinstance(handle, MemoryTransfer) or handle._fabric is not self.fabric:
            raise DataPlaneError(f"not a {self.name} transfer of this fabric: {handle!r}")
        return self.fabric._check(handle)

    def release(self, handle: Any) -> None:
        """Cancel (unless ``release_stops_landing`` is False on a READ plane) and forget a
        transfer; idempotent, never raises."""
        if isinstance(handle, MemoryTransfer) and handle._fabric is self.fabric:
            self.fabric._release(handle, self._release_stops_landing)
            self._handles.discard(handle)


class MemoryPlane(MemoryServingPlane, MemoryFetchingPlane, DataTransport):
    """Both halves, READ model (entry point ``memory``)."""


class MemoryPushPlane(MemoryPlane):
    """Both halves, PUSH model (entry point ``memory-push``): ``revoke`` stops transfers."""

    name = "memory-push"
    capabilities = _caps(TransferModel.PUSH)
