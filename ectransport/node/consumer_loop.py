"""The consumer's threading policy around a :class:`ConsumerDriver`: an I/O thread, and a caller
that drives its own fetch while nothing else is in flight.

Whichever thread holds the driver's lock runs :meth:`ConsumerDriver.step`: the node's I/O thread,
or — for a lone synchronous fetch while nothing else is in flight — the calling thread itself,
which then sends the request, waits in the control poll for the answer, posts the read and builds
the result without handing work to another thread and back (each hand-off is a scheduler wake-up:
~0.1 ms on a quiet 2-core host, milliseconds on a loaded one). While nothing is in flight the I/O
thread parks without watching the sockets (events queue in the control client and are handled at
the next step, at most :data:`~ectransport.node.consumer_driver.MAX_WAIT_S` later).

A caller that finds the I/O thread holding the lock with no fetch of its own to drive (it handles
the releases of results just handed out, renewals, quarantined transfers) asks for the lock
(:meth:`ConsumerLoop._lock_for_caller`): the I/O thread's control poll is interrupted, and it
parks after its step instead of stepping again. Without that, a caller fetching again right
after its previous results were handed out (their releases queued while the I/O thread held the
lock) handed its fetch to the I/O thread, whose next step held the lock again when the caller
came back: 15-30 % of back-to-back 8 x 1 MiB batches ran through the I/O thread (issue 16),
each with two thread hand-offs more.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ectransport.node.consumer_driver import ConsumerDriver
from ectransport.node.inbox import (
    Connect,
    InboxItem,
    ReleaseHeld,
    Snapshot,
    StartBatch,
    StartFetch,
)
from ectransport.node.results import Held, Outcome, ProducerAddress
from ectransport.protocol import Ticket
from ectransport.session import Miss, MissReason

log = logging.getLogger("ectransport.node.consumer")

#: While transfers are in flight the I/O loop sleeps this long between checks, seconds.
_BUSY_SLEEP_S = 50e-6
#: How long fetch() waits for the drive lock while the parked I/O thread makes its periodic
#: non-blocking step (instead of handing its fetch to that thread), seconds.
_BRIEF_WAIT_S = 0.005
#: How long stats() waits for the driving thread to take a snapshot, seconds.
_SNAPSHOT_WAIT_S = 5.0


class ConsumerLoop:
    """Runs a :class:`ConsumerDriver` on an I/O thread (started here) and on fetching callers.

    Args:
        driver: what to drive; closed by :meth:`close`.
        name: the I/O thread's name suffix.
        fetch_timeout_s: default overall deadline of one fetch.
    """

    def __init__(self, driver: ConsumerDriver, *, name: str, fetch_timeout_s: float):
        self.driver = driver
        self.fetch_timeout_s = fetch_timeout_s
        self._stop = threading.Event()
        self._kick = threading.Event()  # un-parks the I/O thread
        self._brief = False  # the I/O thread holds the lock only for a non-blocking step
        self._want = 0  # callers waiting for the lock in _lock_for_caller (the I/O thread yields)
        self._want_lock = threading.Lock()
        self._owner = 0  # ident of the thread holding the driver's lock (0: none)
        self._thread = threading.Thread(target=self._run, name=f"ect-{name}", daemon=True)
        self._thread.start()

    # -- any thread ----------------------------------------------------------------------------
    def _deadline(self, timeout_s: float | None) -> float:
        t = timeout_s if timeout_s is not None else self.fetch_timeout_s
        return self.driver.clock() + t

    def _submit(self, producer: ProducerAddress, mm_hash: str, timeout_s: float | None, *,
                held: bool = False, nbytes: int | None = None,
                ticket: Ticket | None = None) -> Future[Any]:
        fut: Future[Any] = Future()
        self._enqueue(StartFetch(producer, mm_hash, self._deadline(timeout_s), fut, held, nbytes,
                                 ticket))
        return fut

    def _batch(self, producer: ProducerAddress, mm_hashes: list[str],
               timeout_s: float | None,
               tickets: Sequence[Ticket | None] | None = None) -> StartBatch:
        deadline = self._deadline(timeout_s)
        ts = list(tickets) if tickets is not None else [None] * len(mm_hashes)
        if len(ts) != len(mm_hashes):
            raise ValueError(f"{len(ts)} tickets for {len(mm_hashes)} mm_hashes")
        return StartBatch(producer, deadline, tuple(
            StartFetch(producer, m, deadline, Future(), ticket=t) for m, t in zip(mm_hashes, ts)))

    def _submit_many(self, producer: ProducerAddress, mm_hashes: list[str],
                     timeout_s: float | None,
                     tickets: Sequence[Ticket | None] | None = None) -> list[Future[Any]]:
        item = self._batch(producer, mm_hashes, timeout_s, tickets)
        if item.items:
            self._enqueue(item)
        return [it.future for it in item.items]

    def _fetch_many(self, producer: ProducerAddress, mm_hashes: list[str],
                    timeout_s: float | None,
                    tickets: Sequence[Ticket | None] | None = None) -> list[Outcome]:
        """As :meth:`_fetch` for several entries of one producer, started together."""
        if self._stop.is_set():
            return [Miss(m, MissReason.INTERNAL, "consumer closed") for m in mm_hashes]
        item = self._batch(producer, mm_hashes, timeout_s, tickets)
        if not item.items:
            return []
        lock = self.driver.lock
        if threading.current_thread() is not self._thread and self._lock_for_caller():
            try:  # the I/O thread is parked (or between steps): drive these fetches here
                self._owner = threading.get_ident()
                if not self._stop.is_set():
                    d = self.driver
                    d.start_batch(item, d.clock())
                    self._drive(lambda: all(it.future.done() for it in item.items),
                                item.deadline)
                wake = not self.driver.idle() or self._stop.is_set()
            finally:
                self._owner = 0
                lock.release()
            if wake:
                self._wake_loop()
        else:
            self._enqueue(item)
        out: list[Outcome] = []
        for it in item.items:
            try:
                out.append(it.future.result(
                    timeout=max(0.0, item.deadline - self.driver.clock()) + 5.0))
            except concurrent.futures.TimeoutError:  # pragma: no cover - the loop ends each
                out.append(Miss(it.mm_hash, MissReason.TIMEOUT, "no outcome from the loop"))
            except Exception as e:  # pragma: no cover - closed while waiting
                out.append(Miss(it.mm_hash, MissReason.INTERNAL, f"{type(e).__name__}: {e}"))
        return out

    def _lock_for_caller(self) -> bool:
        """Take the driver's lock for a caller that would drive its own fetch: at once if it is
        free; within :data:`_BRIEF_WAIT_S` if the I/O thread holds it for a non-blocking step,
        or holds it with no fetch waiting (only releases, renewals, quarantined transfers: see
        the module docstring) — it is then asked to yield: its poll is interrupted and it parks
        after its step. False: the caller hands its fetch to whoever drives (the lock is held by
        another caller, or by the I/O thread driving other fetches)."""
        lock = self.driver.lock
        if lock.acquire(blocking=False):
            return True
        if self._brief:
            return lock.acquire(timeout=_BRIEF_WAIT_S)
        d = self.driver
        # racy reads (no lock): at worst a wait of _BRIEF_WAIT_S, then the fetch is handed over
        if self._owner != self._thread.ident or d.fetches_waiting():
            return False
        with self._want_lock:
            self._want += 1
        try:
            d.control.wake()  # out of a blocking poll; _run then parks instead of stepping on
            return lock.acquire(timeout=_BRIEF_WAIT_S)
        finally:
            with self._want_lock:
                self._want -= 1

    def _release_held(self, held: Held) -> None:
        if self._stop.is_set():
            return
        self._enqueue(ReleaseHeld(held.local_key, held.entry_id))

    def _connect(self, producer: ProducerAddress, timeout_s: float) -> str:
        fut: Future[str] = Future()
        self._enqueue(Connect(producer, self.driver.clock() + timeout_s, fut))
        return fut.result(timeout=timeout_s + 5.0)

    def _fetch(self, producer: ProducerAddress, mm_hash: str, timeout_s: float | None, *,
               nbytes: int | None = None, ticket: Ticket | None = None) -> Outcome:
        """Fetch, blocking until landed or missed (never past the deadline): on the calling
        thread when nothing else is in flight, else through the I/O thread."""
        if self._stop.is_set():
            return Miss(mm_hash, MissReason.INTERNAL, "consumer closed")
        fut: Future[Any] = Future()
        item = StartFetch(producer, mm_hash, self._deadline(timeout_s), fut, nbytes=nbytes,
                          ticket=ticket)
        lock = self.driver.lock
        if threading.current_thread() is not self._thread and self._lock_for_caller():
            try:  # the I/O thread is parked (or between steps): drive this fetch here
                self._owner = threading.get_ident()
                if self._stop.is_set():
                    return Miss(mm_hash, MissReason.INTERNAL, "consumer closed")
                self._drive_until(item)
                wake = not self.driver.idle() or self._stop.is_set()
            finally:
                self._owner = 0
                lock.release()
            if wake:
                self._wake_loop()  # what this caller leaves behind is the I/O thread's
        else:
            self._enqueue(item)
        try:
            return fut.result(timeout=max(0.0, item.deadline - self.driver.clock()) + 5.0)
        except concurrent.futures.TimeoutError:  # pragma: no cover - the loop guarantees one
            return Miss(mm_hash, MissReason.TIMEOUT, "no outcome from the consumer loop")

    def step(self, now: float | None = None) -> bool:
        """Drive one non-blocking round on the calling thread if no other thread is driving
        (e.g. from the vLLM scheduler's step, so that outcomes resolve there without waiting for
        the I/O thread); returns whether it did. ``now``: see :meth:`ConsumerDriver.step`."""
        lock = self.driver.lock
        if self._stop.is_set() or not lock.acquire(blocking=False):
            return False
        try:
            self._owner = threading.get_ident()
            if self.driver.closed:
                return False
            self.driver.step(now, wait_s=0.0)
        except Exception:
            log.exception("unexpected consumer loop error (continuing)")
        finally:
            self._owner = 0
            lock.release()
        return True

    def _stats(self) -> dict[str, int]:
        """A consistent snapshot of the driver's gauges: taken under its lock when it is free
        (or held by this very thread, e.g. an observer), else by the driving thread."""
        d = self.driver
        if self._owner == threading.get_ident():  # this thread drives (an observer asks)
            return d.gauges()
        if d.lock.acquire(blocking=False):
            try:
                return d.gauges()
            finally:
                d.lock.release()
        fut: Future[dict[str, int]] = Future()
        self._enqueue(Snapshot(fut))  # the driving thread's next step answers
        try:
            return fut.result(timeout=_SNAPSHOT_WAIT_S)
        except concurrent.futures.TimeoutError:  # pragma: no cover - a step is never that long
            with d.lock:
                return d.gauges()

    def close(self) -> None:
        """Stop; in-flight fetches end as misses, handles are released. Idempotent.

        The landing region stays mapped while a result still refers to it."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_loop()
        self._thread.join(timeout=10.0)
        self.driver.close_resources()

    # -- the I/O thread ------------------------------------------------------------------------
    def _run(self) -> None:
        d = self.driver
        fresh = True  # events may have queued while parked: step once before parking again
        while not self._stop.is_set():
            with d.lock:
                self._owner = threading.get_ident()
                if fresh or not d.idle():
                    self._brief = fresh  # a non-blocking step: a fetch() may wait for the lock
                    self._guarded_step(wait_s=0.0 if fresh else None)
                    self._brief = fresh = False
                    if not d.idle() and not self._want:
                        self._owner = 0
                        continue
                # idle, or a caller asked for the lock (_lock_for_caller): it drives everything
                # while it holds the lock and kicks us when it leaves work behind
                park_s = d.idle_timeout()
                self._owner = 0
            # Nothing in flight: park without the lock so that a caller of fetch() can drive
            # its own fetch; submit()/release/close kick us awake.
            self._kick.wait(park_s)
            self._kick.clear()
            fresh = True
        with d.lock:
            self._owner = threading.get_ident()
            d.shutdown()
            self._owner = 0

    def _enqueue(self, item: InboxItem) -> None:
        """Queue work for whoever drives the node and wake the I/O thread. Once the driver has
        shut down nobody drives it: the item is failed here (the shutdown sets ``closed`` before
        its own drain, so an item appended before that drain is failed by it, any later one
        here)."""
        d = self.driver
        d.post(item)
        if d.closed:
            with d.lock:
                d.fail_inbox()
        else:
            self._wake_loop()

    def _guarded_step(self, wait_s: float | None = None) -> None:
        d = self.driver
        try:
            d.step(wait_s=wait_s)
        except Exception:
            log.exception("unexpected consumer loop error (continuing)")
            time.sleep(0.01)  # not a busy loop if the error repeats
            return
        if not d.inbox and d.busy():
            # A transfer is still in flight after this round of checks: yield the CPU instead of
            # spinning, so the data plane's progress threads (and the producer, on a small host)
            # can run; the sleep bounds the added latency to ~_BUSY_SLEEP_S (zmq polls have 1 ms
            # granularity). Measured on 2 cores, interleaved: spinning made 64 KiB fetches 5x
            # slower (8.5 vs 1.7 ms p50) and 8.8 MiB ones 1.2x slower.
            time.sleep(_BUSY_SLEEP_S)

    def _drive_until(self, item: StartFetch) -> None:
        """Start a fetch and run the loop on the calling thread (lock held) until it is
        resolved, the node stops or the deadline is well past; the I/O thread takes over
        whatever is left. Events that queued while the loop was parked are handled in the
        first poll after the request is sent (the session copes with them at any point)."""
        d = self.driver
        d.start_fetch(item, d.clock())
        self._drive(item.future.done, item.deadline)

    def _drive(self, done: Callable[[], bool], deadline: float) -> None:
        """Step (lock held) until ``done()``, the node stops or ``deadline`` is well past."""
        d = self.driver
        limit = deadline + 1.0
        while not done() and not self._stop.is_set() and d.clock() < limit:
            self._guarded_step()

    def _wake_loop(self) -> None:
        """Un-park the I/O thread and interrupt whichever thread is in the control poll."""
        self._kick.set()
        self.driver.control.wake()
