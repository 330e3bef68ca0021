"""The ``vllm-wire`` profile: exchange encoder-cache entries with vLLM 0.33.0's own EC P2P stack.

vLLM's ``ECCPUConnector`` speaks a small protocol of its own (wire version 2 in vLLM 0.33.0): over
a plain ZMQ DEALER → ROUTER connection, every message is the two frames ``[b"", payload]``; the
payload is a msgpack map tagged under ``"type"``: ``"req"`` (consumer → producer: mm_hash,
compatibility hash, session id, connector version) and ``"ack"`` (producer → consumer: status,
echoed session id, source block indices, NIXL agent metadata, a msgpack list of
``(addr, size, device_id)`` descriptors). The consumer reads with a one-sided NIXL READ whose
notification message is ``"<session_id>:<mm_hash>"``; the producer unpins on that notification or
when a 30 s lease runs out. The types below are our own description of that wire, written from the
protocol's facts (see ``docs/interop.md``), not vLLM's code.

What this profile gives up, and why it is opt-in:

* **No authentication, no encryption.** vLLM's control plane is plain ZMQ; this profile can only
  speak it with ``Security(insecure=True)`` *and* ``profile="vllm-wire"``; anything else is a
  :class:`~ectransport.errors.ConfigError`.
* **A soft version check.** vLLM encodes with ``omit_defaults``: a sender whose connector version
  equals its own default leaves the field out, so a missing version reads as
  :data:`VLLM_WIRE_VERSION` here. We always write the field.

What it keeps:

* **Grants expose only the granted blocks.** Our producer registers just the granted runs with
  NIXL for the lifetime of the grant and sends *partial* agent metadata (connection info plus that
  registration only) and a descriptor list holding only the granted blocks, with
  ``src_block_indices = [0, 1, ...]`` indexing that list. A consumer cannot name any other block,
  even with hand-made descriptors: its NIXL agent knows no other memory of ours.
* Because vLLM's consumer caches a peer registration keyed by the agent-metadata bytes alone, a
  different grant must come with different metadata bytes (it does: the registration differs),
  which makes the consumer re-register. A re-registration while another READ of the same consumer
  session is in flight would cut that READ off, so our producer keeps **one live grant per vLLM
  session**: a second request of the same session meanwhile gets NACK_NOT_READY, which vLLM
  retries (``one_grant_per_session=False`` lifts this for consumers known to fetch serially).
* Per-consumer pin budgets (``budget_bytes``): vLLM's wire has no BUSY status, so an exhausted
  budget answers NACK_NOT_READY (retryable) as well.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np

from ectransport.control.base import ControlServer, PeerId, Received, ServerEvent
from ectransport.data.base import Capabilities, DataTransport, RegionLike, TransferModel, XferState
from ectransport.errors import ConfigError, DataPlaneError, PlaneUnavailable
from ectransport.node.common import Layout, Security
from ectransport.node.consumer import Fetched, ProducerAddress
from ectransport.node.producer import ProducerNode
from ectransport.session import Miss, MissReason, Revoke, Send
from ectransport.store import AllocFailed, BlockStore, HostRegion, Run

log = logging.getLogger("ectransport.compat.vllm_wire")

#: The profile name an operator must pass to opt in.
PROFILE = "vllm-wire"
#: vLLM 0.33.0's ``EC_CONNECTOR_VERSION``: what a request without a version field means.
VLLM_WIRE_VERSION = 2
#: The vLLM release whose wire this profile speaks (also an input of the compatibility hash).
VLLM_VERSION = "0.33.0"
#: Name of the producer-side NIXL export in a node's plane table.
EXPORT_PLANE = "vllm-nixl"
_MAX_ID = 256


class VllmStatus(enum.IntEnum):
    """vLLM's transfer status codes (same numbers as :class:`ectransport.protocol.Status`)."""

    OK = 0
    NACK_MISSING = 1
    NACK_INCOMPAT = 2
    NACK_VERSION = 3
    NACK_INTERNAL = 4
    NACK_NOT_READY = 5


_Str = Annotated[str, msgspec.Meta(max_length=_MAX_ID)]


