"""Our producer's side of the vLLM wire: a sans-I/O session that answers vLLM XferReqs from an
ectransport :class:`BlockStore`, driven by the same :class:`~ectransport.node.ProducerDriver` as
ECTP's :class:`~ectransport.session.ProducerSession` (same event API).

Grants expose only the granted blocks (:class:`~.wire_nixl.VllmNixlExport` registers them per
grant). Because vLLM's consumer caches a peer registration keyed by the agent-metadata bytes
alone, a different grant comes with different metadata bytes, which makes the consumer
re-register; a re-registration while another READ of the same consumer session is in flight would
cut that READ off, so this session keeps **one live grant per vLLM session** by default. vLLM's
wire has no BUSY status: an exhausted per-session pin budget answers NACK_NOT_READY (retryable).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ectransport.compat.wire_codec import (
    VLLM_WIRE_VERSION,
    DecodeErrors,
    VllmStatus,
    WireAck,
    WireReq,
    decode_req,
    encode_ack,
)
from ectransport.compat.wire_nixl import EXPORT_PLANE, Export
from ectransport.session import Command, Revoke, Send
from ectransport.store import BlockStore, Run

log = logging.getLogger("ectransport.compat.vllm_wire")


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

    def pinned_by_identity(self) -> dict[str, int]:
        """Pinned bytes per vLLM session id (the wire has no authenticated identity)."""
        out: dict[str, int] = {}
        for g in self._grants.values():
            out[g.session_id] = out.get(g.session_id, 0) + g.pinned_bytes
        return out

    def on_frame(self, peer: Any, data: bytes, now: float, user: str = "") -> list[Command]:
        try:
            req = decode_req(data)
        except DecodeErrors:
            self.stats["bad_frames"] += 1
            return []
        return [Send(peer, self._answer(req, now))]

    def _nack(self, req: WireReq, status: VllmStatus) -> bytes:
        self.nacks[status] = self.nacks.get(status, 0) + 1
        return encode_ack(WireAck(mm_hash=req.mm_hash, status=int(status)))

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
        ack = encode_ack(WireAck(mm_hash=req.mm_hash, status=int(VllmStatus.OK), session_id=sid,
                                  src_block_indices=list(range(ex.num_blocks)),
                                  agent_metadata=ex.agent_metadata,
                                  mem_descriptor=ex.mem_descriptor))
        self._grants[key] = _WGrant(key, sid, req.mm_hash, entry.entry_id, pinned,
                                    now + self.lease_s, ack, ex.token)
        self.stats["grants"] += 1
        return ack

    def on_notification(self, notif: bytes, now: float) -> list[Command]:
        try:
            key = notif.decode("utf-8")
        except UnicodeDecodeError:
            return []
        return self._release(key, "completed")

    def on_peer_down(self, peer: Any, now: float) -> list[Command]:
        return []  # vLLM sessions are not bound to a connection; leases clean up

    def poll(self, now: float) -> list[Command]:
        cmds: list[Command] = []
        for key in [k for k, g in self._grants.items() if g.deadline <= now]:
            log.warning("vllm-wire lease expired: %s", key[:48])
            cmds += self._release(key, "expired")
        return cmds

    def close(self) -> list[Command]:
        cmds: list[Command] = []
        for key in list(self._grants):
            cmds += self._release(key, "released_peer_down")
        return cmds

    def _release(self, key: str, why: str) -> list[Command]:
        g = self._grants.pop(key, None)
        if g is None:
            self.stats["late_signals"] += 1
            return []
        self.store.unpin(g.mm_hash, g.entry_id)
        self.stats[why] += 1
        return [Revoke(EXPORT_PLANE, g.token)]
