"""The fleet phase of ``benchmarks/vllm_ttft.py``: three real vLLM engines (``ec_both``, the
tests' tiny Qwen2-VL) serving a workload whose images repeat across instances, two ways side by
side in one run:

- ``every instance encodes``: the three instances with ectransport's connector and no fleet
  directory — an image is encoded once per instance that sees it (later repeats on the same
  instance are loaded from its own host region, the local tier);
- ``fleet directory``: the same three with ``fleet_url`` (a real redis-server started here): an
  image one instance encoded is fetched by the others from it, found through the directory with
  no ``ec_transfer_params`` from an orchestrator; an image nobody holds is claimed and encoded
  once in the fleet.

The workload: ``requests`` requests, one at a time, round-robin over the instances, each an image
drawn (seeded, uniformly) from ``images`` distinct ones; the same sequence for both. Per request:
TTFT (the wall time of the instance's ``LLM.generate``, ``max_tokens=1``) and the encoder runs
of that instance (the test-only probe plugin). Reported: TTFT p50/p90 over every request and
over *cross-instance first sights* (an instance's first request for an image another instance
already encoded: where the fleet fetches instead of encoding), encoder runs per distinct image
(1.0 is the fleet's target), the fleet hit rate (first sights served with no encoder run), and
the directory's own figures read from each instance's ``metrics_port`` (items looked up and found,
claims, lookup round-trip p50/p99 from the ``ectransport_fleet_lookup_seconds`` histogram: bucket
upper bounds).

vLLM's own cross-instance store path (``ECMooncakeConnector``: a Mooncake store) needs Mooncake's
transfer engine and CUDA; it cannot run on this CPU-only host, so it is not in the table.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PHASES = ("every instance encodes", "fleet directory")
INSTANCES = ("A", "B", "C")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload(requests: int, images: int, seed: int = 7) -> list[tuple[str, int]]:
    """``(instance, image id)`` per request: round-robin instances, images drawn uniformly."""
    rng = random.Random(seed)
    return [
        (INSTANCES[k % len(INSTANCES)], 1_000_000 + rng.randrange(images)) for k in range(requests)
    ]


def run_phase(
    name: str,
    engines: dict[str, Any],
    work: list[tuple[str, int]],
    side: int,
    metrics_ports: dict[str, int] | None,
) -> dict:
    """Send ``work`` one request at a time; per-request TTFT and encoder runs, then summaries."""
    from ttft_util import pct

    seen: dict[int, set[str]] = {}  # image -> instances that had it
    encoded_by: dict[int, set[str]] = {}  # image -> instances whose encoder ran for it
    rows: list[dict] = []
    # warm-up, unmeasured: each instance encodes an image of its own and every other one asks
    # for it (compilation, the instances' first connections to each other)
    for n, src in enumerate(INSTANCES):
        for inst in (src, *[i for i in INSTANCES if i != src]):
            engines[inst].generate([{"image": 900_000 + n, "side": side, "max_tokens": 1}])
    t0 = time.monotonic()
    for k, (inst, image) in enumerate(work):
        e = engines[inst]
        before = e.encoded()
        (o,) = e.generate([{"image": image, "side": side, "max_tokens": 1}])
        ran = e.encoded() - before
        first_here = inst not in seen.get(image, set())
        elsewhere = bool(encoded_by.get(image, set()) - {inst})
        rows.append(
            {
                "k": k,
                "instance": inst,
                "image": image,
                "ttft_s": o["s"],
                "encoder": ran,
                "first_here": first_here,
                "cross_first": first_here and elsewhere,
            }
        )
        seen.setdefault(image, set()).add(inst)
        if ran:
            encoded_by.setdefault(image, set()).add(inst)
    wall_s = time.monotonic() - t0
    distinct = len(seen)
    runs = sum(r["encoder"] for r in rows)
    cross = [r for r in rows if r["cross_first"]]
    hits = sum(1 for r in cross if r["encoder"] == 0)

    def stats(rs: list[dict]) -> dict:
        xs = [r["ttft_s"] for r in rs]
        return {
            "n": len(xs),
            "p50_ms": pct(xs, 0.5) * 1e3 if xs else None,
            "p90_ms": pct(xs, 0.9) * 1e3 if xs else None,
        }

    out = {
        "phase": name,
        "requests": len(rows),
        "distinct_images": distinct,
        "encoder_runs": runs,
        "encoder_runs_per_image": runs / distinct if distinct else 0.0,
        "cross_instance_first_sights": len(cross),
        "fleet_hit_rate": hits / len(cross) if cross else 0.0,
        "ttft_all": stats(rows),
        "ttft_cross_first": stats(cross),
        "ttft_first_here": stats([r for r in rows if r["first_here"]]),
        "ttft_repeat_here": stats([r for r in rows if not r["first_here"]]),
        "wall_s": wall_s,
        "rows": rows,
    }
    if metrics_ports:
        out["directory"] = directory_figures(metrics_ports)
    shown = {k: v for k, v in out.items() if k not in ("directory", "rows")}
    print(f"{name}: {json.dumps(shown)}", flush=True)
    return out


def directory_figures(ports: dict[str, int]) -> dict:
    """The fleet families of every instance's ``metrics_port``, summed: items found / not,
    claims, and the lookup round trip's p50/p99 (histogram bucket upper bounds)."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = misses = 0.0
    claims: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for port in ports.values():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "ectransport_fleet_lookup_items_total":
                    if s.labels.get("outcome") == "hit":
                        hits += s.value
                    else:
                        misses += s.value
                elif s.name == "ectransport_fleet_claims_total":
                    o = s.labels["outcome"]
                    claims[o] = claims.get(o, 0.0) + s.value
                elif s.name == "ectransport_fleet_lookup_seconds_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
    total = max(buckets.values()) if buckets else 0.0

    def quantile(q: float) -> float | None:
        for le, n in sorted(buckets.items()):
            if total and n >= q * total:
                return le * 1e3
        return None

    return {
        "lookup_items_hit": hits,
        "lookup_items_miss": misses,
        "directory_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "claims": claims,
        "lookups": total,
        "lookup_p50_ms_le": quantile(0.5),
        "lookup_p99_ms_le": quantile(0.99),
    }