class WireReq(msgspec.Struct, tag="req", tag_field="type", frozen=True):
    """Consumer → producer. A missing ``connector_version`` means the sender's default (2)."""

    mm_hash: _Str
    compatibility_hash: Annotated[str, msgspec.Meta(max_length=128)]
    session_id: _Str = ""
    connector_version: int = VLLM_WIRE_VERSION


class WireAck(msgspec.Struct, tag="ack", tag_field="type", omit_defaults=True, frozen=True):
    """Producer → consumer. Defaults are omitted on the wire, as vLLM writes them."""

    mm_hash: _Str
    status: int
    session_id: _Str = ""
    src_block_indices: list[int] = []
    agent_metadata: bytes = b""
    mem_descriptor: bytes = b""


_req_dec = msgspec.msgpack.Decoder(WireReq)
_ack_dec = msgspec.msgpack.Decoder(WireAck)
_enc = msgspec.msgpack.Encoder()
_desc_dec = msgspec.msgpack.Decoder(list[tuple[int, int, int]])


def encode_req(mm_hash: str, compatibility_hash: str, session_id: str,
               connector_version: int = VLLM_WIRE_VERSION) -> bytes:
    """An XferReq payload with every field written (the version explicitly, never omitted)."""
    return _enc.encode({"type": "req", "mm_hash": mm_hash, "compatibility_hash": compatibility_hash,
                        "session_id": session_id, "connector_version": connector_version})


def vllm_compat_hash(vllm_version: str, model: str, dtype: str, block_bytes: int) -> str:
    """vLLM's peer-compatibility fingerprint: SHA-256 hex of the compact JSON array
    ``[vllm_version, model, dtype, block_bytes]`` (UTF-8). ``dtype`` as vLLM prints a torch dtype,
    e.g. ``"torch.bfloat16"``; a bare ``"bfloat16"`` is prefixed."""
    if not dtype.startswith("torch."):
        dtype = f"torch.{dtype}"
    doc = json.dumps([vllm_version, model, dtype, int(block_bytes)], separators=(",", ":"))
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


def require_opt_in(profile: str | None, security: Security) -> None:
    """Raise ConfigError unless the operator opted in: ``profile="vllm-wire"`` and insecure."""
    if profile != PROFILE:
        raise ConfigError(f"the vLLM wire profile must be named explicitly: profile={PROFILE!r} "
                          f"(got {profile!r})")
    if not security.insecure or security.secret_key or security.allow_dir or security.allow:
        raise ConfigError("vLLM's EC wire protocol has no authentication or encryption: opt in "
                          "with security=Security(insecure=True) (no keys, no allow-list) and "
                          "run it only on a trusted network")


@dataclass(frozen=True)
class VllmWireParams:
    """What vLLM hashes into its compatibility fingerprint (layout gives model, dtype, hidden)."""

    layout: Layout
    vllm_version: str = VLLM_VERSION

    @property
    def compat_hash(self) -> str:
        return vllm_compat_hash(self.vllm_version, self.layout.model_id, self.layout.dtype,
                                self.layout.block_bytes)


# -- producer: the NIXL export (per-grant registration, partial metadata) -----------------------
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
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise PlaneUnavailable(f"the vLLM wire profile needs nixl ({e})") from e
        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.agent_name = f"{node_id}-{uuid.uuid4().hex[:8]}"
        self._base = int(region.addr)
        self._block_bytes = int(region.block_bytes)
        self._lock = threading.Lock()
        self._regs: dict[bytes, Any] = {}
        try:
            self._agent = nixl_agent(self.agent_name, nixl_agent_config(backends=["UCX"]))
        except Exception as e:  # noqa: BLE001 - nixl errors have no common base
            raise PlaneUnavailable(f"cannot start a NIXL agent: {e}") from e
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
        return Export(token, bytes(meta), _enc.encode(descs), len(descs))

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


# -- producer: sans-I/O session -------------------------------------------------------------------
@dataclass
class _WGrant:
    key: str
    session_id: str
    mm_hash: str
    entry_id: int
    pinned_bytes: int
    deadline: float
    ack: bytes
    token: bytes


