"""ConsumerDriver: the consumer's sessions driven over a control client and data planes.

    driver = ConsumerDriver(control, planes, region, store, layout, config, own_region=True)
    driver.post(StartFetch(producer, mm_hash, deadline, future))   # any thread
    with driver.lock:
        driver.step()                    # the thread that holds the lock drives: one round

One session per producer connection (a :class:`FetchSession`: ECTP's ConsumerSession unless
``new_session`` makes another kind). A step polls the control client, takes the typed inbox,
matches every control event to its session, polls in-flight transfers on their plane, runs the
sessions' timers, and executes the commands they return in one place (:meth:`execute`, in
:mod:`ectransport.node.consumer_executor`); outcomes resolve the callers' futures. The driver owns
no thread: :class:`ConsumerNode` runs it on its I/O thread or on a caller's, and the vLLM
scheduler may call :meth:`step` from its own loop.

Only the thread holding :attr:`lock` may call :meth:`step` and the other non-thread-safe methods;
:meth:`post` and :meth:`release_later` may be called from anywhere.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from ectransport.control.base import AuthFailed, ControlClient, Down, Received, Up
from ectransport.data.base import DataTransport
from ectransport.errors import (
    AuthError,
    ECTransportError,
    NoCommonPlane,
    ProtocolError,
    VersionError,
)
from ectransport.node.common import Layout
from ectransport.node.consumer_executor import ConsumerExecutor
from ectransport.node.driver import Observers
from ectransport.node.fetch_session import BatchFetch, FetchSession, SizedFetch
from ectransport.node.inbox import (
    Connect,
    InboxItem,
    ReleaseFetched,
    ReleaseHeld,
    Snapshot,
    StartBatch,
    StartFetch,
)
from ectransport.node.results import ProducerAddress
from ectransport.protocol import FrameError, Status, Ticket, Welcome, decode
from ectransport.session import (
    ConsumerConfig,
    ConsumerSession,
    FetchState,
    Miss,
    MissReason,
)
from ectransport.store import BlockRegion, BlockStore

log = logging.getLogger("ectransport.node.consumer")

#: Longest wait of a step with nothing due (events queue in the control client meanwhile), s.
MAX_WAIT_S = 0.1


class ConsumerDriver(ConsumerExecutor):
    """Drives the consumer's fetch sessions (see module docstring).

    Args:
        control / planes / region / own_region / observers: see :class:`Driver`.
        store: the landing region's block store.
        layout: what fetched bytes mean (for :class:`Fetched`).
        config: ECTP session settings (used by the default ``new_session``).
        require_binding: see :class:`ConsumerNode`.
        new_session: ``(conn, now) -> FetchSession``; default ECTP's :class:`ConsumerSession`.
        zero_copy: hand out landed bytes in place (pinned until the result is collected);
            False copies them out and frees the landing blocks at once.
        clock: the monotonic clock (the validity window's: see ConsumerSession).
    """

    def __init__(self, control: ControlClient, planes: dict[str, DataTransport],
                 region: BlockRegion, store: BlockStore, layout: Layout, config: ConsumerConfig,
                 *, own_region: bool, observers: Observers | None = None,
                 require_binding: bool = True,
                 new_session: Callable[[str, float], FetchSession] | None = None,
                 zero_copy: bool = True, clock: Callable[[], float] = time.monotonic):
        super().__init__(control, planes, region, own_region=own_region, observers=observers)
        self.store = store
        self.layout = layout
        self.config = config
        self.require_binding = require_binding
        self.zero_copy = zero_copy
        self.clock = clock
        self._new_session = new_session or self._ectp_session
        self.inbox: collections.deque[InboxItem] = collections.deque()
        self.sessions: dict[str, FetchSession] = {}
        self._producers: dict[str, ProducerAddress] = {}  # conn -> where it was dialed
        self._waiters: dict[tuple[str, str], list[StartFetch]] = {}
        self._started: dict[tuple[str, str], float] = {}  # (conn, mm_hash) -> fetch start
        self._connecting: dict[str, list[Connect]] = {}
        self._refused: dict[str, type[ECTransportError]] = {}  # conn -> typed session error
        #: set (lock held) once the driver shut down: nobody drives it any more
        self.closed = False

    def _ectp_session(self, conn: str, now: float) -> FetchSession:
        return ConsumerSession(self.config, conn, self.store, now, observer=self.observers)

    # -- any thread ----------------------------------------------------------------------------
    def post(self, item: InboxItem) -> None:
        """Queue a command for whoever drives next (atomic; wakes nobody: see ConsumerNode)."""
        self.inbox.append(item)

    def release_later(self, local_key: str, entry_id: int) -> None:
        """Finalizer of a zero-copy Fetched's buffer (any thread): return its blocks now if no
        thread is driving (no wake-up), else through the inbox. Never blocks and never wakes
        anyone: a finalizer can run inside the locks a wake-up takes (garbage collection at any
        point), which would deadlock."""
        if self.closed:
            return
        if self.lock.acquire(blocking=False):
            try:
                self._release(local_key, entry_id)
            finally:
                self.lock.release()
            return
        self.inbox.append(ReleaseFetched(local_key, entry_id))  # the driver's next step

    # -- queries (lock held) -------------------------------------------------------------------
    def busy(self) -> bool:
        """A data-plane transfer is in flight (its state is polled every step)."""
        return any(s.reading() for s in self.sessions.values())

    def idle(self) -> bool:
        """Nothing queued, connecting or in flight (a thread driving this may park)."""
        return not (self.inbox or self._connecting or self._waiters
                    or any(s.in_flight() for s in self.sessions.values()))

    def idle_timeout(self) -> float:
        """Seconds until the next session or connect deadline, at most :data:`MAX_WAIT_S`."""
        ds = [d for s in self.sessions.values() if (d := s.next_deadline()) is not None]
        ds += [c.deadline for waiters in self._connecting.values() for c in waiters]
        if not ds:
            return MAX_WAIT_S
        return min(MAX_WAIT_S, max(0.0, min(ds) - self.clock()))

    def gauges(self) -> dict[str, int]:
        """``producers``, ``in_flight``, ``quarantined_peers``, ``quarantined_transfers``,
        ``free_blocks``, ``offer_reads``, ``offers_held`` (see :meth:`ConsumerNode.stats`), consistent: lock held."""
        now = self.clock()
        sessions = list(self.sessions.values())
        states = [st for s in sessions for st in s.fetch_states().values()]
        return {"producers": len(sessions),
                "in_flight": sum(st is not FetchState.QUARANTINED for st in states),
                "quarantined_peers": sum(now < s.blocked_until for s in sessions),
                "quarantined_transfers": sum(st is FetchState.QUARANTINED for st in states),
                "free_blocks": self.store.free_blocks,
                "offer_reads": sum(getattr(s, "offer_reads", 0) for s in sessions),
                "offers_held": sum(getattr(s, "offers_held", 0) for s in sessions)}

    # -- driving (lock held) -------------------------------------------------------------------
    def step(self, now: float | None = None, *, wait_s: float | None = 0.0) -> None:
        """One round: poll the control client (``wait_s`` seconds; None: until the next session
        deadline, or not at all while a transfer is in flight), then the control events, the
        inbox, the in-flight transfers and the session timers. ``now`` defaults to the clock
        after the poll (pass it only with ``wait_s=0``). Events come before the inbox: an
        ``Offer`` received while the node was idle must be known when a fetch with its ticket
        starts (ECTP v2 §10)."""
        if wait_s is None:
            wait_s = 0.0 if self.busy() else self.idle_timeout()
        events = self.control.poll(wait_s)
        if now is None:
            now = self.clock()
        for ev in events:
            self._on_event(ev, now)
        while self.inbox:
            self._take(self.inbox.popleft(), now)
        for s in list(self.sessions.values()):
            plane = self.planes.get(s.plane) if s.plane else None
            if plane is not None:
                for key, handle in s.reading():
                    state = plane.check(handle).value
                    t = self.clock()  # observed after the check: the validity window's clock
                    why = plane.error_detail(handle) if state == "err" else ""
                    self.execute(s, s.on_read_state(key, state, t, why), t)
            self.execute(s, s.poll(now), now)
            if s.conn in self._connecting:
                self._check_connecting(s, now)
            if s.failed is not None and not s.in_flight():
                self._drop(s)

    def start_fetch(self, item: StartFetch, now: float) -> None:
        """Start (or join) a fetch now instead of through the inbox (a caller driving its own)."""
        try:
            self._start(item, now)
        except Exception as e:  # as a step would: log, and this fetch ends as a miss
            log.exception("unexpected error starting a fetch (continuing)")
            self._resolve(item.producer.key, Miss(item.mm_hash, MissReason.INTERNAL,
                                                  f"{type(e).__name__}: {e}"))

    def shutdown(self) -> None:
        """Close every session (in-flight fetches miss, handles are released), fail what is
        queued; afterwards :attr:`closed` is set and nothing drives the driver any more."""
        now = self.clock()
        for s in list(self.sessions.values()):
            self.execute(s, s.close(), now)
        self.closed = True  # before the drain: see ConsumerNode._enqueue
        self.fail_inbox()
        for waiters in self._connecting.values():
            for c in waiters:
                if not c.future.done():
                    c.future.set_exception(ECTransportError("consumer closed"))

    def fail_inbox(self) -> None:
        """After shutdown: every queued fetch misses, every connect fails."""
        while self.inbox:
            match self.inbox.popleft():
                case StartFetch(mm_hash=mm, future=fut) if not fut.done():
                    fut.set_result(Miss(mm, MissReason.INTERNAL, "consumer closed"))
                case StartBatch(items=items):
                    for it in items:
                        if not it.future.done():
                            it.future.set_result(Miss(it.mm_hash, MissReason.INTERNAL,
                                                      "consumer closed"))
                case Connect(future=cfut) if not cfut.done():
                    cfut.set_exception(ECTransportError("consumer closed"))
                case Snapshot(future=sfut) if not sfut.done():
                    sfut.set_result(self.gauges())
                case _:
                    pass

    def _take(self, item: InboxItem, now: float) -> None:
        match item:  # one case per command type (node/inbox.py)
            case StartFetch():
                self._start(item, now)
            case StartBatch():
                self._start_many(item, now)
            case Connect():
                self._start_connect(item, now)
            case ReleaseFetched(local_key=key, entry_id=eid):
                self._release(key, eid)
            case ReleaseHeld(local_key=key, entry_id=eid):
                self._release_held(key, eid)
            case Snapshot(future=fut):
                if not fut.done():
                    fut.set_result(self.gauges())

    def _on_event(self, ev: Received[str] | Up | AuthFailed | Down[str], now: float) -> None:
        match ev:
            case Received(source=str() as conn, data=data):
                s = self.sessions.get(conn)
                if s is None:
                    return
                was_welcomed, was_failed = s.welcomed, s.failed
                self.execute(s, s.on_frame(data, now), now)
                if s.failed is not None and was_failed is None:
                    self._classify_refusal(s, data)
                if s.welcomed and not was_welcomed and s.plane in self.planes:
                    log.info("producer %s (%s): protocol v%s, data plane %s (%s)", conn,
                             s.producer_id, s.version, s.plane,
                             self.planes[s.plane].describe_transport())
            case Up(conn=conn):
                if (s := self.sessions.get(conn)) is not None:
                    self.execute(s, s.on_up(now), now)
            case AuthFailed(conn=conn, reason=reason):
                if (s := self.sessions.get(conn)) is not None:
                    log.info("authentication with producer %s failed: %s", conn, reason)
                    self.execute(s, s.on_auth_failed(reason, now), now)
            case Down(source=str() as conn):
                if (s := self.sessions.get(conn)) is not None:
                    self.execute(s, s.on_peer_down(now), now)

    def _classify_refusal(self, s: FetchSession, frame: bytes) -> None:
        """Name the typed error of a session that a frame just failed, from typed fields: a
        Welcome refusing with NACK_INCOMPAT although its compatibility hash equals ours refuses
        the data planes (ECTP §4: the hash is checked first), hence NoCommonPlane."""
        try:
            msg = decode(frame, versions=self.config.versions)
        except FrameError:
            return
        if isinstance(msg, Welcome) and msg.status is Status.NACK_INCOMPAT \
                and msg.compat_hash == self.config.compat_hash:
            self._refused[s.conn] = NoCommonPlane

    # -- fetches and connects ------------------------------------------------------------------
    def _catch_up(self, now: float) -> None:
        """Handle the control events already received (no wait): a fetch with a ticket started
        by a caller between steps must see the offers that arrived while the node was idle."""
        for ev in self.control.poll(0.0):
            self._on_event(ev, now)

    def _start(self, item: StartFetch, now: float) -> None:
        if item.ticket is not None:
            self._catch_up(now)
        producer, mm_hash = item.producer, item.mm_hash
        key = (producer.key, mm_hash)
        waiters = self._waiters.setdefault(key, [])
        waiters.append(item)
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
        if item.nbytes is not None and isinstance(s, SizedFetch):
            self.execute(s, s.fetch_sized(mm_hash, item.nbytes, now, item.deadline), now)
        elif item.ticket is not None and isinstance(s, BatchFetch):
            self.execute(s, s.fetch_many([mm_hash], now, item.deadline,
                                         tickets={mm_hash: item.ticket}), now)
        else:
            self.execute(s, s.fetch(mm_hash, now, item.deadline), now)

    def start_batch(self, item: StartBatch, now: float) -> None:
        """Start (or join) several fetches now (a caller driving its own; see start_fetch)."""
        try:
            self._start_many(item, now)
        except Exception as e:
            log.exception("unexpected error starting fetches (continuing)")
            for it in item.items:
                self._resolve(item.producer.key, Miss(it.mm_hash, MissReason.INTERNAL,
                                                      f"{type(e).__name__}: {e}"))

    def _start_many(self, item: StartBatch, now: float) -> None:
        """Join the fetches already in flight; start the others together: in one
        :meth:`BatchFetch.fetch_many` (one ReqBatch on ECTP v2), else one by one."""
        producer = item.producer
        if any(it.ticket is not None for it in item.items):
            self._catch_up(now)
        new: list[str] = []
        tickets: dict[str, Ticket] = {}
        for it in item.items:
            key = (producer.key, it.mm_hash)
            waiters = self._waiters.setdefault(key, [])
            waiters.append(it)
            if len(waiters) == 1:
                self._started[key] = now
                new.append(it.mm_hash)
                if it.ticket is not None:
                    tickets[it.mm_hash] = it.ticket
        if not new:
            return
        try:
            s = self._session_for(producer, now)
        except Exception as e:
            for mm_hash in new:
                miss = Miss(mm_hash, MissReason.INTERNAL, f"cannot connect: {e}")
                self._observe_outcome(producer.key, "", miss, now)
                self._resolve(producer.key, miss)
            return
        if isinstance(s, BatchFetch):
            self.execute(s, s.fetch_many(new, now, item.deadline, tickets=tickets or None), now)
        else:
            for mm_hash in new:
                self.execute(s, s.fetch(mm_hash, now, item.deadline), now)

    def _session_for(self, producer: ProducerAddress, now: float) -> FetchSession:
        s = self.sessions.get(producer.key)
        if s is None:
            conn = self.control.connect(producer.host, producer.port, producer.public_key)
            s = self._new_session(conn, now)
            self.sessions[conn] = s
            self._producers[conn] = producer
        return s

    def _start_connect(self, item: Connect, now: float) -> None:
        try:
            s = self._session_for(item.producer, now)
        except Exception as e:
            item.future.set_exception(e)
            return
        if s.blocked_until and not s.welcomed and s.in_flight() == 0 and now >= s.blocked_until:
            self.execute(s, s.fetch_probe(now), now)
        self._connecting.setdefault(s.conn, []).append(item)
        self._check_connecting(s, now)

    def _check_connecting(self, s: FetchSession, now: float) -> None:
        """Resolve ``connect`` waiters of a session: welcomed, failed, quarantined or late."""
        keep = []
        for c in self._connecting.get(s.conn, []):
            if s.welcomed:
                c.future.set_result(s.plane or "")
            elif s.failed is not None:
                c.future.set_exception(self.session_error(s.conn, s.failed))
            elif now < s.blocked_until:
                c.future.set_exception(ECTransportError(
                    f"producer {s.conn} is quarantined for {s.blocked_until - now:.1f} s after: "
                    f"{s.blocked_reason}"))
            elif now >= c.deadline:
                c.future.set_exception(ECTransportError(
                    f"no Welcome from producer {s.conn} in time: unreachable, stopped or slow"))
            else:
                keep.append(c)
        if keep:
            self._connecting[s.conn] = keep
        else:
            self._connecting.pop(s.conn, None)

    def session_error(self, conn: str, miss: Miss) -> ECTransportError:
        """The typed exception for a session-wide failure (see :meth:`ConsumerNode.connect`):
        from what the control plane or the refusing Welcome said, else from the miss reason."""
        typed = self._refused.get(conn)
        if typed is None:
            typed = {MissReason.AUTH: AuthError,
                     MissReason.VERSION: VersionError}.get(miss.reason, ProtocolError)
        return typed(miss.detail)

    def _drop(self, s: FetchSession) -> None:
        self.sessions.pop(s.conn, None)
        self._producers.pop(s.conn, None)
        self._refused.pop(s.conn, None)
        self.control.disconnect(s.conn)
        if s.plane and s.binding is not None:  # drops only this session's data-plane state
            self.planes[s.plane].unbind_peer(s.binding)
