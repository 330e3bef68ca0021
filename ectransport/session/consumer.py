"""ConsumerSession: the sans-I/O state machine for fetches from one producer connection.

One ConsumerSession per producer connection (``conn``); many fetches in flight. Per fetch::

    QUEUED ──(Welcome OK)──► WAITING_ACK ──(ack OK, local blocks allocated)──► READING ──► DONE
       │                         │ NACK / ack deadline                           │ ERR
       ▼                         ▼                                               ▼
      Miss                      Miss                                            Miss
                                             read deadline with the DMA still in flight:
                                             QUARANTINED (local blocks kept) ──► settled
                                             when the plane reports it over, or at the
                                             quarantine deadline (handle released once)

Every fetch ends in exactly one :class:`Report` by its deadline. Local blocks are allocated from
the consumer's :class:`BlockStore` once the ack tells the size, under the key ``<mm_hash>#<n>``
(so several landed copies of one mm_hash may coexist); they become READY on DONE and belong to
the caller from then on.
"""

from __future__ import annotations

import enum
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from ectransport.protocol import (
    RETRYABLE,
    SUPPORTED_VERSIONS,
    FrameError,
    Hello,
    Nack,
    Status,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)
from ectransport.session.commands import (
    Command,
    Landed,
    Miss,
    MissReason,
    PostRead,
    Release,
    Report,
    Send,
)
from ectransport.session.producer import notif_for
from ectransport.store import AllocFailed, BlockStore, Entry

log = logging.getLogger("ectransport.session.consumer")


class FetchState(enum.Enum):
    QUEUED = "queued"  #: waiting for the connection to be welcomed
    WAITING_ACK = "waiting_ack"
    READING = "reading"
    QUARANTINED = "quarantined"


_NACK_REASON = {
    Status.NACK_MISSING: MissReason.MISSING,
    Status.NACK_INCOMPAT: MissReason.INCOMPATIBLE,
    Status.NACK_VERSION: MissReason.VERSION,
    Status.NACK_BUSY: MissReason.BUSY,
    Status.NACK_NOT_READY: MissReason.MISSING,
    Status.NACK_BAD_REQUEST: MissReason.INTERNAL,
    Status.NACK_INTERNAL: MissReason.INTERNAL,
}


@dataclass(frozen=True)
class ConsumerConfig:
    """Consumer-side settings (seconds).

    Attributes:
        node_id: this node's name, sent in Hello.
        compat_hash: must equal the producer's.
        planes: data planes this node can use, best first.
        versions: protocol versions spoken.
        ack_timeout_s: XferReq → XferAck deadline [2 s, as vLLM's consumer_ack_timeout_s].
        read_timeout_s: data-plane transfer deadline after the ack [20 s].
        quarantine_s: how long a timed-out transfer keeps its local blocks [60 s].
        hello_timeout_s: connection + Hello → Welcome deadline [5 s].
    """

    node_id: str
    compat_hash: str
    planes: tuple[str, ...] = ("nixl",)
    versions: tuple[int, ...] = SUPPORTED_VERSIONS
    ack_timeout_s: float = 2.0
    read_timeout_s: float = 20.0
    quarantine_s: float = 60.0
    hello_timeout_s: float = 5.0


@dataclass
class Fetch:
    """One fetch in flight (keyed by mm_hash within a session)."""

    mm_hash: str
    state: FetchState
    deadline: float  # of the current state
    final_deadline: float  # the caller's overall deadline
    started: float
    grant_id: int = -1
    entry: Entry | None = None  # local landing blocks, keyed "<mm_hash>#<n>" in the store
    handle: Any = None
    timings: dict[str, float] = field(default_factory=dict)


