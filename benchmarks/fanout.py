"""N consumer *processes* on one producer (issue 16 item 7): ectransport vs raw NIXL READs.

    python benchmarks/fanout.py --quick            # 4 consumer processes, ~1 min
    python benchmarks/fanout.py --full             # 32 consumer processes (part of run.py --full)
    python benchmarks/fanout.py --n 8 --duration-s 5
    python benchmarks/fanout.py --full --merge benchmarks/results/results.json
        # measure, then put the result under "fanout" in that results.json (re-render the docs
        # with: python benchmarks/run.py --from-json benchmarks/results/results.json)

One producer process (``benchmarks/server.py``: a ProducerNode offering nixl, CURVE on, holding
16 entries of 8.8 MiB; or the raw NIXL agent with the same bytes registered). N consumer processes
(``fanout.py --worker``), spawned together, each: builds its consumer (a ConsumerNode with the nixl
plane and its own CURVE key, or a raw NIXL agent with the same agent config), connects, fetches
one entry (verified byte for byte) and says "warm"; when every one is warm, all start together
at one instant and fetch back to back, one fetch in flight each, for ``duration_s``; the last
fetch of each is verified again. Both groups read one entry (the raw endpoint registers one source
per size; ``--entries K`` makes the ConsumerNodes cycle over K of the 16, which is not cache-fair).

Per group (``ect-nixl``: ConsumerNodes; ``raw-nixl``: raw agents that check the READ's state with
a 50 µs pause, as the ConsumerNode's loop does; ``raw-nixl-spin``: without the pause), only one
group alive at a time (``--full``: blocks ect, raw, raw, ect, raw-spin; ``--quick``: ect, raw):

* aggregate GB/s: bytes whose fetch ended inside the common window / window length;
* per-fetch latency p50/p99 over every fetch of every process in the window;
* warm-up: from spawning the N processes to the last one's first fetch landed (and per process:
  interpreter + imports, consumer/agent built, connected, first fetch; CPU-seconds used by then);
* CPU-seconds per fetch inside the window, of the consumer processes and of the producer.

Issue 16 target: N = 32 processes reach ≥ 80 % of the raw aggregate and p99 ≤ 3× p50; the raw
group is the floor (its own p99/p50 shows what the host's scheduler does to 32 busy processes).
The report's rows, notes and docs section are made by ``fanout_report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import common  # noqa: E402
import fetchpaths  # noqa: E402
import phases  # noqa: E402

from ectransport.settings_schema import ConsumerSettings, ControlClientSettings, NodeSettings  # noqa: E402

#: Issue 16 item 7 targets.
TARGET_FRACTION_OF_RAW = 0.80
TARGET_P99_OVER_P50 = 3.0
GROUPS = ("ect-nixl", "raw-nixl", "raw-nixl-spin")
#: raw-nixl: pause between READ state checks, seconds (ectransport.node.consumer_loop's
#: _BUSY_SLEEP_S: the ConsumerNode's I/O loop sleeps this long between checks)
POLL_SLEEP_S = 50e-6


@dataclass
class FanoutConfig:
    n: int = 4  # consumer processes per group
    size: str = "8.8MiB"
    duration_s: float = 3.0  # measured window per block
    blocks: list[str] = field(default_factory=lambda: ["ect-nixl", "raw-nixl"])
    shared_key: bool = False  # every consumer one CURVE identity (one pin budget), not its own
    preimport: list[str] = field(default_factory=list)  # modules each process imports first
    #: distinct entries an ect-nixl consumer cycles over (≤ 16). 1: the raw endpoint registers
    #: one source per size, so both groups read one 8.8 MiB entry and neither gains from caches
    #: the other lacks (cycling over 16 entries cost ~0.7-0.9 ms more per 8.8 MiB fetch here)
    entries: int = 1
    ready_timeout_s: float = 300.0  # spawn → every process warm
    fetch_timeout_s: float = 60.0

    @classmethod
    def quick(cls) -> FanoutConfig:
        return cls()

    @classmethod
    def full(cls) -> FanoutConfig:
        return cls(n=32, duration_s=10.0,
                   blocks=["ect-nixl", "raw-nixl", "raw-nixl", "ect-nixl", "raw-nixl-spin"],
                   ready_timeout_s=900.0)


# -- consumer process ---------------------------------------------------------------------------


def _expected(nbytes: int):
    """The bytes of every entry: the server's source for the one size it holds."""
    from server import _sources  # noqa: PLC0415

    return _sources([nbytes])[0]


