"""Where a consumer's fetch outcomes go: the callers waiting for each fetch, and what they are
handed — a zero-copy :class:`~ectransport.node.results.Fetched` over the landing blocks (pinned
until its last view is collected), a copy, a :class:`~ectransport.node.results.Held` (pinned
until released), or the :class:`~ectransport.session.Miss` as it is.

:class:`Outcomes` belongs to a :class:`~ectransport.node.consumer_driver.ConsumerDriver` and runs
on the thread that drives it; the finalizer of a zero-copy result (any thread, at any point of a
garbage collection) only hands a release to ``release_later``, never touching the store.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Callable
from concurrent.futures import InvalidStateError

import numpy as np

from ectransport.node.common import Layout
from ectransport.node.driver import Observers
from ectransport.node.inbox import StartFetch
from ectransport.node.results import Fetched, Held, Outcome, fetch_event
from ectransport.session import Landed, Miss
from ectransport.store import BlockRegion, BlockStore

log = logging.getLogger("ectransport.node.consumer")


class Outcomes:
    """The waiters of every fetch in flight, keyed by ``(connection, mm_hash)``, and how a
    landed entry is handed to them.

    Args:
        store / region / layout: the landing region, its block store and what its bytes mean.
        observers: told ``fetch`` once per outcome.
        zero_copy: hand landed bytes out in place; False copies them out and frees the blocks.
        clock: the driver's clock. release_later: ``(local_key, entry_id)``, called by the
            finalizer of a zero-copy result from any thread: must only queue the release.
    """

    def __init__(self, store: BlockStore, region: BlockRegion, layout: Layout,
                 observers: Observers, *, zero_copy: bool, clock: Callable[[], float],
                 release_later: Callable[[str, int], None]):
        self.store = store
        self.region = region
        self.layout = layout
        self.observers = observers
        self.zero_copy = zero_copy
        self.clock = clock
        self.release_later = release_later
        self._waiters: dict[tuple[str, str], list[StartFetch]] = {}
        self._started: dict[tuple[str, str], float] = {}
        #: results ready for their futures, handed over by :meth:`deliver` at the end of the
        #: driver's step: a caller woken earlier would wait for the interpreter while the step
        #: finishes (its completions' sends, the timers), two threads taking turns at it
        self._ready: list[tuple[StartFetch, Outcome | Held]] = []

    def __bool__(self) -> bool:
        return bool(self._waiters)

    def join(self, conn: str, item: StartFetch, now: float) -> bool:
        """Wait for the fetch of ``item.mm_hash`` from ``conn``; True if it is new (start it),
        False if it joined one in flight."""
        key = (conn, item.mm_hash)
        waiters = self._waiters.setdefault(key, [])
        waiters.append(item)
        if len(waiters) == 1:
            self._started[key] = now
            return True
        return False

    def report(self, conn: str, session_id: str, outcome: Landed | Miss, now: float) -> None:
        """A session reported the outcome of a fetch: hand it to its waiters."""
        self._observe(conn, session_id, outcome, now)
        if not isinstance(outcome, Landed):
            self.resolve(conn, outcome)
            return
        timings = dict(outcome.timings)
        timings["total"] = timings.get("landed", 0.0) + (self.clock() - now)
        if any(w.held for w in self._waiters.get((conn, outcome.mm_hash), ())):
            self._report_held(conn, outcome, timings)
            return
        e = outcome.entry
        if self.zero_copy and len(e.runs) == 1 and e.nbytes:
            # in place: the landing blocks stay pinned until the last view is collected
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
        self.resolve(conn, Fetched(outcome.mm_hash, data, self.layout, outcome.plane, timings))

    def _report_held(self, conn: str, outcome: Landed, timings: dict[str, float]) -> None:
        """Waiters of a landed fetch of which one at least is a ``submit_held``: one pin per
        :class:`Held`; plain waiters get a copy (the pinned blocks are not theirs to release)."""
        e = outcome.entry
        copy: Fetched | None = None
        for w in self._waiters.pop((conn, outcome.mm_hash), []):
            if w.future.done():
                continue
            if w.held:
                self.store.pin_if_ready(e.mm_hash)
                self._ready.append((w, Held(outcome.mm_hash, e.runs, e.nbytes,
                                            self.store.block_bytes, e.mm_hash, e.entry_id,
                                            outcome.plane, timings)))
            else:
                if copy is None:
                    copy = Fetched(outcome.mm_hash, self.region.read(e.runs, e.nbytes),
                                   self.layout, outcome.plane, timings)
                self._ready.append((w, copy))
        entry = self.store.get(e.mm_hash)
        if entry is not None and entry.entry_id == e.entry_id and entry.pins == 0:
            self.store.discard(e.mm_hash)  # no Held was handed out after all

    def resolve(self, conn: str, result: Outcome) -> None:
        """Hand ``result`` to every waiter of its fetch from ``conn`` (at :meth:`deliver`)."""
        self._started.pop((conn, result.mm_hash), None)
        self._ready += [(w, result) for w in self._waiters.pop((conn, result.mm_hash), [])]

    def deliver(self) -> None:
        """Set the futures of every outcome of this step (the driver's last act in a step)."""
        ready, self._ready = self._ready, []
        for w, result in ready:
            try:  # one lock round per future, not two (done() then set_result())
                w.future.set_result(result)
            except InvalidStateError:  # cancelled by its caller
                pass

    def miss(self, conn: str, mm_hash: str, miss: Miss, now: float) -> None:
        """A fetch that could not even start (no session): observed and resolved."""
        self._observe(conn, "", miss, now)
        self.resolve(conn, miss)

    def release(self, local_key: str, entry_id: int) -> None:
        """The last view of a zero-copy result was collected: its blocks go back."""
        e = self.store.get(local_key)
        if e is not None and e.entry_id == entry_id:
            self.store.unpin(local_key, entry_id)
            self.store.discard(local_key)

    def release_held(self, local_key: str, entry_id: int) -> None:
        """One pin of a :class:`Held` goes; its blocks with the last one."""
        e = self.store.get(local_key)
        if e is not None and e.entry_id == entry_id and e.pins > 0:
            self.store.unpin(local_key, entry_id)
            if e.pins == 0:
                self.store.discard(local_key)

    def _observe(self, conn: str, session_id: str, outcome: Landed | Miss, now: float) -> None:
        """One ``fetch`` event and one debug line per outcome, with the transfer's identifiers."""
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