def run(a: Any, model: str, keys_dir: str, region_dir: str, logs: str) -> dict:
    """Both phases (module docstring); returns the results dict."""
    import subprocess

    from _engines import EngineProcess, ec_config
    from tiny_vlm import image_tokens
    from ttft_util import _cpu, _env

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.fleet.redis_server import RedisServer

    cli = [sys.executable, "-m", "ectransport.cli"]
    allow = os.path.join(keys_dir, "allowed")
    for inst in INSTANCES:
        subprocess.run(
            [*cli, "keys", "generate", "--out", keys_dir, "--name", f"enc-{inst}"],
            check=True,
            timeout=60,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            [*cli, "keys", "allow", os.path.join(keys_dir, f"enc-{inst}.key"), "--dir", allow],
            check=True,
            timeout=60,
            stdout=subprocess.DEVNULL,
        )
    trusted = [os.path.join(keys_dir, f"enc-{i}.key") for i in INSTANCES]
    tokens = image_tokens(a.fleet_side)
    item = tokens * a.hidden * 2
    region = max(64 << 20, 4 * a.fleet_images * item)  # every image fits: no eviction
    work = workload(a.fleet_requests, a.fleet_images)
    results: dict = {
        "setup": {
            "hidden": a.hidden,
            "vision_scale": a.vision_scale,
            "side": a.fleet_side,
            "image_tokens": tokens,
            "item_bytes": item,
            "requests": a.fleet_requests,
            "images": a.fleet_images,
            "instances": len(INSTANCES),
            "cpu": _cpu(),
        },
        "phases": {},
        "not_run": {
            "vLLM ECMooncakeConnector (cross-instance store)": "needs Mooncake's transfer engine and CUDA; this host is "
            "CPU-only"
        },
    }
    (Path(logs) / "redis").mkdir(exist_ok=True)
    redis = RedisServer(Path(logs) / "redis").start()
    try:
        for phase in PHASES:
            fleet = phase == "fleet directory"
            engines: dict[str, Any] = {}
            ports = {i: free_port() for i in INSTANCES} if fleet else None
            try:
                for n, inst in enumerate(INSTANCES):
                    extra: dict[str, Any] = {
                        "secret_key_file": os.path.join(keys_dir, f"enc-{inst}.key_secret"),
                        "allow_dir": allow,
                        "producer_keys": trusted,
                        "shm_dir": region_dir,
                        "region_bytes": region,
                        "fetch_timeout_s": 10.0,
                    }
                    if fleet:
                        assert ports is not None
                        extra.update(
                            fleet_url=redis.url,
                            fleet_liveness_ttl_s=3.0,
                            fleet_claim_wait_s=20.0,
                            metrics_port=ports[inst],
                        )
                    with _env({"VLLM_CPU_OMP_THREADS_BIND": str(n % 2)}):
                        engines[inst] = EngineProcess(
                            f"fleet-{phase.split()[0]}-{inst}",
                            model,
                            ec_config("ec_both", **extra),
                            logs,
                            max_model_len=tokens + 256,
                        )
                print(
                    f"{phase}: engines up in "
                    + ", ".join(f"{e.start_s:.0f} s" for e in engines.values()),
                    flush=True,
                )
                results["phases"][phase] = run_phase(phase, engines, work, a.fleet_side, ports)
            finally:
                for e in reversed(list(engines.values())):
                    with contextlib.suppress(Exception):
                        e.close()
    finally:
        redis.stop()
    return results


