"""ConsumerNode: fetches encoder-cache entries from producers, peer to peer.

    node = ConsumerNode(layout=Layout(hidden=3584), security=sec)
    out = node.fetch(ProducerAddress("10.0.0.5", 5601, producer_pubkey), mm_hash)
    if out.ok:
        tensor = out.tensor()          # [num_tokens, hidden], layout.dtype
    else:
        print(out.reason, out.detail)  # recompute locally

One :class:`ConsumerSession` per producer is driven over the ZMQ control client and the data plane
by whichever thread holds the node's drive lock: the node's I/O thread, or — for a lone
synchronous :meth:`ConsumerNode.fetch` while nothing else is in flight — the calling thread
itself, which then sends the XferReq, waits in the ZMQ poll for the XferAck, posts the read and
builds the result without handing work to another thread and back (each hand-off is a scheduler
wake-up: ~0.1 ms on a quiet 2-core host, milliseconds on a loaded one). While nothing is in flight
the I/O thread parks without watching the sockets (events queue in ZeroMQ and are handled at the
next step, at most ~0.1 s later). ``fetch``/``submit`` may be called from any thread; every fetch
ends by its deadline in exactly one :class:`Fetched` or :class:`Miss`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ectransport.control.base import AuthFailed, ControlClient, Down, Received, Up
from ectransport.data.base import DataTransport, identity_of
from ectransport.data.registry import load_plane
from ectransport.errors import (
    AuthError,
    ConfigError,
    ECTransportError,
    NoCommonPlane,
    ProtocolError,
    VersionError,
)
from ectransport.node.common import Layout, Security, region_for
from ectransport.protocol import SUPPORTED_VERSIONS
from ectransport.session import (
    Bind,
    Command,
    ConsumerConfig,
    ConsumerSession,
    Landed,
    Miss,
    MissReason,
    PostRead,
    Release,
    Report,
    Send,
)
from ectransport.store import BlockRegion, BlockStore, Run

log = logging.getLogger("ectransport.node.consumer")

#: While transfers are in flight the I/O loop sleeps this long between checks, seconds.
_BUSY_SLEEP_S = 50e-6
#: How long fetch() waits for the drive lock while the parked I/O thread makes its periodic
#: non-blocking step (instead of handing its fetch to that thread), seconds.
_BRIEF_WAIT_S = 0.005


@dataclass(frozen=True)
class ProducerAddress:
    """Where a producer listens and its CURVE public key (Z85; None only in insecure mode)."""

    host: str
    port: int
    public_key: str | None = None

    @property
    def key(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Fetched:
    """A fetched entry.

    ``data`` is a 1-D uint8 array **over the consumer's landing region** (zero copy): the local
    blocks stay pinned for as long as ``data`` or anything derived from it (numpy views, the
    :meth:`tensor`) is alive, and are returned to the region when the last of them is garbage-
    collected. Keep what you need, drop the rest; a consumer whose region is full of held entries
    reports ``Miss(NO_SPACE)``.

    Attributes:
        timings: seconds since the fetch started: ``req`` (XferReq sent), ``ack``, ``posted``
            (data-plane transfer posted), ``landed``; plus ``total`` (until the result was ready).
        plane: the data plane that moved the bytes.
    """

    mm_hash: str
    data: np.ndarray
    layout: Layout
    plane: str
    timings: dict[str, float] = field(default_factory=dict)

    ok = True

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def tensor(self):
        """The entry as a torch tensor ``[num_tokens, hidden]`` of ``layout.dtype`` (no copy)."""
        import torch

        dt = getattr(torch, self.layout.dtype)
        return torch.from_numpy(self.data).view(dt).reshape(-1, self.layout.hidden)


@dataclass(frozen=True)
class Held:
    """A fetched entry kept where it landed: READY and pinned in the consumer's region until
    :meth:`ConsumerNode.release_held` (for callers that read the blocks themselves, e.g. another
    process mapping the same ``/dev/shm`` region).

    Attributes:
        mm_hash: the fetched key.
        runs: the landing blocks in the consumer's region, in payload order.
        nbytes: payload size in bytes (the first ``nbytes`` bytes of ``runs``).
        block_bytes: bytes per block of the region.
        local_key / entry_id: the landing entry in the consumer's store (names the release).
        plane / timings: as in :class:`Fetched`.
    """

    mm_hash: str
    runs: tuple[Run, ...]
    nbytes: int
    block_bytes: int
    local_key: str
    entry_id: int
    plane: str
    timings: dict[str, float] = field(default_factory=dict)

    ok = True


Outcome = Fetched | Miss


class ConsumerNode:
    """Fetch entries from producers (see module docstring).

    Args:
        layout: must match the producers' (compatibility hash).
        region_bytes: local landing region in bytes (fetched entries stay there, zero copy, until
            their :class:`Fetched` is dropped).
        security: this node's CURVE key pair (producers' keys come with each ProducerAddress).
        planes: data planes this node can use, best first.
        ack_timeout_s / read_timeout_s / quarantine_s: see :class:`ConsumerConfig`.
        fetch_timeout_s: default overall deadline of one fetch.
        versions: ECTP versions spoken (override only to emulate older/newer nodes).
        region: land into this region instead of a private one (e.g. a ``/dev/shm`` region that
            other processes read); its ``block_bytes`` must be ``layout.block_bytes``,
            ``region_bytes`` is then ignored, and :meth:`close` leaves it to its owner.
        plane_options: plane name → keyword options for that plane's constructor.
        control_options: keyword options for :class:`ZmqControlClient` (heartbeats,
            ``handshake_timeout_s``, frame limits, reconnect intervals).
        session_options: further :class:`ConsumerConfig` fields (``hello_timeout_s``,
            ``retry_backoff_s``, ``retry_backoff_max_s``, ``peer_backoff_s``,
            ``peer_backoff_max_s``, ``request_notifications``).
        control: fetch over this control client instead of the ZeroMQ/CURVE one built from
            ``security`` (e.g. ``ectransport.control.memory``'s in-memory pair in tests about
            node logic); the node closes it.
        require_binding: refuse a producer whose Welcome declares no data-plane endpoint (an
            ectransport before plugin API 2, or a producer trying to make its grants unbound, so
            that they could name any agent or address). Default True; False accepts such grants
            unbound, as before.
        observer: optional ``(event, fields) -> None`` for metrics and logs, called on the thread
            driving the node — its I/O thread, or a :meth:`fetch` caller running its own fetch —
            (keep it cheap; do not fetch from it or close the node; one that raises is logged and
            ignored): ``fetch`` once per
            outcome (``outcome`` ok|miss, ``reason``, ``seconds`` since the fetch started,
            ``transfer_s``, ``nbytes``, ``plane``, ``descriptors`` = landing runs, ``peer``,
            ``session_id``, ``mm_hash`` (12 chars), ``grant_id``), and the session's
            ``peer_quarantined`` / ``peer_lifted`` / ``transfer_quarantined``. More with
            :meth:`add_observer`.

    Raises:
        ConfigError: bad settings (unknown option names included).
        PlaneUnavailable: a requested plane cannot run here.
    """

    def __init__(
        self,
        *,
        layout: Layout = Layout(),
        region_bytes: int = 256 << 20,
        security: Security,
        planes: tuple[str, ...] = ("nixl",),
        ack_timeout_s: float = 2.0,
        read_timeout_s: float = 20.0,
        quarantine_s: float = 60.0,
        fetch_timeout_s: float = 30.0,
        node_id: str | None = None,
        versions: tuple[int, ...] = SUPPORTED_VERSIONS,
        region: BlockRegion | None = None,
        plane_options: Mapping[str, Mapping[str, Any]] | None = None,
        control_options: Mapping[str, Any] | None = None,
        session_options: Mapping[str, Any] | None = None,
        observer: Callable[[str, dict[str, Any]], None] | None = None,
        require_binding: bool = True,
        control: ControlClient | None = None,
    ):
        from ectransport.control.zmqctl import ZmqControlClient

        self._observers: list[Callable[[str, dict[str, Any]], None]] = \
            [observer] if observer is not None else []
        self._started: dict[tuple[str, str], float] = {}  # (conn, mm_hash) -> fetch start

        self.layout = layout
        self.node_id = node_id or f"consumer-{uuid.uuid4().hex[:8]}"
        self._own_region = region is None
        self.region = region_for(layout, region_bytes, region)
        self.store = BlockStore(self.region.num_blocks, layout.block_bytes)
        self.fetch_timeout_s = fetch_timeout_s
        extra = dict(session_options or {})
        allowed = {f.name for f in dataclasses.fields(ConsumerConfig)} - {
            "node_id", "compat_hash", "planes", "versions", "ack_timeout_s", "read_timeout_s",
            "quarantine_s", "localities", "mem_kinds"}
        if unknown := sorted(set(extra) - allowed):
            raise ConfigError(f"unknown session option(s) {unknown}; known: {sorted(allowed)}")
        self._planes: dict[str, DataTransport] = {}
        self._control: ControlClient | None = None  # set below; None only if __init__ fails
        try:
            for name in planes:
                opts = dict((plane_options or {}).get(name, {}))
                self._planes[name] = load_plane(name)(
                    node_id=self.node_id, region=self.region,
                    identity=identity_of(security.public_key), **opts)
            self._control = control if control is not None else ZmqControlClient(
                secret_key=security.secret_key, public_key=security.public_key,
                insecure=security.insecure, **dict(control_options or {}))
            localities = tuple((n, p.locality()) for n, p in self._planes.items())
        except BaseException:
            self._close_resources()
            raise
        self.config = ConsumerConfig(node_id=self.node_id, compat_hash=layout.compat_hash,
                                     planes=tuple(planes), ack_timeout_s=ack_timeout_s,
                                     read_timeout_s=read_timeout_s, quarantine_s=quarantine_s,
                                     versions=tuple(versions), localities=localities,
                                     mem_kinds=(getattr(self.region, "mem_kind", "DRAM"),),
                                     **extra)
        self._producers: dict[str, ProducerAddress] = {}  # conn -> where it was dialed
        self.require_binding = require_binding
        self._sessions: dict[str, ConsumerSession] = {}
        self._waiters: dict[tuple[str, str], list[Future]] = {}
        self._hold: weakref.WeakSet[Future] = weakref.WeakSet()  # futures of submit_held
        self._inbox: collections.deque = collections.deque()
        self._connecting: dict[str, list[tuple[Future, float]]] = {}
        self._stop = threading.Event()
        # Whoever holds _drive runs _step (the sessions, the control client and the planes are
        # used by one thread at a time; the lock is also the memory barrier ZeroMQ asks for when
        # a socket changes threads). _kick un-parks the I/O thread.
        self._drive = threading.Lock()
        self._kick = threading.Event()
        self._brief = False  # the I/O thread holds _drive only for a non-blocking step
        self._closed = False  # set under _drive by the I/O thread's shutdown
        self._thread = threading.Thread(target=self._run, name=f"ect-{self.node_id}", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------------------------
    def submit(self, producer: ProducerAddress, mm_hash: str, *,
               timeout_s: float | None = None) -> Future:
        """Start a fetch; the Future resolves to :class:`Fetched` or :class:`Miss` by the deadline.

        The Future holds its result: a :class:`Fetched` keeps its landing blocks until both the
        result and the Future are dropped (pipelined callers should drop each Future once done).
        """
        fut: Future = Future()
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.fetch_timeout_s)
        self._enqueue(("fetch", producer, mm_hash, deadline, fut))
        return fut

    def submit_held(self, producer: ProducerAddress, mm_hash: str, *,
                    timeout_s: float | None = None) -> Future:
        """Like :meth:`submit`, but the Future resolves to :class:`Held` (or :class:`Miss`): the
        landed bytes stay in this node's region, pinned, until :meth:`release_held`."""
        fut: Future = Future()
        self._hold.add(fut)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.fetch_timeout_s)
        self._enqueue(("fetch", producer, mm_hash, deadline, fut))
        return fut

    def release_held(self, held: Held) -> None:
        """Give back the blocks of a :class:`Held` (any thread; once per Held)."""
        if self._stop.is_set():
            return
        self._enqueue(("release_held", held.local_key, "", held.entry_id, None))

    def connect(self, producer: ProducerAddress, *, timeout_s: float = 5.0) -> str:
        """Connect, authenticate and negotiate with a producer now (fetches do this lazily).

        Returns:
            The negotiated data plane.

        Raises:
            AuthError: CURVE failed (unknown client key, "producer key mismatch", plain/CURVE).
            VersionError: no common protocol version.
            NoCommonPlane: no data plane in common (the message names both lists).
            ProtocolError: compatibility hash mismatch or another refusal.
            ECTransportError: no Welcome within ``timeout_s`` (producer unreachable or stopped),
                or the producer is quarantined after recent failures.
        """
        fut: Future = Future()
        self._enqueue(("connect", producer, "", time.monotonic() + timeout_s, fut))
        return fut.result(timeout=timeout_s + 5.0)

    def fetch(self, producer: ProducerAddress, mm_hash: str, *,
              timeout_s: float | None = None) -> Outcome:
        """Fetch one entry, blocking until it landed or missed (never past the deadline).

        When nothing else is in flight, the calling thread drives the fetch itself (see the
        module docstring); otherwise the fetch joins the I/O thread's work like :meth:`submit`.
        Either way the result is the same :class:`Fetched` or :class:`Miss`.
        """
        if self._stop.is_set():
            return Miss(mm_hash, MissReason.INTERNAL, "consumer closed")
        t = timeout_s if timeout_s is not None else self.fetch_timeout_s
        fut: Future = Future()
        deadline = time.monotonic() + t
        if threading.current_thread() is not self._thread and (
                self._drive.acquire(blocking=False)
                or (self._brief and self._drive.acquire(timeout=_BRIEF_WAIT_S))):
            try:  # the I/O thread is parked (or between steps): drive this fetch here
                if self._stop.is_set():
                    return Miss(mm_hash, MissReason.INTERNAL, "consumer closed")
                self._drive_until(producer, mm_hash, deadline, fut)
                wake = not self._idle() or self._stop.is_set()
            finally:
                self._drive.release()
            if wake:
                self._wake_loop()  # what this caller leaves behind is the I/O thread's
        else:
            self._enqueue(("fetch", producer, mm_hash, deadline, fut))
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
        except concurrent.futures.TimeoutError:  # pragma: no cover - the loop guarantees an outcome
            return Miss(mm_hash, MissReason.TIMEOUT, "no outcome from the consumer loop")

    def plane_transports(self) -> dict[str, str]:
        return {n: p.describe_transport() for n, p in self._planes.items()}

    def plane(self, name: str) -> DataTransport:
        """The data plane ``name`` this node fetches with (its counters, capabilities; for
        diagnostics and tests). The node owns it: do not close it or drive transfers on it.

        Raises:
            KeyError: the node was not configured with that plane.
        """
        return self._planes[name]

    def session(self, producer: ProducerAddress | str) -> ConsumerSession | None:
        """The session with ``producer`` (a ProducerAddress or its ``"host:port"`` key), or None
        if there is none now (never dialed, or dropped after a terminal failure). For diagnostics
        and tests: the node's thread drives it — read its state (``failed``, ``plane``,
        ``fetch_states()``), never feed it events."""
        key = producer.key if isinstance(producer, ProducerAddress) else producer
        return self._sessions.get(key)

    def add_observer(self, observer: Callable[[str, dict[str, Any]], None]) -> None:
        """Also tell ``observer`` what happens (see the ``observer`` argument); any thread."""
        self._observers = [*self._observers, observer]

    def stats(self) -> dict[str, int]:
        """Gauges of this consumer (any thread): ``producers`` (sessions), ``in_flight`` fetches,
        ``quarantined_peers`` (producers in their backoff now), ``quarantined_transfers`` (timed-
        out reads whose landing blocks are held until the DMA can no longer land),
        ``free_blocks`` of the landing region."""
        from ectransport.session.consumer import FetchState

        for _ in range(10):  # the loop thread mutates the sessions; retry a torn read
            try:
                sessions = list(self._sessions.values())
                now = time.monotonic()
                states = [st for s in sessions for st in s.fetch_states().values()]
                return {"producers": len(sessions),
                        "in_flight": sum(st is not FetchState.QUARANTINED for st in states),
                        "quarantined_peers": sum(now < s.blocked_until for s in sessions),
                        "quarantined_transfers": sum(st is FetchState.QUARANTINED for st in states),
                        "free_blocks": self.store.free_blocks}
            except RuntimeError:
                time.sleep(0.001)
        return {"producers": 0, "in_flight": 0, "quarantined_peers": 0,
                "quarantined_transfers": 0, "free_blocks": self.store.free_blocks}

    def snapshot(self) -> dict[str, Any]:
        """What a metrics exporter reads: ``role`` ("consumer"), ``node_id``, ``stats`` (as
        :meth:`stats`), ``planes`` (plane name → transport underneath)."""
        return {"role": "consumer", "node_id": self.node_id, "stats": self.stats(),
                "planes": self.plane_transports()}

    def close(self) -> None:
        """Stop; in-flight fetches end as misses, handles are released. Idempotent.

        The landing region stays mapped while a :class:`Fetched` still refers to it."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._control is not None:
            self._wake_loop()
        self._thread.join(timeout=10.0)
        self._close_resources()

    def __enter__(self) -> ConsumerNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        control = self._control
        assert control is not None
        fresh = True  # events may have queued while parked: step once before parking again
        while not self._stop.is_set():
            with self._drive:
                if fresh or not self._idle():
                    self._brief = fresh  # a non-blocking step: a fetch() may wait for the lock
                    self._guarded_step(control, wait=0.0 if fresh else None)
                    self._brief = fresh = False
                    if not self._idle():
                        continue
                park_s = self._idle_timeout()
            # Nothing in flight: park without the drive lock so that a caller of fetch() can drive
            # its own fetch; submit()/release/close kick us awake.
            self._kick.wait(park_s)
            self._kick.clear()
            fresh = True
        with self._drive:
            self._shutdown()

    def _shutdown(self) -> None:
        now = time.monotonic()
        for s in list(self._sessions.values()):
            self._execute(s, s.close(), now)
        self._closed = True  # before the drain: see _enqueue
        self._fail_inbox()
        for waiters in self._connecting.values():
            for fut, _ in waiters:
                if not fut.done():
                    fut.set_exception(ECTransportError("consumer closed"))

    def _fail_inbox(self) -> None:
        """After shutdown (drive lock held): every queued fetch misses, every connect fails."""
        while self._inbox:
            kind, _, mm, _, fut = self._inbox.popleft()
            if kind == "fetch":
                if not fut.done():
                    fut.set_result(Miss(mm, MissReason.INTERNAL, "consumer closed"))
            elif kind == "connect" and not fut.done():
                fut.set_exception(ECTransportError("consumer closed"))

    def _enqueue(self, item: tuple) -> None:
        """Queue work for whoever drives the node and wake the I/O thread. Once the node has shut
        down nobody drives it: the item is failed here (the shutdown sets ``_closed`` before its
        own drain, so an item appended before that drain is failed by it, any later one here)."""
        self._inbox.append(item)
        if self._closed:
            with self._drive:
                self._fail_inbox()
        else:
            self._wake_loop()

    def _guarded_step(self, control: ControlClient, wait: float | None = None) -> None:
        try:
            self._step(control, wait)
        except Exception:
            log.exception("unexpected consumer loop error (continuing)")
            time.sleep(0.01)

    def _drive_until(self, producer: ProducerAddress, mm_hash: str, deadline: float,
                     fut: Future) -> None:
        """Start a fetch and run the loop on the calling thread (drive lock held) until ``fut``
        is resolved, the node stops or the deadline is well past; the I/O thread takes over
        whatever is left. Events that queued while the loop was parked are handled in the
        first poll after the XferReq is sent (the session copes with them at any point)."""
        control = self._control
        assert control is not None
        try:
            self._start(producer, mm_hash, deadline, fut, time.monotonic())
        except Exception as e:  # as the I/O thread would: log, and this fetch ends as a miss
            log.exception("unexpected error starting a fetch (continuing)")
            self._resolve(producer.key, Miss(mm_hash, MissReason.INTERNAL,
                                             f"{type(e).__name__}: {e}"))
            return
        limit = deadline + 1.0
        while not fut.done() and not self._stop.is_set() and time.monotonic() < limit:
            self._guarded_step(control)

    def _idle(self) -> bool:
        """Nothing queued, connecting or in flight (the I/O thread may park)."""
        return not (self._inbox or self._connecting or self._waiters
                    or any(s.in_flight() for s in self._sessions.values()))

    def _wake_loop(self) -> None:
        """Un-park the I/O thread and interrupt whichever thread is in the control poll."""
        self._kick.set()
        assert self._control is not None
        self._control.wake()

    def _step(self, control: ControlClient, wait: float | None = None) -> None:
        """One round: poll the control plane (``wait`` seconds, default: until the next session
        deadline, or not at all while a transfer is in flight), then the inbox, the events, the
        in-flight transfers and the session timers."""
        if wait is None:
            busy = any(s.reading() for s in self._sessions.values())
            wait = 0.0 if busy else self._idle_timeout()
        events = control.poll(wait)
        now = time.monotonic()
        while self._inbox:
            kind, producer, mm_hash, deadline, fut = self._inbox.popleft()
            if kind == "release":
                self._release(producer, deadline)
            elif kind == "release_held":
                self._release_held(producer, deadline)
            elif kind == "fetch":
                self._start(producer, mm_hash, deadline, fut, now)
            else:
                self._start_connect(producer, deadline, fut, now)
        for ev in events:
            conn = ev.conn if isinstance(ev, (Up, AuthFailed)) else ev.source
            s = self._sessions.get(conn)
            if s is None:
                continue
            if isinstance(ev, Received):
                was = s.welcomed
                self._execute(s, s.on_frame(ev.data, now), now)
                if s.welcomed and not was:
                    assert s.plane is not None  # a Welcome names the plane
                    log.info("producer %s (%s): protocol v%s, data plane %s (%s)", conn,
                             s.producer_id, s.version, s.plane,
                             self._planes[s.plane].describe_transport())
            elif isinstance(ev, Up):
                self._execute(s, s.on_up(now), now)
            elif isinstance(ev, AuthFailed):
                log.info("authentication with producer %s failed: %s", conn, ev.reason)
                self._execute(s, s.on_auth_failed(ev.reason, now), now)
            elif isinstance(ev, Down):
                self._execute(s, s.on_peer_down(now), now)
        for s in list(self._sessions.values()):
            plane = self._planes.get(s.plane) if s.plane else None
            if plane is not None:
                for mm_hash, handle in s.reading():
                    state = plane.check(handle).value
                    t = time.monotonic()  # observed after the check: the validity window's clock
                    why = plane.error_detail(handle) if state == "err" else ""
                    self._execute(s, s.on_read_state(mm_hash, state, t, why), t)
            self._execute(s, s.poll(now), now)
            if s.conn in self._connecting:
                self._check_connecting(s, now)
            if s.failed is not None and not s.in_flight():
                self._drop(s)
        if not self._inbox and any(s.reading() for s in self._sessions.values()):
            # A transfer is still in flight after this round of checks: yield the CPU instead of
            # spinning, so the data plane's progress threads (and the producer, on a small host)
            # can run; the sleep bounds the added latency to ~_BUSY_SLEEP_S (zmq polls have 1 ms
            # granularity). Measured on 2 cores, interleaved: spinning made 64 KiB fetches 5x
            # slower (8.5 vs 1.7 ms p50) and 8.8 MiB ones 1.2x slower.
            time.sleep(_BUSY_SLEEP_S)

    def _idle_timeout(self) -> float:
        ds = [d for s in self._sessions.values() if (d := s.next_deadline()) is not None]
        ds += [d for waiters in self._connecting.values() for _, d in waiters]
        if not ds:
            return 0.1
        return min(0.1, max(0.0, min(ds) - time.monotonic()))

    def _start(self, producer: ProducerAddress, mm_hash: str, deadline: float, fut: Future,
               now: float) -> None:
        key = (producer.key, mm_hash)
        waiters = self._waiters.setdefault(key, [])
        waiters.append(fut)
        if len(waiters) > 1:  # the same fetch is already in flight: join it
            return
        self._started[key] = now
        try:
            s = self._session_for(producer, now)
        except Exception as e:
            miss = Miss(mm_hash, MissReason.INTERNAL, f"cannot connect: {e}")
            self._observe_outcome(producer.key, "", miss, now)
            self._resolve(producer.key, miss)
            return
        self._execute(s, s.fetch(mm_hash, now, deadline), now)

    def _session_for(self, producer: ProducerAddress, now: float) -> ConsumerSession:
        s = self._sessions.get(producer.key)
        if s is None:
            assert self._control is not None
            conn = self._control.connect(producer.host, producer.port, producer.public_key)
            s = ConsumerSession(self.config, conn, self.store, now, observer=self._observe)
            self._sessions[conn] = s
            self._producers[conn] = producer
        return s

    def _start_connect(self, producer: ProducerAddress, deadline: float, fut: Future,
                       now: float) -> None:
        try:
            s = self._session_for(producer, now)
        except Exception as e:
            fut.set_exception(e)
            return
        if s.blocked_until and not s.welcomed and s.in_flight() == 0 and now >= s.blocked_until:
            self._execute(s, s.fetch_probe(now), now)
        self._connecting.setdefault(s.conn, []).append((fut, deadline))
        self._check_connecting(s, now)

    def _check_connecting(self, s: ConsumerSession, now: float) -> None:
        """Resolve ``connect`` waiters of a session: welcomed, failed, quarantined or late."""
        waiters = self._connecting.get(s.conn, [])
        keep = []
        for fut, deadline in waiters:
            if s.welcomed:
                fut.set_result(s.plane)
            elif s.failed is not None:
                fut.set_exception(_session_error(s.failed))
            elif now < s.blocked_until:
                fut.set_exception(ECTransportError(
                    f"producer {s.conn} is quarantined for {s.blocked_until - now:.1f} s after: "
                    f"{s.blocked_reason}"))
            elif now >= deadline:
                fut.set_exception(ECTransportError(
                    f"no Welcome from producer {s.conn} in time: unreachable, stopped or slow"))
            else:
                keep.append((fut, deadline))
        if keep:
            self._connecting[s.conn] = keep
        else:
            self._connecting.pop(s.conn, None)

    def _execute(self, s: ConsumerSession, cmds: list[Command], now: float) -> None:
        control = self._control
        assert control is not None
        for c in cmds:
            if isinstance(c, Send):
                control.send(c.peer, c.data)
            elif isinstance(c, PostRead):
                assert s.plane is not None  # reads are posted on the negotiated plane only
                plane = self._planes[s.plane]
                try:
                    handle = plane.start(c.prepared, c.plane_grant, c.runs, c.nbytes, c.notif)
                except Exception as e:
                    log.warning("posting transfer of %s failed: %s", c.key[:12], e)
                    self._execute(s, s.on_read_failed(c.key, str(e), now), now)
                else:
                    self._execute(s, s.on_read_posted(c.key, handle, now), now)
                    state = plane.check(handle)  # UCX may have copied inside start() already
                    if state.value != "proc":
                        t = time.monotonic()
                        why = plane.error_detail(handle) if state.value == "err" else ""
                        self._execute(s, s.on_read_state(c.key, state.value, t, why), t)
            elif isinstance(c, Bind):
                self._bind(s, c, now)
            elif isinstance(c, Release):
                self._planes[s.plane].release(c.handle) if s.plane else None
            elif isinstance(c, Report):
                self._report(s, c.outcome, now)

    def _bind(self, s: ConsumerSession, c: Bind, now: float) -> None:
        """Have the negotiated plane validate the producer's declared endpoint (tied to the CURVE
        key this node dialed it with and the host it dialed) and tell the session."""
        producer = self._producers[s.conn]
        plane = self._planes[c.plane]
        old, old_plane = s.binding, s.plane
        if not c.endpoint and self.require_binding:
            self._execute(s, s.on_bind_failed(
                f"the producer declared no {c.plane} endpoint, so its grants could not be bound "
                f"to it (an older ectransport, or a hostile producer); upgrade it, or pass "
                f"require_binding=False to accept unbound grants", now), now)
            return
        try:
            binding = plane.bind_peer(c.endpoint, peer=s.conn, host=producer.host,
                                      identity=identity_of(producer.public_key))
        except Exception as e:
            log.warning("producer %s: %s plane refused its endpoint: %s", s.conn, c.plane, e)
            self._execute(s, s.on_bind_failed(str(e), now), now)
            return
        if old is not None and old is not binding and old_plane in self._planes:
            self._planes[old_plane].unbind_peer(old)  # on the plane that made it
        self._execute(s, s.on_bound(binding, now), now)

    def _report(self, s: ConsumerSession, outcome: Landed | Miss, now: float) -> None:
        self._observe_outcome(s.conn, s.session_id, outcome, now)
        if isinstance(outcome, Landed) and any(
                f in self._hold for f in self._waiters.get((s.conn, outcome.mm_hash), ())):
            self._report_held(s, outcome, now)
            return
        if isinstance(outcome, Landed):
            e = outcome.entry
            if len(e.runs) == 1:  # zero copy: hand out the landing blocks, pinned until released
                self.store.pin_if_ready(e.mm_hash)
                owner = (ctypes.c_uint8 * e.nbytes).from_address(
                    self.region.addr + e.runs[0].start * self.region.block_bytes
                ) if e.nbytes else None
                if owner is not None:
                    # numpy's stub omits ctypes arrays, which do export the buffer protocol
                    data = np.frombuffer(owner, dtype=np.uint8)  # type: ignore[call-overload]
                else:
                    data = np.empty(0, dtype=np.uint8)
                if owner is not None:
                    weakref.finalize(owner, self._release_later, e.mm_hash, e.entry_id)
                else:
                    self._release(e.mm_hash, e.entry_id)
            else:  # scattered landing blocks: one copy into a contiguous array
                data = self.region.read(e.runs, e.nbytes)
                self.store.discard(e.mm_hash)
            timings = dict(outcome.timings)
            timings["total"] = timings.get("landed", 0.0) + (time.monotonic() - now)
            result: Outcome = Fetched(outcome.mm_hash, data, self.layout, outcome.plane, timings)
        else:
            result = outcome
        self._resolve(s.conn, result)

    def _report_held(self, s: ConsumerSession, outcome: Landed, now: float) -> None:
        """Resolve the waiters of a landed fetch when at least one of them is a submit_held: one
        pin per Held; plain waiters get a copy (the pinned blocks are not theirs to release)."""
        e = outcome.entry
        timings = dict(outcome.timings)
        timings["total"] = timings.get("landed", 0.0) + (time.monotonic() - now)
        copy: Fetched | None = None
        for fut in self._waiters.pop((s.conn, outcome.mm_hash), []):
            if fut.done():
                continue
            if fut in self._hold:
                self.store.pin_if_ready(e.mm_hash)
                fut.set_result(Held(outcome.mm_hash, e.runs, e.nbytes, self.store.block_bytes,
                                    e.mm_hash, e.entry_id, outcome.plane, timings))
            else:
                if copy is None:
                    copy = Fetched(outcome.mm_hash, self.region.read(e.runs, e.nbytes),
                                   self.layout, outcome.plane, timings)
                fut.set_result(copy)
        entry = self.store.get(e.mm_hash)
        if entry is not None and entry.entry_id == e.entry_id and entry.pins == 0:
            self.store.discard(e.mm_hash)  # no Held was handed out after all

    def _release_held(self, local_key: str, entry_id: int) -> None:
        e = self.store.get(local_key)
        if e is not None and e.entry_id == entry_id and e.pins > 0:
            self.store.unpin(local_key, entry_id)
            if e.pins == 0:
                self.store.discard(local_key)

    def _release_later(self, local_key: str, entry_id: int) -> None:
        """Finalizer of a Fetched's buffer (any thread): return its blocks now if no thread is
        driving the node (no wake-up), else via the inbox."""
        if self._stop.is_set():
            return
        if self._drive.acquire(blocking=False):  # never blocks: a finalizer may run anywhere
            try:
                self._release(local_key, entry_id)
            finally:
                self._drive.release()
            return
        # Someone drives: its next step takes this from the inbox (a driving caller wakes the I/O
        # thread when it leaves work behind). No wake-up from here: a finalizer can run inside
        # the locks a wake-up takes (garbage collection at any point), which would deadlock.
        self._inbox.append(("release", local_key, "", entry_id, None))

    def _release(self, local_key: str, entry_id: int) -> None:
        e = self.store.get(local_key)
        if e is not None and e.entry_id == entry_id:
            self.store.unpin(local_key, entry_id)
            self.store.discard(local_key)

    def _resolve(self, conn: str, result: Outcome) -> None:
        for fut in self._waiters.pop((conn, result.mm_hash), []):
            if not fut.done():
                fut.set_result(result)

    def _drop(self, s: ConsumerSession) -> None:
        self._sessions.pop(s.conn, None)
        self._producers.pop(s.conn, None)
        assert self._control is not None
        self._control.disconnect(s.conn)
        if s.plane and s.binding is not None:  # drops only this session's data-plane state
            self._planes[s.plane].unbind_peer(s.binding)

    def _close_resources(self) -> None:
        if self._control is not None:
            self._control.close()
        for p in self._planes.values():
            p.close()
        self._planes.clear()
        if self._own_region:
            self.region.close()


    def _observe(self, event: str, fields: dict[str, Any]) -> None:
        for obs in self._observers:
            try:
                obs(event, fields)
            except Exception:
                log.exception("observer failed on %s (ignored)", event)

    def _observe_outcome(self, conn: str, session_id: str, outcome: Landed | Miss,
                         now: float) -> None:
        """One ``fetch`` event and one log line per outcome, with the transfer's identifiers."""
        started = self._started.pop((conn, outcome.mm_hash), None)
        if not self._observers and not log.isEnabledFor(logging.DEBUG):
            return
        fields: dict[str, Any] = {"peer": conn, "session_id": session_id,
                                  "mm_hash": outcome.mm_hash[:12], "grant_id": -1,
                                  "seconds": (now - started) if started is not None else None}
        if isinstance(outcome, Landed):
            t = outcome.timings
            fields.update(grant_id=outcome.grant_id, outcome="ok", reason="", plane=outcome.plane,
                          nbytes=outcome.entry.nbytes, descriptors=len(outcome.entry.runs),
                          transfer_s=(t["landed"] - t.get("posted", t.get("ack", 0.0)))
                          if "landed" in t else None)
            log.debug("fetched %d bytes in %d runs via %s", outcome.entry.nbytes,
                      len(outcome.entry.runs), outcome.plane, extra=fields)
        else:
            fields.update(outcome="miss", reason=outcome.reason.value, detail=outcome.detail)
            log.debug("miss: %s: %s", outcome.reason.value, outcome.detail, extra=fields)
        self._observe("fetch", fields)


def _session_error(miss: Miss) -> ECTransportError:
    """The typed exception for a session-wide failure (see :meth:`ConsumerNode.connect`)."""
    if miss.reason is MissReason.AUTH:
        return AuthError(miss.detail)
    if miss.reason is MissReason.VERSION:
        return VersionError(miss.detail)
    if miss.reason is MissReason.INCOMPATIBLE and "no common data plane" in miss.detail:
        return NoCommonPlane(miss.detail)
    return ProtocolError(miss.detail)
