"""What a consumer session's commands do: :class:`Executor` performs them on the control client,
the data planes and the landing region, and hands back what the planes answer as
:data:`Feedback` values — never as a call into the session. The driver feeds each one to the
session and performs the commands it returns in turn, in one loop
(:meth:`ConsumerDriver._run <ectransport.node.consumer_driver.ConsumerDriver>`): execution is
iterative, never re-entrant.

Sends are held until :meth:`Executor.flush` (the end of that loop): the completions of an
``AckBatch`` follow all of its READs and outcomes instead of one after each READ — a send wakes
ZeroMQ's I/O thread and, behind it, the producer, competing for the cores on which the next READ
copies. A frame only ever leaves later than its command, never before an earlier one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ectransport.control.base import ControlClient
from ectransport.data.base import DataTransport, identity_of
from ectransport.node.fetch_session import FetchSession
from ectransport.node.results import ProducerAddress
from ectransport.session import Bind, Command, Land, Landed, Miss, PostRead, Release, Report, Send
from ectransport.store import BlockRegion

log = logging.getLogger("ectransport.node.consumer")


@dataclass(frozen=True)
class ReadPosted:
    key: str
    handle: Any


@dataclass(frozen=True)
class ReadFailed:
    key: str
    detail: str


@dataclass(frozen=True)
class ReadState:
    """A transfer is no longer in progress (``state`` ``"done"`` or ``"err"``), observed at
    ``t`` (after the check: the validity window's clock)."""

    key: str
    state: str
    t: float
    detail: str


@dataclass(frozen=True)
class Bound:
    binding: Any


@dataclass(frozen=True)
class BindFailed:
    detail: str


#: What a plane answered, for the session to hear.
Feedback = ReadPosted | ReadFailed | ReadState | Bound | BindFailed


class Executor:
    """Performs a consumer session's commands (module docstring).

    Args:
        control: the control client (sends). planes: data planes by name. region: the landing
            region (inline entries are written into it).
        producers: connection key → where it was dialed (host and CURVE key, for bindings).
        report: ``(session, outcome, now)``: a fetch's outcome (``Report``).
        require_binding: refuse a producer whose Welcome declares no endpoint.
        clock: the driver's clock.
    """

    def __init__(self, control: ControlClient, planes: dict[str, DataTransport],
                 region: BlockRegion, producers: dict[str, ProducerAddress],
                 report: Callable[[FetchSession, Landed | Miss, float], None], *,
                 require_binding: bool, clock: Callable[[], float]):
        self.control = control
        self.planes = planes
        self.region = region
        self.producers = producers
        self.report = report
        self.require_binding = require_binding
        self.clock = clock
        self._sends: list[tuple[str, bytes]] = []

    def perform(self, s: FetchSession, cmds: list[Command], now: float) -> list[Feedback]:
        """Carry out ``cmds`` of session ``s`` in order; returns what the planes answered."""
        out: list[Feedback] = []
        i = 0
        while i < len(cmds):
            c = cmds[i]
            i += 1
            match c:
                case Send(peer=peer, data=data):
                    self._sends.append((peer, data))
                case PostRead():  # with the PostReads right after it (one AckBatch's READs)
                    reads = [c]
                    while i < len(cmds) and isinstance(nxt := cmds[i], PostRead):
                        reads.append(nxt)
                        i += 1
                    out += self._post(s, reads)
                case Land(runs=runs, data=data):  # an inline entry (ECTP v2): its Report follows
                    self.region.write(runs, np.frombuffer(data, dtype=np.uint8))
                case Bind():
                    out.append(self._bind(s, c))
                case Release(handle=handle):
                    if s.plane:
                        self.planes[s.plane].release(handle)
                case Report(outcome=outcome):
                    self.report(s, outcome, now)
                case _:
                    log.warning("consumer session returned an unexpected command %r", c)
        return out

    def flush(self) -> None:
        """Send what the performed commands queued, in order."""
        sends, self._sends = self._sends, []
        for peer, data in sends:
            self.control.send(peer, data)

    def release(self, s: FetchSession, pending: list[Feedback]) -> None:
        """The handles of feedback never handed to the session (an error stopped the loop)."""
        if s.plane:
            for fb in pending:
                if isinstance(fb, ReadPosted):
                    self.planes[s.plane].release(fb.handle)

    def _post(self, s: FetchSession, reads: list[PostRead]) -> list[Feedback]:
        """Post READs back to back, then report each: posted (or failed to post), and its state
        if it is no longer in progress (UCX may copy inside ``start()``: NIXL over ``cma``
        does). Posting them all first keeps the bookkeeping out from between the copies (a
        1 MiB copy leaves the CPU caches cold for the Python that follows it)."""
        assert s.plane is not None  # reads are posted on the negotiated plane only
        plane = self.planes[s.plane]
        posted: list[Feedback] = []
        for c in reads:
            try:
                handle = plane.start(c.prepared, c.plane_grant, c.runs, c.nbytes, c.notif)
            except Exception as e:
                log.warning("posting transfer of %s failed: %s", c.key[:12], e)
                posted.append(ReadFailed(c.key, str(e)))
                continue
            posted.append(ReadPosted(c.key, handle))
        out: list[Feedback] = []
        for fb in posted:
            out.append(fb)
            if isinstance(fb, ReadPosted):
                state = plane.check(fb.handle).value
                if state != "proc":
                    why = plane.error_detail(fb.handle) if state == "err" else ""
                    out.append(ReadState(fb.key, state, self.clock(), why))
        return out

    def _bind(self, s: FetchSession, c: Bind) -> Feedback:
        """Have the negotiated plane validate the producer's declared endpoint (tied to the
        CURVE key this node dialed it with and the host it dialed)."""
        producer = self.producers[s.conn]
        plane = self.planes[c.plane]
        if not c.endpoint and self.require_binding:
            return BindFailed(f"the producer declared no {c.plane} endpoint, so its grants could "
                              f"not be bound to it (an older ectransport, or a hostile producer); "
                              f"upgrade it, or pass require_binding=False to accept unbound "
                              f"grants")
        try:
            binding = plane.bind_peer(c.endpoint, peer=s.conn, host=producer.host,
                                      identity=identity_of(producer.public_key))
        except Exception as e:
            log.warning("producer %s: %s plane refused its endpoint: %s", s.conn, c.plane, e)
            return BindFailed(str(e))
        old, old_plane = s.binding, s.plane
        if old is not None and old is not binding and old_plane in self.planes:
            self.planes[old_plane].unbind_peer(old)  # on the plane that made it
        return Bound(binding)


def feed(s: FetchSession, fb: Feedback, now: float) -> list[Command]:
    """Hand one plane answer to its session; returns the session's commands."""
    match fb:
        case ReadPosted(key=key, handle=handle):
            return s.on_read_posted(key, handle, now)
        case ReadFailed(key=key, detail=detail):
            return s.on_read_failed(key, detail, now)
        case ReadState(key=key, state=state, t=t, detail=detail):
            return s.on_read_state(key, state, t, detail)
        case Bound(binding=binding):
            return s.on_bound(binding, now)
        case BindFailed(detail=detail):
            return s.on_bind_failed(detail, now)
    raise AssertionError(fb)  # pragma: no cover - the union is closed