class VllmWireProducerSession:
    """Answers vLLM XferReqs from an ectransport :class:`BlockStore` (sans-I/O).

    Same event API as :class:`ectransport.session.ProducerSession` (``on_frame``,
    ``on_notification``, ``on_peer_down``, ``poll``, ``close``), so a :class:`ProducerNode` loop
    drives it unchanged. Checks, in vLLM's order: version (NACK_VERSION), compatibility hash
    (NACK_INCOMPAT), session id present and without ``':'`` (NACK_INTERNAL, as vLLM answers a
    missing one), entry present (NACK_MISSING) and ready (NACK_NOT_READY), one live grant per
    session and the session's pin budget (NACK_NOT_READY: retryable on vLLM's side). A request for
    a (session, mm_hash) whose grant is live is answered with the same ack, without a second pin.
    Malformed frames are dropped without a reply (vLLM's consumer expects only acks).
    """

    def __init__(self, *, compat_hash: str, store: BlockStore,
                 export: Callable[[Sequence[Run]], Export],
                 lease_s: float = 30.0, budget_bytes: int | None = None,
                 one_grant_per_session: bool = True):
        self.compat_hash = compat_hash
        self.store = store
        self._export = export
        self.lease_s = lease_s
        self.budget_bytes = budget_bytes if budget_bytes is not None else store.region_bytes // 4
        self.one_grant_per_session = one_grant_per_session
        self._grants: dict[str, _WGrant] = {}
        self.stats: dict[str, int] = {"grants": 0, "completed": 0, "expired": 0,
                                      "released_peer_down": 0, "bad_frames": 0, "late_signals": 0}
        self.nacks: dict[VllmStatus, int] = {}

    @property
    def active_grants(self) -> int:
        return len(self._grants)

    def pinned_bytes(self, session_id: str | None = None) -> int:
        return sum(g.pinned_bytes for g in self._grants.values()
                   if session_id is None or g.session_id == session_id)

    def on_frame(self, peer: Any, data: bytes, now: float, user: str = "") -> list:
        try:
            req = _req_dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            self.stats["bad_frames"] += 1
            return []
        return [Send(peer, self._answer(req, now))]

    def _nack(self, req: WireReq, status: VllmStatus) -> bytes:
        self.nacks[status] = self.nacks.get(status, 0) + 1
        return _enc.encode(WireAck(mm_hash=req.mm_hash, status=int(status)))

    def _answer(self, req: WireReq, now: float) -> bytes:
        if req.connector_version != VLLM_WIRE_VERSION:
            return self._nack(req, VllmStatus.NACK_VERSION)
        if req.compatibility_hash != self.compat_hash:
            return self._nack(req, VllmStatus.NACK_INCOMPAT)
        sid = req.session_id
        if not sid or ":" in sid:
            return self._nack(req, VllmStatus.NACK_INTERNAL)
        key = f"{sid}:{req.mm_hash}"
        live = self._grants.get(key)
        if live is not None:
            return live.ack
        entry = self.store.get(req.mm_hash)
        if entry is None:
            return self._nack(req, VllmStatus.NACK_MISSING)
        if not entry.ready:
            return self._nack(req, VllmStatus.NACK_NOT_READY)
        if self.one_grant_per_session and any(g.session_id == sid for g in self._grants.values()):
            return self._nack(req, VllmStatus.NACK_NOT_READY)
        pinned = entry.num_blocks * self.store.block_bytes
        if self.pinned_bytes(sid) + pinned > self.budget_bytes:
            return self._nack(req, VllmStatus.NACK_NOT_READY)
        entry = self.store.pin_if_ready(req.mm_hash)
        assert entry is not None
        try:
            ex = self._export(entry.runs)
        except Exception:  # a plane failure must not leak the pin or stop the node
            self.store.unpin(entry.mm_hash, entry.entry_id)
            log.exception("vllm-wire export failed")
            return self._nack(req, VllmStatus.NACK_INTERNAL)
        ack = _enc.encode(WireAck(mm_hash=req.mm_hash, status=int(VllmStatus.OK), session_id=sid,
                                  src_block_indices=list(range(ex.num_blocks)),
                                  agent_metadata=ex.agent_metadata,
                                  mem_descriptor=ex.mem_descriptor))
        self._grants[key] = _WGrant(key, sid, req.mm_hash, entry.entry_id, pinned,
                                    now + self.lease_s, ack, ex.token)
        self.stats["grants"] += 1
        return ack

    def on_notification(self, notif: bytes, now: float) -> list:
        try:
            key = notif.decode("utf-8")
        except UnicodeDecodeError:
            return []
        return self._release(key, "completed")

    def on_peer_down(self, peer: Any, now: float) -> list:
        return []  # vLLM sessions are not bound to a connection; leases clean up

    def poll(self, now: float) -> list:
        cmds: list = []
        for key in [k for k, g in self._grants.items() if g.deadline <= now]:
            log.warning("vllm-wire lease expired: %s", key[:48])
            cmds += self._release(key, "expired")
        return cmds

    def close(self) -> list:
        cmds: list = []
        for key in list(self._grants):
            cmds += self._release(key, "released_peer_down")
        return cmds

    def _release(self, key: str, why: str) -> list:
        g = self._grants.pop(key, None)
        if g is None:
            self.stats["late_signals"] += 1
            return []
        self.store.unpin(g.mm_hash, g.entry_id)
        self.stats[why] += 1
        return [Revoke(EXPORT_PLANE, g.token)]


