"""The consumer's one I/O thread.

Ownership rule: the I/O thread alone drives the :class:`~ectransport.node.consumer_driver.
ConsumerDriver` — it alone touches the control sockets, the data planes, the sessions and the
landing store. Every other thread hands work over (:meth:`IoLoop.submit`: the driver's inbox,
then a wake-up of the thread's control poll) and waits for its future with a deadline
(:meth:`IoLoop.wait`). Nothing is shared but the inbox (a deque, appended atomically) and the
futures (which lock themselves).

The thread steps the driver in a loop and sets the futures of each step's outcomes right before
it blocks (in the control poll, or in the sleep below), so that the callers it wakes find the
interpreter free. While a transfer is in flight it checks without waiting and sleeps
:data:`BUSY_SLEEP_S` between checks (yielding the CPU to the data plane's progress
threads and, on a small host, to the producer: spinning made 64 KiB fetches 5x slower on 2
cores); otherwise it waits in the control poll until the next deadline (at most
:data:`~ectransport.node.consumer_driver.MAX_WAIT_S`) or a wake-up.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import sys
import threading
import time
from concurrent.futures import Future
from typing import TypeVar

from ectransport.node.consumer_driver import ConsumerDriver
from ectransport.node.inbox import InboxItem

log = logging.getLogger("ectransport.node.consumer")

T = TypeVar("T")

#: While transfers are in flight the thread sleeps this long between checks, seconds.
BUSY_SLEEP_S = 50e-6
#: How long :meth:`IoLoop.close` waits for the thread to finish its shutdown, seconds.
JOIN_S = 10.0


class IoLoop:
    """Runs ``driver`` on a thread of its own named ``ect-<name>`` (module docstring)."""

    def __init__(self, driver: ConsumerDriver, *, name: str):
        self.driver = driver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ect-{name}", daemon=True)
        self._thread.start()

    @property
    def on_loop(self) -> bool:
        """Whether the calling thread is the I/O thread (an observer, say)."""
        return threading.current_thread() is self._thread

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def submit(self, item: InboxItem) -> None:
        """Hand ``item`` to the I/O thread and wake it (any thread)."""
        self.driver.post(item)
        self.driver.control.wake()

    def wait(self, fut: Future[T], deadline: float, *, grace_s: float = 5.0) -> T:
        """``fut``'s result, waiting until ``deadline`` (the driver's clock) plus ``grace_s``:
        the driver resolves every fetch by its deadline, so the grace is only ever spent if the
        I/O thread is stuck.

        Raises:
            concurrent.futures.TimeoutError: no result by then; whatever the future raises.
        """
        return fut.result(timeout=max(0.0, deadline - self.driver.clock()) + grace_s)

    def close(self) -> None:
        """Stop the thread (in-flight fetches miss, handles are released, queued work fails),
        then close the control client, the planes and the region. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.driver.control.wake()
        self._thread.join(timeout=JOIN_S)
        if self._thread.is_alive():  # pragma: no cover - a plane call that never returns
            log.error("consumer I/O thread did not stop within %.0f s; closing anyway", JOIN_S)
        self.driver.parts.close()

    def _run(self) -> None:
        _fine_timer_slack()
        d = self.driver
        while not self._stop.is_set():
            try:
                d.step(wait_s=None, hold_results=True)  # delivered just before we block
            except Exception:
                log.exception("unexpected consumer loop error (continuing)")
                d.outcomes.deliver()
                self._stop.wait(0.01)  # not a busy loop if the error repeats
                continue
            if not d.inbox and d.busy():
                d.outcomes.deliver()
                time.sleep(BUSY_SLEEP_S)
        try:
            d.shutdown()
        except Exception:  # pragma: no cover - reported, the resources still close
            log.exception("consumer shutdown failed")


def _fine_timer_slack() -> None:
    """Let this thread's short sleeps end on time: Linux rounds a sleep up by the thread's timer
    slack (50 µs by default), which made the busy loop's 50 µs sleep take about 120 µs here
    (prctl PR_SET_TIMERSLACK to 1 µs: 73 µs). Elsewhere, or if refused, nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, ns
    except (OSError, AttributeError):  # pragma: no cover - no libc symbol
        pass


def result_or_miss(loop: IoLoop, fut: Future[T], deadline: float, miss: T) -> T:
    """``fut``'s result by the deadline (:meth:`IoLoop.wait`), or ``miss`` if none came (a
    stuck I/O thread, or a node closed meanwhile)."""
    try:
        return loop.wait(fut, deadline)
    except concurrent.futures.TimeoutError:  # pragma: no cover - the driver ends each fetch
        return miss
    except Exception:  # pragma: no cover - closed while waiting
        return miss