class ConsumerSession:
    """Fetches from one producer connection (see module docstring).

    Args:
        config: :class:`ConsumerConfig`.
        conn: the control connection key (``"host:port"``), used as ``Send.peer``.
        store: the consumer's block store (local blocks for landed entries).
        now: creation time; the Hello deadline starts here.
        session_id: fixed id for tests; default a fresh UUID4 hex.
    """

    def __init__(self, config: ConsumerConfig, conn: str, store: BlockStore, now: float,
                 *, session_id: str | None = None):
        self.config = config
        self.conn = conn
        self.store = store
        self.session_id = session_id or uuid.uuid4().hex
        self.version: int | None = None
        self.plane: str | None = None
        self.producer_id = ""
        self.failed: Miss | None = None  # terminal session failure (auth, version, incompat)
        self._hello_deadline = now + config.hello_timeout_s
        self._fetches: dict[str, Fetch] = {}
        self._quarantine: dict[str, Fetch] = {}
        self._seq = 0  # local landing entries are keyed "<mm_hash>#<seq>": a landing zone, not a cache

    # -- queries -------------------------------------------------------------------------------
    @property
    def welcomed(self) -> bool:
        return self.version is not None

    def in_flight(self) -> int:
        return len(self._fetches) + len(self._quarantine)

    def reading(self) -> list[tuple[str, Any]]:
        """(mm_hash, handle) of every transfer whose data-plane state the node must poll."""
        return [(f.mm_hash, f.handle) for f in (*self._fetches.values(), *self._quarantine.values())
                if f.handle is not None]

    def next_deadline(self) -> float | None:
        ds = [f.deadline for f in (*self._fetches.values(), *self._quarantine.values())]
        if not self.welcomed and self.failed is None:
            ds.append(self._hello_deadline)
        return min(ds) if ds else None

    # -- events --------------------------------------------------------------------------------
    def on_up(self, now: float) -> list[Command]:
        """The control connection is up and authenticated: say Hello."""
        hello = Hello(v=max(self.config.versions), session_id=self.session_id,
                      node_id=self.config.node_id, versions=list(self.config.versions),
                      planes=list(self.config.planes), compat_hash=self.config.compat_hash,
                      mem_kinds=["DRAM"])
        return [Send(self.conn, encode(hello))]

    def fetch(self, mm_hash: str, now: float, deadline: float) -> list[Command]:
        """Start fetching ``mm_hash``; the outcome is reported by ``deadline`` at the latest."""
        if self.failed is not None:
            return [Report(Miss(mm_hash, self.failed.reason, self.failed.detail))]
        if mm_hash in self._fetches or mm_hash in self._quarantine:
            return [Report(Miss(mm_hash, MissReason.INTERNAL, "already being fetched"))]
        f = Fetch(mm_hash, FetchState.QUEUED, min(deadline, self._hello_deadline), deadline, now)
        self._fetches[mm_hash] = f
        if self.welcomed:
            return self._send_req(f, now)
        return []

    def on_auth_failed(self, reason: str, now: float) -> list[Command]:
        return self._fail_session(Miss("", MissReason.AUTH, reason))

    def on_peer_down(self, now: float) -> list[Command]:
        """The producer went away: waiting fetches miss; reading ones go to quarantine."""
        cmds: list[Command] = []
        for f in list(self._fetches.values()):
            if f.state is FetchState.READING:
                cmds += self._quarantine_fetch(f, now, MissReason.PEER_DOWN, "producer went away mid-read")
            else:
                del self._fetches[f.mm_hash]
                cmds.append(Report(Miss(f.mm_hash, MissReason.PEER_DOWN, "producer went away")))
        self.version = None
        return cmds

    def on_frame(self, data: bytes, now: float) -> list[Command]:
        versions = (self.version,) if self.version is not None else self.config.versions
        try:
            msg = decode(data, versions=versions)
        except FrameError as e:
            log.warning("bad frame from producer %s: %s", self.conn, e.detail)
            return []
        match msg:
            case Welcome():
                return self._on_welcome(msg, now)
            case XferAck():
                return self._on_ack(msg, now)
            case Nack():
                log.warning("producer %s NACKed a frame: %s %s", self.conn, msg.status.name, msg.detail)
                return []
            case _:
                return []

    def on_read_failed(self, mm_hash: str, detail: str, now: float) -> list[Command]:
        """The node could not post the transfer (plane error). Blocks are freed, nothing landed."""
        f = self._fetches.get(mm_hash)
        if f is None or f.state is not FetchState.READING:
            return []
        return self._finish(f, Miss(mm_hash, MissReason.INTERNAL, detail), ok=False)

    def on_read_posted(self, mm_hash: str, handle: Any, now: float) -> list[Command]:
        f = self._fetches.get(mm_hash)
        if f is None or f.state is not FetchState.READING:
            return [Release(handle)]
        f.handle = handle
        f.timings["posted"] = now
        return []

    def on_read_state(self, mm_hash: str, state: str, now: float) -> list[Command]:
        """Data-plane state of a transfer: ``"proc"``, ``"done"`` or ``"err"``."""
        q = self._quarantine.get(mm_hash)
        if q is not None:
            if state == "proc":
                return []
            return self._settle(q)
        f = self._fetches.get(mm_hash)
        if f is None or f.state is not FetchState.READING or state == "proc":
            return []
        if state == "done":
            assert f.entry is not None
            self.store.mark_ready(f.entry.mm_hash)
            f.timings["landed"] = now
            return self._finish(f, Landed(f.mm_hash, f.entry, self.plane or "",
                                          {k: v - f.started for k, v in f.timings.items()}), ok=True)
        return self._finish(f, Miss(mm_hash, MissReason.INTERNAL, "data-plane transfer failed"), ok=False)

    def poll(self, now: float) -> list[Command]:
        """Apply deadlines: hello, ack, read (→ quarantine) and quarantine (→ settle)."""
        cmds: list[Command] = []
        if not self.welcomed and self.failed is None and now >= self._hello_deadline and self._fetches:
            return self._fail_session(Miss("", MissReason.TIMEOUT, "no Welcome from producer in time"),
                                      terminal=False)
        for f in list(self._fetches.values()):
            if now < f.deadline:
                continue
            if f.state is FetchState.READING:
                cmds += self._quarantine_fetch(f, now, MissReason.TIMEOUT, "read deadline passed")
            else:
                del self._fetches[f.mm_hash]
                what = "ack" if f.state is FetchState.WAITING_ACK else "connection"
                cmds.append(Report(Miss(f.mm_hash, MissReason.TIMEOUT, f"no {what} before the deadline")))
        for q in list(self._quarantine.values()):
            if now >= q.deadline:
                cmds += self._settle(q)
        return cmds

    def close(self) -> list[Command]:
        """Shutdown: every fetch misses, every handle is released, local blocks freed."""
        cmds = self._fail_session(Miss("", MissReason.INTERNAL, "consumer closing"))
        for q in list(self._quarantine.values()):
            cmds += self._settle(q)
        return cmds

    # -- internals -----------------------------------------------------------------------------
    def _send_req(self, f: Fetch, now: float) -> list[Command]:
        f.state = FetchState.WAITING_ACK
        f.deadline = min(f.final_deadline, now + self.config.ack_timeout_s)
        f.timings["req"] = now
        req = XferReq(v=self.version or 0, session_id=self.session_id, mm_hash=f.mm_hash,
                      compat_hash=self.config.compat_hash, dest=b"")
        return [Send(self.conn, encode(req))]

    def _on_welcome(self, msg: Welcome, now: float) -> list[Command]:
        if msg.session_id != self.session_id or self.welcomed:
            return []
        if msg.status is not Status.OK:
            reason = _NACK_REASON.get(msg.status, MissReason.INTERNAL)
            return self._fail_session(Miss("", reason, msg.detail or msg.status.name))
        if msg.version not in self.config.versions or msg.plane not in self.config.planes:
            return self._fail_session(Miss("", MissReason.VERSION,
                                           f"producer chose version {msg.version} / plane {msg.plane!r}"))
        self.version, self.plane, self.producer_id = msg.version, msg.plane, msg.node_id
        cmds: list[Command] = []
        for f in list(self._fetches.values()):
            if f.state is FetchState.QUEUED:
                cmds += self._send_req(f, now)
        return cmds

    def _on_ack(self, msg: XferAck, now: float) -> list[Command]:
        f = self._fetches.get(msg.mm_hash)
        if f is None or f.state is not FetchState.WAITING_ACK or msg.session_id != self.session_id:
            # a grant we no longer want (late or duplicate ack): let the producer unpin now
            if (msg.status is Status.OK and msg.grant is not None
                    and msg.session_id == self.session_id
                    and (f is None or f.grant_id != msg.grant.grant_id)):
                return [self._done(msg.mm_hash, msg.grant.grant_id, ok=False)]
            return []
        f.timings["ack"] = now
        if msg.status is not Status.OK:
            del self._fetches[f.mm_hash]
            reason = _NACK_REASON.get(msg.status, MissReason.INTERNAL)
            detail = f"{msg.status.name}: {msg.detail}" if msg.detail else msg.status.name
            if msg.status in RETRYABLE:
                detail += " (retryable)"
            return [Report(Miss(f.mm_hash, reason, detail))]
        g = msg.grant
        if g is None or g.block_bytes != self.store.block_bytes or g.plane != self.plane or \
                g.num_blocks != self.store.blocks_for(g.entry_bytes):
            del self._fetches[f.mm_hash]
            cmds: list[Command] = [Report(Miss(f.mm_hash, MissReason.INTERNAL, "grant does not match local layout"))]
            if g is not None:
                cmds.append(self._done(f.mm_hash, g.grant_id, ok=False))
            return cmds
        f.grant_id = g.grant_id
        self._seq += 1
        entry = self.store.alloc(f"{f.mm_hash}#{self._seq}", g.entry_bytes)
        if isinstance(entry, AllocFailed):
            del self._fetches[f.mm_hash]
            return [self._done(f.mm_hash, g.grant_id, ok=False),
                    Report(Miss(f.mm_hash, MissReason.NO_SPACE,
                                f"local region cannot hold {g.entry_bytes} bytes ({entry.reason})"))]
        f.entry = entry
        f.state = FetchState.READING
        f.deadline = min(f.final_deadline, now + self.config.read_timeout_s)
        notif = notif_for((self.session_id, f.mm_hash, g.grant_id))
        return [PostRead(f.mm_hash, g.plane_grant, entry.runs, g.entry_bytes, notif)]

    def _done(self, mm_hash: str, grant_id: int, ok: bool) -> Send:
        return Send(self.conn, encode(XferDone(v=self.version or max(self.config.versions),
                                               session_id=self.session_id, mm_hash=mm_hash,
                                               grant_id=grant_id, ok=ok)))

    def _finish(self, f: Fetch, outcome: Landed | Miss, ok: bool) -> list[Command]:
        del self._fetches[f.mm_hash]
        cmds: list[Command] = []
        if f.handle is not None:
            cmds.append(Release(f.handle))
            f.handle = None
        if not ok and f.entry is not None:
            self.store.discard(f.entry.mm_hash)
        if f.grant_id >= 0 and self.welcomed:
            cmds.append(self._done(f.mm_hash, f.grant_id, ok=ok))
        cmds.append(Report(outcome))
        return cmds

    def _quarantine_fetch(self, f: Fetch, now: float, reason: MissReason, detail: str) -> list[Command]:
        del self._fetches[f.mm_hash]
        cmds: list[Command] = [Report(Miss(f.mm_hash, reason, detail + "; transfer quarantined"))]
        if f.handle is None:  # nothing in flight on the data plane: free at once
            if f.entry is not None:
                self.store.discard(f.entry.mm_hash)
            return cmds
        f.state = FetchState.QUARANTINED
        f.deadline = now + self.config.quarantine_s
        self._quarantine[f.mm_hash] = f
        if self.welcomed and f.grant_id >= 0:
            cmds.append(self._done(f.mm_hash, f.grant_id, ok=False))
        return cmds

    def _settle(self, q: Fetch) -> list[Command]:
        del self._quarantine[q.mm_hash]
        cmds: list[Command] = []
        if q.handle is not None:
            cmds.append(Release(q.handle))
            q.handle = None
        if q.entry is not None:
            self.store.discard(q.entry.mm_hash)
        return cmds

    def _fail_session(self, miss: Miss, terminal: bool = True) -> list[Command]:
        if terminal:
            self.failed = miss
        cmds: list[Command] = []
        for f in list(self._fetches.values()):
            if f.state is FetchState.READING:
                cmds += self._quarantine_fetch(f, f.deadline, miss.reason, miss.detail)
            else:
                del self._fetches[f.mm_hash]
                cmds.append(Report(Miss(f.mm_hash, miss.reason, miss.detail)))
        return cmds
