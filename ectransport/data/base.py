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
#: planes whose ``plugin_api_version`` equals it.
PLUGIN_API_VERSION = 1


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
    """

    transfer_model: TransferModel
    mem_kinds: frozenset[str]
    max_transfer_bytes: int | None
    notifications: bool


class RegionLike(Protocol):
    """What a plane needs of the node's region (``ectransport.store.HostRegion`` satisfies it)."""

    addr: int  # base address
    nbytes: int
    block_bytes: int
    mem_kind: str


Handle = Any  # plane-specific transfer handle; opaque to callers


class DataTransport(ABC):
    """Base class of every data plane (built-in or plugin).

    Construct with ``Plane(node_id=..., region=...)``. The region is registered with the plane
    for the plane's lifetime; :meth:`close` deregisters it and releases every handle.

    Raises (constructor): ``PlaneUnavailable`` if the plane's dependency or backend cannot run here.
    """

    name: ClassVar[str]
    plugin_api_version: ClassVar[int] = PLUGIN_API_VERSION
    capabilities: ClassVar[Capabilities]

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """Whether the plane can run on this machine, and why not (cheap; no region needed)."""
        return True, "ok"

    def describe_transport(self) -> str:
        """What the plane actually uses underneath (e.g. UCX transports ``"cma,tcp"``), for logs."""
        return self.name

    # -- producer side --------------------------------------------------------------------------
    @abstractmethod
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """The ``plane_grant`` for exactly these blocks (and nothing else of the region).

        Pure computation on cached state; called on the producer's hot path.
        """

    def revoke(self, plane_grant: bytes) -> None:
        """The grant ended (unpinned): stop serving it. Planes whose consumers read the region
        directly (NIXL) cannot revoke and inherit this no-op; planes that serve requests (TCP, UCX)
        must refuse a revoked grant from now on."""

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

        ``prepared`` is reserved (always None in plugin API 1).

        ``notif`` is delivered to the producer's :meth:`poll_notifications` on completion if the
        plane has notifications.

        Raises:
            DataPlaneError: the grant is malformed or does not match ``runs``/``nbytes``.
        """

    @abstractmethod
    def check(self, handle: Handle) -> XferState:
        """Non-blocking state of a transfer handle (either side)."""

    @abstractmethod
    def release(self, handle: Handle) -> None:
        """Release a handle, cancelling it if the plane can; idempotent, never raises."""

    def forget_peer(self, peer: str) -> None:
        """Drop cached state about a remote peer (e.g. a producer that restarted)."""

    @abstractmethod
    def close(self) -> None:
        """Release every handle and deregister the region; idempotent."""
