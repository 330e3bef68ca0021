"""What running work on a thread that was idle costs on this host, with no ectransport at all.

    python benchmarks/wakecost.py [--mib 8.8] [--n 300]

The same copy of ``--mib`` MiB into a preallocated NumPy array, timed (p50 of ``--n``) four ways:
back to back on one thread; on a worker thread woken for each copy (the caller waits on an
``Event``: the shape of a fetch handed to an I/O thread); and on one thread sleeping 0.2 ms and
2 ms between copies. On a small VM a CPU that was idle runs the copy up to 2x slower (its caches
and, on a VM, its vCPU were given up meanwhile): this is the floor under issue 22's hand-off, see
``benchmarks/BUILDS.md``. Last, an empty hand-over and back (a ``Future`` passed through a queue
to a worker thread that sets it; the caller waits on it): the least any fetch handed to an I/O
thread pays on top of its own work.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from concurrent.futures import Future

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=8.8, help="bytes per copy, MiB")
    ap.add_argument("--n", type=int, default=300, help="copies per way")
    a = ap.parse_args()
    src = np.ones(int(a.mib * (1 << 20)), dtype=np.uint8)
    dst = np.zeros_like(src)

    def copy() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t

    def spaced(gap_s: float) -> list[float]:
        out = []
        for _ in range(a.n):
            out.append(copy())
            time.sleep(gap_s)
        return out

    ways = {"back to back, one thread": [copy() for _ in range(a.n)]}
    go, done, woken = threading.Event(), threading.Event(), []

    def worker() -> None:
        for _ in range(a.n):
            if not go.wait(10.0):
                return
            go.clear()
            woken.append(copy())
            done.set()

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    for _ in range(a.n):
        done.clear()
        go.set()
        if not done.wait(10.0):
            raise SystemExit("the worker thread did not answer within 10 s")
        time.sleep(0.0002)
    th.join(10.0)
    ways["on a thread woken for each copy"] = woken
    ways["one thread, 0.2 ms idle between copies"] = spaced(0.0002)
    ways["one thread, 2 ms idle between copies"] = spaced(0.002)
    ways["empty hand-over and back (no copy)"] = round_trips(a.n * 10)
    for name, ts in ways.items():
        print(f"{name:42} p50 {statistics.median(ts) * 1e6:8.0f} µs")


def round_trips(n: int) -> list[float]:
    """Seconds per empty hand-over: a Future through a queue to a worker that sets it."""
    q: queue.SimpleQueue[Future[None] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (fut := q.get()) is not None:
            fut.set_result(None)

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    out = []
    for _ in range(n):
        fut: Future[None] = Future()
        t = time.perf_counter()
        q.put(fut)
        fut.result(timeout=10.0)
        out.append(time.perf_counter() - t)
    q.put(None)
    th.join(10.0)
    return out[n // 10:]  # the first tenth warms up


if __name__ == "__main__":
    main()
