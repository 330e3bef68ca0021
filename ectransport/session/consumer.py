"""ConsumerSession: the sans-I/O state machine for fetches from one producer connection.

One ConsumerSession per producer connection (``conn``); many fetches in flight. Per fetch::

    QUEUED ──(Welcome OK, endpoint bound)──► WAITING_ACK ──(ack OK, local blocks allocated)──► READING ──► DONE
       │                      │   ▲   │ NACK_NOT_READY / NACK_BUSY                   │ ERR
       │                      │   └── BACKOFF (retry with backoff until the deadline) │
       ▼                      ▼ other NACK / ack deadline                             ▼
      Miss                   Miss                                                    Miss
                                  read deadline with the DMA still in flight:
                                  QUARANTINED (local blocks kept) ──► settled when the plane
                                  reports it over, or at the quarantine deadline (handle
                                  released exactly once)

While READING, leases are renewed with ``Renew`` every ``lease/6``, extending by ``2/3·lease``
(vLLM's NIXL KV lease scheme). Every fetch ends in exactly one :class:`Report` by its deadline.

**Validity window** (ECTP v1 §6.3; the rule that keeps wrong bytes from ever being reported). A
grant is used only while the consumer can prove its lease is alive, on its own clock, from a
moment that precedes the grant: ``valid_until = (XferReq sent) + lease_s − margin`` with
``margin = min(validity_margin_s, lease_s / 4)``. The producer's lease starts when it issues the
grant, after the request was sent, so the producer cannot have unpinned (or re-used) the blocks
before ``valid_until``. Therefore an ack handled after ``valid_until`` is not used (the grant is
given back with ``XferDone(ok=False)`` and the request re-sent while the fetch deadline allows), and
a transfer whose completion is observed after it is discarded and reported as a miss (its
transfer is quarantined as after a read timeout). ``Renew`` frames are not confirmed in v1, so the
consumer never counts them: a transfer must complete inside the window of its own request.

**Binding** (issue 17). A Welcome's ``endpoint`` (the producer plane's declaration) is handed to
the node as a :class:`Bind` command; fetches wait until :meth:`on_bound` (with the plane's binding,
which every :class:`PostRead` then carries as ``prepared``) or :meth:`on_bind_failed`, which fails
this session alone.

**Peer quarantine.** A producer that timed out (ack or read), answered NACK_INTERNAL or went away
is quarantined for a backoff that doubles from ``peer_backoff_s`` up to ``peer_backoff_max_s``;
meanwhile :meth:`fetch` fails fast with ``Miss(QUARANTINED)``. The first fetch after the backoff
re-sends ``Hello`` as a probe; a ``Welcome`` lifts the quarantine and resets the backoff.

Local blocks are allocated from the consumer's :class:`BlockStore` once the ack tells the size,
under the key ``<mm_hash>#<n>`` (a landing zone, not a cache: several landed copies of one
mm_hash may coexist); they become READY on DONE and belong to the caller from then on.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ectransport.errors import ProtocolError
from ectransport.protocol import (
    RETRYABLE,
    SUPPORTED_VERSIONS,
    FrameError,
    Hello,
    Nack,
    Renew,
    Status,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)
from ectransport.protocol.messages import MAX_HASH_LEN
from ectransport.session.commands import (
    Bind,
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

#: Longest lease a consumer accepts in a grant, seconds (one day). A longer one is nonsensical
#: (and would make the validity window, and the renewals computed from it, unbounded).
MAX_LEASE_S = 86400.0
#: Shortest lease a consumer accepts, seconds: a grant that expires before a round trip could
#: complete is useless (and would make the consumer ask again and again).
MIN_LEASE_S = 0.1
#: How often one fetch asks again after a grant arrived past its validity window.
MAX_LATE_GRANTS = 3


class Link(enum.Enum):
    """Connection state of a :class:`ConsumerSession` (ECTP §8.1); see :data:`LINK_TRANSITIONS`.

    Orthogonal to it: the peer quarantine (``blocked_until``), after which the next fetch
    re-sends Hello as a probe (READY → GREETING, the negotiated version kept).
    """

    DOWN = "down"  #: no authenticated control connection (initial; after the connection dropped)
    GREETING = "greeting"  #: Hello sent, Welcome awaited
    BINDING = "binding"  #: Welcome OK; the node binds the producer's declared endpoint
    READY = "ready"  #: negotiated and bound: requests flow
    FAILED = "failed"  #: terminal: auth, version, incompatible, endpoint refused, closing


#: (state, event) → next state, for the events the node (or the session itself) drives. A
#: combination not listed is illegal: the session raises :class:`IllegalTransition` (h11's rule)
#: instead of silently proceeding. Frames from the network are never "illegal events": one that
#: does not fit the state (a second Welcome, an ack for nothing) is hostile or late input and is
#: ignored or refused, never raised.
LINK_TRANSITIONS: dict[tuple[Link, str], Link] = {
    **{(st, "up"): Link.GREETING for st in (Link.DOWN, Link.GREETING, Link.BINDING, Link.READY)},
    (Link.FAILED, "up"): Link.FAILED,
    **{(st, "down"): Link.DOWN for st in (Link.DOWN, Link.GREETING, Link.BINDING, Link.READY)},
    (Link.FAILED, "down"): Link.FAILED,
    (Link.READY, "probe"): Link.GREETING,
    (Link.GREETING, "probe"): Link.GREETING,
    (Link.GREETING, "welcome_ok"): Link.BINDING,
    (Link.BINDING, "bound"): Link.READY,
    **{(st, "fail"): Link.FAILED for st in Link},
}


class IllegalTransition(ProtocolError):
    """The node drove a :class:`ConsumerSession` with an event its state does not allow (e.g. a
    binding answered twice); the message names the state and the event."""

    def __init__(self, state: Link, event: str):
        super().__init__(f"consumer session: event {event!r} is illegal in state {state.name}")
        self.state = state
        self.event = event


class FetchState(enum.Enum):
    QUEUED = "queued"  #: waiting for the connection to be welcomed
    WAITING_ACK = "waiting_ack"
    BACKOFF = "backoff"  #: a retryable NACK; XferReq is sent again at ``retry_at``
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
        retry_backoff_s / retry_backoff_max_s: first and largest wait before re-sending an
            XferReq answered NACK_NOT_READY or NACK_BUSY [0.02 s → 0.5 s, doubling].
        peer_backoff_s / peer_backoff_max_s: peer quarantine after a failure [1 s → 60 s].
        mem_kinds: memory kinds of the landing region, sent in Hello (``"DRAM"``, ``"VRAM"``).
        localities: ``(plane, token)`` pairs sent in Hello: each plane's
            ``DataTransport.locality()``, from which the producer judges reachability.
        validity_margin_s: safety margin of the validity window (see the module docstring)
            [0.25 s; at most a quarter of the lease].
        request_notifications: ask the data plane to notify the producer when a transfer
            completes (ECTP v1 §5 accepts the notification or ``XferDone`` as the completion
            signal; this consumer always sends ``XferDone``, so the notification is only a
            backstop for a consumer that dies between the two). Off by default: over NIXL the
            notification is a second UCX message the READ waits for, measured +0.15 ms per
            64 KiB fetch on a 2-core host, nothing at 8.8 MiB. [False]
    """

    node_id: str
    compat_hash: str
    planes: tuple[str, ...] = ("nixl",)
    versions: tuple[int, ...] = SUPPORTED_VERSIONS
    ack_timeout_s: float = 2.0
    read_timeout_s: float = 20.0
    quarantine_s: float = 60.0
    hello_timeout_s: float = 5.0
    retry_backoff_s: float = 0.02
    retry_backoff_max_s: float = 0.5
    peer_backoff_s: float = 1.0
    peer_backoff_max_s: float = 60.0
    request_notifications: bool = False
    validity_margin_s: float = 0.25
    localities: tuple[tuple[str, bytes], ...] = ()
    mem_kinds: tuple[str, ...] = ("DRAM",)


