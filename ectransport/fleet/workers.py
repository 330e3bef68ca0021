"""The directory's worker threads: its asynchronous calls never block their caller.

A :class:`Workers` runs a call on one of two pools — ``lookups`` (one thread: a scheduler's
lookups, in order) and ``waits`` (4 threads: ``claim_or_wait``, which may wait seconds for a
claimant) — and caps the calls queued at :data:`MAX_IN_FLIGHT`: beyond it, or once closed, the
future is already done with the call's refusal (``BUSY`` / ``CLOSED``), so a caller that
submits every step never piles up work behind an outage.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable
from typing import Any

from ectransport.fleet.outcomes import DirectoryUnavailable, UnavailableReason

log = logging.getLogger("ectransport.fleet")

#: asynchronous calls queued at most before submits answer BUSY
MAX_IN_FLIGHT = 256

_THREADS = {"lookups": 1, "waits": 4}


class Workers:
    """The lookup and waiting threads of one directory (module docstring; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self._pools: dict[str, cf.ThreadPoolExecutor] = {}

    def submit(
        self,
        pool: str,
        fn: Callable[[], Any],
        refused: Callable[[DirectoryUnavailable], Any],
        callback: Callable[[Any], None] | None,
    ) -> cf.Future[Any]:
        """Run ``fn`` on ``pool`` (``lookups`` or ``waits``); its future. ``refused(why)`` is
        the result when the call is not run; ``callback(result)`` is called on the worker
        thread (or at once when refused; exceptions are logged)."""
        with self._lock:
            ex = None
            if self._in_flight < MAX_IN_FLIGHT and not self._closed:
                self._in_flight += 1
                ex = self._pools.get(pool)
                if ex is None:
                    ex = self._pools[pool] = cf.ThreadPoolExecutor(
                        _THREADS[pool], thread_name_prefix=f"ect-fleet-{pool}"
                    )
            closed = self._closed
        if ex is None:
            reason = UnavailableReason.CLOSED if closed else UnavailableReason.BUSY
            fut: cf.Future[Any] = cf.Future()
            fut.set_result(refused(DirectoryUnavailable(reason, f"{MAX_IN_FLIGHT} calls queued")))
            call_back(callback, fut.result())
            return fut

        def run() -> Any:
            try:
                out = fn()
            finally:
                with self._lock:
                    self._in_flight -= 1
            call_back(callback, out)
            return out

        try:
            return ex.submit(run)
        except RuntimeError:  # closed meanwhile
            with self._lock:
                self._in_flight -= 1
            fut = cf.Future()
            fut.set_result(refused(DirectoryUnavailable(UnavailableReason.CLOSED)))
            return fut

    def close(self) -> None:
        """Refuse new calls; cancel the queued ones (running ones end by their deadlines)."""
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for ex in pools:
            ex.shutdown(wait=False, cancel_futures=True)


def call_back(callback: Callable[[Any], None] | None, value: Any) -> None:
    """``callback(value)``, its exceptions logged and dropped."""
    if callback is None:
        return
    try:
        callback(value)
    except Exception:
        log.exception("fleet directory: a lookup callback raised (ignored)")