def _thread_cpu() -> dict[str, float]:
    """CPU-seconds per thread of this process, by Python thread name, else ``native:<comm>``
    (the NIXL progress thread, UCX's and ZeroMQ's threads)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tck = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as fh:
                comm = fh.read().strip()
        except OSError:  # the thread ended
            continue
        name = names.get(int(tid)) or f"native:{comm}"
        name = "consumer I/O thread" if name.startswith("ect-consumer") else name
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / tck
    return out


def worker(spec: dict) -> int:
    """One consumer process: JSON lines on stdout (``warm``, ``done`` or ``error``), commands on
    stdin (``{"go_at", "duration_s"}``, then ``exit``). Native libraries that print go to
    stderr."""
    t_main = time.monotonic()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(**msg) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    import numpy as np

    for mod in spec.get("preimport", ()):  # e.g. torch, as in a vLLM process
        __import__(mod)
    t_pre = time.monotonic()
    nbytes, copies, w = spec["nbytes"], spec["copies"], spec["index"]
    closer = None
    try:
        if spec["group"] == "ect-nixl":
            from ectransport.node.common import Layout, Security
            from ectransport.node.consumer import ConsumerNode, ProducerAddress

            rows = -(-nbytes // common.BLOCK)
            node = ConsumerNode(
                layout=Layout(hidden=common.HIDDEN),
                security=Security.from_files(spec["secret"]),
                settings=ConsumerSettings(
                    region_bytes=(2 * rows + 1) * common.BLOCK,
                    fetch_timeout_s=spec["fetch_timeout_s"],
                ),
                node=NodeSettings(planes=("nixl",)),
                control_settings=ControlClientSettings(handshake_timeout_s=30.0),
            )
            closer = node.close
            t_plane = time.monotonic()
            addr = ProducerAddress("127.0.0.1", spec["port"], spec["public_key"])
            node.connect(addr, timeout_s=spec["fetch_timeout_s"])
            t_connect = time.monotonic()

            def one(j: int, check: bool) -> bool | None:
                out = node.fetch(addr, f"s0-c{(w + j) % copies}")
                if not out.ok:
                    print(f"worker {w}: miss {out.reason} {out.detail}", file=sys.stderr)
                    return None
                if not check:
                    return True
                ok = bool(np.array_equal(out.data, want))
                if not ok:
                    print(f"worker {w}: wrong bytes in {out.nbytes} bytes fetched",
                          file=sys.stderr)
                del out  # zero copy: dropping the Fetched gives its blocks back
                return ok
        else:
            # the nixl import the plane does (no torch import on a CPU-only torch: see
            # ectransport.data.nixl_agent._import_nixl_meta), so both groups start alike
            from ectransport.data.nixl_agent import _import_nixl

            _import_nixl()
            raw = fetchpaths.RawNixl(spec["raw"], [nbytes], 1)
            closer = raw.close
            t_plane = t_connect = time.monotonic()  # the agent loads the producer's metadata

            # raw-nixl polls as the ConsumerNode's loop does (a 50 µs sleep between checks, which
            # lets the other processes' READs run); raw-nixl-spin polls in a tight loop
            # (fetchpaths.RawNixl.one), which with N processes on 2 CPUs takes CPU from the others
            pause_s = 0.0 if spec["group"] == "raw-nixl-spin" else POLL_SLEEP_S

            def one(j: int, check: bool) -> bool | None:
                x = raw._post(0, 0)
                while not raw._poll(x):
                    if pause_s:
                        time.sleep(pause_s)
                return bool(np.array_equal(raw.bufs[0][:nbytes], want)) if check else True
        want = _expected(nbytes)
        t0 = time.monotonic()
        first_ok = one(0, True)
        t_first = time.monotonic()
        if first_ok is None:
            raise RuntimeError("the first fetch missed (see this worker's log)")
        cpu = os.times()
        say(warm={"main": t_main, "preimport": t_pre, "plane": t_plane, "connect": t_connect,
                  "first": t_first, "first_fetch_s": t_first - t0, "first_ok": first_ok,
                  "pid": os.getpid(), "cpu_s": cpu.user + cpu.system})
        cmd = json.loads(sys.stdin.readline())
        idle = os.times()  # between this process's first fetch and "go": idle, others warm up
        idle_s = [idle.user + idle.system - cpu.user - cpu.system, time.monotonic() - t_first]
        go_at, end_at = cmd["go_at"], cmd["go_at"] + cmd["duration_s"]
        time.sleep(max(0.0, go_at - time.monotonic()))
        lat, ends, misses, j = [], [], 0, 1
        c0, th0 = os.times(), _thread_cpu()
        while time.monotonic() < end_at:
            t0 = time.perf_counter()
            r = one(j, False)
            dt = time.perf_counter() - t0
            j += 1
            if r is None:
                misses += 1
                continue
            lat.append(round(dt, 7))
            ends.append(round(time.monotonic() - go_at, 6))
        c1, th1 = os.times(), _thread_cpu()
        last_ok = one(j, True)  # None: a miss (counted), nothing to verify
        misses += last_ok is None
        say(done={"lat": lat, "ends": ends, "misses": misses, "bytes_ok": last_ok is not False,
                  "cpu_s": c1.user + c1.system - c0.user - c0.system,
                  "idle_cpu_s": idle_s[0], "idle_wall_s": idle_s[1],
                  "cpu_by_thread_s": {k: round(v - th0.get(k, 0.0), 3) for k, v in th1.items()}})
        sys.stdin.readline()  # exit
    except Exception as e:  # noqa: BLE001 - reported to the parent, which aborts the block
        import traceback

        traceback.print_exc()
        say(error=f"{type(e).__name__}: {e}")
    finally:
        if closer is not None:
            try:
                closer()
            except Exception:  # noqa: BLE001
                pass
    os._exit(0)  # skip slow native destructors (NIXL/UCX) at interpreter exit


# -- orchestration ------------------------------------------------------------------------------


class _Group:
    """N worker processes of one group; their stdout lines land in one queue as (index, msg)."""

    def __init__(self, specs: list[dict], logdir: Path):
        self.q: queue.Queue = queue.Queue()
        self.procs: list[subprocess.Popen] = []
        self.spawned: list[float] = []
        self.logs = [logdir / f"{s['group']}-{s['block']}-w{s['index']}.log" for s in specs]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.t_spawn = time.monotonic()
        for s, log in zip(specs, self.logs, strict=True):
            with open(log, "wb") as errf:
                p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                      json.dumps(s)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=errf, text=True, bufsize=1,
                                     env=env)
            self.spawned.append(time.monotonic())
            self.procs.append(p)
            threading.Thread(target=self._read, args=(len(self.procs) - 1, p),
                             daemon=True).start()

    def _read(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            if line.startswith("{"):
                self.q.put((i, json.loads(line)))
        self.q.put((i, {"error": f"process exited ({p.wait()})"}))

    def collect(self, key: str, timeout_s: float) -> dict[int, dict]:
        """``key`` message of every worker; raises RuntimeError on an error or the deadline."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.procs):
            try:
                i, msg = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                late = sorted(set(range(len(self.procs))) - set(got))
                raise RuntimeError(f"{len(late)} process(es) sent no {key!r} within "
                                   f"{timeout_s:.0f} s (e.g. worker {late[0]}: "
                                   f"{self._tail(late[0])})") from None
            if key in msg:
                got[i] = msg[key]
            elif "error" in msg and i not in got:
                raise RuntimeError(f"worker {i}: {msg['error']} ({self._tail(i)})")
        return got

    def _tail(self, i: int) -> str:
        try:
            return self.logs[i].read_text(errors="replace")[-600:].strip() or "no stderr"
        except OSError:
            return "no log"

    def send(self, msg: dict) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps(msg) + "\n")
                p.stdin.flush()
            except OSError:
                pass

    def close(self) -> None:
        self.send({"op": "exit"})
        deadline = time.monotonic() + 30.0
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _block(cfg: FanoutConfig, result: dict, server: phases.Server, group: str, b: int,
           nbytes: int, secrets: list[str], logdir: Path) -> dict:
    copies = min(cfg.entries, common.copies_of(nbytes))
    with phases.Phase(result, server, f"fanout-{group}-{b}") as ph:
        if group.startswith("ect"):
            info = ph.open(group, kind="ect", plane="nixl", curve=True)
            base = {"port": info["port"], "public_key": info["public_key"]}
        else:
            r = ph.open(group, kind="raw", plane="nixl", delay_us=common.RAW_NIXL_DELAY_US)
            base = {"raw": {k: r[k] for k in ("agent", "meta", "descs")}}
        specs = [{**base, "group": group, "block": b, "index": w, "nbytes": nbytes,
                  "copies": copies, "secret": secrets[w % len(secrets)],
                  "fetch_timeout_s": cfg.fetch_timeout_s, "preimport": cfg.preimport}
                 for w in range(cfg.n)]
        common.log(f"fanout {group} block {b}: spawning {cfg.n} consumer processes")
        g = _Group(specs, logdir)
        try:
            warm = g.collect("warm", cfg.ready_timeout_s)
            all_warm = time.monotonic()
            ph.running()
            go_at = time.monotonic() + 0.5
            g.send({"go_at": go_at, "duration_s": cfg.duration_s})
            time.sleep(max(0.0, go_at - time.monotonic()))
            # the producer process's CPU use inside the window (it sleeps there, measuring)
            prod = server.call(op="idle", seconds=max(0.1, cfg.duration_s - 0.1),
                               timeout=cfg.duration_s + 60.0)
            done = g.collect("done", cfg.duration_s + cfg.fetch_timeout_s + 60.0)
        finally:
            g.close()
    lat = [x for d in done.values() for x in d["lat"]]
    in_window = sum(1 for d in done.values() for e in d["ends"] if e <= cfg.duration_s)
    steps = ("main", "preimport", "plane", "connect", "first")
    rel = [{k: warm[i][k] - g.spawned[i] for k in steps} for i in range(cfg.n)]
    out = {
        "group": group, "block": b, "n": cfg.n,
        "aggregate_gbps": in_window * nbytes / cfg.duration_s / 1e9,
        "fetches": len(lat), "fetches_in_window": in_window,
        "misses": sum(d["misses"] for d in done.values()),
        "bytes_ok": all(w["first_ok"] for w in warm.values())
        and all(d["bytes_ok"] for d in done.values()),
        "latency": common.stats(lat) if lat else None,
        # CPU-seconds per fetch inside the window: consumer processes (all), producer process
        "cpu_per_fetch_s": {"consumers": sum(d["cpu_s"] for d in done.values())
                            / max(1, len(lat)),
                            "producer": prod.get("cpu_per_s", 0.0) * cfg.duration_s
                            / max(1, len(lat))},
        "producer_cpu_per_s": prod.get("cpu_per_s"),
        # consumer CPU-seconds per fetch by thread (all processes together)
        "cpu_per_fetch_by_thread_s": _by_thread(done, len(lat)),
        "per_process_gbps": sorted(round(sum(1 for e in d["ends"] if e <= cfg.duration_s)
                                         * nbytes / cfg.duration_s / 1e9, 3)
                                   for d in done.values()),
        "warmup": {
            "all_warm_s": all_warm - g.t_spawn,
            "spawn_s": g.spawned[-1] - g.t_spawn,
            # per process, seconds since its own spawn, median and max over the N processes
            **{f"{k}_s": {"p50": statistics.median(x[k] for x in rel),
                          "max": max(x[k] for x in rel)}
               for k in steps},
            "cpu_s": {"p50": statistics.median(w["cpu_s"] for w in warm.values()),
                      "sum": sum(w["cpu_s"] for w in warm.values())},
            # CPU-s/s of the warm processes waiting for the others (an idle node: NIXL progress
            # thread, I/O thread, heartbeats): all their CPU while waiting / all their waiting
            "idle_cpu_per_s": sum(d["idle_cpu_s"] for d in done.values())
            / max(1e-3, sum(d["idle_wall_s"] for d in done.values())),
            "first_fetch_s": {"p50": statistics.median(w["first_fetch_s"] for w in warm.values()),
                              "max": max(w["first_fetch_s"] for w in warm.values())},
        },
        "loadavg": os.getloadavg()[0],
    }
    common.log(f"fanout {group} block {b}: {out['aggregate_gbps']:.2f} GB/s, "
                f"p50 {harness_fmt(out['latency'], 'p50')} p99 {harness_fmt(out['latency'], 'p99')}"
                f", all warm in {out['warmup']['all_warm_s']:.1f} s, misses {out['misses']}, "
                f"bytes_ok {out['bytes_ok']}")
    return out


