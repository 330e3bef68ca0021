"""Consumer side and orchestration of the ectransport benchmark (see ``docs/performance.md``).

The producer side runs in another OS process (``benchmarks/server.py``). The run is a sequence of
phases; each opens, in both processes, only what it measures and closes it before the next (every
NIXL agent has a progress thread; idle agents of other paths would take CPU from the measured one
on this 2-core host). Within a phase the paths are interleaved rep by rep (A/B/A/B, order
reversed on odd reps to cancel drift). Phases:

* ``baselines``: memcpy and safetensors, nothing else open;
* ``<plane>-curve`` / ``<plane>-plain``: one ProducerNode offering only that plane + the plane's
  raw endpoint; latency per size (and, CURVE on, pipelined throughput) of ect-<plane> A/B with
  raw-<plane> — and, where this build speaks ECTP v2 (issue 16), A/B/C with ect-<plane>-v1 (a
  consumer configured ``versions=(1,)``: the v1 path, against the same producer); then (CURVE
  on, 1 MiB in the run) a batch of 8 × 1 MiB: one ``submit_many`` (one ReqBatch on v2) vs 8 raw
  READs posted together (and the v1 path's 8 XferReqs); for nixl the raw endpoint is then closed
  and a pyzmq echo opened for the control-plane round trip;
* ``solo-*``: 8.8 MiB with ect-nixl alone, raw-nixl alone, and raw-nixl-spin (agents with NIXL's
  default, spinning progress thread) alone;
* ``nixl-scope`` / ``scope-micro``: the NIXL plane with ``grant_scope="grant"`` A/B with
  ``"region"`` (fetch latency and throughput, then per-grant costs in-process; ``scope.py``);
* ``consumers-nixl``: N ConsumerNodes vs N raw agents, one group alive at a time;
* ``recompute``;
* ``vllm-p2p-*``: vLLM's own ECCPUConnector P2P stack (its sessions over its NIXL transport,
  ``vllm_p2p.py``), ect-nixl (v2 and v1 paths) and raw-nixl, each path alone, every size.

Paths measured:

* ectransport fetches over each plane, CURVE on (and off);
* the raw plane without ectransport: NIXL READ between two agents, ucxx tag send/recv, TCP
  ``sendall``/``recv_into``;
* single-core memcpy (``numpy.copyto`` into a pre-faulted buffer);
* the safetensors save+load path (vLLM's ECExampleConnector) on /dev/shm and on a disk-backed dir;
* local recompute with the demo's ReferenceEncoder (separately: it is 100-1000x slower).

Results are a dict (see :func:`run`), written as JSON by ``report.py`` with the ratio table, a PNG
and ``docs/performance.md``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import itertools
import json
import math
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
HIDDEN = 3584  # Qwen2-VL-7B; one row = 7168 bytes (bf16)
BLOCK = HIDDEN * 2
MiB = 1 << 20

SIZES = {  # label -> target bytes (rounded to whole rows of BLOCK bytes)
    "64KiB": 64 * 1024,
    "1MiB": MiB,
    "4.7MiB": int(4.7 * MiB),
    "8.8MiB": int(8.8 * MiB),
    "42MiB": 42 * MiB,
    "64MiB": 64 * MiB,
}

#: Raw NIXL agents use ectransport's NIXL plane agent config (UCX backend, progress thread pausing
#: this long between passes), so an A/B differs only by ectransport. NIXL's Python default (0:
#: the progress thread spins, ~1 core per agent) is measured alone as ``raw-nixl-spin``.
RAW_NIXL_DELAY_US = 100


def _has_v2() -> bool:
    from ectransport.protocol import SUPPORTED_VERSIONS

    return 2 in SUPPORTED_VERSIONS


#: This build speaks ECTP v2: the v1 path (a consumer configured ``versions=(1,)``) is measured
#: A/B with the default (v2) one.
HAS_V2 = _has_v2()

TARGETS = {
    "single_8.8MiB_vs_raw_nixl": 1.25,
    "pipelined_ge4MiB_fraction_of_raw": 0.85,
    "control_rtt_plain_s": 150e-6,
    "control_rtt_curve_s": 250e-6,
    "speedup_vs_safetensors_8.8MiB": 5.0,
}


@dataclass
class Config:
    mode: str = "quick"
    sizes: list[str] = field(default_factory=lambda: ["1MiB", "8.8MiB"])
    planes: list[str] = field(default_factory=lambda: ["nixl", "tcp"])
    curve_off: bool = False  # also measure ectransport with plain ZMQ
    warmup: int = 3
    reps: int = 15  # latency samples per path and size (after warm-up)
    thr_reps: int = 5  # throughput repetitions
    inflight: list[int] = field(default_factory=lambda: [4])
    thr_min_bytes: int = 4 * MiB  # pipelined throughput for sizes >= this
    consumers: list[int] = field(default_factory=list)
    consumers_size: str = "8.8MiB"
    rtt_samples: int = 40
    recompute_reps: int = 5
    recompute_direct_max: int = 9 * MiB  # larger sizes: per-token time of the largest direct size
    safetensors: bool = True
    scope: bool = True  # the nixl grant_scope A/B (issue 13, benchmarks/scope.py)
    scope_sizes: list[str] | None = None  # labels compared there; None = every size of the run
    scope_reps: int = 15  # samples per scope and size (half above 9 MiB)
    micro_reps: int = 30  # samples per case of the in-process scope micro-benchmarks
    vllm_p2p: bool = True  # vLLM's own ECCPUConnector P2P stack at each size (vllm_p2p.py)
    vllm_p2p_blocks: int = 1  # phases per path there (ABCD, DCBA, ...), samples pooled

    @classmethod
    def quick(cls) -> Config:
        # recompute: direct at 1 MiB only, the 8.8 MiB figure is its per-token time scaled
        return cls(recompute_direct_max=2 * MiB, warmup=2, reps=9, rtt_samples=30)

    @classmethod
    def full(cls) -> Config:
        return cls(mode="full", sizes=list(SIZES), planes=["nixl", "tcp", "ucx"], curve_off=True,
                   warmup=3, reps=25, thr_reps=5, inflight=[1, 4, 16], consumers=[1, 2, 8],
                   rtt_samples=200, scope_sizes=["64KiB", "1MiB", "8.8MiB", "64MiB"],
                   scope_reps=100, micro_reps=200, vllm_p2p_blocks=2)


def rows_of(label: str) -> int:
    return max(1, round(SIZES[label] / BLOCK))


def copies_of(nbytes: int) -> int:
    """Distinct entries per size on the producer (max pipelining depth for that size)."""
    return 16 if nbytes <= 9 * MiB else 4


def stats(xs: list[float]) -> dict:
    s = sorted(xs)
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    p90 = s[min(len(s) - 1, math.ceil(0.90 * len(s)) - 1)]
    return {"p50": statistics.median(s), "p90": p90, "p99": p99, "min": s[0], "max": s[-1],
            "n": len(s)}


#: UCX variables the user set before the benchmark started; any other UCX_* variable was put in
#: os.environ by ``import ucxx`` (UCX_RNDV_THRESH=8192, ...), which would change how NIXL agents
#: created later in this process talk UCX (measured: UCX_RNDV_THRESH=8192 in the READ initiator's
#: environment makes an 8.8 MiB NIXL READ 40-120 ms instead of ~1-1.5 ms here).
_USER_UCX_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))


@contextlib.contextmanager
def nixl_env():
    """Create NIXL agents without the UCX variables ucxx's import injected (restored after)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ)
             if k.startswith("UCX_") and k not in _USER_UCX_ENV}
    try:
        yield
    finally:
        os.environ.update(saved)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- producer process ---------------------------------------------------------------------------


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


