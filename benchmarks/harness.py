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
and ``docs/performance.md``. This module is the orchestration only: the shared constants and
:class:`~common.Config` are in ``common.py``, the producer process and a phase in ``phases.py``,
the measured paths in ``fetchpaths.py``, the scope and vLLM phases in ``scope.py`` and
``vllm_p2p.py`` (none of which imports this module).
"""

from __future__ import annotations

import gc
import math
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import (
    BLOCK,
    HAS_V2,
    HIDDEN,
    RAW_NIXL_DELAY_US,
    Config,
    MiB,
    copies_of,
    log,
    rows_of,
    stats,
)
from fetchpaths import (
    AnnouncedPath,
    EctPath,
    Memcpy,
    RawNixl,
    Safetensors,
    open_raw,
)
from phases import Phase, Server, interleaved, throughput
from scope import run_scope
from vllm_p2p import run_vllm_p2p


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
                    raw = open_raw(ph, result, plane, sizes, slots)
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
            run_scope(cfg, result, server, labels, sizes)

        # phase: N consumers on one producer
        if cfg.consumers:
            result["consumers"] = consumers(cfg, result, server, labels, sizes)

        # phase: recompute (nothing open)
        with Phase(result, server, "recompute"):
            result["recompute"] = recompute(cfg, labels, sizes)

        # phases: vLLM's own P2P stack vs ect-nixl (v2, v1) vs raw-nixl, each alone; last, as
        # they import vLLM into both processes (issue 16; skipped, with the reason, without it)
        if cfg.vllm_p2p:
            run_vllm_p2p(cfg, result, server, labels, sizes)
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
                p = open_raw(ph, result, "nixl", sizes, 1, 0 if spin else RAW_NIXL_DELAY_US)
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
