"""Our consumer's side of the vLLM wire: a sans-I/O session per vLLM producer, driven by the same
:class:`~ectransport.node.ConsumerDriver` as ECTP's ConsumerSession (it satisfies
:class:`~ectransport.node.FetchSession`). Per fetch::

    fetch_sized ─► WAITING_ACK ──(OK ack, descriptors checked)──► READING ──(DONE)──► Landed
                    │  ▲   │ NACK_NOT_READY                           │ ERR          │
                    │  └── BACKOFF (doubling 20 ms → 0.5 s)             ▼              │
                    │ no ack in ack_timeout_s: ask again (as vLLM does) Miss           │
                    ▼ other NACK / deadline                 read deadline, READ in flight:
                   Miss                                     QUARANTINED (landing blocks kept
                                                            until the plane says it is over)

vLLM's wire does not carry the entry's size: the caller gives it (``ec_transfer_params``'
``size_bytes``), and the landing blocks are allocated before the request. There is no handshake:
the connection is usable at once (no Hello/Welcome, no binding), the producer is whatever answers.
A quarantined READ keeps its blocks by state, not by what a message says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ectransport.compat.wire_codec import (
    VLLM_WIRE_VERSION,
    DecodeErrors,
    VllmStatus,
    WireAck,
    decode_ack,
    decode_descs,
    encode_req,
)
from ectransport.compat.wire_nixl import EXPORT_PLANE, WireRead
from ectransport.session import (
    Command,
    FetchState,
    IllegalTransition,
    Landed,
    Link,
    Miss,
    MissReason,
    PostRead,
    Release,
    Report,
    Send,
)
from ectransport.store import AllocFailed, BlockStore, Entry

_NACK_REASON = {
    VllmStatus.NACK_MISSING: MissReason.MISSING,
    VllmStatus.NACK_INCOMPAT: MissReason.INCOMPATIBLE,
    VllmStatus.NACK_VERSION: MissReason.VERSION,
    VllmStatus.NACK_INTERNAL: MissReason.INTERNAL,
}


@dataclass(frozen=True)
class WireConsumerConfig:
    """Settings of a vLLM-wire consumer session (seconds).

    Attributes:
        compat_hash: vLLM's fingerprint of the layout (``vllm_compat_hash``).
        session_id: this consumer's vLLM session id (notifications are ``"<id>:<mm_hash>"``).
        connector_version: the version written in every request.
        ack_timeout_s: wait for an ack before asking again [2 s].
        read_timeout_s: READ deadline after the ack [20 s].
        retry_backoff_s / retry_backoff_max_s: NACK_NOT_READY backoff, doubling [0.02 → 0.5 s].
        quarantine_s: how long a READ past its deadline keeps its landing blocks at most, if
            NIXL never reports it over (then the handle is released; as ECTP's consumer) [60 s].
    """

    compat_hash: str
    session_id: str
    connector_version: int = VLLM_WIRE_VERSION
    ack_timeout_s: float = 2.0
    read_timeout_s: float = 20.0
    retry_backoff_s: float = 0.02
    retry_backoff_max_s: float = 0.5
    quarantine_s: float = 60.0


@dataclass
class _Fetch:
    mm_hash: str
    entry: Entry
    state: FetchState
    deadline: float  # of the current state
    final_deadline: float
    started: float
    backoff_s: float
    handle: Any = None
    not_ready: bool = False  # the latest answer was NACK_NOT_READY
    timings: dict[str, float] = field(default_factory=dict)


class VllmWireSession:
    """Fetches from one vLLM producer connection (see module docstring).

    Args:
        config: :class:`WireConsumerConfig`.
        conn: the control connection key (``"host:port"``), ``Send.peer``.
        store: the consumer's landing store (keys ``vllm-wire/<mm_hash>/<n>``).
        now: creation time.
    """

    plane = EXPORT_PLANE
    binding = None
    welcomed = True  # no handshake on this wire
    blocked_until = 0.0
    blocked_reason = ""
    version = VLLM_WIRE_VERSION

    def __init__(self, config: WireConsumerConfig, conn: str, store: BlockStore, now: float):
        self.config = config
        self.conn = conn
        self.store = store
        self.session_id = config.session_id
        self.producer_id = conn
        self.failed: Miss | None = None
        self.link = Link.READY
        self._fetches: dict[str, _Fetch] = {}
        self._quarantine: dict[str, _Fetch] = {}  # landing key -> READ past its deadline
        self._seq = 0

    # -- queries -------------------------------------------------------------------------------
    def in_flight(self) -> int:
        return len(self._fetches) + len(self._quarantine)

    def fetch_states(self) -> dict[str, FetchState]:
        return {**{k: f.state for k, f in self._fetches.items()},
                **{k: f.state for k, f in self._quarantine.items()}}

    def reading(self) -> list[tuple[str, Any]]:
        out = [(f.mm_hash, f.handle) for f in self._fetches.values() if f.handle is not None]
        return out + [(k, q.handle) for k, q in self._quarantine.items()]

    def next_deadline(self) -> float | None:
        ds = [f.deadline for f in (*self._fetches.values(), *self._quarantine.values())]
        return min(ds) if ds else None

    # -- events --------------------------------------------------------------------------------
    def fetch(self, mm_hash: str, now: float, deadline: float) -> list[Command]:
        """The wire cannot tell the size: a fetch without one is refused (use fetch_sized)."""
        return [Report(Miss(mm_hash, MissReason.INCOMPATIBLE,
                            "the vLLM wire needs the entry's size (size_bytes) to fetch it"))]

    def fetch_sized(self, mm_hash: str, nbytes: int, now: float,
                    deadline: float) -> list[Command]:
        """Fetch ``mm_hash`` of ``nbytes`` bytes (whole rows) by ``deadline``."""
        bb = self.store.block_bytes
        if nbytes <= 0 or nbytes % bb:
            return [Report(Miss(mm_hash, MissReason.INCOMPATIBLE,
                                f"size {nbytes} is not whole rows of {bb} bytes"))]
        if self.failed is not None:
            return [Report(Miss(mm_hash, self.failed.reason, self.failed.detail))]
        self._seq += 1
        entry = self.store.alloc(f"vllm-wire/{mm_hash}/{self._seq}", nbytes)
        if isinstance(entry, AllocFailed):
            return [Report(Miss(mm_hash, MissReason.NO_SPACE,
                                f"local region cannot hold {nbytes} bytes"))]
        f = _Fetch(mm_hash, entry, FetchState.WAITING_ACK, deadline, deadline, now,
                   self.config.retry_backoff_s)
        self._fetches[mm_hash] = f
        return self._send_req(f, now)

    def fetch_probe(self, now: float) -> list[Command]:
        return []  # no quarantine of the peer on this wire

    def on_up(self, now: float) -> list[Command]:
        return []  # nothing to say: requests flow at once

    def on_auth_failed(self, reason: str, now: float) -> list[Command]:
        return self._fail(Miss("", MissReason.AUTH, reason), now)

    def on_peer_down(self, now: float) -> list[Command]:
        return []  # vLLM sessions are not bound to a connection: deadlines end the fetches

    def on_bound(self, binding: Any, now: float) -> list[Command]:
        raise IllegalTransition(self.link, "bound")  # this wire never asks for a binding

    def on_bind_failed(self, detail: str, now: float) -> list[Command]:
        raise IllegalTransition(self.link, "bind_failed")

    def on_frame(self, data: bytes, now: float) -> list[Command]:
        """An ack (anything else, or an ack for no fetch of ours waiting for one, is ignored)."""
        try:
            ack = decode_ack(data)
        except DecodeErrors:
            return []
        f = self._fetches.get(ack.mm_hash)
        if f is None or f.state is not FetchState.WAITING_ACK:
            return []
        if ack.status == VllmStatus.OK and ack.session_id != self.session_id:
            return []  # a grant for another session: not ours to use
        f.timings["ack"] = now
        if ack.status == VllmStatus.NACK_NOT_READY:
            if now + f.backoff_s >= f.final_deadline:
                return self._finish(f, Miss(f.mm_hash, MissReason.MISSING,
                                            "still NACK_NOT_READY at the deadline"))
            f.state, f.deadline, f.not_ready = FetchState.BACKOFF, now + f.backoff_s, True
            f.backoff_s = min(self.config.retry_backoff_max_s, f.backoff_s * 2)
            return []
        if ack.status != VllmStatus.OK:
            status = VllmStatus(ack.status) if ack.status in VllmStatus._value2member_map_ \
                else None
            reason = _NACK_REASON.get(status, MissReason.INTERNAL) if status is not None \
                else MissReason.INTERNAL
            name = status.name if status is not None else ack.status
            return self._finish(f, Miss(f.mm_hash, reason, f"vLLM producer answered {name}"))
        return self._on_grant(f, ack, now)

    def _on_grant(self, f: _Fetch, ack: WireAck, now: float) -> list[Command]:
        bb = self.store.block_bytes
        try:
            descs = decode_descs(ack.mem_descriptor)
        except DecodeErrors:
            return self._finish(f, Miss(f.mm_hash, MissReason.INTERNAL, "malformed mem_descriptor"))
        idx = ack.src_block_indices
        n_blocks = f.entry.nbytes // bb
        if len(idx) != n_blocks:
            return self._finish(f, Miss(
                f.mm_hash, MissReason.INCOMPATIBLE,
                f"producer grants {len(idx)} blocks, expected {n_blocks} ({f.entry.nbytes} bytes)"))
        if any(not 0 <= i < len(descs) or descs[i][1] != bb for i in idx):
            return self._finish(f, Miss(f.mm_hash, MissReason.INCOMPATIBLE,
                                        "descriptor sizes/indices do not match"))
        read = WireRead(self.conn, ack.agent_metadata,
                        tuple((descs[i][0], bb, descs[i][2]) for i in idx))
        notif = f"{self.session_id}:{f.mm_hash}".encode()
        return [PostRead(f.mm_hash, b"", f.entry.runs, f.entry.nbytes, notif, read)]

    def on_read_failed(self, mm_hash: str, detail: str, now: float) -> list[Command]:
        f = self._fetches.get(mm_hash)
        if f is None:
            return []
        return self._finish(f, Miss(mm_hash, MissReason.INTERNAL, detail))

    def on_read_posted(self, mm_hash: str, handle: Any, now: float) -> list[Command]:
        f = self._fetches[mm_hash]
        f.handle, f.state = handle, FetchState.READING
        f.timings["posted"] = now
        f.deadline = min(f.final_deadline, now + self.config.read_timeout_s)
        return []

    def on_read_state(self, mm_hash: str, state: str, now: float,
                      detail: str = "") -> list[Command]:
        """The plane's view of a READ (``key`` is the mm_hash, or a quarantined landing key)."""
        q = self._quarantine.get(mm_hash)
        if q is not None:  # a READ past its deadline: its blocks come back once it is over
            if state == "proc":
                return []
            del self._quarantine[mm_hash]
            self.store.discard(q.entry.mm_hash)
            return [Release(q.handle)]
        f = self._fetches.get(mm_hash)
        if f is None or f.state is not FetchState.READING or state == "proc":
            return []
        cmds: list[Command] = [Release(f.handle)]
        f.handle = None
        if state == "done":
            del self._fetches[mm_hash]
            f.timings["landed"] = now
            self.store.mark_ready(f.entry.mm_hash)
            entry = self.store.get(f.entry.mm_hash)
            assert entry is not None
            timings = {k: v - f.started for k, v in f.timings.items()}
            return cmds + [Report(Landed(mm_hash, entry, EXPORT_PLANE, timings))]
        return cmds + self._finish(f, Miss(mm_hash, MissReason.INTERNAL,
                                           detail or "NIXL READ failed"))

    def poll(self, now: float) -> list[Command]:
        cmds: list[Command] = []
        for key, q in [(k, q) for k, q in self._quarantine.items() if now >= q.deadline]:
            del self._quarantine[key]  # NIXL never said it is over: give up on it (as ECTP)
            self.store.discard(q.entry.mm_hash)
            cmds.append(Release(q.handle))
        for f in [f for f in self._fetches.values() if now >= f.deadline]:
            if f.state is FetchState.READING:
                cmds += self._quarantine_read(f, now)
            elif now >= f.final_deadline:
                if f.not_ready:
                    miss = Miss(f.mm_hash, MissReason.MISSING, "still NACK_NOT_READY at the deadline")
                else:
                    miss = Miss(f.mm_hash, MissReason.TIMEOUT, f"no XferAck from {self.conn}")
                cmds += self._finish(f, miss)
            else:  # BACKOFF over, or no ack in time: ask again (vLLM's consumer does too)
                cmds += self._send_req(f, now)
        return cmds

    def close(self) -> list[Command]:
        cmds: list[Command] = []
        for f in list(self._fetches.values()):
            if f.handle is not None:
                cmds.append(Release(f.handle))
                f.handle = None
            cmds += self._finish(f, Miss(f.mm_hash, MissReason.INTERNAL, "consumer closed"))
        for key, q in list(self._quarantine.items()):
            del self._quarantine[key]
            cmds.append(Release(q.handle))
            self.store.discard(q.entry.mm_hash)
        return cmds

    # -- internals -----------------------------------------------------------------------------
    def _send_req(self, f: _Fetch, now: float) -> list[Command]:
        f.state = FetchState.WAITING_ACK
        f.deadline = min(f.final_deadline, now + self.config.ack_timeout_s)
        f.timings.setdefault("req", now)
        c = self.config
        return [Send(self.conn, encode_req(f.mm_hash, c.compat_hash, self.session_id,
                                           c.connector_version))]

    def _quarantine_read(self, f: _Fetch, now: float) -> list[Command]:
        """The read deadline passed with the READ in flight (NIXL cannot abort it): keep its
        landing blocks, keyed by their store key, until the plane reports it over."""
        del self._fetches[f.mm_hash]
        f.state, f.deadline = FetchState.QUARANTINED, now + self.config.quarantine_s
        self._quarantine[f.entry.mm_hash] = f
        return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, "read deadline passed (quarantined)"))]

    def _finish(self, f: _Fetch, miss: Miss) -> list[Command]:
        self._fetches.pop(f.mm_hash, None)
        self.store.discard(f.entry.mm_hash)
        return [Report(miss)]

    def _fail(self, miss: Miss, now: float) -> list[Command]:
        self.failed = miss
        self.link = Link.FAILED
        cmds: list[Command] = []
        for f in list(self._fetches.values()):
            if f.state is FetchState.READING:
                cmds += self._quarantine_read(f, now)
            else:
                cmds += self._finish(f, Miss(f.mm_hash, miss.reason, miss.detail))
        return cmds
