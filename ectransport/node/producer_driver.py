"""ProducerDriver: one producer-side serving session driven over a control server and planes.

    driver = ProducerDriver(session, Parts(control, planes, region, own_region=True))
    while serving:
        driver.step(wait_s=0.02)     # or step(now) from a loop that owns the clock

The session (ECTP's :class:`ProducerSession`, or a wire profile's) is sans-I/O; the driver feeds
it control events, data-plane notifications and the time, and performs the commands it returns.
A session that lets requests wait for readiness (ECTP v2, :class:`WaitingSession`) is also told
which entries changed (:meth:`ProducerDriver.entry_changed`, called by ``put``/``commit``/``abort``
under the lock) and swept no later than its next waiting deadline.
Public methods that touch the session or the store hold :attr:`Driver.lock`; the plane and
control-plane I/O of a step happens outside it, so ``put`` from other threads is never blocked
behind a send. One thread steps at a time: a :class:`ProducerNode` that was started steps on its
own thread; one that was not (tests, a caller with its own loop) is stepped by its owner.
With fleet trust (``trust``: :class:`~ectransport.node.trust.NodeTrust`) each step refreshes it
(outside the lock) and, when it says so, ends the live sessions it no longer admits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, runtime_checkable

from ectransport.control.base import ControlServer, Down, PeerId, Received
from ectransport.node.driver import Observers, Parts
from ectransport.node.trust import NodeTrust, TrustingServer
from ectransport.protocol import Ticket
from ectransport.session import Command, Revoke, Send

log = logging.getLogger("ectransport.node.producer")

#: How often the session's timers (leases, grace periods) are swept, seconds.
SWEEP_S = 0.05


class ServingSession(Protocol):
    """What a :class:`ProducerDriver` needs from a producer-side session (ECTP's
    :class:`~ectransport.session.ProducerSession` and the vLLM wire profile's both fit)."""

    def on_frame(self, peer: Any, data: bytes, now: float, user: str = "") -> list[Any]: ...

    def on_notification(self, notif: bytes, now: float) -> list[Any]: ...

    def on_peer_down(self, peer: Any, now: float) -> list[Any]: ...

    def poll(self, now: float) -> list[Any]: ...

    def close(self) -> list[Any]: ...

    # gauges and counters, read by ProducerNode.stats() / snapshot() under the driver's lock
    @property
    def stats(self) -> Mapping[str, int]: ...

    @property
    def nacks(self) -> Mapping[Any, int]: ...  # status enum -> NACKs sent

    @property
    def active_grants(self) -> int: ...

    def pinned_bytes(self) -> int: ...

    def pinned_by_identity(self) -> dict[str, int]: ...


@runtime_checkable
class AnnouncingSession(Protocol):
    """A serving session that holds and offers announced entries (ECTP v2 §10)."""

    def announce(
        self, mm_hash: str, now: float, to: str | Collection[str] | None = None
    ) -> tuple[Ticket | None, list[Any]]: ...


@runtime_checkable
class WaitingSession(Protocol):
    """A serving session whose requests may wait for an entry to become ready (ECTP v2's
    :class:`~ectransport.session.ProducerSession`)."""

    def waits_for(self, mm_hash: str) -> bool: ...

    def on_entries_changed(self, mm_hashes: Collection[str], now: float) -> list[Any]: ...

    def next_deadline(self) -> float | None: ...


class ProducerDriver:
    """Drives one :class:`ServingSession` (see module docstring).

    Args:
        session: the sans-I/O serving session (its store is guarded by :attr:`lock`).
        parts: the control server, planes and region it drives and closes.
        observers: told what happens (see :class:`~ectransport.node.ProducerNode`).
        clock: the monotonic clock used when :meth:`step` is not given ``now``.
        trust: fleet trust of the session's admission (module docstring).
    """

    def __init__(
        self,
        session: ServingSession,
        parts: Parts[ControlServer],
        *,
        observers: Observers | None = None,
        clock: Callable[[], float] = time.monotonic,
        trust: NodeTrust | None = None,
    ):
        self.parts = parts
        self.trust = trust
        self.control = parts.control
        self.planes = parts.planes
        self.observers = observers if observers is not None else Observers()
        #: held by whoever touches the session or the store (the stepping thread, ``put``)
        self.lock = threading.Lock()
        self.session = session
        self.clock = clock
        self._last_sweep = float("-inf")
        self._waiting: WaitingSession | None = (
            session if isinstance(session, WaitingSession) else None
        )
        #: mm_hashes whose entries changed while requests waited for them (any thread appends,
        #: the stepping thread drains)
        self._changed: deque[str] = deque()
        #: commands a caller thread produced (e.g. the offers of an announcement), performed by
        #: the stepping thread at its next step
        self._deferred: deque[Command] = deque()

    def defer(self, cmds: list[Command]) -> None:
        """Have the stepping thread perform ``cmds`` at its next step (any thread; a step waiting
        for control events returns at once). ZeroMQ sockets are used by one thread only."""
        if cmds:
            self._deferred.extend(cmds)
            self.control.wake()

    def entry_changed(self, mm_hash: str) -> None:
        """The entry ``mm_hash`` became ready or went away (call with :attr:`lock` held, from
        any thread): if a request waits for it, the next :meth:`step` answers it, and a step
        waiting for control events returns at once."""
        if self._waiting is not None and self._waiting.waits_for(mm_hash):
            self._changed.append(mm_hash)
            self.control.wake()

    def step(self, now: float | None = None, *, wait_s: float = 0.0) -> None:
        """One round: wait up to ``wait_s`` for control events, answer them (answers are sent
        first: consumers wait for them; then the items waiting for entries that changed), then
        data-plane notifications and, every :data:`SWEEP_S` or at a waiting item's deadline, the
        session's timers. ``now`` defaults to the clock after the wait, which ends early at that
        deadline."""
        with self.lock:
            due = self._due()
        if due is not None and now is None and wait_s > 0:  # wake for the next waiting deadline
            wait_s = min(wait_s, max(0.0, due - self.clock()))
        events = self.control.poll(wait_s)
        trust = self.trust
        recheck = trust is not None and trust.refresh(self.clock() if now is None else now)
        if trust is not None:  # the allow-list's refusals at the handshake, counted by reason
            trust.handshake_refusals(int(getattr(self.control, "reject_count", 0) or 0))
        cmds: list[Command] = []
        while self._deferred:
            cmds.append(self._deferred.popleft())
        with self.lock:
            t = self.clock() if now is None else now
            for ev in events:
                match ev:
                    case Received(source=PeerId() as peer, data=data):
                        cmds += self.session.on_frame(peer, data, t, user=peer.user)
                    case Down(source=peer):
                        cmds += self.session.on_peer_down(peer, t)
            if self._changed and self._waiting is not None:
                changed: set[str] = set()
                while self._changed:
                    changed.add(self._changed.popleft())
                cmds += self._waiting.on_entries_changed(changed, t)
            if recheck and trust is not None and isinstance(self.session, TrustingServer):
                for peer, refused in trust.admission.recheck():
                    cmds += self.session.on_trust_lost(peer, refused, t)
        self.perform(cmds)
        cmds = []
        with self.lock:
            for plane in self.planes.values():
                for notif in plane.poll_notifications():
                    cmds += self.session.on_notification(notif, t)
            due = self._due()
            if t - self._last_sweep > SWEEP_S or (due is not None and due <= t):
                cmds += self.session.poll(t)
                self._last_sweep = t
        self.perform(cmds)

    def _due(self) -> float | None:
        """The session's next waiting deadline, if it has any (lock held)."""
        return self._waiting.next_deadline() if self._waiting is not None else None

    def perform(self, cmds: list[Command]) -> None:
        """Carry out the session's commands (sends, grant revocations); lock not held."""
        for c in cmds:
            match c:
                case Send(peer=peer, data=data):
                    self.control.send(peer, data)
                case Revoke(plane=name, plane_grant=grant):
                    plane = self.planes.get(name)
                    if plane is not None:
                        plane.revoke(grant)
                case _:
                    log.warning("producer session returned an unexpected command %r", c)

    def close(self) -> None:
        """End every grant (revoking them on their planes), then close control, planes, region."""
        with self.lock:
            self.session.close()  # the planes close next: nothing is left to revoke on them
        self.parts.close()
