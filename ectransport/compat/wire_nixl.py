"""The NIXL side of the vLLM wire profile: the producer's per-grant export and the consumer's
one-sided READ, each a :class:`DataTransport` the node drivers use like any other plane.

* :class:`VllmNixlExport` (producer): registers exactly the granted runs for the lifetime of the
  grant and describes them with *partial* agent metadata, so a vLLM consumer cannot name any other
  block of ours; :meth:`~VllmNixlExport.revoke` deregisters them.
* :class:`VllmNixlReader` (consumer): registers its landing region once, loads a producer's agent
  metadata when it changes (vLLM's producers send the same bytes every time, ours a new
  registration per grant) and posts one READ per fetch whose notification is
  ``"<session_id>:<mm_hash>"``. NIXL cannot abort a READ: a read past its deadline is
  quarantined by the session until :meth:`~VllmNixlReader.check` says it is over.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ectransport.compat.wire_codec import Desc, encode_descs
from ectransport.data.base import Capabilities, DataTransport, RegionLike, TransferModel, XferState
from ectransport.errors import DataPlaneError, PlaneUnavailable
from ectransport.store import Run

log = logging.getLogger("ectransport.compat.vllm_wire")

#: Name of the NIXL plane of the profile in a node's plane table (both sides).
EXPORT_PLANE = "vllm-nixl"


def _new_agent(name: str) -> Any:
    """A NIXL agent on the UCX backend.

    Raises:
        PlaneUnavailable: nixl is not installed or the agent cannot start.
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise PlaneUnavailable(f"the vLLM wire profile needs nixl ({e})") from e
    logging.getLogger("nixl").setLevel(logging.WARNING)
    try:
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    except Exception as e:  # noqa: BLE001 - nixl errors have no common base
        raise PlaneUnavailable(f"cannot start a NIXL agent: {e}") from e


# -- producer: the per-grant export (partial metadata) ------------------------------------------
@dataclass
class Export:
    """One exported grant: ``token`` names it for :meth:`VllmNixlExport.revoke`."""

    token: bytes
    agent_metadata: bytes
    mem_descriptor: bytes
    num_blocks: int


class VllmNixlExport(DataTransport):
    """Producer-side NIXL agent that exposes granted blocks to vLLM consumers, one grant at a time.

    :meth:`export` registers exactly the granted runs and returns partial agent metadata
    (connection info + that registration) and one ``(addr, block_bytes, 0)`` descriptor per granted
    block in payload order; :meth:`revoke` deregisters it. Notifications from consumers' READs come
    out of :meth:`poll_notifications`. It is not a consumer plane (``start`` raises).

    Raises (constructor): PlaneUnavailable if nixl or its UCX backend is missing.
    """

    name = EXPORT_PLANE
    capabilities = Capabilities(TransferModel.READ, frozenset({"DRAM"}), None, True)

    def __init__(self, *, node_id: str, region: RegionLike):
        self.agent_name = f"{node_id}-{uuid.uuid4().hex[:8]}"
        self._base = int(region.addr)
        self._block_bytes = int(region.block_bytes)
        self._lock = threading.Lock()
        self._regs: dict[bytes, Any] = {}
        self._agent = _new_agent(self.agent_name)
        self._closed = False

    def describe_transport(self) -> str:
        return "nixl/UCX (vLLM wire, per-grant registration)"

    def export(self, runs: Sequence[Run]) -> Export:
        """Register ``runs`` (granted blocks, payload order); describe them for a vLLM consumer."""
        descs = [(self._base + (r.start + i) * self._block_bytes, self._block_bytes, 0)
                 for r in runs for i in range(r.count)]
        merged: list[tuple[int, int, int, str]] = []
        for r in runs:
            addr, n = self._base + r.start * self._block_bytes, r.count * self._block_bytes
            if merged and merged[-1][0] + merged[-1][1] == addr:
                merged[-1] = (merged[-1][0], merged[-1][1] + n, 0, "")
            else:
                merged.append((addr, n, 0, ""))
        with self._lock:
            if self._closed:
                raise DataPlaneError("vllm-wire export is closed")
            try:
                reg = self._agent.register_memory(merged, "DRAM")
                meta = self._agent.get_partial_agent_metadata(reg, True, ["UCX"])
            except Exception as e:  # noqa: BLE001
                raise DataPlaneError(f"NIXL could not export {len(descs)} blocks: {e}") from e
            token = uuid.uuid4().bytes
            self._regs[token] = reg
        return Export(token, bytes(meta), encode_descs(descs), len(descs))

    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:  # DataTransport API
        return self.export(runs).token

    def revoke(self, plane_grant: bytes) -> None:
        with self._lock:
            reg = self._regs.pop(plane_grant, None)
            if reg is not None and not self._closed:
                try:
                    self._agent.deregister_memory(reg)
                except Exception as e:  # noqa: BLE001
                    log.debug("deregister of a vllm-wire grant failed: %s", e)

    def poll_notifications(self) -> list[bytes]:
        with self._lock:
            if self._closed:
                return []
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as e:  # noqa: BLE001
                log.debug("get_new_notifs failed: %s", e)
                return []
        return [m for msgs in notifs.values() for m in msgs]

    def start(self, prepared, plane_grant, runs, nbytes, notif):  # pragma: no cover - producer only
        raise DataPlaneError("the vllm-wire export is producer-side only")

    def check(self, handle: Any) -> XferState:  # pragma: no cover
        return XferState.ERR

    def release(self, handle: Any) -> None:  # pragma: no cover
        pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for reg in self._regs.values():
                try:
                    self._agent.deregister_memory(reg)
                except Exception:  # noqa: BLE001
                    pass
            self._regs.clear()
            self._closed = True
            self._agent = None


