"""``python -m interop [--full] [--only TEXT] [--skip TEXT] [--out DIR] [--loopback] [--list]``.

Exit status: 0 when every cell met its expectation, 1 on any deviation, 2 on a harness error.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from interop import matrix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interop", description=__doc__)
    ap.add_argument("--full", action="store_true", help="run every cell (default: reduced/CI)")
    ap.add_argument("--only", help="run cells whose name contains this text")
    ap.add_argument("--skip", help="leave out cells whose name contains this text")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                    help="where report.md / report.json / logs go [interop/]")
    ap.add_argument("--loopback", action="store_true",
                    help="use loopback addresses even where network namespaces are available")
    ap.add_argument("--netns", action="store_true", help="require network namespaces")
    ap.add_argument("--no-vllm", action="store_true", help="skip the cells that need vLLM")
    ap.add_argument("--list", action="store_true", help="list the selected cells and exit")
    args = ap.parse_args(argv)

    cells = matrix.select(args.full, args.only)
    if args.skip:
        cells = [c for c in cells if args.skip.lower() not in c.name.lower()]
    if args.list:
        for c in cells:
            print(f"{'ci ' if c.ci else '   '}{c.group:10} {c.name}")
        return 0
    from interop.harness import Harness
    from interop.report import write

    slots = sorted({s for c in cells for s in c.hosts()})
    mode = "loopback" if args.loopback else ("netns" if args.netns else "auto")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))  # run the finally: below
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    h = Harness(slots, mode=mode, out_dir=args.out, with_vllm=False if args.no_vllm else None)
    results = []
    try:
        for cell_res in _run_all(h, cells):
            results.append(cell_res)
    finally:
        h.close()
    extra = []
    if h.topo.stale_removed:
        extra.append(f"removed stale namespaces: {', '.join(h.topo.stale_removed)}")
    if not h.with_vllm:
        extra.append(f"vLLM cells skipped: {h.vllm_reason or 'disabled'}")
    md, js = write(results, args.out, mode=h.topo.mode, mode_reason=h.topo.reason,
                   full=args.full, versions=h.versions, wall_s=time.monotonic() - t0, extra=extra)
    bad = [r for r in results if not r.passed and not r.skipped]
    print(f"interop: {len(results)} cells, {len(bad)} deviation(s), "
          f"{sum(bool(r.skipped) for r in results)} skipped, topology {h.topo.mode}; "
          f"{md} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    for r in bad:
        print(f"  DEVIATION {r.cell.name}: {'; '.join(r.deviations)}", file=sys.stderr)
    return 1 if bad else 0


def _run_all(h, cells):
    """Yield each cell's result; a rich progress bar on a terminal, silence otherwise."""
    if not sys.stderr.isatty():
        for c in cells:
            yield h.run_cell(c)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=False) as prog:
        task = prog.add_task("interop", total=len(cells))
        for c in cells:
            prog.update(task, description=c.name[:48])
            r = h.run_cell(c)
            if not r.passed and not r.skipped:
                prog.console.print(f"[red]DEVIATION[/] {c.name}: {'; '.join(r.deviations)}")
            prog.advance(task)
            yield r


if __name__ == "__main__":
    sys.exit(main())
