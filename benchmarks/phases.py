"""How one measurement phase of the benchmark runs: the producer process (:class:`Server`, i.e.
``server.py`` driven over its stdin/stdout), a :class:`Phase` that opens only what it measures in
both processes and closes it after, and the two ways paths are sampled within a phase
(:func:`interleaved` latency, pipelined :func:`throughput`). A path is any object with ``name``,
``one(size_index, slot) -> seconds`` and ``window(size_index, k, m) -> seconds``
(``fetchpaths.py``).
"""

from __future__ import annotations

import gc
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import HIDDEN, Config, copies_of, log

HERE = Path(__file__).resolve().parent


class Server:
    """The producer process (``server.py``): opens/closes endpoints on command, one phase at a
    time; between phases nothing is open in it."""

    def __init__(self, cfg: Config, sizes: list[int], keydir: Path):
        from ectransport.control.keys import allow_key, generate_keypair

        generate_keypair(keydir / "keys", "producer")
        generate_keypair(keydir / "keys", "consumer")
        allow_key(keydir / "allow", keydir / "keys" / "consumer.key")
        self.consumer_secret = str(keydir / "keys" / "consumer.key_secret")
        conf = {"sizes": sizes, "planes": cfg.planes, "hidden": HIDDEN,
                "copies": [copies_of(n) for n in sizes],
                "producer_secret": str(keydir / "keys" / "producer.key_secret"),
                "allow_dir": str(keydir / "allow")}
        self.errf = open(keydir / "server.stderr", "w+")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "server.py"), "--config",
                                      json.dumps(conf)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.errf, text=True)
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self._q.put(ln) for ln in self.proc.stdout]
                         + [self._q.put(None)], daemon=True).start()
        self.info = self._reply(180)["ready"]

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.errf.seek(0)
                raise RuntimeError("benchmark server died or hung:\n" + self.errf.read()[-3000:])
            if line.startswith("{"):
                return json.loads(line)

    def call(self, timeout: float = 180, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def open(self, **req) -> tuple[int, dict]:
        r = self.call(op="open", **req)
        if "error" in r:
            raise RuntimeError(r["error"])
        return r["id"], r["info"]

    def close_ep(self, h: int) -> dict:
        return self.call(op="close", id=h)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=20)
        except Exception:
            self.proc.kill()
        self.errf.close()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class Phase:
    """One measurement phase: only the endpoints it opens are alive, in both processes.

    On entry it checks that both processes are idle (threads, CPU-s/s over 0.5 s: a leftover
    NIXL agent would show ~0.3-0.7 CPU-s/s); on exit it closes what it opened, consumer side
    first, and records its duration and load average."""

    def __init__(self, result: dict, server: Server, name: str):
        self.result, self.server, self.name = result, server, name
        self.remote: list[int] = []
        self.local: list = []
        self.rec: dict = {"name": name, "opened": []}

    def __enter__(self) -> Phase:
        gc.collect()
        self.rec["loadavg_start"] = os.getloadavg()[0]
        c0 = _cpu_s()
        idle = self.server.call(op="idle", seconds=0.5)
        self.rec["idle_before"] = {
            "server": {"threads": idle["threads"], "cpu_per_s": round(idle["cpu_per_s"], 3),
                       "open": idle["open"]},
            "consumer": {"threads": _threads(), "cpu_per_s": round((_cpu_s() - c0) / 0.5, 3)}}
        self.t0 = time.perf_counter()
        log(f"phase {self.name}: start (idle check {self.rec['idle_before']})")
        return self

    def open(self, label: str, **req) -> dict:
        h, info = self.server.open(**req)
        self.remote.append(h)
        self.rec["opened"].append(label)
        return {"id": h, **info}

    def close_remote(self, h: int) -> None:
        if h in self.remote:
            self.remote.remove(h)
            self.server.close_ep(h)

    def add(self, obj):
        self.local.append(obj)
        return obj

    def drop(self, obj) -> None:
        if obj in self.local:
            self.local.remove(obj)
            obj.close()

    def running(self) -> None:
        """Record the thread counts with everything of this phase open."""
        self.rec.setdefault("threads_open", []).append(
            {"server": self.server.call(op="idle", seconds=0.0)["threads"],
             "consumer": _threads()})

    def __exit__(self, *exc) -> None:
        for obj in reversed(self.local):
            try:
                obj.close()
            except Exception as e:
                log(f"phase {self.name}: closing {obj}: {e}")
        self.local.clear()
        gc.collect()
        for h in reversed(self.remote):
            try:
                self.server.close_ep(h)
            except Exception as e:
                log(f"phase {self.name}: closing server endpoint {h}: {e}")
        self.remote.clear()
        self.rec["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.rec["loadavg_end"] = os.getloadavg()[0]
        self.result["phases"].append(self.rec)
        log(f"phase {self.name}: done in {self.rec['seconds']} s, opened {self.rec['opened']}")


def interleaved(paths: list, i: int, warmup: int, reps: int, slots: int) -> dict[str, list[float]]:
    """One sample per path per rep, A/B/A/B, order reversed on odd reps; warm-up discarded."""
    samples: dict[str, list[float]] = {p.name: [] for p in paths}
    for rep in range(warmup + reps):
        order = paths if rep % 2 == 0 else paths[::-1]
        for p in order:
            dt = p.one(i, rep % slots)
            if rep >= warmup:
                samples[p.name].append(dt)
    return samples


def throughput(paths: list, i: int, nbytes: int, k: int, reps: int) -> dict[str, dict]:
    m = max(2 * k, 8)
    out: dict[str, list[float]] = {p.name: [] for p in paths}
    for rep in range(reps + 1):  # rep 0 is a warm-up
        order = paths if rep % 2 == 0 else paths[::-1]
        for p in order:
            dt = p.window(i, k, m)
            if rep:
                out[p.name].append(m * nbytes / dt / 1e9)
    res = {}
    for name, xs in out.items():
        res[name] = {"gbps": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
                     "entries_per_rep": m}
    return res
