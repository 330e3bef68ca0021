"""``ectransport bench``: ectransport side by side with the raw planes, memcpy, the safetensors
path and local recompute.

The harness lives in the repository's ``benchmarks/`` directory, not in the wheel: it needs what
the package does not (safetensors and matplotlib from the ``dev`` extra, a NIXL install, the
repository's docs/ to regenerate), and it runs producer and consumer as scripts. From an installed
package the command finds it through ``ECTRANSPORT_BENCHMARKS_DIR`` or the current directory, and
otherwise says how to get it (exit code 2)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ectransport.cli.app import cli, friendly
from ectransport.errors import ConfigError


def _is_harness(d: Path) -> bool:
    return (d / "harness.py").exists() and (d / "server.py").exists()


def _benchmarks_dir() -> Path:
    """The harness folder: ``$ECTRANSPORT_BENCHMARKS_DIR`` if set (it must hold the harness),
    else the source checkout this package runs from (an editable install), else
    ``./benchmarks``.

    Raises:
        ConfigError: ``$ECTRANSPORT_BENCHMARKS_DIR`` holds no harness, or none was found.
    """
    env = os.environ.get("ECTRANSPORT_BENCHMARKS_DIR")
    if env:
        if _is_harness(Path(env)):
            return Path(env)
        raise ConfigError(
            f"ECTRANSPORT_BENCHMARKS_DIR={env} holds no benchmark harness (harness.py and "
            "server.py): point it at the benchmarks/ folder of an ectransport source checkout, "
            "or unset it to use the checkout you run from")
    cands = [Path.cwd() / "benchmarks"]
    root = Path(__file__).resolve().parents[2]  # the checkout, when ectransport/ is a source tree
    if (root / "pyproject.toml").exists() and (root / "ectransport").is_dir():
        cands.insert(0, root / "benchmarks")
    for d in cands:
        if _is_harness(d):
            return d
    raise ConfigError(
        "the benchmark harness (benchmarks/harness.py) is not part of the installed package; "
        "it ships with the source. Get a source checkout (`git clone` the ectransport repository, "
        "then `pip install -e '.[nixl,dev]'` in it) and run `ectransport bench` inside that "
        "checkout, or point ECTRANSPORT_BENCHMARKS_DIR at its benchmarks/ folder "
        "(looked in: " + ", ".join(str(d) for d in cands) + ")")


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
    processes. Needs the harness from a source checkout (its benchmarks/ folder, found in the
    current directory or through ECTRANSPORT_BENCHMARKS_DIR); an installed wheel alone says how
    to get it."""
    import importlib.util

    d = _benchmarks_dir()
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    spec = importlib.util.spec_from_file_location("ectransport_benchmarks_run", d / "run.py")
    assert spec is not None and spec.loader is not None  # a .py path always gets a source loader
    bench_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_run)

    bench_run.main(quick=mode == "quick", out=out, write_docs=False if no_docs else None)