@dataclass
class Fetch:
    """One fetch in flight (keyed by mm_hash within a session)."""

    mm_hash: str
    state: FetchState
    deadline: float  # of the current state (ack, read, retry, quarantine)
    final_deadline: float  # the caller's overall deadline
    started: float
    grant_id: int = -1
    lease_s: float = 0.0
    entry: Entry | None = None  # local landing blocks, keyed "<mm_hash>#<n>" in the store
    handle: Any = None
    retry_s: float = 0.0
    req_sent: float = 0.0  # when the latest XferReq of this fetch was sent (consumer clock)
    late_grants: int = 0  # grants that arrived past their validity window
    valid_until: float = float("inf")  # end of the granted lease's validity window
    last_nack: Status | None = None
    timings: dict[str, float] = field(default_factory=dict)


class ConsumerSession:
    """Fetches from one producer connection (see module docstring).

    Args:
        config: :class:`ConsumerConfig`.
        conn: the control connection key (``"host:port"``), used as ``Send.peer``.
        store: the consumer's block store (local blocks for landed entries).
        now: creation time; the Hello deadline starts here.
        session_id: fixed id for tests; default a fresh UUID4 hex.
        observer: optional ``(event, fields) -> None`` for metrics and logs (called synchronously,
            must be cheap): ``peer_quarantined`` (``seconds``, ``why``), ``peer_lifted`` (a
            Welcome ended a quarantine), ``transfer_quarantined`` (``mm_hash``, ``grant_id``);
            fields carry ``peer`` (the connection) and ``session_id``.
    """

    def __init__(
        self,
        config: ConsumerConfig,
        conn: str,
        store: BlockStore,
        now: float,
        *,
        session_id: str | None = None,
        observer: Callable[[str, dict[str, Any]], None] | None = None,
    ):
        self.config = config
        self.conn = conn
        self.store = store
        self.session_id = session_id or uuid.uuid4().hex
        self.version: int | None = None
        self.plane: str | None = None
        self.producer_id = ""
        self.failed: Miss | None = None  # terminal session failure (auth, version, incompat)
        self.blocked_until = 0.0  # peer quarantine
        self.blocked_reason = ""
        self._backoff = config.peer_backoff_s
        self.link = Link.DOWN
        self._probe_due = False  # re-Hello before the next fetch (quarantine ended)
        self._hello_deadline = float("inf")  # set while a Hello is unanswered
        self._next_renew = float("inf")
        self._fetches: dict[str, Fetch] = {}
        self._quarantine: dict[str, Fetch] = {}
        self._seq = 0
        self._welcome: Welcome | None = None  # an OK Welcome whose endpoint is being bound
        self.binding: Any = None  # the plane's binding of this producer (PostRead.prepared)
        #: mm_hashes whose XferReq timed out unanswered (a late OK ack is given back with an
        #: XferDone); bounded, so unsolicited acks are never reflected one for one.
        self._abandoned: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.observer = observer

    # -- queries -------------------------------------------------------------------------------
    @property
    def welcomed(self) -> bool:
        """A protocol version was negotiated on the current connection (READY, or a probe)."""
        return self.version is not None

    @property
    def _connected(self) -> bool:
        return self.link in (Link.GREETING, Link.BINDING, Link.READY)

    def _go(self, event: str) -> None:
        """Apply ``event`` to :attr:`link` per :data:`LINK_TRANSITIONS`.

        Raises:
            IllegalTransition: the pair is not in the table.
        """
        nxt = LINK_TRANSITIONS.get((self.link, event))
        if nxt is None:
            raise IllegalTransition(self.link, event)
        self.link = nxt

    def in_flight(self) -> int:
        return len(self._fetches) + len(self._quarantine)

    def fetch_states(self) -> dict[str, FetchState]:
        return {
            **{k: f.state for k, f in self._fetches.items()},
            **{k: f.state for k, f in self._quarantine.items()},
        }

    def reading(self) -> list[tuple[str, Any]]:
        """(mm_hash, handle) of every transfer whose data-plane state the node must poll."""
        return [
            (f.mm_hash, f.handle)
            for f in (*self._fetches.values(), *self._quarantine.values())
            if f.handle is not None
        ]

    def next_deadline(self) -> float | None:
        ds = [f.deadline for f in (*self._fetches.values(), *self._quarantine.values())]
        if self._fetches and self.failed is None:
            ds.append(self._hello_deadline)
        if any(f.state is FetchState.READING for f in self._fetches.values()):
            ds.append(self._next_renew)
        return min(ds) if ds else None

    # -- events --------------------------------------------------------------------------------
    def on_up(self, now: float) -> list[Command]:
        """The control connection is up and authenticated: say Hello (nothing once failed)."""
        self._go("up")
        return [] if self.link is Link.FAILED else self._hello(now)

    def fetch(self, mm_hash: str, now: float, deadline: float) -> list[Command]:
        """Start fetching ``mm_hash``; the outcome is reported by ``deadline`` at the latest."""
        if self.failed is not None:
            return [Report(Miss(mm_hash, self.failed.reason, self.failed.detail))]
        if now < self.blocked_until:
            return [
                Report(
                    Miss(
                        mm_hash,
                        MissReason.QUARANTINED,
                        f"producer quarantined for {self.blocked_until - now:.1f} s more "
                        f"after: {self.blocked_reason}",
                    )
                )
            ]
        if not mm_hash or len(mm_hash) > MAX_HASH_LEN:
            return [
                Report(
                    Miss(
                        mm_hash, MissReason.INTERNAL, f"mm_hash must be 1-{MAX_HASH_LEN} characters"
                    )
                )
            ]
        if mm_hash in self._fetches or mm_hash in self._quarantine:
            return [Report(Miss(mm_hash, MissReason.INTERNAL, "already being fetched"))]
        cmds: list[Command] = []
        if (self._probe_due and self.link in (Link.READY, Link.GREETING)
                and not any(x.state is FetchState.QUEUED for x in self._fetches.values())):
            cmds += self._probe(now)  # probe a producer whose quarantine just ended
        f = Fetch(mm_hash, FetchState.QUEUED, deadline, deadline, now)
        self._fetches[mm_hash] = f
        if self.link is Link.READY:  # else it waits: sent once the session is READY (again)
            cmds += self._send_req(f, now)
        return cmds

    def fetch_probe(self, now: float) -> list[Command]:
        """Probe a producer whose quarantine ended (Hello), without a fetch."""
        if (not self._probe_due or self.link not in (Link.READY, Link.GREETING)
                or now < self.blocked_until):
            return []
        return self._probe(now)

    def on_auth_failed(self, reason: str, now: float) -> list[Command]:
        return self._fail_session(Miss("", MissReason.AUTH, reason))

    def on_peer_down(self, now: float) -> list[Command]:
        """The producer went away: waiting fetches miss (retryable), reading ones are quarantined,
        and the producer is quarantined."""
        cmds: list[Command] = []
        was_connected = self._connected
        self._go("down")  # first: no XferDone to a dead peer
        for f in list(self._fetches.values()):
            if f.state is FetchState.READING:
                cmds += self._quarantine_fetch(
                    f, now, MissReason.PEER_DOWN, "producer went away mid-read"
                )
            else:
                del self._fetches[f.mm_hash]
                detail = "producer went away" if was_connected else "producer unreachable"
                cmds.append(Report(Miss(f.mm_hash, MissReason.PEER_DOWN, detail + " (retryable)")))
        why = "producer went away" if was_connected else "producer unreachable (no connection)"
        self.version = None
        self._welcome = None
        self._hello_deadline = float(
            "inf"
        )  # the next Up sends Hello; queued fetches keep their deadlines
        self._penalize(now, why)
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
                log.warning(
                    "producer %s NACKed a frame: %s %s", self.conn, msg.status.name, msg.detail
                )
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

    def on_read_state(self, mm_hash: str, state: str, now: float, detail: str = "") -> list[Command]:
        """Data-plane state of a transfer: ``"proc"``, ``"done"`` or ``"err"`` (``detail``: the
        plane's reason for an error, put in the miss)."""
        q = self._quarantine.get(mm_hash)
        if q is not None:
            return [] if state == "proc" else self._settle(q)
        f = self._fetches.get(mm_hash)
        if f is None or f.state is not FetchState.READING or state == "proc":
            return []
        if state == "done" and now >= f.valid_until:
            # the bytes may postdate the lease: never report them (§6.3)
            self._penalize(now, "transfer completed after its grant's validity window")
            return self._quarantine_fetch(
                f, now, MissReason.TIMEOUT,
                f"transfer completed {now - f.valid_until:.3f} s after its grant's validity "
                f"window; bytes discarded")
        if state == "done":
            assert f.entry is not None
            self.store.mark_ready(f.entry.mm_hash)
            f.timings["landed"] = now
            self._backoff = self.config.peer_backoff_s
            return self._finish(
                f,
                Landed(
                    f.mm_hash,
                    f.entry,
                    self.plane or "",
                    {k: v - f.started for k, v in f.timings.items()},
                    f.grant_id,
                ),
                ok=True,
            )
        why = f"data-plane transfer failed: {detail[:300]}" if detail else \
            "data-plane transfer failed"
        return self._finish(f, Miss(mm_hash, MissReason.INTERNAL, why), ok=False)

    def poll(self, now: float) -> list[Command]:
        """Apply deadlines (hello, ack, read → quarantine, quarantine → settle), retries, renewals."""
        cmds: list[Command] = []
        if self._fetches and self.failed is None and now >= self._hello_deadline:
            self._hello_deadline = float("inf")  # one penalty per unanswered Hello
            self._penalize(now, "no Welcome in time")
            for f in [f for f in self._fetches.values() if f.state is FetchState.QUEUED]:
                del self._fetches[f.mm_hash]
                cmds.append(
                    Report(
                        Miss(f.mm_hash, MissReason.TIMEOUT, "no Welcome from the producer in time")
                    )
                )
        for f in list(self._fetches.values()):
            if now >= f.final_deadline or now >= f.deadline:
                cmds += self._expire(f, now)
        reading = [f for f in self._fetches.values() if f.state is FetchState.READING]
        if reading and now >= self._next_renew and self.welcomed:
            lease = min(f.lease_s for f in reading)
            cmds.append(
                Send(
                    self.conn,
                    encode(
                        Renew(
                            v=self.version or 0,
                            session_id=self.session_id,
                            grant_ids=[f.grant_id for f in reading][:4096],
                            extend_s=lease * 2 / 3,
                        )
                    ),
                )
            )
            self._next_renew = now + lease / 6
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
    def _probe(self, now: float) -> list[Command]:
        self._go("probe")
        return self._hello(now)

    def _hello(self, now: float) -> list[Command]:
        self._hello_deadline = now + self.config.hello_timeout_s  # inf again once answered
        hello = Hello(
            v=max(self.config.versions),
            session_id=self.session_id,
            node_id=self.config.node_id,
            versions=list(self.config.versions),
            planes=list(self.config.planes),
            compat_hash=self.config.compat_hash,
            mem_kinds=list(self.config.mem_kinds),
            localities=dict(self.config.localities),
        )
        return [Send(self.conn, encode(hello))]

    def _penalize(self, now: float, why: str) -> None:
        self.blocked_until = now + self._backoff
        self.blocked_reason = why
        self._backoff = min(self._backoff * 2, self.config.peer_backoff_max_s)
        self._probe_due = True  # the next fetch after the backoff probes with Hello first
        log.warning(
            "producer %s quarantined for %.1f s: %s",
            self.conn,
            self.blocked_until - now,
            why,
            extra={"peer": self.conn, "session_id": self.session_id},
        )
        self._emit("peer_quarantined", seconds=self.blocked_until - now, why=why)

    def _expire(self, f: Fetch, now: float) -> list[Command]:
        final = now >= f.final_deadline
        own = (
            final and now < f.deadline
        )  # the caller's deadline came first: not the producer's fault
        if f.state is FetchState.READING:
            if not own:
                self._penalize(now, "read deadline passed")
            return self._quarantine_fetch(f, now, MissReason.TIMEOUT, "read deadline passed")
        if f.state is FetchState.BACKOFF and not final:
            return self._send_req(f, now)
        del self._fetches[f.mm_hash]
        if f.last_nack is not None and (f.state is FetchState.BACKOFF or final):
            reason = _NACK_REASON.get(f.last_nack, MissReason.INTERNAL)
            return [Report(Miss(f.mm_hash, reason, f"still {f.last_nack.name} at the deadline"))]
        if f.state is FetchState.WAITING_ACK:
            self._abandon(f.mm_hash)
            if not own:
                self._penalize(now, "no ack before the deadline")
            return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, "no ack before the deadline"))]
        return [Report(Miss(f.mm_hash, MissReason.TIMEOUT, "not connected before the deadline"))]

    def _abandon(self, mm_hash: str) -> None:
        self._abandoned[mm_hash] = None
        self._abandoned.move_to_end(mm_hash)
        while len(self._abandoned) > 1024:
            self._abandoned.popitem(last=False)

    def _send_req(self, f: Fetch, now: float) -> list[Command]:
        f.state = FetchState.WAITING_ACK
        f.deadline = min(f.final_deadline, now + self.config.ack_timeout_s)
        f.req_sent = now
        f.timings.setdefault("req", now)
        req = XferReq(
            v=self.version or 0,
            session_id=self.session_id,
            mm_hash=f.mm_hash,
            compat_hash=self.config.compat_hash,
            dest=b"",
        )
        return [Send(self.conn, encode(req))]

    def _on_welcome(self, msg: Welcome, now: float) -> list[Command]:
        if msg.session_id != self.session_id or self.link is not Link.GREETING:
            return []  # not ours, or not awaited (a duplicate or late Welcome): ignored
        if msg.status is not Status.OK:
            reason = _NACK_REASON.get(msg.status, MissReason.INTERNAL)
            return self._fail_session(Miss("", reason, msg.detail or msg.status.name))
        if msg.version not in self.config.versions or msg.plane not in self.config.planes:
            return self._fail_session(
                Miss(
                    "",
                    MissReason.VERSION,
                    f"producer chose version {msg.version} / plane {msg.plane!r}",
                )
            )
        if self.plane is not None and msg.plane != self.plane and self.reading():
            # the handles in flight belong to the old plane: never hand them to another
            return self._fail_session(Miss(
                "", MissReason.INTERNAL,
                f"producer switched its data plane from {self.plane!r} to {msg.plane!r} while "
                f"transfers were in flight"))
        self._welcome = msg
        self._go("welcome_ok")
        self._hello_deadline = float("inf")  # answered; the node binds at once
        return [Bind(msg.plane, msg.endpoint)]

    def on_bound(self, binding: Any, now: float) -> list[Command]:
        """The node's plane accepted the Welcome's endpoint: the session is usable; queued fetches
        send their requests.

        Raises:
            IllegalTransition: no binding was asked for (the session is not BINDING).
        """
        msg, self._welcome = self._welcome, None
        self._go("bound")
        assert msg is not None  # BINDING always holds its Welcome
        self.binding = binding
        self.version, self.plane, self.producer_id = msg.version, msg.plane, msg.node_id
        if self.blocked_until:
            self._emit("peer_lifted")
        self.blocked_until, self.blocked_reason, self._probe_due = 0.0, "", False
        self._hello_deadline = float("inf")
        self._backoff = self.config.peer_backoff_s
        cmds: list[Command] = []
        for f in list(self._fetches.values()):
            if f.state is FetchState.QUEUED:
                cmds += self._send_req(f, now)
        return cmds

    def on_bind_failed(self, detail: str, now: float) -> list[Command]:
        """The node's plane refused the Welcome's endpoint (malformed, or naming what this
        producer cannot own): this session fails — every fetch from this producer misses with
        INCOMPATIBLE — and no other producer is affected.

        Raises:
            IllegalTransition: no binding was asked for (the session is not BINDING).
        """
        if self.link is not Link.BINDING:
            raise IllegalTransition(self.link, "bind_failed")
        self._welcome = None
        return self._fail_session(
            Miss("", MissReason.INCOMPATIBLE, f"producer's data-plane endpoint refused: {detail}"))

    def _on_ack(self, msg: XferAck, now: float) -> list[Command]:
        f = self._fetches.get(msg.mm_hash)
        if f is None or f.state is not FetchState.WAITING_ACK or msg.session_id != self.session_id:
            # the late grant of a request we gave up on: let the producer unpin now — once, and
            # only for a request we really sent (never a reflection of unsolicited acks)
            if (
                msg.status is Status.OK
                and msg.grant is not None
                and msg.session_id == self.session_id
                and msg.mm_hash in self._abandoned
                and f is None
            ):
                del self._abandoned[msg.mm_hash]
                return [self._done(msg.mm_hash, msg.grant.grant_id, ok=False)]
            return []
        f.timings["ack"] = now
        if msg.status in RETRYABLE:
            f.last_nack = msg.status
            f.retry_s = min(
                max(f.retry_s * 2, self.config.retry_backoff_s), self.config.retry_backoff_max_s
            )
            f.state = FetchState.BACKOFF
            f.deadline = min(f.final_deadline, now + f.retry_s)
            return []
        if msg.status is not Status.OK:
            del self._fetches[f.mm_hash]
            if msg.status is Status.NACK_INTERNAL:
                self._penalize(now, f"NACK_INTERNAL: {msg.detail}")
            reason = _NACK_REASON.get(msg.status, MissReason.INTERNAL)
            detail = f"{msg.status.name}: {msg.detail}" if msg.detail else msg.status.name
            return [Report(Miss(f.mm_hash, reason, detail))]
        g = msg.grant
        bad = _grant_problem(g, self.plane, self.store)
        if bad:  # refused, never clamped: a producer that sends this is broken or hostile
            del self._fetches[f.mm_hash]
            cmds: list[Command] = [Report(Miss(f.mm_hash, MissReason.INTERNAL, f"bad grant: {bad}"))]
            if g is not None:
                cmds.append(self._done(f.mm_hash, g.grant_id, ok=False))
            return cmds
        assert g is not None
        margin = min(self.config.validity_margin_s, g.lease_s / 4)
        valid_until = f.req_sent + g.lease_s - margin
        if now >= valid_until:  # the lease may be over already: never use this grant (§6.3)
            cmds = [self._done(f.mm_hash, g.grant_id, ok=False)]
            late = now - valid_until
            f.late_grants += 1
            if f.late_grants <= MAX_LATE_GRANTS and now + self.config.ack_timeout_s < f.final_deadline:
                log.warning("grant for %s handled %.3f s after its validity window; asking again",
                            f.mm_hash[:12], late, extra={"peer": self.conn})
                return cmds + self._send_req(f, now)
            del self._fetches[f.mm_hash]
            return cmds + [Report(Miss(
                f.mm_hash, MissReason.TIMEOUT,
                f"grant handled {late:.3f} s after its validity window (lease {g.lease_s} s from "
                f"the request); not used"))]
        f.grant_id, f.lease_s, f.valid_until = g.grant_id, g.lease_s, valid_until
        self._seq += 1
        # landing keys are unique per consumer node: the session id is (UUID4), the sequence
        # is per session — fetches of one mm_hash from several producers never collide
        entry = self.store.alloc(f"{f.mm_hash}#{self.session_id}.{self._seq}", g.entry_bytes)
        if isinstance(entry, AllocFailed):
            del self._fetches[f.mm_hash]
            return [
                self._done(f.mm_hash, g.grant_id, ok=False),
                Report(
                    Miss(
                        f.mm_hash,
                        MissReason.NO_SPACE,
                        f"local region cannot hold {g.entry_bytes} bytes ({entry.reason})",
                    )
                ),
            ]
        f.entry = entry
        f.state = FetchState.READING
        f.deadline = min(f.final_deadline, now + self.config.read_timeout_s, valid_until)
        if not any(x.state is FetchState.READING and x is not f for x in self._fetches.values()):
            self._next_renew = now + f.lease_s / 6
        notif = (notif_for((self.session_id, f.mm_hash, g.grant_id))
                 if self.config.request_notifications else b"")
        return [PostRead(f.mm_hash, g.plane_grant, entry.runs, g.entry_bytes, notif,
                         self.binding)]

    def _done(self, mm_hash: str, grant_id: int, ok: bool) -> Send:
        return Send(
            self.conn,
            encode(
                XferDone(
                    v=self.version or max(self.config.versions),
                    session_id=self.session_id,
                    mm_hash=mm_hash,
                    grant_id=grant_id,
                    ok=ok,
                )
            ),
        )

    def _finish(self, f: Fetch, outcome: Landed | Miss, ok: bool) -> list[Command]:
        del self._fetches[f.mm_hash]
        if not ok and f.entry is not None:
            self.store.discard(f.entry.mm_hash)
        # the caller first: the release and the XferDone send (which wakes ZeroMQ's I/O thread)
        # follow, instead of delaying the outcome by a thread switch (measured ~1.5 ms on 2 cores)
        cmds: list[Command] = [Report(outcome)]
        if f.handle is not None:
            cmds.append(Release(f.handle))
            f.handle = None
        if f.grant_id >= 0 and self.welcomed:
            cmds.append(self._done(f.mm_hash, f.grant_id, ok=ok))
            self._retry_busy_now()
        return cmds

    def _retry_busy_now(self) -> None:
        """A grant of ours just ended (its XferDone is on the way): the oldest fetch backing off
        after a NACK_BUSY — our pin budget at this producer — retries at the next :meth:`poll`
        instead of after its backoff; the retry leaves after the XferDone on the same ordered
        connection, so the producer has unpinned first. One retry per ended grant (the freed
        budget fits about one more entry; the others keep their backoff rather than flooding the
        producer, whose per-consumer frame rate is limited)."""
        busy = [g for g in self._fetches.values() if g.state is FetchState.BACKOFF
                and g.last_nack is Status.NACK_BUSY and g.deadline != float("-inf")]
        if busy:
            min(busy, key=lambda g: g.started).deadline = float("-inf")  # poll() re-sends it

    def _quarantine_fetch(
        self, f: Fetch, now: float, reason: MissReason, detail: str
    ) -> list[Command]:
        del self._fetches[f.mm_hash]
        cmds: list[Command] = [Report(Miss(f.mm_hash, reason, detail + "; transfer quarantined"))]
        if f.handle is None:  # nothing in flight on the data plane: free at once
            if f.entry is not None:
                self.store.discard(f.entry.mm_hash)
            return cmds
        f.state = FetchState.QUARANTINED
        f.deadline = now + self.config.quarantine_s
        log.info(
            "transfer quarantined for %.0f s: %s",
            self.config.quarantine_s,
            detail,
            extra={
                "peer": self.conn,
                "session_id": self.session_id,
                "mm_hash": f.mm_hash[:12],
                "grant_id": f.grant_id,
            },
        )
        self._emit(
            "transfer_quarantined", mm_hash=f.mm_hash[:12], grant_id=f.grant_id, reason=reason.value
        )
        self._quarantine[f.mm_hash] = f
        if f.grant_id >= 0 and self._connected:
            cmds.append(self._done(f.mm_hash, f.grant_id, ok=False))
            self._retry_busy_now()
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

    def _emit(self, event: str, **fields: Any) -> None:
        if self.observer is not None:
            self.observer(event, {"peer": self.conn, "session_id": self.session_id, **fields})

    def _fail_session(self, miss: Miss) -> list[Command]:
        """Terminal: every fetch misses (reading ones are quarantined, their grants given back
        while the connection is up), then the session is FAILED."""
        self.failed = miss
        cmds: list[Command] = []
        for f in list(self._fetches.values()):
            if f.state is FetchState.READING:
                cmds += self._quarantine_fetch(f, f.deadline, miss.reason, miss.detail)
            else:
                del self._fetches[f.mm_hash]
                cmds.append(Report(Miss(f.mm_hash, miss.reason, miss.detail)))
        self._welcome = None
        self._go("fail")
        return cmds


def _grant_problem(g: Any, plane: str | None, store: BlockStore) -> str:
    """Why an OK ack's grant cannot be used ("" if it can): it must exist, match the local layout
    and negotiated plane, and carry a finite, positive lease."""
    if g is None:
        return "an OK ack without a grant"
    if g.plane != plane:
        return f"grant for plane {g.plane!r}, negotiated {plane!r}"
    if g.block_bytes != store.block_bytes or g.num_blocks != store.blocks_for(g.entry_bytes):
        return (f"grant of {g.num_blocks} blocks of {g.block_bytes} bytes for {g.entry_bytes} "
                f"bytes does not match the local layout ({store.block_bytes}-byte blocks)")
    if not (math.isfinite(g.lease_s) and MIN_LEASE_S <= g.lease_s <= MAX_LEASE_S):
        return (f"lease_s must be a number of seconds in [{MIN_LEASE_S:g}, {MAX_LEASE_S:g}], "
                f"got {g.lease_s!r}")
    return ""
