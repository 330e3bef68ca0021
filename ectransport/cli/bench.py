"""``ectransport bench``: ectransport side by side with the raw planes, memcpy, the safetensors
path and local recompute (the harness lives in the repository's ``benchmarks/`` directory)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ectransport.cli.main import cli, friendly
from ectransport.errors import ConfigError


def _benchmarks_dir() -> Path:
    env = os.environ.get("ECTRANSPORT_BENCHMARKS_DIR")
    cands = ([Path(env)] if env else []) + [Path(__file__).resolve().parents[2] / "benchmarks",
                                             Path.cwd() / "benchmarks"]
    for d in cands:
        if (d / "harness.py").exists() and (d / "server.py").exists():
            return d
    raise ConfigError("the benchmark harness (benchmarks/harness.py) was not found: run from a "
                      "source checkout of ectransport or set ECTRANSPORT_BENCHMARKS_DIR")


@cli.command()
@click.option("--quick", "mode", flag_value="quick", default=True,
              help="Subset in < 3 min: 1 MiB and 8.8 MiB, nixl+tcp, CURVE on, nixl grant vs "
                   "region scope (default).")
@click.option("--full", "mode", flag_value="full",
              help="Every size, plane, CURVE on/off, 1/4/16 in flight, 1/2/8 consumers, nixl "
                   "grant vs region scope; writes JSON, a PNG and docs/performance.md.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Directory for results.json and performance.png (full default: "
                   "benchmarks/results; quick: nothing written unless given).")
@click.option("--no-docs", is_flag=True, help="Full run: do not rewrite docs/performance.md.")
@friendly
def bench(mode: str, out: Path | None, no_docs: bool) -> None:
    """Measure ectransport against the raw data planes (NIXL READ, ucxx, TCP sockets), the
    single-core memcpy limit, vLLM's safetensors save/load path and local recompute, in the same
    run, interleaved, and print the ratio table (ectransport/raw, ectransport/memcpy,
    baseline/ectransport per size), plus the NIXL plane's grant_scope "grant" vs "region" (fetch
    latency A/B and the per-grant cost on each side). Producer and consumer run as two
    processes."""
    import importlib.util

    d = _benchmarks_dir()
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    spec = importlib.util.spec_from_file_location("ectransport_benchmarks_run", d / "run.py")
    assert spec is not None and spec.loader is not None  # a .py path always gets a source loader
    bench_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_run)

    bench_run.main(quick=mode == "quick", out=out, write_docs=False if no_docs else None)
