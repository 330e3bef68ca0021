"""The fleet directory on a workload where images repeat across instances (issue 24).

    python benchmarks/fleet.py                      # 3 instances, 200 requests, 50 images
    python benchmarks/fleet.py --requests 60 --images 15 --out /tmp/fleet.json

Three instance processes (each a ProducerNode, a ConsumerNode and the reference vision encoder of
``ectransport.demo`` with Qwen2-VL-7B geometry: 1.3-2.3 MB per image, ~0.15 s per encode on one
CPU thread) get 200 requests for 50 distinct images (each image 4 times, shuffled, dealt round
robin), and serve them one after another, all three at once, in two modes side by side in the
same run, on the same machine:

- ``every-instance-encodes`` (the floor): no directory; an instance encodes each image the first
  time *it* sees it and reuses its own copy after that (its local tier);
- ``fleet``: a redis-server (started here, loopback) as the directory; an instance that does not
  hold an image asks the directory (``claim_or_wait``: holders, or the claim, in one round trip):
  it fetches from a holder, or encodes under the claim (the others wait for that encode and then
  fetch), or encodes locally when the wait runs out.

Measured per mode: encoder runs per distinct image (target 1.0 with the fleet), fleet hit rate
(requests served by a fetch from another instance / requests not held locally), the directory's
lookup round trip p50/p99 (every round trip of every instance while serving, pooled: a
``claim_or_wait`` attempt or poll is one), the directory cost per request (the time of its round trips with
Redis, not the wait for a claimant; target ≤ 1 ms p50 on loopback), and the time to the encoder
output per request (what the encoder adds to TTFT: a local hit, a fetch, a wait for the
claimant, or an encode) p50/p99, and the makespan. Every fetched entry is checked: its SHA-256
must equal the encoding instance's.

vLLM's cross-instance store path (``ECMooncakeConnector`` with ``cross_encoder_cache`` on a
Mooncake store) cannot run here: ``mooncake.store`` of mooncake-transfer-engine 0.3.13.post1
links ``libibverbs.so.1`` and ``libcuda.so.1``, and this machine has no CUDA driver (see
``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("every-instance-encodes", "fleet")
#: issue 24 targets
TARGET_ENCODES_PER_IMAGE = 1.0
TARGET_DIRECTORY_COST_P50_S = 1e-3


def variants(n: int) -> list[bytes]:
    """``n`` distinct PNG images: crops of the bundled photographs (Qwen2-VL-sized outputs)."""
    from PIL import Image

    from ectransport.demo.images import load_images

    base = [Image.open(io.BytesIO(it.data)).convert("RGB") for it in load_images()]
    out = []
    for k in range(n):
        im = base[k % len(base)]
        w, h = im.size
        d = 4 * (k // len(base)) + 1
        buf = io.BytesIO()
        im.crop((d, d, w - d, h - d)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


# -- one instance ---------------------------------------------------------------------------------


def worker(spec: dict) -> int:
    """An instance (module docstring): ``ready`` on stdout, then ``{"run": [...], "go_at"}`` on
    stdin → one ``done`` line with a record per request."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(**msg: object) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    from ectransport.demo.encoder import ReferenceEncoder
    from ectransport.fleet import Acquired
    from ectransport.node import ConsumerNode, Layout, ProducerNode, Security
    from ectransport.node.common import as_bytes
    from ectransport.node.fleet import FleetFetcher
    from ectransport.settings_schema import (
        ConsumerSettings,
        FleetSettings,
        NodeSettings,
        ProducerSettings,
    )

    enc = ReferenceEncoder()
    layout = Layout(model_id=enc.model_id, dtype="bfloat16", hidden=3584)
    images = variants(spec["images"])
    trusted = set(spec["trusted"])
    fleet = (
        FleetSettings(url=spec["url"], instance=spec["name"], claim_wait_s=30.0)
        if spec["url"]
        else FleetSettings()
    )
    sec = Security(public_key=spec["public"], secret_key=spec["secret"])
    planes = (spec["plane"],)
    producer = ProducerNode(
        layout=layout,
        security=sec,
        settings=ProducerSettings(region_bytes=256 << 20),
        node=NodeSettings(planes=planes, node_id=spec["name"]),
        fleet=fleet,
        fleet_trusted=lambda k, c: k in trusted,
    ).start()
    consumer = ConsumerNode(
        layout=layout,
        security=sec,
        settings=ConsumerSettings(region_bytes=32 << 20, fetch_timeout_s=10.0, hello_timeout_s=2.0),
        node=NodeSettings(planes=planes),
    )
    d = producer.fleet.directory if producer.fleet is not None else None
    spent = [0.0]  # directory round trips of the request in progress, s
    rtts: list[float] = []  # every round trip with Redis while serving, s
    serving = [True]
    if d is not None:
        inner = d._lookup

        def timed(*a: object, **k: object):  # type: ignore[no-untyped-def]
            out = inner(*a, **k)  # type: ignore[arg-type]
            spent[0] += out[0].elapsed_s
            if serving[0] and out[0].elapsed_s > 0:  # 0: not sent (backoff, closed)
                rtts.append(out[0].elapsed_s)
            return out

        d._lookup = timed  # type: ignore[method-assign]
        if not d.wait_live(30.0):
            say(error="fleet directory not live")
            return 1
    fetcher = FleetFetcher(consumer, d) if d is not None else None
    say(ready=spec["name"])
    cmd = json.loads(sys.stdin.readline())
    time.sleep(max(0.0, cmd["go_at"] - time.time()))
    records = []
    encodes = 0
    t_start = time.perf_counter()
    for i in cmd["run"]:
        data = images[i]
        mm = hashlib.sha256(data).hexdigest()
        t0 = time.perf_counter()
        spent[0] = 0.0
        rec: dict = {"img": i}

        def encode(claim: object = None, data: bytes = data, mm: str = mm) -> str:
            nonlocal encodes
            out = enc.encode(data)
            encodes += 1
            if claim is not None:
                producer.fleet.encoding(claim)  # type: ignore[union-attr]
            producer.put(mm, out)
            return hashlib.sha256(as_bytes(out).tobytes()).hexdigest()

        if producer.lookup(mm) is not None:
            rec["how"] = "held"
        elif d is None or fetcher is None:
            rec["how"], rec["digest"] = "encoded", encode()
        else:
            got = d.claim_or_wait(mm)
            if got.outcome is Acquired.FOUND:
                out, h = fetcher.fetch_from(mm, got.holders, time.monotonic() + 10.0)
                if h is not None and out.ok:
                    rec["how"], rec["from"] = "fetched", h.instance
                    rec["digest"] = hashlib.sha256(out.data.tobytes()).hexdigest()
                    del out
                else:
                    rec["how"], rec["digest"] = "local", encode()
            elif got.outcome is Acquired.ENCODE:
                rec["how"], rec["digest"] = "encoded", encode(got.claim)
            else:
                rec["how"], rec["digest"] = "local", encode()
            rec["waited_s"] = got.waited_s
        rec["s"] = time.perf_counter() - t0
        rec["dir_s"] = spent[0]
        records.append(rec)
    makespan = time.perf_counter() - t_start
    serving[0] = False
    idle: list[float] = []  # the same lookups once every instance is done (no encoder running)
    say(served=spec["name"])
    if d is not None:
        sys.stdin.readline()  # "replay": the parent says when every instance is done
        for i in cmd["run"]:
            idle.append(d.lookup(hashlib.sha256(images[i]).hexdigest()).elapsed_s)
    stats = d.stats() if d is not None else {}
    say(
        done={
            "records": records,
            "encodes": encodes,
            "makespan_s": makespan,
            "idle": idle,
            "rtts": rtts,
            "claims_waited": stats.get("claims_waited", 0),
        }
    )
    sys.stdin.readline()
    consumer.close()
    producer.close()
    os._exit(0)