def render(r: dict) -> str:
    """The ``benchmarks/TTFT.md`` section of the fleet phase."""
    s = r["setup"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} ms"

    lines = [
        "## Fleet phase: images repeating across three instances",
        "",
        f"Three `ec_both` vLLM engines (vllm-cpu, CPU: {s['cpu']}; tiny Qwen2-VL, hidden "
        f"{s['hidden']}, vision scale {s['vision_scale']}, {s['side']} px images: "
        f"{s['image_tokens']} tokens, {s['item_bytes'] / 1e6:.2f} MB); {s['requests']} "
        f"requests one at a time, round-robin over the instances, each one of "
        f"{s['images']} distinct images (seeded, uniform), no `ec_transfer_params`. "
        "Generated by `benchmarks/vllm_ttft.py --phase fleet`.",
        "",
        "| phase | TTFT p50 | TTFT p90 | cross-instance first sights: TTFT p50 | p90 | "
        "repeats on the same instance: TTFT p50 | encoder runs per distinct image | "
        "fleet hit rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in PHASES:
        p = r["phases"].get(name)
        if p is None:
            continue
        lines.append(
            f"| {name} | {ms(p['ttft_all']['p50_ms'])} | {ms(p['ttft_all']['p90_ms'])} "
            f"| {ms(p['ttft_cross_first']['p50_ms'])} | "
            f"{ms(p['ttft_cross_first']['p90_ms'])} | {ms(p['ttft_repeat_here']['p50_ms'])} | "
            f"{p['encoder_runs_per_image']:.2f} (target 1.0 with the fleet) | "
            f"{p['fleet_hit_rate']:.2f} ({p['cross_instance_first_sights']} first "
            "sights) |"
        )
    d = r["phases"].get("fleet directory", {}).get("directory")
    if d:
        lines += [
            "",
            f"The directory (from the instances' `metrics_port`): {d['lookups']:.0f} "
            f"lookups, items found {d['lookup_items_hit']:.0f} / not "
            f"{d['lookup_items_miss']:.0f} (hit rate {d['directory_hit_rate']:.2f}), "
            f"claims {json.dumps({k: int(v) for k, v in d['claims'].items() if v})}, "
            f"lookup round trip p50 ≤ {ms(d['lookup_p50_ms_le'])}, p99 ≤ "
            f"{ms(d['lookup_p99_ms_le'])} (histogram bucket bounds).",
        ]
    lines += [
        "",
        "*Cross-instance first sights*: an instance's first request for an image "
        "another instance already encoded — with the fleet it is fetched from that "
        "instance, without it encoded again. *Repeats on the same instance* are served by "
        "vLLM's own encoder cache or the instance's region (the local tier) in both phases; "
        "with the fleet an instance that fetched an item keeps no copy of its own, so once "
        "vLLM evicted it a repeat fetches it again. TTFT on this shared 2-core host is noisy "
        "(other jobs ran beside it); the encoder-run counts are exact (probe plugin). Not run: "
        + "; ".join(f"{k}: {v}" for k, v in r["not_run"].items())
        + ".",
    ]
    return "\n".join(lines) + "\n"
