"""The in-process fabric behind :class:`~ectransport.testing.memory.MemoryPlane`: where producer
regions are registered, where transfers are recorded, and the script that decides what each
transfer does (complete, wait, fail, stall, complete out of order).

A transfer is decided when the consumer's plane starts it, by the first of: the one-shot actions
queued with :meth:`MemoryFabric.next` (and its shorthands ``fail_next``, ``stall_next``,
``delay_next``, ``reorder_next``), then the rules added with :meth:`MemoryFabric.script` (in
order; the first that returns an action wins), then the default :class:`Complete` ``()``. Its
outcome is observed at the consumer's ``check``: that is when the bytes land (copied from the
producer's region as it is *then*) and the producer's notification is queued. Actions:

==============================  ==================================================================
``Complete(checks=0, at=None,   DONE at the first ``check`` after ``checks`` checks answered PROC
notify=True)``                  and once the fabric's clock reads ``at`` or later; ``notify=False``
                                loses the producer's notification (the consumer's ``XferDone`` or
                                the lease must end the grant). ``Delay`` is the same class.
``Fail(detail, checks=0,        ERR with ``detail`` (what ``error_detail`` says), with the same
at=None)``                      timing; nothing lands.
``Stall()``                     PROC until :meth:`MemoryTransfer.resume` (with another action).
``Reorder(size, order=None)``   one object for ``size`` transfers: each completes only once all
                                ``size`` were posted and those before it in ``order`` (posting
                                positions; default: reverse posting order) are over.
==============================  ==================================================================

Time is a parameter: give the fabric a clock (``MemoryFabric(clock=ManualClock())``) and move it
yourself. Nothing here sleeps or starts a thread; :meth:`MemoryFabric.wait_for` waits, with a
deadline, for another thread (a node's I/O thread) to post or finish transfers.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ectransport.plugin import Span, TransferModel, XferState, segment_pair


@dataclass(frozen=True)
class Complete:
    """Complete (DONE, bytes landed) at the first check after ``checks`` PROC answers, once the
    fabric clock reads ``at`` (seconds, same clock) or later; ``notify`` False drops the
    producer's notification."""

    checks: int = 0
    at: float | None = None
    notify: bool = True


Delay = Complete  #: ``Delay(checks=3)`` / ``Delay(at=12.5)`` read better in a test


@dataclass(frozen=True)
class Fail:
    """End in ERR with ``detail``, with :class:`Complete`'s timing; no byte lands."""

    detail: str = "injected failure"
    checks: int = 0
    at: float | None = None


@dataclass(frozen=True)
class Stall:
    """Stay PROC until :meth:`MemoryTransfer.resume`."""


class Reorder:
    """Complete ``size`` transfers in ``order``: a list of posting positions (0 = the first
    transfer given this object), default ``reversed(range(size))``. A member completes at a check
    once all ``size`` were posted and every member before it in ``order`` is over (done, failed
    or released). Returned by a rule for more than ``size`` transfers, it is skipped (the next
    rule decides).

    Raises:
        ValueError: ``size`` < 1 or ``order`` is not a permutation of ``range(size)``.
    """

    def __init__(self, size: int, order: Sequence[int] | None = None):
        if size < 1:
            raise ValueError(f"a reorder group needs at least 1 transfer, got {size}")
        self.order = list(reversed(range(size))) if order is None else list(order)
        if sorted(self.order) != list(range(size)):
            raise ValueError(f"order {self.order} is not a permutation of range({size})")
        self.size = size
        self.members: list[MemoryTransfer] = []

    def _join(self, xfer: MemoryTransfer) -> bool:
        if len(self.members) >= self.size:
            return False
        self.members.append(xfer)
        return True

    def _due(self, xfer: MemoryTransfer) -> bool:
        if len(self.members) < self.size:
            return False
        rank = self.order.index(self.members.index(xfer))
        return not any(self.members[pos].in_flight for pos in self.order[:rank])


Action = Complete | Fail | Stall | Reorder
#: a script rule: what one transfer does, or None to let the next rule decide
Rule = Callable[["MemoryTransfer"], Action | None]


class ManualClock:
    """A clock that moves only when told (seconds): pass it as ``MemoryFabric(clock=...)``."""

    def __init__(self, now: float = 0.0):
        self.now = float(now)

    def __call__(self) -> float:
        return self.now

    def advance(self, dt_s: float) -> float:
        """Move forward ``dt_s`` seconds; the new time."""
        self.now += dt_s
        return self.now


@dataclass(eq=False)
class ServedRegion:
    """A serving plane's region on the fabric (registered under ``key``) and its live grants:
    token → ``(payload spans of the region, nbytes)``."""

    key: str
    node: str
    identity: str
    mem: memoryview
    notifications: bool
    grants: dict[bytes, tuple[list[Span], int]] = field(default_factory=dict)
    notifs: list[bytes] = field(default_factory=list)
    closed: bool = False