def _by_thread(done: dict[int, dict], fetches: int) -> dict[str, float]:
    tot: dict[str, float] = {}
    for d in done.values():
        for k, v in d.get("cpu_by_thread_s", {}).items():
            tot[k] = tot.get(k, 0.0) + v
    return {k: v / max(1, fetches) for k, v in sorted(tot.items(), key=lambda kv: -kv[1])}


def harness_fmt(s: dict | None, q: str) -> str:
    return "—" if not s else f"{s[q] * 1e3:.1f} ms"


def summarize(blocks: list[dict]) -> dict:
    """Per group: aggregate GB/s (median over its blocks, min–max), pooled per-fetch latency
    percentiles (from each block's p50/p99: medians), warm-up of its first block."""
    out = {}
    for g in GROUPS:
        mine = [b for b in blocks if b["group"] == g and b.get("latency")]
        if not mine:
            continue
        agg = [b["aggregate_gbps"] for b in mine]
        out[g] = {"aggregate_gbps": statistics.median(agg), "min": min(agg), "max": max(agg),
                  "blocks": len(mine),
                  "p50": statistics.median(b["latency"]["p50"] for b in mine),
                  "p99": statistics.median(b["latency"]["p99"] for b in mine),
                  "all_warm_s": mine[0]["warmup"]["all_warm_s"],
                  "all_warm_s_max": max(b["warmup"]["all_warm_s"] for b in mine),
                  "misses": sum(b["misses"] for b in mine),
                  "bytes_ok": all(b["bytes_ok"] for b in mine)}
        cpu = [b["cpu_per_fetch_s"] for b in mine if b.get("cpu_per_fetch_s")]
        if cpu:
            out[g]["cpu_per_fetch_s"] = {k: statistics.median(c[k] for c in cpu)
                                         for k in ("consumers", "producer")}
    return out


