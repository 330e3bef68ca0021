"""Before/after between builds: the full benchmark of each named git revision, interleaved.

    python benchmarks/builds.py --rev before=68c1f9d --rev after=HEAD --rounds 2
    python benchmarks/builds.py --rev after=HEAD --rev tree=. --rounds 3   # "." = the work tree

Each revision is checked out into a temporary git worktree (``.`` runs this work tree as it is)
and its own ``benchmarks/run.py --full`` runs with that tree first on ``PYTHONPATH`` (so the
producer subprocess runs the same build), in rounds: A, B, ... then A, B, ... again, so that a
drift of the machine over the run reaches every build alike. Every ectransport path of a run is
read next to the raw path of the same run (``ect/raw``: the machine's state cancels out), and
per path the report gives each build's median over its rounds and the spread of its rounds —
a difference smaller than that spread is noise. Writes ``<out>/builds.json`` and prints the
table; ``--markdown`` writes the table as ``benchmarks/BUILDS.md`` (copied into
``docs/performance.md`` by ``report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def flatten(res: dict[str, Any]) -> dict[str, tuple[float, float | None]]:
    """``path -> (value, value of the raw path of the same run or None)`` of one full run: p50
    latencies in seconds per size and ectransport plane, throughput in GB/s at each number in
    flight, the control round trip, the 8-entry batch, N consumers and the fan-out."""
    out: dict[str, tuple[float, float | None]] = {}
    for size, paths in res.get("latency", {}).items():
        for name, st in paths.items():
            if name.startswith("ect-") and isinstance(st, dict) and "p50" in st:
                plane = name.split("-")[1]
                raw = paths.get(f"raw-{plane}", {}).get("p50")
                out[f"latency {size} {name} p50 s"] = (st["p50"], raw)
    for size, by_k in res.get("throughput", {}).items():
        for k, paths in by_k.items():
            for name, st in paths.items():
                if name.startswith("ect-") and isinstance(st, dict) and "gbps" in st:
                    plane = name.split("-")[1]
                    raw = paths.get(f"raw-{plane}", {}).get("gbps")
                    out[f"throughput {size} k={k} {name} GB/s"] = (st["gbps"], raw)
    rtt = res.get("control_rtt", {})
    for ect, raw in (("ect-curve", "raw-zmq-curve"), ("ect-plain", "raw-zmq-plain")):
        if ect in rtt:
            out[f"control round trip {ect} p50 s"] = (rtt[ect]["p50"],
                                                       rtt.get(raw, {}).get("p50"))
    for label, paths in res.get("batch", {}).items():
        for name, st in paths.items():
            if name.startswith("ect-") and isinstance(st, dict) and "p50" in st:
                raw = paths.get("raw-nixl", {}).get("p50")
                out[f"batch {label} {name} p50 s"] = (st["p50"], raw)
    cons = res.get("consumers", {})
    for n, paths in cons.items():
        if isinstance(paths, dict) and "ect-nixl" in paths:
            out[f"consumers N={n} ect-nixl GB/s"] = (paths["ect-nixl"]["gbps"],
                                                     paths.get("raw-nixl", {}).get("gbps"))
    fan = res.get("fanout", {}).get("summary", {})
    if "ect-nixl" in fan:
        out["fan-out ect-nixl aggregate GB/s"] = (fan["ect-nixl"]["aggregate_gbps"],
                                                  fan.get("raw-nixl", {}).get("aggregate_gbps"))
    return out


def _checkout(rev: str, tmp: Path) -> Path:
    if rev == ".":
        return REPO
    path = tmp / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), rev],
                   check=True, capture_output=True)
    return path


def run_build(tree: Path, out: Path) -> dict[str, Any]:
    """One full run of ``tree``'s own benchmark, that tree first on the import path."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    if "VLLM_VENV" not in env and (REPO / ".venv-vllm").is_dir():  # one vLLM for every build
        env["VLLM_VENV"] = str(REPO / ".venv-vllm")
    cmd = [sys.executable, str(tree / "benchmarks" / "run.py"), "--full", "--out", str(out),
           "--no-docs"]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    res: dict[str, Any] = json.loads((out / "results.json").read_text())
    res.setdefault("meta", {})["wall_s"] = time.monotonic() - t0
    return res


def compare(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per path: each build's median value and ect/raw ratio over its rounds, with their range."""
    flat = {b: [flatten(r) for r in rs] for b, rs in runs.items()}
    paths = sorted(set.intersection(*(set(f) for fs in flat.values() for f in fs)))
    rows = []
    for p in paths:
        row: dict[str, Any] = {"path": p}
        for b, fs in flat.items():
            vals = [f[p][0] for f in fs]
            ratios = [f[p][0] / f[p][1] for f in fs if f[p][1]]
            row[b] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
                      "vs_raw": statistics.median(ratios) if ratios else None,
                      "vs_raw_range": [min(ratios), max(ratios)] if ratios else None}
        rows.append(row)
    return rows


def _fmt(p: str, v: float) -> str:
    if p.endswith(" s"):
        return f"{v * 1e6:.0f} µs" if v < 1e-3 else f"{v * 1e3:.2f} ms"
    return f"{v:.2f}"


def table(rows: list[dict[str, Any]], builds: list[str]) -> str:
    """Markdown: per path, each build's median (its rounds' range) and ect/raw, and the last
    build's change against the first, on the value and on ect/raw."""
    a, z = builds[0], builds[-1]
    head = ["path", *[f"{b}: median (range)" for b in builds], *[f"{b}: ect/raw" for b in builds],
            f"{z}/{a}", f"{z}/{a} on ect/raw"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        p = r["path"]
        cells = [p.rsplit(" ", 1)[0] if p.endswith((" s", " GB/s")) else p]
        cells += [f"{_fmt(p, r[b]['median'])} ({_fmt(p, r[b]['min'])}–{_fmt(p, r[b]['max'])})"
                  for b in builds]
        cells += ["—" if r[b]["vs_raw"] is None else f"{r[b]['vs_raw']:.2f}×" for b in builds]
        cells.append(f"{r[z]['median'] / r[a]['median']:.2f}×")
        vr = (r[z]["vs_raw"] / r[a]["vs_raw"]) if r[a]["vs_raw"] and r[z]["vs_raw"] else None
        cells.append("—" if vr is None else f"{vr:.2f}×")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", action="append", required=True, metavar="NAME=REV",
                    help="a build: a name and a git revision (\".\" = this work tree), in order")
    ap.add_argument("--rounds", type=int, default=2, help="full runs per build, interleaved")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "builds")
    ap.add_argument("--markdown", action="store_true", help="write benchmarks/BUILDS.md")
    a = ap.parse_args()
    named = [tuple(s.split("=", 1)) for s in a.rev]
    builds = [n for n, _ in named]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in builds}
    with tempfile.TemporaryDirectory(prefix="ect-builds-") as td:
        trees = {n: _checkout(rev, Path(td)) for n, rev in named}
        try:
            for i in range(a.rounds):
                for n in builds:
                    print(f"== round {i + 1}/{a.rounds}: {n} ({trees[n]})", flush=True)
                    runs[n].append(run_build(trees[n], Path(td) / f"{n}-{i}"))
        finally:
            for n, rev in named:
                if rev != ".":
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(trees[n])], check=False, capture_output=True)
    rows = compare(runs)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {n: {"rev": rev, "runs": [r["meta"] for r in runs[n]]} for n, rev in named}
    (a.out / "builds.json").write_text(json.dumps({"builds": meta, "rows": rows}, indent=1))
    md = table(rows, builds)
    print(md)
    if a.markdown:
        (HERE / "BUILDS.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