@dataclass(eq=False)
class MemoryTransfer:
    """One transfer started on the fabric: the fetching plane's handle, and what a test inspects.

    Attributes:
        seq: posting order on the fabric (0, 1, ...).
        producer, consumer: the node ids of the serving and the fetching plane.
        nbytes, notif: what the consumer started.
        model: READ (the source was fixed at start: a revoke does not stop it) or PUSH (the grant
            is looked up when the transfer completes: after ``revoke``, it fails).
        action: what the script decided (changed by :meth:`resume`).
        state: what the consumer's ``check`` answers; ``detail`` why it is ERR.
        checks: how many times the consumer checked it.
        released: the consumer released it; ``landed``: its bytes were written into the
            consumer's blocks; ``in_flight``: it may still land (True until it completes, fails or
            is cancelled — a released READ of a plane with ``release_stops_landing=False`` stays
            in flight until resumed).
    """

    seq: int
    producer: str
    consumer: str
    nbytes: int
    notif: bytes
    model: TransferModel
    action: Action = field(default_factory=Complete)
    state: XferState = XferState.PROC
    detail: str = ""
    checks: int = 0
    released: bool = False
    landed: bool = False
    in_flight: bool = True
    # where the bytes come from and go (set by the fetching plane)
    _fabric: MemoryFabric | None = field(default=None, repr=False)
    _src: ServedRegion | None = field(default=None, repr=False)
    _token: bytes = field(default=b"", repr=False)
    _src_spans: list[Span] | None = field(default=None, repr=False)
    _src_error: str = field(default="", repr=False)
    _dst: memoryview | None = field(default=None, repr=False)
    _dst_spans: list[Span] = field(default_factory=list, repr=False)
    _planned_at: int = field(default=0, repr=False)

    def resume(self, action: Action | None = None) -> bool:
        """Replace what the transfer does by ``action`` (default :class:`Complete` ``()``),
        counted from now: the consumer's next check sees the outcome. A released transfer still in
        flight (a READ that could not be cancelled) completes or fails here and now. False if
        the transfer is over.

        Raises:
            ValueError: ``action`` is a :class:`Reorder` (groups are joined when posted).
        """
        assert self._fabric is not None
        return self._fabric._resume(self, action or Complete())


