"""The consumer driver's command executor: what a fetch session's commands do, and where their
outcomes go.

:meth:`ConsumerExecutor.execute` carries out the commands a session returns — ``Send`` on the
control client, ``PostRead`` on the negotiated plane, ``Land`` (an inline ECTP v2 entry) into the
landing region, ``Bind`` (the Welcome's endpoint validated by the plane), ``Release`` of a plane
handle, ``Report`` — and feeds back what the planes answer. A ``Report`` resolves the callers'
futures: a landed entry is handed out zero-copy (its landing blocks pinned until the last view is
collected), copied out, or pinned once per :class:`~ectransport.node.results.Held`; a miss is
handed over as it is. Every outcome is one ``fetch`` event and one log line.

:class:`~ectransport.node.consumer_driver.ConsumerDriver` derives from this and owns the state it
uses (declared below); only the thread holding the driver's lock calls these methods.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from typing import Any

import numpy as np

from ectransport.control.base import ControlClient
from ectransport.data.base import identity_of
from ectransport.node.common import Layout
from ectransport.node.driver import Driver
from ectransport.node.fetch_session import FetchSession
from ectransport.node.inbox import Connect, StartFetch
from ectransport.node.results import Fetched, Held, Outcome, ProducerAddress, fetch_event
from ectransport.session import (
    Bind,
    Command,
    Land,
    Landed,
    Miss,
    PostRead,
    Release,
    Report,
    Send,
)
from ectransport.store import BlockStore

log = logging.getLogger("ectransport.node.consumer")


class ConsumerExecutor(Driver[ControlClient]):
    """Executes a consumer session's commands and resolves outcomes (see the module docstring);
    construct a :class:`~ectransport.node.consumer_driver.ConsumerDriver`."""

    # set by ConsumerDriver.__init__ (see its docstring)
    store: BlockStore
    layout: Layout
    require_binding: bool
    zero_copy: bool
    clock: Callable[[], float]
    _producers: dict[str, ProducerAddress]
    _waiters: dict[tuple[str, str], list[StartFetch]]
    _started: dict[tuple[str, str], float]
    _connecting: dict[str, list[Connect]]
    #: control frames held back until the outermost :meth:`execute` returns (None: none open)
    _sends: list[tuple[str, bytes]] | None = None

    def fetches_waiting(self) -> bool:
        """Whether a fetch or a connect waits for its outcome. Any thread, lock or not: without
        the lock a hint only (CPython reads a dict's size atomically), for the threading policy
        of :class:`~ectransport.node.consumer_loop.ConsumerLoop`."""
        return bool(self._waiters or self._connecting)

    def release_later(self, local_key: str, entry_id: int) -> None:
        """Finalizer of a zero-copy buffer (any thread): see
        :meth:`~ectransport.node.consumer_driver.ConsumerDriver.release_later`."""
        raise NotImplementedError

    def execute(self, s: FetchSession, cmds: list[Command], now: float) -> None:
        """Carry out a session's commands, feeding back what the planes answer.

        ``Send`` commands leave in their order, but only once the outermost call returns: the
        XferDones of an ``AckBatch`` follow all of its READs and outcomes instead of one after
        each READ. A send wakes ZeroMQ's I/O thread and, behind it, the producer (which unpins and
        revokes), competing for the cores on which the next READ copies (NIXL over UCX ``cma``
        copies on the posting thread); a burst wakes them about once. A frame only ever leaves
        later than its command, never before an earlier one: an XferDone still follows its
        READ's completion and release, and a retry the XferDone that freed its budget."""
        outer = self._sends is None
        if outer:
            self._sends = []
        try:
            self._execute(s, cmds, now)
        finally:
            if outer:
                sends, self._sends = self._sends, None
                for peer, data in sends or ():
                    self.control.send(peer, data)

    def _execute(self, s: FetchSession, cmds: list[Command], now: float) -> None:
        sends = self._sends
        assert sends is not None  # inside execute()
        i = 0
        while i < len(cmds):
            c = cmds[i]
            i += 1
            match c:
                case Send(peer=peer, data=data):
                    sends.append((peer, data))
                case PostRead():  # with the PostReads right after it (one AckBatch's READs)
                    reads = [c]
                    while i < len(cmds) and isinstance(cmds[i], PostRead):
                        reads.append(cmds[i])  # type: ignore[arg-type]
                        i += 1
                    self._post_reads(s, reads, now)
                case Land(runs=runs, data=data):  # an inline entry (ECTP v2): its Report follows
                    self.region.write(runs, np.frombuffer(data, dtype=np.uint8))
                case Bind():
                    self._bind(s, c, now)
                case Release(handle=handle):
                    if s.plane:
                        self.planes[s.plane].release(handle)
                case Report(outcome=outcome):
                    self._report(s, outcome, now)
                case _:
                    log.warning("consumer session returned an unexpected command %r", c)

    def _post_reads(self, s: FetchSession, reads: list[PostRead], now: float) -> None:
        """Post READs back to back, then tell the session about each, in order: posted (or
        failed to post), and its state if it is no longer in progress (UCX may have copied
        inside ``start()``: NIXL over ``cma`` does).

        Posting them all first keeps the per-entry bookkeeping out from between the copies (a
        1 MiB copy leaves the CPU caches cold for the Python that follows it). The session sees
        the same events in the same order as when each READ is handled before the next is
        posted; the only other events it sees meanwhile are those of the READs posted with it,
        and it treats a fetch as reading from the moment it returned the PostRead, so a READ
        posted but not yet reported is never given up on without its blocks being kept."""
        assert s.plane is not None  # reads are posted on the negotiated plane only
        plane = self.planes[s.plane]
        posted: list[tuple[PostRead, Any]] = []  # (read, its handle or why it was not posted)
        for c in reads:
            try:
                posted.append((c, plane.start(c.prepared, c.plane_grant, c.runs, c.nbytes,
                                              c.notif)))
            except Exception as e:
                log.warning("posting transfer of %s failed: %s", c.key[:12], e)
                posted.append((c, e))
        for k, (c, handle) in enumerate(posted):
            try:
                if isinstance(handle, Exception):
                    self.execute(s, s.on_read_failed(c.key, str(handle), now), now)
                    continue
                self.execute(s, s.on_read_posted(c.key, handle, now), now)
                state = plane.check(handle).value
                if state != "proc":
                    t = self.clock()  # observed after the check: the validity window's clock
                    why = plane.error_detail(handle) if state == "err" else ""
                    self.execute(s, s.on_read_state(c.key, state, t, why), t)
            except BaseException:  # the READs not handed over yet are released, not leaked
                for _, h in posted[k + 1:]:
                    if not isinstance(h, Exception):
                        plane.release(h)
                raise

    def _bind(self, s: FetchSession, c: Bind, now: float) -> None:
        """Have the negotiated plane validate the producer's declared endpoint (tied to the CURVE
        key this node dialed it with and the host it dialed) and tell the session."""
        producer = self._producers[s.conn]
        plane = self.planes[c.plane]
        old, old_plane = s.binding, s.plane
        if not c.endpoint and self.require_binding:
            self.execute(s, s.on_bind_failed(
                f"the producer declared no {c.plane} endpoint, so its grants could not be bound "
                f"to it (an older ectransport, or a hostile producer); upgrade it, or pass "
                f"require_binding=False to accept unbound grants", now), now)
            return
        try:
            binding = plane.bind_peer(c.endpoint, peer=s.conn, host=producer.host,
                                      identity=identity_of(producer.public_key))
        except Exception as e:
            log.warning("producer %s: %s plane refused its endpoint: %s", s.conn, c.plane, e)
            self.execute(s, s.on_bind_failed(str(e), now), now)
            return
        if old is not None and old is not binding and old_plane in self.planes:
            self.planes[old_plane].unbind_peer(old)  # on the plane that made it
        self.execute(s, s.on_bound(binding, now), now)

    # -- outcomes ------------------------------------------------------------------------------
    def _report(self, s: FetchSession, outcome: Landed | Miss, now: float) -> None:
        self._observe_outcome(s.conn, s.session_id, outcome, now)
        if not isinstance(outcome, Landed):
            self._resolve(s.conn, outcome)
            return
        if any(w.held for w in self._waiters.get((s.conn, outcome.mm_hash), ())):
            self._report_held(s, outcome, now)
            return
        e = outcome.entry
        if self.zero_copy and len(e.runs) == 1 and e.nbytes:
            # zero copy: hand out the landing blocks, pinned until the last view is collected
            self.store.pin_if_ready(e.mm_hash)
            owner = (ctypes.c_uint8 * e.nbytes).from_address(
                self.region.addr + e.runs[0].start * self.region.block_bytes)
            # numpy's stub omits ctypes arrays, which do export the buffer protocol
            data = np.frombuffer(owner, dtype=np.uint8)  # type: ignore[call-overload]
            weakref.finalize(owner, self.release_later, e.mm_hash, e.entry_id)
        elif self.zero_copy and len(e.runs) == 1:
            data = np.empty(0, dtype=np.uint8)
            self.store.discard(e.mm_hash)
        else:  # scattered landing blocks (or copies asked for): one copy into a contiguous array
            data = self.region.read(e.runs, e.nbytes)
            self.store.discard(e.mm_hash)
        timings = dict(outcome.timings)
        timings["total"] = timings.get("landed", 0.0) + (self.clock() - now)
        self._resolve(s.conn, Fetched(outcome.mm_hash, data, self.layout, outcome.plane, timings))

    def _report_held(self, s: FetchSession, outcome: Landed, now: float) -> None:
        """Resolve the waiters of a landed fetch when at least one of them is a submit_held: one
        pin per Held; plain waiters get a copy (the pinned blocks are not theirs to release)."""
        e = outcome.entry
        timings = dict(outcome.timings)
        timings["total"] = timings.get("landed", 0.0) + (self.clock() - now)
        copy: Fetched | None = None
        for w in self._waiters.pop((s.conn, outcome.mm_hash), []):
            if w.future.done():
                continue
            if w.held:
                self.store.pin_if_ready(e.mm_hash)
                w.future.set_result(Held(outcome.mm_hash, e.runs, e.nbytes, self.store.block_bytes,
                                         e.mm_hash, e.entry_id, outcome.plane, timings))
            else:
                if copy is None:
                    copy = Fetched(outcome.mm_hash, self.region.read(e.runs, e.nbytes),
                                   self.layout, outcome.plane, timings)
                w.future.set_result(copy)
        entry = self.store.get(e.mm_hash)
        if entry is not None and entry.entry_id == e.entry_id and entry.pins == 0:
            self.store.discard(e.mm_hash)  # no Held was handed out after all

    def _release_held(self, local_key: str, entry_id: int) -> None:
        e = self.store.get(local_key)
        if e is not None and e.entry_id == entry_id and e.pins > 0:
            self.store.unpin(local_key, entry_id)
            if e.pins == 0:
                self.store.discard(local_key)

    def _release(self, local_key: str, entry_id: int) -> None:
        e = self.store.get(local_key)
        if e is not None and e.entry_id == entry_id:
            self.store.unpin(local_key, entry_id)
            self.store.discard(local_key)

    def _resolve(self, conn: str, result: Outcome) -> None:
        for w in self._waiters.pop((conn, result.mm_hash), []):
            try:  # one lock round per future, not two (done() then set_result())
                w.future.set_result(result)
            except InvalidStateError:  # cancelled by its caller
                pass

    def _observe_outcome(self, conn: str, session_id: str, outcome: Landed | Miss,
                         now: float) -> None:
        """One ``fetch`` event and one log line per outcome, with the transfer's identifiers."""
        started = self._started.pop((conn, outcome.mm_hash), None)
        if not self.observers and not log.isEnabledFor(logging.DEBUG):
            return
        fields = fetch_event(conn, session_id, outcome, started, now)
        if isinstance(outcome, Landed):
            log.debug("fetched %d bytes in %d runs via %s", outcome.entry.nbytes,
                      len(outcome.entry.runs), outcome.plane, extra=fields)
        else:
            log.debug("miss: %s: %s", outcome.reason.value, outcome.detail, extra=fields)
        self.observers("fetch", fields)