# -- orchestration --------------------------------------------------------------------------------


class _Redis:
    def __init__(self) -> None:
        exe = shutil.which("redis-server") or shutil.which("valkey-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="ect-fleet-bench-")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def run_mode(mode: str, url: str | None, deals: list[list[int]], images: int, plane: str) -> dict:
    """One mode: three instance processes serve their deals at once; returns the summary."""
    import zmq

    kps = [tuple(k.decode() for k in zmq.curve_keypair()) for _ in deals]
    trusted = [p for p, _ in kps]
    procs = []
    lines: list[dict] = []
    for n, (pub, sec) in enumerate(kps):
        spec = {
            "name": f"inst-{n}",
            "url": url,
            "public": pub,
            "secret": sec,
            "trusted": trusted,
            "images": images,
            "plane": plane,
        }
        p = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=dict(os.environ, NIXL_LOG_LEVEL="WARN"),
        )
        procs.append(p)
    try:
        for p in procs:
            msg = json.loads(p.stdout.readline())  # type: ignore[union-attr]
            if "ready" not in msg:
                raise RuntimeError(f"instance failed: {msg}")
        go_at = time.time() + 1.0
        for p, deal in zip(procs, deals, strict=True):
            p.stdin.write(json.dumps({"run": deal, "go_at": go_at}) + "\n")  # type: ignore
            p.stdin.flush()  # type: ignore[union-attr]

        for p in procs:  # every instance serves its deal ...
            msg = json.loads(p.stdout.readline())  # type: ignore[union-attr]
            if "served" not in msg:
                raise RuntimeError(f"instance failed: {msg}")
        for p in procs:  # ... then, the host idle, replays its lookups (fleet mode)
            if url is not None:
                p.stdin.write("replay\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
        for p in procs:
            lines.append(json.loads(p.stdout.readline())["done"])  # type: ignore[union-attr]
    finally:
        for p in procs:
            try:
                p.stdin.write("exit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    recs = [r for d in lines for r in d["records"]]
    digests: dict[int, set[str]] = {}
    for r in recs:
        if "digest" in r:
            digests.setdefault(r["img"], set()).add(r["digest"])
    seen = {r["img"] for r in recs}
    encodes = sum(d["encodes"] for d in lines)
    not_held = [r for r in recs if r["how"] != "held"]
    lat = [r["s"] for r in recs]
    dir_s = [r["dir_s"] for r in recs if r["how"] != "held" and "waited_s" in r]
    rtts = [x for d in lines for x in d["rtts"]]  # every instance's round trips, pooled
    return {
        "mode": mode,
        "requests": len(recs),
        "distinct_images": len(seen),
        "encoder_runs": encodes,
        "encoder_runs_per_image": encodes / max(1, len(seen)),
        "how": {
            h: sum(1 for r in recs if r["how"] == h)
            for h in ("held", "fetched", "encoded", "local")
        },
        "fleet_hit_rate": (
            sum(1 for r in not_held if r["how"] == "fetched") / len(not_held) if not_held else None
        ),
        "bytes_consistent": all(len(v) == 1 for v in digests.values()),
        "latency_p50_s": _pct(lat, 0.5),
        "latency_p99_s": _pct(lat, 0.99),
        "latency_mean_s": statistics.fmean(lat) if lat else None,
        "makespan_s": max(d["makespan_s"] for d in lines),
        "directory_cost_p50_s": _pct(dir_s, 0.5),
        "directory_cost_p99_s": _pct(dir_s, 0.99),
        "lookups": len(rtts),
        "lookup_p50_s": _pct(rtts, 0.5),
        "lookup_p99_s": _pct(rtts, 0.99),
        "claims_waited": sum(d["claims_waited"] for d in lines),
        "directory_cost_idle_p50_s": _pct([x for d in lines for x in d["idle"]], 0.5),
        "directory_cost_idle_p99_s": _pct([x for d in lines for x in d["idle"]], 0.99),
    }


def run(
    requests: int = 200, images: int = 50, instances: int = 3, plane: str = "nixl", seed: int = 24
) -> dict:
    """Both modes in one run (module docstring); returns ``{"config", "modes", "targets"}``."""
    from ectransport.data.registry import try_load

    if try_load(plane) is None:
        plane = "tcp"
    rng = random.Random(seed)
    work = [i % images for i in range(requests)]
    rng.shuffle(work)
    deals = [work[k::instances] for k in range(instances)]
    redis = _Redis()
    try:
        modes = [
            run_mode("every-instance-encodes", None, deals, images, plane),
            run_mode("fleet", redis.url, deals, images, plane),
        ]
    finally:
        redis.close()
    fl = modes[1]
    return {
        "config": {
            "requests": requests,
            "images": images,
            "instances": instances,
            "plane": plane,
            "encoder": "ReferenceEncoder (Qwen2-VL-7B geometry)",
            "host_cpus": os.cpu_count(),
        },
        "modes": modes,
        "targets": {
            "encoder_runs_per_image": [
                TARGET_ENCODES_PER_IMAGE,
                fl["encoder_runs_per_image"],
                fl["encoder_runs_per_image"] <= TARGET_ENCODES_PER_IMAGE,
            ],
            "directory_cost_p50_s": [
                TARGET_DIRECTORY_COST_P50_S,
                fl["directory_cost_p50_s"],
                (fl["directory_cost_p50_s"] or 1) <= TARGET_DIRECTORY_COST_P50_S,
            ],
        },
        "vllm_cross_instance_store": "not run: mooncake.store (mooncake-transfer-engine "
        "0.3.13.post1) needs libibverbs.so.1 and libcuda.so.1; "
        "this machine has no CUDA driver",
    }


def table(res: dict) -> str:
    """The Markdown table of a result (docs/performance.md, docs/fleet.md)."""

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:.2f}"

    rows = [
        "| mode | encoder runs / image | hit rate | time to encoder output p50 / p99 "
        "(ms) | makespan (s) | directory cost / request p50 / p99 (ms) | lookup p50 / p99 "
        "(ms) | held · fetched · encoded · local |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in res["modes"]:
        hr = (
            "—"
            if m["fleet_hit_rate"] is None or m["mode"] != "fleet"
            else f"{m['fleet_hit_rate']:.0%}"
        )
        h = m["how"]
        rows.append(
            f"| {m['mode']} | {m['encoder_runs_per_image']:.2f} ({m['encoder_runs']} for "
            f"{m['distinct_images']}) | {hr} | {ms(m['latency_p50_s'])} / "
            f"{ms(m['latency_p99_s'])} | {m['makespan_s']:.1f} | "
            f"{ms(m['directory_cost_p50_s'])} / {ms(m['directory_cost_p99_s'])} | "
            f"{ms(m['lookup_p50_s'])} / {ms(m['lookup_p99_s'])} | {h['held']} · {h['fetched']} · "
            f"{h['encoded']} · {h['local']} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--images", type=int, default=50)
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--plane", default="nixl")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fleet.json")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    res = run(args.requests, args.images, args.instances, args.plane)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    print(json.dumps(res["targets"], indent=2))
    ok = all(t[2] for t in res["targets"].values()) and all(
        m["bytes_consistent"] for m in res["modes"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