class MemoryFabric:
    """What the memory planes of one test share: producer regions by key, every transfer, and the
    script (see the module docstring). Thread-safe (one lock); nothing here sleeps.

    Args:
        clock: the time source of :class:`Complete`/:class:`Fail` ``at`` (seconds), default
            ``time.monotonic``; tests pass a :class:`ManualClock`.
    """

    _shared: ClassVar[MemoryFabric | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.id = secrets.token_hex(8)
        #: what fetching planes on this fabric send as their locality (and serving ones reach)
        self.locality = f"memory-fabric:{self.id}".encode()
        self._cond = threading.Condition(threading.RLock())
        self._regions: dict[str, ServedRegion] = {}
        self._transfers: list[MemoryTransfer] = []
        self._once: deque[Action] = deque()
        self._rules: list[Rule] = []

    @classmethod
    def shared(cls) -> MemoryFabric:
        """The process-wide fabric: what a memory plane built without a ``fabric`` option uses."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = MemoryFabric()
            return cls._shared

    # -- the script -----------------------------------------------------------------------------
    def script(self, rule: Rule) -> Rule:
        """Add ``rule``, asked (after the one-shot actions) for every transfer posted from now
        on, in the order rules were added; returns it (for :meth:`unscript`)."""
        with self._cond:
            self._rules.append(rule)
        return rule

    def unscript(self, rule: Rule) -> None:
        """Remove a rule added by :meth:`script` (no-op if absent)."""
        with self._cond:
            if rule in self._rules:
                self._rules.remove(rule)

    def next(self, action: Action, count: int = 1) -> None:
        """The next ``count`` transfers posted do ``action`` (one-shots run in the order queued,
        before any rule)."""
        with self._cond:
            self._once.extend([action] * count)

    def fail_next(self, detail: str = "injected failure", count: int = 1) -> None:
        """The next ``count`` transfers end in ERR with ``detail``."""
        self.next(Fail(detail), count)

    def stall_next(self, count: int = 1) -> None:
        """The next ``count`` transfers stay PROC until resumed."""
        self.next(Stall(), count)

    def delay_next(self, checks: int = 0, at: float | None = None, count: int = 1) -> None:
        """The next ``count`` transfers answer PROC to ``checks`` checks and until ``at``."""
        self.next(Complete(checks=checks, at=at), count)

    def reorder_next(self, size: int, order: Sequence[int] | None = None) -> Reorder:
        """The next ``size`` transfers complete in ``order`` (default: reverse posting order)."""
        group = Reorder(size, order)
        self.next(group, size)
        return group

    # -- what a test inspects -------------------------------------------------------------------
    @property
    def transfers(self) -> list[MemoryTransfer]:
        """Every transfer posted on this fabric, in posting order (a copy of the list)."""
        with self._cond:
            return list(self._transfers)

    def in_flight(self) -> list[MemoryTransfer]:
        """The transfers that may still land."""
        with self._cond:
            return [x for x in self._transfers if x.in_flight]

    def stalled(self) -> list[MemoryTransfer]:
        """The transfers in flight under a :class:`Stall`."""
        with self._cond:
            return [x for x in self._transfers if x.in_flight and isinstance(x.action, Stall)]

    def wait_for(self, predicate: Callable[[MemoryFabric], bool], timeout_s: float) -> bool:
        """Wait until ``predicate(fabric)`` holds (re-checked whenever a transfer is posted,
        checked, released or resumed), at most ``timeout_s`` seconds; whether it holds."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout_s)

    # -- for the planes ---------------------------------------------------------------------------
    def _register(self, region: ServedRegion) -> None:
        with self._cond:
            self._regions[region.key] = region

    def _unregister(self, key: str) -> None:
        with self._cond:
            region = self._regions.pop(key, None)
            if region is not None:
                region.closed = True
                region.grants.clear()
                region.notifs.clear()
            self._cond.notify_all()

    def _region(self, key: str) -> ServedRegion | None:
        with self._cond:
            return self._regions.get(key)

    def _post(self, xfer: MemoryTransfer, key: str) -> None:
        """Record a transfer the fetching plane built for the region registered as ``key``, fix
        its source (READ: the grant's blocks as registered now) and decide its action."""
        with self._cond:
            xfer.seq, xfer._fabric = len(self._transfers), self
            src = xfer._src = self._regions.get(key)
            if src is None or src.closed:
                xfer._src_error = "producer plane closed"
            elif xfer.model is TransferModel.READ:
                grant = src.grants.get(xfer._token)
                if grant is None:
                    xfer._src_error = "unknown or revoked grant (registration dropped)"
                else:
                    xfer._src_spans = grant[0]
            xfer.action = self._decide(xfer)
            self._transfers.append(xfer)
            self._cond.notify_all()

    def _decide(self, xfer: MemoryTransfer) -> Action:
        while self._once:
            action = self._once.popleft()
            if not isinstance(action, Reorder) or action._join(xfer):
                return action
        for rule in list(self._rules):
            decided = rule(xfer)
            if decided is not None and (not isinstance(decided, Reorder) or decided._join(xfer)):
                return decided
        return Complete()

    def _check(self, xfer: MemoryTransfer) -> XferState:
        with self._cond:
            if xfer.in_flight and not xfer.released:
                xfer.checks += 1
                self._advance(xfer)
                self._cond.notify_all()
            return xfer.state

    def _advance(self, xfer: MemoryTransfer) -> None:
        action = xfer.action
        if isinstance(action, Stall):
            return
        if isinstance(action, Reorder):
            if action._due(xfer):
                self._finish(xfer, Complete())
            return
        if xfer.checks - xfer._planned_at > action.checks and (
                action.at is None or self.clock() >= action.at):
            self._finish(xfer, action)

    def _finish(self, xfer: MemoryTransfer, action: Complete | Fail) -> None:
        """Complete (copy the bytes, queue the notification) or fail ``xfer``, under the lock."""
        xfer.in_flight = False
        if isinstance(action, Fail):
            xfer.state, xfer.detail = XferState.ERR, action.detail
            return
        src, spans = xfer._src, xfer._src_spans
        if xfer._src_error or src is None or src.closed:
            xfer.state = XferState.ERR
            xfer.detail = xfer._src_error or "producer plane closed"
            return
        if xfer.model is TransferModel.PUSH:
            grant = src.grants.get(xfer._token)  # a PUSH producer serves what is granted *now*
            if grant is None:
                xfer.state, xfer.detail = XferState.ERR, "producer refused: unknown or revoked grant"
                return
            spans = grant[0]
        assert spans is not None and xfer._dst is not None
        if spans:
            for (s_off, n), (d_off, _) in zip(*segment_pair(spans, xfer._dst_spans), strict=True):
                xfer._dst[d_off:d_off + n] = src.mem[s_off:s_off + n]
        xfer.landed = True
        if not xfer.released:
            xfer.state = XferState.DONE
        if action.notify and src.notifications:
            src.notifs.append(xfer.notif)

    def _release(self, xfer: MemoryTransfer, stops_landing: bool) -> None:
        with self._cond:
            if xfer.released:
                return
            xfer.released = True
            if xfer.in_flight:
                xfer.state = XferState.ERR
                if stops_landing or xfer.model is TransferModel.PUSH:
                    xfer.in_flight = False
                    xfer.detail = "released before it completed"
                else:
                    xfer.detail = "released in flight (the READ may still land)"
            self._cond.notify_all()

    def _resume(self, xfer: MemoryTransfer, action: Action) -> bool:
        if isinstance(action, Reorder):
            raise ValueError("resume() takes Complete, Fail or Stall; a Reorder group is joined "
                             "when a transfer is posted")
        with self._cond:
            if not xfer.in_flight:
                return False
            xfer.action, xfer._planned_at = action, xfer.checks
            if xfer.released and not isinstance(action, Stall):
                self._finish(xfer, action)
            self._cond.notify_all()
            return True
