"""ConsumerDriver: the consumer's sessions driven over a control client and data planes.

    driver = ConsumerDriver(parts, store, layout, config)
    driver.post(StartFetch(producer, mm_hash, deadline, future))   # any thread
    driver.step()                        # the owning thread: one bounded round

One session per producer connection (a :class:`FetchSession`: ECTP's ConsumerSession unless
``new_session`` makes another kind). A step polls the control client, feeds its events to their
sessions, takes the typed inbox, checks the transfers in flight, runs the sessions' timers; every
command a session returns is performed by the :class:`~ectransport.node.executor.Executor` and
what the planes answer is fed back in the same loop (:meth:`ConsumerDriver._run`), never by a
nested call. Outcomes resolve the callers' futures (:class:`~ectransport.node.outcomes.Outcomes`).

Ownership: the driver owns no thread, and exactly one thread at a time may call :meth:`step`,
:meth:`shutdown` and the queries (a :class:`~ectransport.node.ConsumerNode`: its I/O thread).
:meth:`post` and :meth:`release_later` may be called from any thread. Fleet trust (``trust``):
each step refreshes it on this thread and fails the sessions it no longer admits.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from ectransport.control.base import AuthFailed, ControlClient, Down, Received, Up
from ectransport.errors import (
    AuthError,
    ECTransportError,
    NoCommonPlane,
    ProtocolError,
    VersionError,
)
from ectransport.node.common import Layout
from ectransport.node.driver import Observers, Parts
from ectransport.node.executor import Executor, Feedback, feed
from ectransport.node.fetch_session import FetchSession, batching, sized
from ectransport.node.inbox import (
    Connect,
    InboxItem,
    ReleaseFetched,
    ReleaseHeld,
    Snapshot,
    StartBatch,
    StartFetch,
)
from ectransport.node.outcomes import Outcomes
from ectransport.node.results import ProducerAddress
from ectransport.node.trust import NodeTrust, TrustingFetcher
from ectransport.protocol import FrameError, Status, Ticket, Welcome, decode
from ectransport.session import (
    Command,
    ConsumerConfig,
    ConsumerSession,
    FetchState,
    Landed,
    Miss,
    MissReason,
)
from ectransport.store import BlockStore

log = logging.getLogger("ectransport.node.consumer")

#: Longest wait of a step with nothing due (events queue in the control client meanwhile), s.
MAX_WAIT_S = 0.1


class ConsumerDriver:
    """Drives the consumer's fetch sessions (module docstring).

    Args:
        parts: the control client, planes and landing region it drives and closes.
        store: the landing region's block store. layout: what fetched bytes mean.
        config: ECTP session settings (used by the default ``new_session``).
        observers: told what happens (see :class:`~ectransport.node.ConsumerNode`).
        require_binding: see :class:`~ectransport.node.ConsumerNode`.
        new_session: ``(conn, now) -> FetchSession``; default ECTP's ConsumerSession.
        zero_copy: hand out landed bytes in place (pinned until the result is collected);
            False copies them out and frees the landing blocks at once.
        clock: the monotonic clock (the validity window's: see ConsumerSession).
        trust: fleet trust (:class:`~ectransport.node.trust.NodeTrust`): ECTP sessions check
            the producer's certificate with its admission.
    """

    def __init__(self, parts: Parts[ControlClient], store: BlockStore, layout: Layout,
                 config: ConsumerConfig, *, observers: Observers | None = None,
                 require_binding: bool = True,
                 new_session: Callable[[str, float], FetchSession] | None = None,
                 zero_copy: bool = True, clock: Callable[[], float] = time.monotonic,
                 trust: NodeTrust | None = None):
        self.parts = parts
        self.trust = trust
        self.control = parts.control
        self.planes = parts.planes
        self.store = store
        self.config = config
        self.clock = clock
        self.observers = observers if observers is not None else Observers()
        self.sessions: dict[str, FetchSession] = {}
        self.inbox: collections.deque[InboxItem] = collections.deque()
        self._new_session = new_session or self._ectp_session
        self._producers: dict[str, ProducerAddress] = {}  # conn -> where it was dialed
        self._connecting: dict[str, list[Connect]] = {}
        self._refused: dict[str, type[ECTransportError]] = {}  # conn -> typed session error
        self.outcomes = Outcomes(store, parts.region, layout, self.observers,
                                 zero_copy=zero_copy, clock=clock,
                                 release_later=self.release_later)
        self.executor = Executor(parts.control, parts.planes, parts.region, self._producers,
                                 self._report, require_binding=require_binding, clock=clock)
        self._gate = threading.Lock()  # post() vs shutdown(): nothing is queued after the drain
        self.closed = False  #: set (under the gate) once shut down

    def _ectp_session(self, conn: str, now: float) -> FetchSession:
        t = self.trust
        return ConsumerSession(self.config, conn, self.store, now, observer=self.observers,
                               admission=t.admission if t is not None else None,
                               producer_key=self._producers[conn].public_key or "")

    # -- any thread ----------------------------------------------------------------------------
    def post(self, item: InboxItem) -> None:
        """Queue a command for the next :meth:`step` (wakes nobody). After :meth:`shutdown` the
        item fails at once (a miss, or the ``consumer closed`` error)."""
        with self._gate:
            if not self.closed:
                self.inbox.append(item)
                return
        self._fail(item)

    def release_later(self, local_key: str, entry_id: int) -> None:
        """Finalizer of a zero-copy result (any thread, possibly inside a garbage collection):
        queue its release for the next step; never blocks, never wakes anyone (a finalizer may
        run inside the locks a wake-up takes)."""
        self.inbox.append(ReleaseFetched(local_key, entry_id))

    # -- queries (the owning thread) -----------------------------------------------------------
    def busy(self) -> bool:
        """A data-plane transfer is in flight (its state is checked every step)."""
        return any(s.reading() for s in self.sessions.values())

    def idle(self) -> bool:
        """Nothing queued, connecting or in flight."""
        return not (self.inbox or self._connecting or self.outcomes
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
        ``free_blocks``, ``offer_reads``, ``offers_held`` and, with fleet trust, ``trust_*``
        (:meth:`~ectransport.node.trust.NodeTrust.stats`) (see ConsumerNode.stats)."""
        now = self.clock()
        sessions = list(self.sessions.values())
        states = [st for s in sessions for st in s.fetch_states().values()]
        return {"producers": len(sessions),
                "in_flight": sum(st is not FetchState.QUARANTINED for st in states),
                "quarantined_peers": sum(now < s.blocked_until for s in sessions),
                "quarantined_transfers": sum(st is FetchState.QUARANTINED for st in states),
                "free_blocks": self.store.free_blocks,
                "offer_reads": sum(getattr(s, "offer_reads", 0) for s in sessions),
                "offers_held": sum(getattr(s, "offers_held", 0) for s in sessions),
                **(self.trust.stats() if self.trust is not None else {})}

    # -- driving (the owning thread) -----------------------------------------------------------
    def step(self, now: float | None = None, *, wait_s: float | None = 0.0,
             hold_results: bool = False) -> None:
        """One round: poll the control client (``wait_s`` seconds; None: until the next
        deadline, or not at all while a transfer is in flight), then its events (first: an
        ``Offer`` received meanwhile must be known when a fetch with its ticket starts), the
        inbox, the transfers in flight and the session timers. ``now`` defaults to the clock
        after the poll (pass it only with ``wait_s=0``).

        The step's outcomes reach their futures at its end; with ``hold_results`` they wait for
        the caller's :meth:`Outcomes.deliver <ectransport.node.outcomes.Outcomes.deliver>` or
        the next step's, just before its poll: a thread that blocks right after delivering
        leaves the interpreter to the callers it woke, instead of taking turns with them."""
        if wait_s is None:
            wait_s = 0.0 if self.busy() else self.idle_timeout()
        self.outcomes.deliver()
        events = self.control.poll(wait_s)
        if now is None:
            now = self.clock()
        recheck = self.trust is not None and self.trust.refresh(now)
        for ev in events:
            self._on_event(ev, now)
        if recheck or (self.trust is not None and self.trust.renewed):
            assert self.trust is not None
            self._recheck(now, self.trust.renewed)
            self.trust.renewed = False
        while self.inbox:
            self._take(self.inbox.popleft(), now)
        for s in list(self.sessions.values()):
            plane = self.planes.get(s.plane) if s.plane else None
            if plane is not None:
                for key, handle in s.reading():
                    state = plane.check(handle).value
                    if state != "proc":
                        t = self.clock()  # observed after the check: the validity window's
                        why = plane.error_detail(handle) if state == "err" else ""
                        self._run(s, s.on_read_state(key, state, t, why), t)
            self._run(s, s.poll(now), now)
            if s.conn in self._connecting:
                self._check_connecting(s, now)
            if s.failed is not None and not s.in_flight():
                self._drop(s)
        if not hold_results:
            self.outcomes.deliver()

    def _recheck(self, now: float, renewed: bool) -> None:
        """Tell the sessions whose producer fleet trust no longer admits (revoked: they fail;
        else they say Hello again), and, when this node's certificate was re-issued, every
        session (they say Hello again with it)."""
        assert self.trust is not None
        lost = dict(self.trust.admission.recheck())
        for conn, s in list(self.sessions.items()):
            if isinstance(s, TrustingFetcher) and (conn in lost or renewed):
                self._run(s, s.on_trust_change(lost.get(conn), now), now)

    def _run(self, s: FetchSession, cmds: list[Command], now: float) -> None:
        """Perform ``cmds`` and everything that follows from them: each plane answer is fed to
        the session and the commands it returns are performed in turn, until none is left; then
        the sends leave."""
        work: collections.deque[Feedback] = collections.deque()
        try:
            work.extend(self.executor.perform(s, cmds, now))
            while work:
                work.extend(self.executor.perform(s, feed(s, work.popleft(), now), now))
        except BaseException:
            self.executor.release(s, list(work))  # handles never handed over are not leaked
            raise
        finally:
            self.executor.flush()

    def _report(self, s: FetchSession, outcome: Landed | Miss, now: float) -> None:
        self.outcomes.report(s.conn, s.session_id, outcome, now)

    def shutdown(self) -> None:
        """Close every session (in-flight fetches miss, handles are released), fail what is
        queued; nothing is queued afterwards (:meth:`post` fails it at once)."""
        now = self.clock()
        for s in list(self.sessions.values()):
            self._run(s, s.close(), now)
        with self._gate:
            self.closed = True
        while self.inbox:
            self._fail(self.inbox.popleft())
        for waiters in self._connecting.values():
            for c in waiters:
                if not c.future.done():
                    c.future.set_exception(ECTransportError("consumer closed"))
        self.outcomes.deliver()

    def _fail(self, item: InboxItem) -> None:
        """A command that will never be taken: its fetches miss, its connect fails."""
        closed = "consumer closed"
        match item:
            case StartFetch(mm_hash=mm, future=fut) if not fut.done():
                fut.set_result(Miss(mm, MissReason.INTERNAL, closed))
            case StartBatch(items=items):
                for it in items:
                    if not it.future.done():
                        it.future.set_result(Miss(it.mm_hash, MissReason.INTERNAL, closed))
            case Connect(future=cfut) if not cfut.done():
                cfut.set_exception(ECTransportError(closed))
            case Snapshot(future=sfut) if not sfut.done():
                sfut.set_exception(ECTransportError(closed))

    def _take(self, item: InboxItem, now: float) -> None:
        match item:  # one case per command type (node/inbox.py)
            case StartFetch():
                self._start(item.producer, [item], item.deadline, now)
            case StartBatch():
                self._start(item.producer, list(item.items), item.deadline, now)
            case Connect():
                self._start_connect(item, now)
            case ReleaseFetched(local_key=key, entry_id=eid):
                self.outcomes.release(key, eid)
            case ReleaseHeld(local_key=key, entry_id=eid):
                self.outcomes.release_held(key, eid)
            case Snapshot(future=fut):
                if not fut.done():
                    fut.set_result(self.gauges())

    def _on_event(self, ev: Received[str] | Up | AuthFailed | Down[str], now: float) -> None:
        match ev:
            case Received(source=str() as conn, data=data):
                if (s := self.sessions.get(conn)) is None:
                    return
                was_welcomed, was_failed = s.welcomed, s.failed
                self._run(s, s.on_frame(data, now), now)
                if s.failed is not None and was_failed is None:
                    self._classify_refusal(s, data)
                if s.welcomed and not was_welcomed and s.plane in self.planes:
                    log.info("producer %s (%s): protocol v%s, data plane %s (%s)", conn,
                             s.producer_id, s.version, s.plane,
                             self.planes[s.plane].describe_transport())
            case Up(conn=conn):
                if (s := self.sessions.get(conn)) is not None:
                    self._run(s, s.on_up(now), now)
            case AuthFailed(conn=conn, reason=reason):
                if (s := self.sessions.get(conn)) is not None:
                    log.info("authentication with producer %s failed: %s", conn, reason)
                    self._run(s, s.on_auth_failed(reason, now), now)
            case Down(source=str() as conn):
                if (s := self.sessions.get(conn)) is not None:
                    self._run(s, s.on_peer_down(now), now)

    def _classify_refusal(self, s: FetchSession, frame: bytes) -> None:
        """Name the typed error of a session a frame just failed, from typed fields: a Welcome
        refusing with NACK_INCOMPAT although its compatibility hash equals ours refuses the data
        planes (ECTP §4: the hash is checked first), hence NoCommonPlane."""
        try:
            msg = decode(frame, versions=self.config.versions)
        except FrameError:
            return
        if isinstance(msg, Welcome) and msg.status is Status.NACK_INCOMPAT \
                and msg.compat_hash == self.config.compat_hash:
            self._refused[s.conn] = NoCommonPlane

    # -- fetches and connects ------------------------------------------------------------------
    def _start(self, producer: ProducerAddress, items: list[StartFetch], deadline: float,
               now: float) -> None:
        """Start (or join) fetches from ``producer``: the new ones together — in one
        :meth:`BatchFetch.fetch_many` (one ReqBatch on ECTP v2), else one by one."""
        if any(it.ticket is not None for it in items):
            for ev in self.control.poll(0.0):  # offers that arrived since the step's poll
                self._on_event(ev, now)
        new = [it for it in items if self.outcomes.join(producer.key, it, now)]
        if not new:
            return
        try:
            s = self._session_for(producer, now)
        except Exception as e:
            for it in new:
                self.outcomes.miss(producer.key, it.mm_hash, Miss(
                    it.mm_hash, MissReason.INTERNAL, f"cannot connect: {e}"), now)
            return
        tickets: dict[str, Ticket] = {it.mm_hash: it.ticket for it in new if it.ticket}
        one_sized = sized(s) if len(new) == 1 and new[0].nbytes is not None else None
        many = batching(s)
        if one_sized is not None and new[0].nbytes is not None:
            self._run(s, one_sized.fetch_sized(new[0].mm_hash, new[0].nbytes, now, deadline), now)
        elif many is not None:
            self._run(s, many.fetch_many([it.mm_hash for it in new], now, deadline,
                                         tickets=tickets or None), now)
        else:
            for it in new:
                self._run(s, s.fetch(it.mm_hash, now, deadline), now)

    def _session_for(self, producer: ProducerAddress, now: float) -> FetchSession:
        s = self.sessions.get(producer.key)
        if s is None:
            conn = self.control.connect(producer.host, producer.port, producer.public_key)
            self._producers[conn] = producer  # first: a new session reads the key dialed
            try:
                s = self._new_session(conn, now)
            except BaseException:
                self._producers.pop(conn, None)
                raise
            self.sessions[conn] = s
        return s

    def _start_connect(self, item: Connect, now: float) -> None:
        try:
            s = self._session_for(item.producer, now)
        except Exception as e:
            item.future.set_exception(e)
            return
        if s.blocked_until and not s.welcomed and s.in_flight() == 0 and now >= s.blocked_until:
            self._run(s, s.fetch_probe(now), now)
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
        """The typed exception for a session-wide failure (see ConsumerNode.connect): from what
        the control plane or the refusing Welcome said, else from the miss reason."""
        typed = self._refused.get(conn)
        if typed is None:
            typed = {MissReason.AUTH: AuthError,
                     MissReason.VERSION: VersionError}.get(miss.reason, ProtocolError)
        return typed(miss.detail)

    def _drop(self, s: FetchSession) -> None:
        self.sessions.pop(s.conn, None)
        self._producers.pop(s.conn, None)
        self._refused.pop(s.conn, None)
        if self.trust is not None:
            self.trust.admission.forget(s.conn)
        self.control.disconnect(s.conn)
        if s.plane and s.binding is not None:  # drops only this session's data-plane state
            self.planes[s.plane].unbind_peer(s.binding)