# -- paths: each has setup(), one(size_index, slot) -> seconds, window(size_index, k, m) ----------


#: ``Fetched.timings`` keys in order: submit → XferReq sent, → XferAck, → transfer posted, →
#: bytes landed, → result (seconds since the fetch started).
FETCH_PHASES = ("req", "ack", "posted", "landed", "total")


class EctPath:
    def __init__(self, name: str, plane: str, curve: bool, ect: dict, consumer_secret: str,
                 sizes: list[int], max_k: dict[int, int], versions: tuple[int, ...] | None = None):
        """``ect``: what the server's ``open kind=ect`` answered (port, public_key);
        ``versions``: the ECTP versions the consumer speaks (None: the build's; ``(1,)``: the v1
        path)."""
        from ectransport.node.common import Layout, Security
        from ectransport.node.consumer import ConsumerNode, ProducerAddress

        self.name, self.plane, self.curve = name, plane, curve
        self.addr = ProducerAddress("127.0.0.1", ect["port"], ect["public_key"] if curve else None)
        sec = Security.from_files(consumer_secret) if curve else Security(insecure=True)
        # landing region: max_k[i] entries of size i in flight, plus one being given back
        need = max(-(-sizes[i] // BLOCK) * (k + 1) for i, k in max_k.items())
        with nixl_env() if plane == "nixl" else contextlib.nullcontext():
            kw = {} if versions is None else {"versions": versions}
            self.node = ConsumerNode(layout=Layout(hidden=HIDDEN),
                                     region_bytes=need * BLOCK + BLOCK, security=sec,
                                     planes=(plane,), fetch_timeout_s=60.0, **kw)
        self.node.connect(self.addr, timeout_s=30.0)
        self.transport = self.node.plane_transports().get(plane, plane)
        self.rtts: list[float] = []
        #: size index -> fetch phase -> seconds (``Fetched.timings`` deltas), when not None
        self.breakdown: dict[int, dict[str, list[float]]] | None = None

    def one(self, i: int, slot: int) -> float:
        t0 = time.perf_counter()
        out = self.node.fetch(self.addr, f"s{i}-c{slot}")
        dt = time.perf_counter() - t0
        if not out.ok:
            raise RuntimeError(f"{self.name}: fetch missed: {out.reason} {out.detail}")
        t = out.timings
        if "ack" in t and "req" in t:
            self.rtts.append(t["ack"] - t["req"])
        if self.breakdown is not None:
            prev, mine = 0.0, self.breakdown.setdefault(i, {})
            for ph in FETCH_PHASES:
                if ph in t:
                    mine.setdefault(ph, []).append(t[ph] - prev)
                    prev = t[ph]
            mine.setdefault("wall", []).append(dt)
        del out  # zero copy: dropping the Fetched returns its blocks to the region
        return dt

    def batch(self, i: int, n: int) -> float:
        """n distinct entries of size i asked for together (``fetch_many``: one ReqBatch on
        ECTP v2, n XferReqs on v1; driven on this thread, as ``one`` drives ``fetch``), until
        all landed; wall seconds."""
        t0 = time.perf_counter()
        outs = self.node.fetch_many(self.addr, [f"s{i}-c{slot}" for slot in range(n)])
        dt = time.perf_counter() - t0
        bad = [r for r in outs if not r.ok]
        if bad:
            raise RuntimeError(f"{self.name}: batch fetch missed: {bad[0].reason} "
                               f"{bad[0].detail}")
        del outs  # the Fetched hold their landing blocks: drop them first
        return dt

    def window(self, i: int, k: int, m: int) -> float:
        """m fetches of size i with k in flight (one distinct key per slot); wall seconds."""
        node, addr = self.node, self.addr
        left = m
        t0 = time.perf_counter()
        pending = {}
        for slot in range(min(k, m)):
            pending[node.submit(addr, f"s{i}-c{slot}")] = slot
            left -= 1
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            free = []
            for f in done:
                free.append(pending.pop(f))
                r = f.result()
                if not r.ok:
                    raise RuntimeError(f"{self.name}: fetch missed: {r.reason} {r.detail}")
            # a Future holds its Fetched (and so the pinned landing blocks): drop both before
            # the next submit so the blocks are back in the region first
            del done, f, r
            for slot in free:
                if left:
                    pending[node.submit(addr, f"s{i}-c{slot}")] = slot
                    left -= 1
        return time.perf_counter() - t0

    def close(self) -> None:
        self.node.close()
        self.node = None


class AnnouncedPath(EctPath):
    """An ectransport consumer fetching on the producer's tickets (ECTP v2 §10): every entry was
    announced by the producer, so each fetch READs at once on the offer its session holds, with
    no request (``ect-<plane>-announced``)."""

    def __init__(self, name: str, plane: str, curve: bool, ect: dict, *args, **kw):
        super().__init__(name, plane, curve, ect, *args, **kw)
        from ectransport.protocol import Ticket

        self.tickets = {mm: Ticket(producer=p, hold_id=h, mm_hash=mm)
                        for mm, (p, h) in (ect.get("tickets") or {}).items()}
        deadline = time.monotonic() + 30.0  # the holds' offers, replayed at the first Sync
        while self.node.stats()["offers_held"] < len(self.tickets) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        self.offered = self.node.stats()["offers_held"]

    def one(self, i: int, slot: int) -> float:
        mm = f"s{i}-c{slot}"
        t0 = time.perf_counter()
        out = self.node.fetch(self.addr, mm, ticket=self.tickets.get(mm))
        dt = time.perf_counter() - t0
        if not out.ok:
            raise RuntimeError(f"{self.name}: fetch missed: {out.reason} {out.detail}")
        del out
        return dt

    def batch(self, i: int, n: int) -> float:
        names = [f"s{i}-c{slot}" for slot in range(n)]
        t0 = time.perf_counter()
        outs = self.node.fetch_many(self.addr, names,
                                    tickets=[self.tickets.get(m) for m in names])
        dt = time.perf_counter() - t0
        bad = [r for r in outs if not r.ok]
        if bad:
            raise RuntimeError(f"{self.name}: batch fetch missed: {bad[0].reason}")
        del outs
        return dt


def _slots(n: int, nbytes: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        b = np.empty(nbytes, np.uint8)
        b[::4096] = 0
        out.append(b)
    return out


class RawNixl:
    _ids = itertools.count()

    def __init__(self, r: dict, sizes: list[int], slots: int, delay_us: int = RAW_NIXL_DELAY_US):
        """``delay_us``: the agent's progress-thread pause (µs; 0 = NIXL's spinning default)."""
        from nixl._api import nixl_agent, nixl_agent_config

        from ectransport.data.nixl import new_agent

        self.name = "raw-nixl"
        self.remote = r["agent"]
        self.descs = r["descs"]
        with nixl_env():
            self.agent = new_agent(nixl_agent, f"bench-raw-consumer-{next(self._ids)}",
                                   nixl_agent_config(backends=["UCX"]), delay_us)
        self.bufs = _slots(slots, max(sizes))
        self.reg = self.agent.register_memory(
            [(int(b.ctypes.data), b.nbytes, 0, "") for b in self.bufs], "DRAM")
        self.agent.add_remote_agent(base64.b64decode(r["meta"]))
        self.transport = "nixl/UCX (raw agents)"

    def _post(self, i: int, slot: int):
        addr, n = self.descs[i]
        ldl = self.agent.get_xfer_descs([(int(self.bufs[slot].ctypes.data), n, 0)], "DRAM")
        rdl = self.agent.get_xfer_descs([(addr, n, 0)], "DRAM")
        x = self.agent.initialize_xfer("READ", ldl, rdl, self.remote, b"")
        st = self.agent.transfer(x)
        if st == "ERR":
            raise RuntimeError("raw nixl: transfer failed")
        return x

    def _poll(self, x) -> bool:
        st = self.agent.check_xfer_state(x)
        if st == "ERR":
            raise RuntimeError("raw nixl: transfer failed")
        if st == "DONE":
            x.release()
            return True
        return False

    def one(self, i: int, slot: int) -> float:
        t0 = time.perf_counter()
        x = self._post(i, slot % len(self.bufs))
        while not self._poll(x):
            pass
        return time.perf_counter() - t0

    def window(self, i: int, k: int, m: int) -> float:
        t0 = time.perf_counter()
        left = m
        live = []
        for slot in range(min(k, m)):
            live.append((self._post(i, slot), slot))
            left -= 1
        while live:
            nxt = []
            for x, slot in live:
                if self._poll(x):
                    if left:
                        nxt.append((self._post(i, slot), slot))
                        left -= 1
                else:
                    nxt.append((x, slot))
            live = nxt
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.agent.remove_remote_agent(self.remote)
        except Exception:
            pass
        try:
            self.agent.deregister_memory(self.reg)
        except Exception:
            pass
        self.agent = None  # the last reference: the native agent and its progress thread go


class RawTcp:
    def __init__(self, r: dict, sizes: list[int], slots: int):
        self.name = "raw-tcp"
        self.port = r["port"]
        self.sizes = sizes
        self.bufs = _slots(slots, max(sizes))
        self.socks = []
        for _ in range(slots):
            s = socket.create_connection(("127.0.0.1", self.port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(s)
        self.transport = "TCP loopback, sendall/recv_into, 1 connection per in-flight transfer"

    def _get(self, i: int, slot: int) -> None:
        from server import ROWS_HEADER  # noqa: PLC0415

        s = self.socks[slot]
        s.sendall(ROWS_HEADER.pack(i))
        view = memoryview(self.bufs[slot])[: self.sizes[i]]
        got, n = 0, self.sizes[i]
        while got < n:
            r = s.recv_into(view[got:])
            if r == 0:
                raise RuntimeError("raw tcp: server closed")
            got += r

    def one(self, i: int, slot: int) -> float:
        t0 = time.perf_counter()
        self._get(i, slot % len(self.socks))
        return time.perf_counter() - t0

    def window(self, i: int, k: int, m: int) -> float:
        per = [m // k + (1 if s < m % k else 0) for s in range(k)]
        t0 = time.perf_counter()
        ths = [threading.Thread(target=lambda s=s: [self._get(i, s) for _ in range(per[s])])
               for s in range(k)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        return time.perf_counter() - t0

    def close(self) -> None:
        for s in self.socks:
            s.close()


class RawUcxx:
    def __init__(self, r: dict, sizes: list[int], slots: int):
        import ucxx

        self.name = "raw-ucx"
        self.sizes = sizes
        self.port = r["port"]
        self.loop = asyncio.new_event_loop()

        async def connect():
            return [await ucxx.create_endpoint("127.0.0.1", self.port,
                                               endpoint_error_handling=False)
                    for _ in range(slots)]

        self.eps = self.loop.run_until_complete(connect())
        self.bufs = _slots(slots, max(sizes))
        try:
            tls = ucxx.get_active_transports()
        except Exception:
            tls = "?"
        self.transport = f"ucxx tag send/recv, endpoint error handling off ({tls})"

    async def _get(self, i: int, slot: int) -> None:
        from server import ROWS_HEADER  # noqa: PLC0415

        ep = self.eps[slot]
        await ep.send(np.frombuffer(ROWS_HEADER.pack(i), np.uint8))
        await ep.recv(self.bufs[slot][: self.sizes[i]])

    def one(self, i: int, slot: int) -> float:
        t0 = time.perf_counter()
        self.loop.run_until_complete(self._get(i, slot % len(self.eps)))
        return time.perf_counter() - t0

    def window(self, i: int, k: int, m: int) -> float:
        per = [m // k + (1 if s < m % k else 0) for s in range(k)]

        async def lane(s: int) -> None:
            for _ in range(per[s]):
                await self._get(i, s)

        async def all_lanes() -> None:
            await asyncio.gather(*(lane(s) for s in range(k)))

        t0 = time.perf_counter()
        self.loop.run_until_complete(all_lanes())
        return time.perf_counter() - t0

    def close(self) -> None:
        async def shut():
            for ep in self.eps:
                try:
                    await ep.close()
                except Exception:
                    pass

        try:
            self.loop.run_until_complete(shut())
        except Exception:
            pass


class Memcpy:
    name = "memcpy"

    def __init__(self, sizes: list[int]):
        rng = np.random.default_rng(1)
        self.src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        self.dst = _slots(1, max(sizes))[0]

    def one(self, i: int, slot: int) -> float:
        src = self.src[i]
        dst = self.dst[: src.nbytes]
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0


class Safetensors:
    """vLLM ECExampleConnector's path: the producer ``save_file``s the tensor into a shared
    directory, the consumer ``load_file``s it (no fsync, as in vLLM); timed save + load."""

    def __init__(self, name: str, directory: Path, sizes: list[int]):
        import torch

        self.name = name
        self.dir = directory
        rng = np.random.default_rng(2)
        self.tensors = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
                        .view(torch.bfloat16).reshape(-1, HIDDEN) for n in sizes]

    def one(self, i: int, slot: int) -> float:
        from safetensors.torch import load_file, save_file

        path = str(self.dir / f"entry-{i}-{slot}.safetensors")
        t0 = time.perf_counter()
        save_file({"ec_cache": self.tensors[i]}, path)
        out = load_file(path)["ec_cache"]
        dt = time.perf_counter() - t0
        del out
        os.unlink(path)
        return dt


# -- measurements -------------------------------------------------------------------------------


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


def recompute(cfg: Config, labels: list[str], sizes: list[int]) -> dict:
    import torch

    from ectransport.demo.encoder import FACTOR, ReferenceEncoder

    enc = ReferenceEncoder(hidden=HIDDEN, dtype="bfloat16", seed=0)
    out: dict = {}
    per_token = None
    per_token_label = ""
    for label, n in sorted(zip(labels, sizes, strict=True), key=lambda x: x[1]):
        tokens = n // BLOCK
        if n > cfg.recompute_direct_max and per_token is not None:
            out[label] = {**{k: v * tokens for k, v in per_token.items()}, "method":
                          f"scaled: per-token time of {per_token_label} x {tokens} tokens"}
            continue
        a = max(1, int(math.sqrt(tokens)))
        b = -(-tokens // a)
        pix = torch.randn(3, FACTOR * a, FACTOR * b, generator=torch.Generator().manual_seed(0))
        xs = []
        for rep in range(1 + cfg.recompute_reps):
            t0 = time.perf_counter()
            enc.encode_pixels(pix)
            if rep:
                xs.append(time.perf_counter() - t0)
        st = stats(xs)
        scale = tokens / (a * b)
        out[label] = {k: (v * scale if k != "n" else v) for k, v in st.items()}
        out[label]["method"] = (f"direct: encode_pixels of a {FACTOR * a}x{FACTOR * b} image "
                                f"({a * b} tokens) scaled to {tokens} tokens")
        per_token = {k: v / tokens for k, v in out[label].items() if k in ("p50", "p99", "min",
                                                                           "max")}
        per_token_label = label
    return out


def control_rtt(cfg: Config, z: dict, ect: EctPath, small: int) -> dict:
    """XferReq→XferAck as the consumer sees it (Fetched.timings ack - req) for the smallest size,
    interleaved with a raw pyzmq DEALER→ROUTER echo of a 170-byte frame (the physical floor).
    ``z``: the server's zmq echo of the same security mode; ``ect.curve`` selects the mode."""
    import zmq

    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    if ect.curve:
        pub, sec = zmq.curve_keypair()
        d.curve_serverkey = z["server_key"].encode()
        d.curve_publickey, d.curve_secretkey = pub, sec
    d.connect(f"tcp://127.0.0.1:{z['port']}")
    frame = os.urandom(170)
    raw = []
    ect.rtts.clear()
    for rep in range(cfg.warmup + cfg.rtt_samples):
        t0 = time.perf_counter()
        d.send(frame)
        d.recv()
        dt = time.perf_counter() - t0
        ect.one(small, rep % 16)
        if rep >= cfg.warmup:
            raw.append(dt)
    d.close(linger=0)
    mode = "curve" if ect.curve else "plain"
    return {f"raw-zmq-{mode}": stats(raw), f"ect-{mode}": stats(ect.rtts[cfg.warmup:])}


RAW = {"nixl": RawNixl, "tcp": RawTcp, "ucx": RawUcxx}


def _open_raw(ph: Phase, result: dict, plane: str, sizes: list[int], slots: int,
              delay_us: int = RAW_NIXL_DELAY_US):
    """Open plane's raw endpoint on both sides (None, error recorded, if it cannot run);
    ``delay_us``: nixl agents' progress-thread pause on both sides."""
    try:
        r = ph.open(f"raw-{plane}", kind="raw", plane=plane, delay_us=delay_us)
    except Exception as e:
        result["errors"][f"raw-{plane}"] = str(e)
        log(f"raw {plane} unavailable (server side): {e}")
        return None
    try:
        raw = ph.add(RawNixl(r, sizes, slots, delay_us) if plane == "nixl"
                     else RAW[plane](r, sizes, slots))
    except Exception as e:
        result["errors"][f"raw-{plane}"] = f"{type(e).__name__}: {e}"
        log(f"raw {plane} unavailable: {e}")
        ph.close_remote(r["id"])
        return None
    result["transports"][raw.name] = raw.transport
    raw.remote_id = r["id"]
    return raw


def run(cfg: Config) -> dict:
    labels = cfg.sizes
    sizes = [rows_of(lb) * BLOCK for lb in labels]
    t_start = time.time()
    load0 = os.getloadavg()
    log(f"mode={cfg.mode} sizes={labels} planes={cfg.planes} load average {load0}")
    result: dict = {
        "meta": {
            "mode": cfg.mode, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_start": load0,
            "config": cfg.__dict__, "block_bytes": BLOCK, "hidden": HIDDEN,
            "method": {
                "processes": "producer = benchmarks/server.py subprocess; consumer = this "
                             "process; one phase at a time, each opening only what it measures "
                             "(one ProducerNode for one plane + that plane's raw endpoint) in "
                             "both processes and closing it before the next",
                "warmup": f"first {cfg.warmup} samples of every path and size discarded "
                          f"(they pay UCX/NIXL registration, connection set-up, page faults); "
                          f"throughput: 1 warm-up rep discarded",
                "buffers": "every source/destination buffer and region pre-touched (one write per "
                           "4 KiB page) before timing",
                "raw_nixl": f"raw NIXL agents (both processes) use ectransport's NIXL plane "
                            f"agent config: UCX backend, progress thread pausing "
                            f"{RAW_NIXL_DELAY_US} µs between passes; NIXL's Python default "
                            f"(spinning progress thread) is measured alone as raw-nixl-spin in "
                            f"the solo phases",
                "interleave": "within a phase, per rep one sample of every path (ectransport "
                              "over plane X and raw plane X), A/B/A/B, order reversed on odd "
                              "reps",
            },
        },
        "sizes": {lb: n for lb, n in zip(labels, sizes, strict=True)},
        "versions": _versions(),
        "transports": {}, "latency": {lb: {} for lb in labels}, "throughput": {},
        "consumers": {}, "control_rtt": {}, "solo": {}, "scope": {}, "phases": [],
        "errors": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="ect-bench-"))
    disk_dir = Path(tempfile.mkdtemp(prefix="ect-bench-disk-", dir="/var/tmp"))
    shm_dir = Path(tempfile.mkdtemp(prefix="ect-bench-", dir="/dev/shm"))
    server = None
    small = int(np.argmin(sizes))
    try:
        t0 = time.perf_counter()
        server = Server(cfg, sizes, tmp)
        log(f"producer process {server.info['pid']} ready in {time.perf_counter() - t0:.1f} s")
        max_k = {i: min(max(cfg.inflight or [1]), copies_of(n)) for i, n in enumerate(sizes)}
        slots = max([1, *max_k.values()] + ([BATCH_N] if "1MiB" in labels else []))

        # phase: memcpy and safetensors (nothing open in either process)
        with Phase(result, server, "baselines"):
            extras: list = [Memcpy(sizes)]
            if cfg.safetensors:
                extras += [Safetensors("safetensors-shm", shm_dir, sizes),
                           Safetensors("safetensors-disk", disk_dir, sizes)]
            for i, lb in enumerate(labels):
                reps = cfg.reps if sizes[i] <= 9 * MiB else max(5, cfg.reps // 2)
                smp = interleaved(extras, i, cfg.warmup, reps, copies_of(sizes[i]))
                result["latency"][lb].update({k: stats(v) for k, v in smp.items()})
            del extras

        # phases: one per plane and security mode — that plane's ProducerNode + its raw endpoint
        rtt_plane = "nixl" if "nixl" in cfg.planes else cfg.planes[0]
        for plane in cfg.planes:
            for curve in ([True, False] if cfg.curve_off else [True]):
                mode = "curve" if curve else "plain"
                name = f"ect-{plane}" + ("" if curve else "-plain")
                rawname = f"raw-{plane}" + ("" if curve else "@plain-phase")
                with Phase(result, server, f"{plane}-{mode}") as ph:
                    info = ph.open(name, kind="ect", plane=plane, curve=curve)
                    result["transports"].setdefault("producer", {}).update(info["transports"])
                    ect = ph.add(EctPath(name, plane, curve, info, server.consumer_secret, sizes,
                                         max_k if curve else dict.fromkeys(max_k, 1)))
                    result["transports"][name] = ect.transport
                    v1 = None
                    if curve and HAS_V2:  # the v1 path against the same producer (issue 16)
                        v1 = ph.add(EctPath(f"{name}-v1", plane, curve, info,
                                            server.consumer_secret, sizes, max_k, versions=(1,)))
                        result["transports"][v1.name] = v1.transport
                    ann = None
                    if curve and info.get("tickets"):  # offers: planes read one-sidedly
                        ann = ph.add(AnnouncedPath(f"{name}-announced", plane, curve, info,
                                                   server.consumer_secret, sizes, max_k))
                        result["transports"][ann.name] = ann.transport
                        log(f"{ann.name}: {ann.offered} of {len(ann.tickets)} offers held")
                    raw = _open_raw(ph, result, plane, sizes, slots)
                    if raw is not None:
                        raw.name = rawname
                    ph.running()
                    paths = [ect] + ([v1] if v1 is not None else []) + \
                        ([ann] if ann is not None else []) + ([raw] if raw is not None else [])
                    for i, lb in enumerate(labels):
                        t0 = time.perf_counter()
                        reps = cfg.reps if sizes[i] <= 9 * MiB else max(5, cfg.reps // 2)
                        smp = interleaved(paths, i, cfg.warmup, reps, copies_of(sizes[i]))
                        result["latency"][lb].update({k: stats(v) for k, v in smp.items()})
                        log(f"latency {plane}-{mode} {lb}: {reps} reps x {len(paths)} paths in "
                            f"{time.perf_counter() - t0:.1f} s")
                    if curve:
                        _throughput(cfg, result, paths, labels, sizes)
                    if curve and "1MiB" in labels:
                        _batch(cfg, result, labels.index("1MiB"), "1MiB", ect, v1, raw, ann)
                    if plane == rtt_plane:
                        # control round trip: the ProducerNode + a pyzmq echo, nothing else
                        if raw is not None:
                            ph.drop(raw)
                            ph.close_remote(raw.remote_id)
                        z = ph.open(f"zmq-echo-{mode}", kind="zmq", curve=curve)
                        ph.running()
                        t0 = time.perf_counter()
                        result["control_rtt"].update(control_rtt(cfg, z, ect, small))
                        result["control_rtt"]["entry_bytes"] = sizes[small]
                        log(f"control round trip {mode}: {time.perf_counter() - t0:.1f} s")

        # phases: each of ect-nixl and raw-nixl alone (no A/B partner alive) at 8.8 MiB
        if "nixl" in cfg.planes and "8.8MiB" in labels:
            _solo(cfg, result, server, labels.index("8.8MiB"), sizes)

        # phases: nixl grant_scope "grant" vs "region" (fetch A/B, then in-process micro)
        if cfg.scope and "nixl" in cfg.planes:
            import scope  # noqa: PLC0415  (benchmarks/scope.py imports this module)

            scope.run_scope(cfg, result, server, labels, sizes)

        # phase: N consumers on one producer
        if cfg.consumers:
            result["consumers"] = consumers(cfg, result, server, labels, sizes)

        # phase: recompute (nothing open)
        with Phase(result, server, "recompute"):
            result["recompute"] = recompute(cfg, labels, sizes)

        # phases: vLLM's own P2P stack vs ect-nixl (v2, v1) vs raw-nixl, each alone; last, as
        # they import vLLM into both processes (issue 16; skipped, with the reason, without it)
        if cfg.vllm_p2p:
            import vllm_p2p  # noqa: PLC0415  (benchmarks/vllm_p2p.py imports this module)

            vllm_p2p.run_vllm_p2p(cfg, result, server, labels, sizes)
    finally:
        if server is not None:
            server.close()
        for d in (tmp, disk_dir, shm_dir):
            shutil.rmtree(d, ignore_errors=True)
    result["meta"]["loadavg_end"] = os.getloadavg()
    result["meta"]["duration_s"] = time.time() - t_start
    return result


def _throughput(cfg: Config, result: dict, paths: list, labels: list[str],
                sizes: list[int]) -> None:
    for i, lb in enumerate(labels):
        if sizes[i] < cfg.thr_min_bytes:
            continue
        by_k = result["throughput"].setdefault(lb, {})
        done_k: set[int] = set()
        for k in cfg.inflight:
            kk = min(k, copies_of(sizes[i]))
            if kk in done_k:  # capped to a depth already measured for this size
                continue
            done_k.add(kk)
            t0 = time.perf_counter()
            r = throughput(paths, i, sizes[i], kk, cfg.thr_reps)
            by_k.setdefault(str(k), {"inflight": kk}).update(r)
            log(f"throughput {lb} k={kk} {[p.name for p in paths]}: "
                f"{time.perf_counter() - t0:.1f} s")


#: Entries per batch in the batch phase (issue 16: 8 × 1 MiB in one request).
BATCH_N = 8


def _batch(cfg: Config, result: dict, i: int, size_label: str, ect: EctPath,
           v1: EctPath | None, raw, ann: EctPath | None = None) -> None:
    """8 entries of size ``i`` fetched together (``EctPath.batch``: one ReqBatch on v2, 8
    XferReqs on the v1 path) A/B with 8 raw READs posted together (``raw.window(i, 8, 8)``),
    interleaved and alternated as the latency phases; ``result["batch"][label][path]``."""
    label = f"{BATCH_N}x{size_label}"
    paths = [(ect.name, lambda: ect.batch(i, BATCH_N))]
    if v1 is not None:
        paths.append((v1.name, lambda: v1.batch(i, BATCH_N)))
    if ann is not None:
        paths.append((ann.name, lambda: ann.batch(i, BATCH_N)))
    if raw is not None and hasattr(raw, "window"):
        paths.append((raw.name, lambda: raw.window(i, BATCH_N, BATCH_N)))
    samples: dict[str, list[float]] = {n: [] for n, _ in paths}
    t0 = time.perf_counter()
    for rep in range(cfg.warmup + cfg.reps):
        for name, fn in (paths if rep % 2 == 0 else paths[::-1]):
            dt = fn()
            if rep >= cfg.warmup:
                samples[name].append(dt)
    result.setdefault("batch", {}).setdefault(label, {}).update(
        {n: stats(v) for n, v in samples.items()})
    log(f"batch {label} {[n for n, _ in paths]}: {time.perf_counter() - t0:.1f} s")


def _solo(cfg: Config, result: dict, server: Server, i: int, sizes: list[int]) -> None:
    """8.8 MiB one at a time with ONLY ect-nixl (then ONLY raw-nixl) alive: how much the A/B
    partner's idle NIXL agents (one per process) cost each path. Not interleaved."""
    lb = next(k for k, v in result["sizes"].items() if v == sizes[i])
    reps = cfg.reps
    for which in ("raw-nixl", "ect-nixl", "raw-nixl-spin", "raw-nixl#2", "ect-nixl#2",
                  "raw-nixl-spin#2"):
        with Phase(result, server, f"solo-{which}") as ph:
            if which.startswith("ect"):
                info = ph.open("ect-nixl", kind="ect", plane="nixl", curve=True)
                p = ph.add(EctPath("ect-nixl", "nixl", True, info, server.consumer_secret, sizes,
                                   {j: 1 for j in range(len(sizes))}))
            else:
                spin = which.startswith("raw-nixl-spin")
                p = _open_raw(ph, result, "nixl", sizes, 1, 0 if spin else RAW_NIXL_DELAY_US)
                if p is None:
                    continue
                p.name = which.split("#")[0]
            ph.running()
            smp = interleaved([p], i, cfg.warmup, reps, copies_of(sizes[i]))[p.name]
            result["solo"].setdefault(lb, {}).setdefault(which.split("#")[0], []).extend(smp)
    for path, xs in result["solo"].get(lb, {}).items():
        result["solo"][lb][path] = stats(xs)


def consumers(cfg: Config, result: dict, server: Server, labels: list[str],
              sizes: list[int]) -> dict:
    """N ConsumerNodes (one process, one thread each, 1 in flight each) fetching the same size
    from one producer vs N raw NIXL agents doing the same; aggregate GB/s. Server side: one
    ProducerNode (nixl) + the raw NIXL agent. Consumer side: only one group is alive at a time
    (N idle agents of the other group would starve this one): per N, blocks ect, raw, raw, ect,
    each opening its group, 1 warm-up rep, then reps, and closing it."""
    i = labels.index(cfg.consumers_size) if cfg.consumers_size in labels else int(np.argmax(sizes))
    nbytes = sizes[i]
    plane = "nixl" if "nixl" in cfg.planes else cfg.planes[0]
    per = 4
    res: dict = {"size": labels[i], "plane": plane, "fetches_per_consumer_per_rep": per,
                 "order": "per N: blocks ect, raw, raw, ect (each group opened, 1 warm-up rep, "
                          "then reps, closed)"}
    with Phase(result, server, f"consumers-{plane}") as ph:
        info = ph.open(f"ect-{plane}", kind="ect", plane=plane, curve=True)
        r = (ph.open("raw-nixl", kind="raw", plane="nixl", delay_us=RAW_NIXL_DELAY_US)
             if plane == "nixl" else None)
        per_block = max(2, -(-cfg.thr_reps // 2))
        for n in cfg.consumers:
            got: dict[str, list[float]] = {}
            for gname in ("ect-" + plane, "raw-nixl", "raw-nixl", "ect-" + plane):
                if gname == "raw-nixl" and r is None:
                    continue
                if gname.startswith("ect"):
                    members = [EctPath(gname, plane, True, info, server.consumer_secret, sizes,
                                       {i: 1}) for _ in range(n)]
                else:
                    members = [RawNixl(r, [nbytes if j == i else 1 for j in range(len(sizes))], 1)
                               for _ in range(n)]
                try:
                    for rep in range(per_block + 1):
                        bar = threading.Barrier(n + 1)

                        def work(p, c, bar=bar, n=n):
                            bar.wait()
                            for f in range(per):
                                p.one(i, (c + f * n) % 16 if nbytes <= 9 * MiB else c % 4)

                        ths = [threading.Thread(target=work, args=(p, c))
                               for c, p in enumerate(members)]
                        for t in ths:
                            t.start()
                        bar.wait()
                        t0 = time.perf_counter()
                        for t in ths:
                            t.join()
                        dt = time.perf_counter() - t0
                        if rep:
                            got.setdefault(gname, []).append(n * per * nbytes / dt / 1e9)
                finally:
                    for p in members:
                        p.close()
                    del members
                    gc.collect()
            res[str(n)] = {g: {"gbps": statistics.median(x), "min": min(x), "max": max(x),
                               "n": len(x)} for g, x in got.items()}
            log(f"{n} consumers done")
    return res


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for d in ("ectransport", "nixl", "ucxx-cu12", "pyzmq", "numpy", "torch", "safetensors",
              "msgspec"):
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            pass
    return out


sys.path.insert(0, str(HERE))  # raw paths import server.ROWS_HEADER