def run(cfg: FanoutConfig, result: dict | None = None) -> dict:
    """Measure; returns the ``fanout`` dict of results.json (``result``: the harness's result
    dict, whose ``phases`` get this run's phases; a private one if None)."""
    from ectransport.control.keys import allow_key, generate_keypair

    nbytes = common.rows_of(cfg.size) * common.BLOCK
    own = result is None
    result = result if result is not None else {"phases": []}
    result.setdefault("phases", [])
    tmp = Path(tempfile.mkdtemp(prefix="ect-fanout-"))
    logdir = tmp / "logs"
    logdir.mkdir()
    out: dict = {"config": asdict(cfg), "size": cfg.size, "nbytes": nbytes, "blocks": [],
                 "targets": {"fraction_of_raw": TARGET_FRACTION_OF_RAW,
                             "p99_over_p50": TARGET_P99_OVER_P50},
                 "loadavg_start": os.getloadavg()[0], "cpus": os.cpu_count(), "errors": {}}
    t0 = time.monotonic()
    server = None
    try:
        server = phases.Server(common.Config(sizes=[cfg.size], planes=["nixl"]), [nbytes], tmp)
        if cfg.shared_key:
            secrets = [server.consumer_secret]
        else:  # one identity per consumer process (as separate vLLM instances): own pin budget
            secrets = []
            for w in range(cfg.n):
                pub, sec = generate_keypair(tmp / "keys", f"fanout-w{w}")
                allow_key(tmp / "allow", pub)
                secrets.append(str(sec))
        for b, group in enumerate(cfg.blocks):
            try:
                out["blocks"].append(_block(cfg, result, server, group, b, nbytes, secrets,
                                            logdir))
            except Exception as e:  # noqa: BLE001 - recorded; the other blocks still run
                out["errors"][f"{group}-{b}"] = f"{type(e).__name__}: {e}"[:1500]
                common.log(f"fanout {group} block {b} failed: {e}")
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out["summary"] = summarize(out["blocks"])
    out["duration_s"] = time.monotonic() - t0
    out["loadavg_end"] = os.getloadavg()[0]
    if own:
        out["phases"] = result["phases"]
    return out


