"""Where does one ectransport fetch spend its time? (a profiling aid for docs/performance.md)

    python benchmarks/profile_fetch.py [--plane nixl] [--size 8.8MiB] [-n 200] [--plain]
        [--announced] [--idle-nodes K]
    py-spy record --subprocesses -o prof.svg -- python benchmarks/profile_fetch.py -n 500

Starts the benchmark server (producer process) with one ProducerNode offering one plane (nothing
else open, as in the benchmark's phases) and fetches one size repeatedly, printing the
p50/min of each phase of ``Fetched.timings`` (req: submit → XferReq sent; ack: → XferAck; posted:
→ data-plane transfer posted; landed: → bytes landed; total) next to the wall time of fetch(),
and the CPU time each process spent per fetch over the measured ones (consumer: this process, all
its threads; producer: the server process), from ``/proc`` (Linux).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import fetchpaths  # noqa: E402
from phases import Server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plane", default="nixl")
    ap.add_argument("--size", default="8.8MiB", choices=list(common.SIZES))
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--plain", action="store_true", help="no CURVE")
    ap.add_argument("--announced", action="store_true",
                    help="fetch on the producer's tickets (ECTP v2 §10: a READ, no request)")
    ap.add_argument("--busy-timeout-us", type=float, default=None,
                    help="experiment: make the consumer loop poll with this timeout instead of "
                         "spinning (poll(0)) while a transfer is in flight (monkeypatch)")
    ap.add_argument("--idle-nodes", type=int, default=0,
                    help="also keep this many other ConsumerNodes connected and idle in this "
                         "process (the benchmark's phases keep the v1, request and raw paths "
                         "open beside the one being timed)")
    a = ap.parse_args()
    if a.busy_timeout_us is not None:
        _patch_busy_poll(a.busy_timeout_us * 1e-6)
    cfg = common.Config(planes=[a.plane], curve_off=a.plain, sizes=[a.size])
    nbytes = common.rows_of(a.size) * common.BLOCK
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(cfg, [nbytes], Path(tmp))
        try:  # as in the benchmark's solo phase: one ProducerNode, one ConsumerNode, nothing else
            _, info = server.open(kind="ect", plane=a.plane, curve=not a.plain)
            kind = fetchpaths.AnnouncedPath if a.announced else fetchpaths.EctPath
            p = kind("ect", a.plane, not a.plain, info, server.consumer_secret, [nbytes], {0: 1})
            idle = [fetchpaths.EctPath(f"idle{j}", a.plane, not a.plain, info,
                                       server.consumer_secret, [nbytes], {0: 1})
                    for j in range(a.idle_nodes)]
            phases: dict[str, list[float]] = {}
            walls = []
            cpu0: tuple[float, float] | None = None
            for k in range(a.n + 5):
                if k == 5:
                    cpu0 = (_cpu_s(os.getpid()), _cpu_s(server.proc.pid))
                t0 = time.perf_counter()
                mm = f"s0-c{k % 16}"
                ticket = p.tickets.get(mm) if a.announced else None
                out = p.node.fetch(p.addr, mm, ticket=ticket)
                wall = time.perf_counter() - t0
                assert out.ok, out
                if k >= 5:
                    walls.append(wall)
                    prev = 0.0
                    for ph in ("req", "ack", "posted", "landed", "total"):
                        v = out.timings.get(ph)
                        if v is not None:
                            phases.setdefault(ph, []).append(v - prev)
                            prev = v
                del out
            assert cpu0 is not None
            cpu = (_cpu_s(os.getpid()) - cpu0[0], _cpu_s(server.proc.pid) - cpu0[1])
            p.close()
            for q in idle:
                q.close()
        finally:
            server.close()
    print(f"{a.plane} {a.size} {'plain' if a.plain else 'CURVE'}: {a.n} fetches")
    for ph, xs in phases.items():
        print(f"  {ph:7s} +{statistics.median(xs) * 1e6:8.0f} µs p50  (min {min(xs) * 1e6:6.0f})")
    print(f"  wall    {statistics.median(walls) * 1e6:9.0f} µs p50  (min {min(walls) * 1e6:6.0f})")
    print(f"  CPU per fetch: consumer {cpu[0] / a.n * 1e6:.0f} µs, producer "
          f"{cpu[1] / a.n * 1e6:.0f} µs")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all threads (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _patch_busy_poll(timeout_s: float) -> None:
    """Re-define ConsumerDriver.step with ``wait_s = <timeout_s> if busy`` (measurement only)."""
    import inspect
    import textwrap

    from ectransport.node import consumer_driver

    src = textwrap.dedent(inspect.getsource(consumer_driver.ConsumerDriver.step))
    assert "0.0 if self.busy()" in src
    ns: dict = {}
    exec(src.replace("0.0 if self.busy()", f"{timeout_s!r} if self.busy()"),  # noqa: S102
         vars(consumer_driver), ns)
    consumer_driver.ConsumerDriver.step = ns["step"]


if __name__ == "__main__":
    main()