# -- consumer: one-sided READs into the landing region ------------------------------------------
@dataclass(frozen=True)
class WireRead:
    """What the consumer session hands the reader with a PostRead (its ``prepared``): the
    producer (``peer``: the control connection), its agent metadata from the ack, and the remote
    descriptor of every granted block in payload order."""

    peer: str
    agent_metadata: bytes
    remote: tuple[Desc, ...]


@dataclass
class _Read:
    xfer: Any
    released: bool = False
    detail: str = ""


@dataclass
class _Remote:
    agent: str
    meta: bytes


class VllmNixlReader(DataTransport):
    """Consumer-side NIXL agent over the landing region (registered once, whole).

    Raises (constructor): PlaneUnavailable if nixl or its UCX backend is missing.
    """

    name = EXPORT_PLANE
    capabilities = Capabilities(TransferModel.READ, frozenset({"DRAM"}), None, True)

    def __init__(self, *, node_id: str, region: RegionLike):
        self._region = region
        self._block_bytes = int(region.block_bytes)
        self._agent: Any = _new_agent(node_id)
        self._remotes: dict[str, _Remote] = {}
        try:
            self._agent.register_memory([(int(region.addr), int(region.nbytes), 0, "")], "DRAM")
        except Exception as e:  # noqa: BLE001
            raise PlaneUnavailable(f"NIXL could not register the landing region: {e}") from e

    def describe_transport(self) -> str:
        return "nixl/UCX (vLLM wire, one-sided READ)"

    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:  # pragma: no cover
        raise DataPlaneError("the vllm-wire reader is consumer-side only")

    def _register(self, peer: str, meta: bytes) -> str:
        r = self._remotes.get(peer)
        if r is not None and r.meta == meta:
            return r.agent
        if r is not None:  # new metadata (a new grant's registration, a restart): reload
            _quiet(self._agent.remove_remote_agent, r.agent)
            del self._remotes[peer]
        try:
            name = self._agent.add_remote_agent(meta)
        except Exception as e:  # noqa: BLE001
            raise DataPlaneError(f"cannot load the NIXL metadata: {e}") from e
        agent = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes[peer] = _Remote(agent, meta)
        return agent

    def start(self, prepared: Any, plane_grant: bytes, runs: Sequence[Run], nbytes: int,
              notif: bytes) -> _Read:
        if not isinstance(prepared, WireRead):
            raise DataPlaneError("the vllm-wire reader needs the ack's descriptors (WireRead)")
        if self._agent is None:
            raise DataPlaneError("the vllm-wire reader is closed")
        agent = self._register(prepared.peer, prepared.agent_metadata)
        bb, base = self._block_bytes, int(self._region.addr)
        local = [(base + (r.start + i) * bb, bb, 0) for r in runs for i in range(r.count)]
        if len(local) != len(prepared.remote):
            raise DataPlaneError(f"{len(prepared.remote)} remote blocks for {len(local)} local")
        lpairs, rpairs = coalesce(local, prepared.remote)
        try:
            ldl = self._agent.get_xfer_descs(lpairs, "DRAM")
            rdl = self._agent.get_xfer_descs(rpairs, "DRAM")
            xfer = self._agent.initialize_xfer("READ", ldl, rdl, agent, notif)
            state = self._agent.transfer(xfer)
        except Exception as e:  # noqa: BLE001
            raise DataPlaneError(f"NIXL refused the READ: {e}") from e
        h = _Read(xfer)
        if state not in ("PROC", "DONE"):
            self.release(h)
            raise DataPlaneError(f"NIXL READ ended in {state}")
        return h

    def check(self, handle: _Read) -> XferState:
        if handle.released or self._agent is None:
            return XferState.ERR
        try:
            st = self._agent.check_xfer_state(handle.xfer)
        except Exception as e:  # noqa: BLE001
            st = f"ERR ({e})"
        if st == "DONE":
            return XferState.DONE
        if st == "PROC":
            return XferState.PROC
        handle.detail = f"NIXL READ ended in {st}"
        return XferState.ERR

    def release(self, handle: _Read) -> None:
        if not handle.released:
            handle.released = True
            _quiet(handle.xfer.release)

    def forget_peer(self, peer: str) -> None:
        r = self._remotes.pop(peer, None)
        if r is not None and self._agent is not None:
            _quiet(self._agent.remove_remote_agent, r.agent)

    def close(self) -> None:
        if self._agent is None:
            return
        for peer in list(self._remotes):
            self.forget_peer(peer)
        self._agent = None


def coalesce(local: Sequence[Desc], remote: Sequence[Desc]) -> tuple[list[Desc], list[Desc]]:
    """Merge neighbouring block pairs that are contiguous on both sides."""
    lo: list[Desc] = []
    ro: list[Desc] = []
    for (la, n, ld), (ra, _, rd) in zip(local, remote, strict=True):
        if lo and lo[-1][0] + lo[-1][1] == la and ro[-1][0] + ro[-1][1] == ra and ro[-1][2] == rd:
            lo[-1] = (lo[-1][0], lo[-1][1] + n, ld)
            ro[-1] = (ro[-1][0], ro[-1][1] + n, rd)
        else:
            lo.append((la, n, ld))
            ro.append((ra, n, rd))
    return lo, ro


def _quiet(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        log.debug("vllm-wire cleanup failed: %s", e)
