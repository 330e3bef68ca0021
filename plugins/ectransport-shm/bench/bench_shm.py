"""Plane-level latency of one 8.8 MiB transfer (a Qwen2-VL image embedding) between two processes:
shm vs tcp (same run, interleaved) vs single-core memcpy.

    python plugins/ectransport-shm/bench/bench_shm.py [--reps 200] [--mib 8.8]

The producer planes run in a child process (this script with ``--serve``); the consumer measures
``start`` → DONE with the grant reused (the producer serves a grant until it is revoked), i.e.
the steady state of a pooled connection.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np
from ectransport.data.tcp import TcpPlane
from ectransport.store import HostRegion, Run

from ectransport_shm import ShmPlane

BLOCK_BYTES = 64 * 1024


def serve(nblocks: int, chunk_kib: int) -> None:
    region = HostRegion(nblocks, BLOCK_BYTES)
    region.buf[:] = np.arange(region.nbytes, dtype=np.uint64).astype(np.uint8)
    shm = ShmPlane(node_id="bench-p", region=region, chunk_bytes=chunk_kib << 10)
    planes = [shm, TcpPlane(node_id="bench-p", region=region)]
    for p in planes:  # one line per plane: grant and endpoint declaration (plugin API 2)
        grant = p.describe([Run(0, nblocks)], nblocks * BLOCK_BYTES)
        print(grant.hex(), p.endpoint().hex() or "-", flush=True)
    sys.stdin.readline()
    for p in planes:
        p.close()


def p50_ms(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100)
    return f"p50 {statistics.median(samples) * 1e3:6.2f} ms  p90 {q[89] * 1e3:6.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", type=int)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--mib", type=float, default=8.8)
    ap.add_argument("--chunk-kib", type=int, default=2048, help="shm ring slot size")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve, a.chunk_kib)
    nblocks = round(a.mib * 2**20 / BLOCK_BYTES)
    nbytes = nblocks * BLOCK_BYTES
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(nblocks),
                              "--chunk-kib", str(a.chunk_kib)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        declared = {name: child.stdout.readline().split() for name in ("shm", "tcp")}
        grants = {name: bytes.fromhex(g) for name, (g, _) in declared.items()}
        region = HostRegion(nblocks, BLOCK_BYTES)
        planes = {"shm": ShmPlane(node_id="bench-c", region=region),
                  "tcp": TcpPlane(node_id="bench-c", region=region)}
        bindings = {name: planes[name].bind_peer(bytes.fromhex(e.strip("-")), peer="bench:0",
                                                 host="127.0.0.1", identity="")
                    for name, (_, e) in declared.items()}
        src = np.ones(nbytes, dtype=np.uint8)
        times: dict[str, list[float]] = {"shm": [], "tcp": [], "memcpy": []}
        runs = [Run(0, nblocks)]
        for rep in range(a.reps + 5):
            order = ["shm", "tcp", "memcpy"] if rep % 2 == 0 else ["memcpy", "tcp", "shm"]
            for name in order:
                t0 = time.perf_counter()
                if name == "memcpy":
                    np.copyto(region.buf[:nbytes], src)
                else:
                    p = planes[name]
                    h = p.start(bindings[name], grants[name], runs, nbytes, b"")
                    while (s := p.check(h)).value == "proc":
                        time.sleep(0.0002)
                    p.release(h)
                    assert s.value == "done", s
                if rep >= 5:  # warm-up
                    times[name].append(time.perf_counter() - t0)
        print(f"{nbytes / 2**20:.2f} MiB, {a.reps} reps, producer in another process")
        for name, ts in times.items():
            gbs = nbytes / statistics.median(ts) / 1e9
            print(f"  {name:7s} {p50_ms(ts)}  ({gbs:5.2f} GB/s)")
        print(f"  shm producer chunk: {a.chunk_kib} KiB")
        for p in planes.values():
            p.close()
        region.close()
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=10)


if __name__ == "__main__":
    main()