# -- producer: plain ROUTER with vLLM's framing ---------------------------------------------------
class VllmRouter(ControlServer):
    """Plain-ZMQ ROUTER speaking vLLM's envelope ``[identity, b"", payload]``.

    Control-server surface used by :class:`ProducerNode`'s loop: ``poll``, ``send``, ``wake``,
    ``close``, ``host``, ``port``. No authentication (the vLLM wire has none).
    """

    def __init__(self, host: str, port: int, max_frame_bytes: int = 1 << 20):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._closed = False
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._router.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as e:
            self._router.close(0)
            self._ctx.term()
            raise ConfigError(f"cannot bind the vLLM wire ROUTER on {host}:{port}: {e}") from None
        self.host = host
        self.port = int(self._router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._waker_r = self._ctx.socket(zmq.PAIR)
        self._waker_w = self._ctx.socket(zmq.PAIR)
        addr = f"inproc://vllm-wire-wake-{id(self)}"
        self._waker_r.bind(addr)
        self._waker_w.connect(addr)
        self._wlock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._waker_r, zmq.POLLIN)
        self.malformed_dropped = 0
        log.warning("vLLM wire profile: PLAIN ZMQ (no authentication, no encryption) on %s:%d",
                    host, self.port)

    def poll(self, timeout_s: float) -> list[ServerEvent]:
        zmq = self._zmq
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if self._waker_r in events:
            while True:
                try:
                    self._waker_r.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
        out: list[ServerEvent] = []
        for _ in range(256):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or frames[1] != b"":
                self.malformed_dropped += 1
                continue
            out.append(Received(PeerId(frames[0], ""), frames[2]))
        return out

    def send(self, peer: PeerId, data: bytes) -> bool:
        try:
            self._router.send_multipart([peer.route, b"", data], self._zmq.NOBLOCK)
            return True
        except self._zmq.ZMQError:
            return False

    def wake(self) -> None:
        with self._wlock:
            try:
                self._waker_w.send(b"", self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        for s in (self._router, self._waker_r, self._waker_w):
            s.close(0)
        self._closed = True
        self._ctx.term()


class VllmWireProducerNode(ProducerNode):
    """A :class:`ProducerNode` that serves stock vLLM consumers over vLLM's own wire.

    Same public API (``put``, ``start``, ``stats``, ``close``, ...). Opt-in only::

        VllmWireProducerNode(profile="vllm-wire", security=Security(insecure=True),
                             layout=Layout(model_id=..., dtype="bfloat16", hidden=...),
                             host="10.0.0.5", port=5601)

    Args:
        profile: must be ``"vllm-wire"``.
        security: must be ``Security(insecure=True)`` (the wire has no authentication).
        vllm_version: the vLLM version string the consumers hash (``vllm.__version__``).
        one_grant_per_session: see the module docstring.
        others: as :class:`ProducerNode` (planes are fixed: the NIXL export).

    Raises:
        ConfigError: no opt-in, bad settings, port in use.
        PlaneUnavailable: nixl is missing.
    """

    def __init__(self, *, profile: str | None = None, security: Security, layout: Layout = Layout(),
                 vllm_version: str = VLLM_VERSION, host: str = "127.0.0.1", port: int = 0,
                 region_bytes: int = 256 << 20, lease_s: float = 30.0,
                 budget_bytes: int | None = None, node_id: str | None = None,
                 one_grant_per_session: bool = True):
        require_opt_in(profile, security)
        self.params = VllmWireParams(layout, vllm_version)
        self._one_grant_per_session = one_grant_per_session
        self._lease_s, self._budget_bytes = lease_s, budget_bytes
        super().__init__(layout=layout, region_bytes=region_bytes, host=host, port=port,
                         security=Security(insecure=True), planes=(), lease_s=lease_s,
                         budget_bytes=budget_bytes,
                         node_id=node_id or f"vllm-wire-{uuid.uuid4().hex[:8]}")

    def _make_control(self, host: str, port: int, security: Security, allow: Any,
                      options: dict[str, Any]) -> VllmRouter:
        """vLLM's framing on a plain ROUTER, plus the per-grant NIXL export plane."""
        self._planes[EXPORT_PLANE] = VllmNixlExport(node_id=self.node_id, region=self.region)
        return VllmRouter(host, port)

    def _export_plane(self) -> VllmNixlExport:
        plane = self._planes[EXPORT_PLANE]
        assert isinstance(plane, VllmNixlExport)  # put there by _make_control
        return plane

    def _make_session(self, config: Any) -> VllmWireProducerSession:  # type: ignore[override]
        return VllmWireProducerSession(
            compat_hash=self.params.compat_hash, store=self.store,
            export=self._export_plane().export, lease_s=self._lease_s,
            budget_bytes=self._budget_bytes, one_grant_per_session=self._one_grant_per_session)


# -- consumer ------------------------------------------------------------------------------------
_NACK_REASON = {
    VllmStatus.NACK_MISSING: MissReason.MISSING,
    VllmStatus.NACK_INCOMPAT: MissReason.INCOMPATIBLE,
    VllmStatus.NACK_VERSION: MissReason.VERSION,
    VllmStatus.NACK_INTERNAL: MissReason.INTERNAL,
}


@dataclass
class _Peer:
    sock: Any
    agent: str | None = None
    meta: bytes | None = None
    quarantined: list = field(default_factory=list)


class VllmWireConsumer:
    """Fetch entries from a stock vLLM producer (``ECCPUConnector`` producer session).

    ``fetch`` is blocking and single-threaded (one fetch at a time per consumer object); every
    fetch ends by its deadline in a :class:`Fetched` or a :class:`Miss`. The producer address comes
    from vLLM's ``ec_transfer_params`` (``peer_host``/``peer_port``); ``nbytes`` is its
    ``size_bytes`` (whole rows of ``layout.block_bytes``).

    A READ that outlives its deadline cannot be aborted (NIXL has no abort): its landing blocks are
    kept (quarantined) and given back once NIXL reports the READ finished.

    Raises (constructor): ConfigError without the opt-in; PlaneUnavailable without nixl.
    """

    def __init__(self, *, profile: str | None = None, security: Security, layout: Layout = Layout(),
                 vllm_version: str = VLLM_VERSION, region_bytes: int = 64 << 20,
                 ack_timeout_s: float = 2.0, read_timeout_s: float = 20.0,
                 node_id: str | None = None, connector_version: int = VLLM_WIRE_VERSION):
        require_opt_in(profile, security)
        import zmq
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise PlaneUnavailable(f"the vLLM wire profile needs nixl ({e})") from e
        logging.getLogger("nixl").setLevel(logging.WARNING)
        self._zmq = zmq
        self.layout = layout
        self.params = VllmWireParams(layout, vllm_version)
        self.connector_version = connector_version
        self.ack_timeout_s, self.read_timeout_s = ack_timeout_s, read_timeout_s
        num_blocks = region_bytes // layout.block_bytes
        if num_blocks < 1:
            raise ConfigError(f"region_bytes {region_bytes} is smaller than one block")
        self.region = HostRegion(num_blocks, layout.block_bytes)
        self.store = BlockStore(num_blocks, layout.block_bytes)
        self.node_id = node_id or f"vllm-wire-consumer-{uuid.uuid4().hex[:8]}"
        self.session_id = str(uuid.uuid4())
        self._agent = nixl_agent(self.node_id, nixl_agent_config(backends=["UCX"]))
        self._agent.register_memory([(self.region.addr, self.region.nbytes, 0, "")], "DRAM")
        self._ctx = zmq.Context()
        self._peers: dict[tuple[str, int], _Peer] = {}
        log.warning("vLLM wire profile consumer: PLAIN ZMQ (no producer authentication)")

    def _peer(self, addr: tuple[str, int]) -> _Peer:
        p = self._peers.get(addr)
        if p is None:
            zmq = self._zmq
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.HEARTBEAT_IVL, 2000)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4000)
            s.connect(f"tcp://{addr[0]}:{addr[1]}")
            p = self._peers[addr] = _Peer(s)
        return p

    def fetch(self, producer: ProducerAddress | tuple[str, int], mm_hash: str, nbytes: int, *,
              timeout_s: float = 30.0) -> Fetched | Miss:
        """Fetch ``mm_hash`` (``nbytes`` bytes: whole rows) from a vLLM producer."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        addr = (producer.host, producer.port) if isinstance(producer, ProducerAddress) else producer
        bb = self.layout.block_bytes
        if nbytes <= 0 or nbytes % bb:
            return Miss(mm_hash, MissReason.INCOMPATIBLE,
                        f"size {nbytes} is not whole rows of {bb} bytes")
        p = self._peer(addr)
        self._settle(p)
        entry = self.store.alloc(f"vllm-wire/{mm_hash}/{uuid.uuid4().hex[:6]}", nbytes)
        if isinstance(entry, AllocFailed):
            return Miss(mm_hash, MissReason.NO_SPACE, f"local region cannot hold {nbytes} bytes")
        keep = False
        try:
            out = self._fetch(p, addr, mm_hash, entry, nbytes, t0, deadline)
            keep = isinstance(out, Miss) and out.reason is MissReason.TIMEOUT and \
                "quarantined" in out.detail
            return out
        finally:
            if not keep:
                self.store.discard(entry.mm_hash)

    def _fetch(self, p: _Peer, addr, mm_hash, entry, nbytes, t0, deadline) -> Fetched | Miss:
        n_blocks = nbytes // self.layout.block_bytes
        timings: dict[str, float] = {}
        backoff = 0.02
        while True:
            req = encode_req(mm_hash, self.params.compat_hash, self.session_id,
                             self.connector_version)
            p.sock.send_multipart([b"", req])
            timings.setdefault("req", time.monotonic() - t0)
            ack = self._wait_ack(p, mm_hash, min(deadline, time.monotonic() + self.ack_timeout_s))
            if ack is None:
                if time.monotonic() >= deadline:
                    return Miss(mm_hash, MissReason.TIMEOUT, f"no XferAck from {addr[0]}:{addr[1]}")
                continue  # vLLM's consumer re-requests after an ack timeout too
            timings["ack"] = time.monotonic() - t0
            status = VllmStatus(ack.status) if ack.status in VllmStatus._value2member_map_ else None
            if status is VllmStatus.NACK_NOT_READY:
                if time.monotonic() + backoff >= deadline:
                    return Miss(mm_hash, MissReason.MISSING, "still NACK_NOT_READY at the deadline")
                time.sleep(backoff)
                backoff = min(0.5, backoff * 2)
                continue
            if status is not VllmStatus.OK:
                reason = MissReason.INTERNAL if status is None else \
                    _NACK_REASON.get(status, MissReason.INTERNAL)
                name = getattr(status, "name", ack.status)
                return Miss(mm_hash, reason, f"vLLM producer answered {name}")
            break
        try:
            descs = _desc_dec.decode(ack.mem_descriptor)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Miss(mm_hash, MissReason.INTERNAL, "malformed mem_descriptor")
        idx = ack.src_block_indices
        if len(idx) != n_blocks:
            return Miss(mm_hash, MissReason.INCOMPATIBLE,
                        f"producer grants {len(idx)} blocks, expected {n_blocks} ({nbytes} bytes)")
        bb = self.layout.block_bytes
        if any(not 0 <= i < len(descs) or descs[i][1] != bb for i in idx):
            return Miss(mm_hash, MissReason.INCOMPATIBLE, "descriptor sizes/indices do not match")
        try:
            self._register(p, ack.agent_metadata)
        except Exception as e:  # noqa: BLE001 - nixl errors have no common base
            return Miss(mm_hash, MissReason.INTERNAL, f"cannot load the NIXL metadata: {e}")
        local = [(self.region.addr + (r.start + i) * bb, bb, 0)
                 for r in entry.runs for i in range(r.count)]
        remote = [(descs[i][0], bb, descs[i][2]) for i in idx]
        lpairs, rpairs = _coalesce(local, remote)
        notif = f"{self.session_id}:{mm_hash}".encode()
        try:
            ldl = self._agent.get_xfer_descs(lpairs, "DRAM")
            rdl = self._agent.get_xfer_descs(rpairs, "DRAM")
            xfer = self._agent.initialize_xfer("READ", ldl, rdl, p.agent, notif)
            state = self._agent.transfer(xfer)
        except Exception as e:  # noqa: BLE001
            return Miss(mm_hash, MissReason.INTERNAL, f"NIXL refused the READ: {e}")
        timings["posted"] = time.monotonic() - t0
        read_deadline = min(deadline, time.monotonic() + self.read_timeout_s)
        while state == "PROC" or state == "DONE":
            if state == "DONE":
                break
            if time.monotonic() >= read_deadline:
                p.quarantined.append((xfer, entry.mm_hash))
                return Miss(mm_hash, MissReason.TIMEOUT, "read deadline passed (quarantined)")
            time.sleep(0.0005)
            state = self._agent.check_xfer_state(xfer)
        if state != "DONE":
            _quiet(xfer.release)
            return Miss(mm_hash, MissReason.INTERNAL, f"NIXL READ ended in {state}")
        _quiet(xfer.release)
        timings["landed"] = time.monotonic() - t0
        data = self.region.read(entry.runs, nbytes)
        timings["total"] = time.monotonic() - t0
        return Fetched(mm_hash, data, self.layout, "vllm-nixl", timings)

    def _wait_ack(self, p: _Peer, mm_hash: str, until: float) -> WireAck | None:
        zmq = self._zmq
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return None
            if not p.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                continue
            frames = p.sock.recv_multipart()
            if len(frames) != 2 or frames[0] != b"":
                continue
            try:
                ack = _ack_dec.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if ack.mm_hash == mm_hash and (ack.status != 0 or ack.session_id == self.session_id):
                return ack

    def _register(self, p: _Peer, meta: bytes) -> None:
        if p.meta == meta and p.agent is not None:
            return
        if p.agent is not None:  # producer restarted (new metadata): forget the old agent
            _quiet(self._agent.remove_remote_agent, p.agent)
        name = self._agent.add_remote_agent(meta)
        p.agent = name.decode() if isinstance(name, bytes) else str(name)
        p.meta = meta

    def _settle(self, p: _Peer) -> None:
        keep = []
        for xfer, key in p.quarantined:
            try:
                st = self._agent.check_xfer_state(xfer)
            except Exception:  # noqa: BLE001
                st = "ERR"
            if st == "PROC":
                keep.append((xfer, key))
            else:
                _quiet(xfer.release)
                self.store.discard(key)
        p.quarantined = keep

    def close(self) -> None:
        if self._agent is None:
            return
        for p in self._peers.values():
            p.sock.close(0)
            for xfer, _ in p.quarantined:
                _quiet(xfer.release)
            if p.agent:
                _quiet(self._agent.remove_remote_agent, p.agent)
        self._peers.clear()
        self._ctx.term()
        self._agent = None
        self.region.close()

    def __enter__(self) -> VllmWireConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _coalesce(local: Sequence[tuple[int, int, int]], remote: Sequence[tuple[int, int, int]]
              ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Merge neighbouring block pairs that are contiguous on both sides."""
    lo: list[tuple[int, int, int]] = []
    ro: list[tuple[int, int, int]] = []
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


def as_rows(data: np.ndarray, layout: Layout) -> np.ndarray:
    """``data`` (1-D uint8) as ``[num_tokens, block_bytes]`` rows (a view)."""
    return data.reshape(-1, layout.block_bytes)