def verdict(f: dict) -> list[str]:
    """One line per target: measured, floor, met; plus why a missed one was missed."""
    s = f.get("summary", {})
    e, r = s.get("ect-nixl"), s.get("raw-nixl")
    lines = []
    if e and r:
        frac = e["aggregate_gbps"] / r["aggregate_gbps"]
        lines.append(f"aggregate: {e['aggregate_gbps']:.2f} GB/s vs raw {r['aggregate_gbps']:.2f}"
                     f" = {frac * 100:.0f} % (target ≥ {TARGET_FRACTION_OF_RAW * 100:.0f} %): "
                     f"{'met' if frac >= TARGET_FRACTION_OF_RAW else 'MISSED'}")
    if e:
        q = e["p99"] / e["p50"]
        rq = f", raw floor {r['p99'] / r['p50']:.1f}×" if r else ""
        lines.append(f"p99/p50: {e['p99'] * 1e3:.1f}/{e['p50'] * 1e3:.1f} ms = {q:.1f}× (target "
                     f"≤ {TARGET_P99_OVER_P50:.0f}×{rq}): "
                     f"{'met' if q <= TARGET_P99_OVER_P50 else 'MISSED'}")
        lines.append(f"warm-up (spawn → all {f['config']['n']} processes' first fetch landed): "
                     f"{e['all_warm_s']:.1f} s" + (f", raw agents {r['all_warm_s']:.1f} s"
                                                   if r else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="4 processes, blocks ect, raw (default)")
    g.add_argument("--full", action="store_true",
                   help="32 processes, blocks ect, raw, raw, ect, raw-spin")
    ap.add_argument("--n", type=int, help="consumer processes per group")
    ap.add_argument("--duration-s", type=float, help="measured window per block")
    ap.add_argument("--blocks",
                    help="comma-separated groups in order (ect-nixl, raw-nixl, raw-nixl-spin)")
    ap.add_argument("--shared-key", action="store_true",
                    help="every consumer process one CURVE identity (one pin budget)")
    ap.add_argument("--entries", type=int, help="distinct entries each ect-nixl process "
                    "cycles over (default 1, as the raw group's one source; up to 16)")
    ap.add_argument("--preimport", help="comma-separated modules every consumer process imports "
                    "first (e.g. torch: a vLLM process has it imported)")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--merge", type=Path,
                    help="put the result under 'fanout' in this results.json")
    a = ap.parse_args(argv)
    if a.worker:
        return worker(json.loads(a.worker))
    cfg = FanoutConfig.full() if a.full else FanoutConfig.quick()
    if a.n:
        cfg.n = a.n
    if a.duration_s:
        cfg.duration_s = a.duration_s
    if a.blocks:
        cfg.blocks = [x.strip() for x in a.blocks.split(",") if x.strip()]
        if bad := [x for x in cfg.blocks if x not in GROUPS]:
            ap.error(f"unknown group(s) {bad}; known: {list(GROUPS)}")
    cfg.shared_key = a.shared_key
    if a.entries:
        cfg.entries = a.entries
    cfg.preimport = [m for m in (a.preimport or "").split(",") if m]
    res = run(cfg)
    for line in verdict(res):
        print(line)
    if res["errors"]:
        print(f"errors: {res['errors']}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))
    if a.merge:
        full = json.loads(a.merge.read_text())
        full["fanout"] = res
        a.merge.write_text(json.dumps(full, indent=1, default=str))
        print(f"merged into {a.merge}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
