"""``python -m interop [--full] [--impl NAME=CMD ...] [--only TEXT] [--out DIR] ...`` runs the
matrix; ``python -m interop check-adapter CMD`` checks an adapter (``interop/ADAPTER.md``).

Every implementation of the run must be available (built, answering its adapter's ``hello``);
one that is not fails the run before any cell, unless ``--allow-unavailable NAME`` says to run
without it. ``--list`` builds and starts nothing.

Exit status: 0 when every cell met its expectation, 1 on any deviation, 2 on a harness error
(an unavailable implementation, no cell selected).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from interop import cases, impls, matrix, venvs


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m interop", description=__doc__)
    ap.add_argument("--full", action="store_true",
                    help="every cell, both earlier releases, the library axis (default: reduced)")
    ap.add_argument("--only", help="run cells whose name contains this text")
    ap.add_argument("--skip", help="leave out cells whose name contains this text")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                    help="where report.md / report.json / logs go [interop/]")
    ap.add_argument("--loopback", action="store_true",
                    help="use loopback addresses even where network namespaces are available")
    ap.add_argument("--netns", action="store_true", help="require network namespaces")
    ap.add_argument("--no-vllm", action="store_true", help="skip the cells that need vLLM")
    ap.add_argument("--list", action="store_true",
                    help="list the implementations and cells and exit, building and starting "
                         "nothing (the cells of an implementation other than this tree follow "
                         "from its adapter's hello, so they are listed when the run starts it)")
    ap.add_argument("--impl", action="append", default=[], metavar="NAME=CMD",
                    help="add an implementation: CMD starts its adapter (ADAPTER.md); it runs "
                         "as producer and as consumer against every implementation of the run "
                         "(repeatable)")
    ap.add_argument("--allow-unavailable", action="append", default=[], metavar="NAME",
                    help="run without implementation NAME if it cannot be built or does not "
                         "answer hello (the report says why); without it an unavailable "
                         "implementation fails the run (repeatable)")
    ap.add_argument("--release", action="append", default=None, metavar="REV",
                    help=f"an earlier release (git revision) to run against this tree "
                         f"(repeatable; default {impls.LAST_V1}, with --full also "
                         f"{impls.FIRST_V2})")
    ap.add_argument("--no-releases", action="store_true", help="no earlier release")
    ap.add_argument("--no-c-client", action="store_true",
                    help=f"leave out the C client ({impls.C_CLIENT} and {impls.C_CLIENT_V1})")
    ap.add_argument("--lib", action="append", default=None, metavar="PINS",
                    help="a library-axis venv, e.g. pyzmq==25.1.0 (comma-separated pins; "
                         "repeatable; default with --full: one venv per library of pyproject "
                         "(pyzmq, msgspec, nixl with its nixl-cu13 backend) at the oldest and "
                         "one at the newest version it admits: "
                         + "; ".join(",".join(p) for p in (*impls.OLDEST_LIBS,
                                                            *impls.NEWEST_LIBS)) + ")")
    ap.add_argument("--cross-only", action="store_true",
                    help="only the implementation x implementation cells")
    ap.add_argument("--cache", type=Path, default=None,
                    help=f"built venvs and binaries [${venvs.ENV_CACHE} or .venv-interop/]")
    return ap


def select_impls(args: argparse.Namespace) -> list[impls.Impl]:
    """The implementations of this run (module ``interop.impls``), not yet built."""
    cache = venvs.cache_dir(args.cache, create=not args.list)
    out = [impls.head()] + ([] if args.no_vllm else [impls.vllm()])
    if not args.no_releases:
        revs = args.release or ([impls.LAST_V1, impls.FIRST_V2] if args.full
                                else [impls.LAST_V1])
        out += [impls.release(r, cache) for r in revs]
    if not args.no_c_client:
        out += [impls.c_client(cache), impls.c_client(cache, v1_only=True)]
    libs = args.lib if args.lib is not None else \
        ([",".join(p) for p in (*impls.OLDEST_LIBS, *impls.NEWEST_LIBS)] if args.full else [])
    out += [impls.lib(tuple(s.split(",")), cache) for s in libs if s.strip()]
    out += [impls.external(s) for s in args.impl]
    names = [i.name for i in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"implementation names must be unique: {names}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check-adapter"]:
        from interop.check_adapter import main as check_main

        return check_main(argv[1:])
    args = _parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        chosen = select_impls(args)
    except ValueError as e:
        print(f"interop: {e}", file=sys.stderr)
        return 2
    if args.list:
        return _list(args, chosen)
    for impl in chosen:
        if impl.axis == "vllm":
            impl.prepare()  # vLLM's classes have no adapter: checks its venv
        else:
            impl.probe()  # builds it first; a failure leaves .unavailable set
    try:
        missing = impls.unavailable(chosen, args.allow_unavailable)
    except ValueError as e:
        print(f"interop: {e}", file=sys.stderr)
        return 2
    if missing:
        for i in missing:
            print(f"interop: implementation {i.name} is unavailable: {i.unavailable[:600]}",
                  file=sys.stderr)
        names = " ".join(f"--allow-unavailable {i.name}" for i in missing)
        print(f"interop: no cell run; fix the above, or leave it out ({names}; "
              "--no-vllm / --no-c-client / --no-releases)", file=sys.stderr)
        return 2
    by_name = {i.name: i for i in chosen}
    cells = _cells(args, chosen)
    if not cells:
        print("interop: no cell selected (check --only / --skip and the implementations' "
              "roles)", file=sys.stderr)
        return 2
    from interop.harness import Harness
    from interop.report import write

    slots = sorted({s for c in cells for s in c.hosts()})
    mode = "loopback" if args.loopback else ("netns" if args.netns else "auto")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))  # run the finally: below
    args.out.mkdir(parents=True, exist_ok=True)
    h = Harness(slots, mode=mode, out_dir=args.out, impls=by_name)
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
    md, _ = write(results, args.out, mode=h.topo.mode, mode_reason=h.topo.reason,
                  full=args.full, versions=h.versions, wall_s=time.monotonic() - t0, extra=extra,
                  impls=chosen)
    bad = [r for r in results if not r.passed and not r.skipped]
    print(f"interop: {len(results)} cells, {len(bad)} deviation(s), "
          f"{sum(bool(r.skipped) for r in results)} skipped, topology {h.topo.mode}; "
          f"{md} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    for i in chosen:
        if i.unavailable:
            print(f"  unavailable {i.name}: {i.unavailable[:300]}", file=sys.stderr)
    for r in bad:
        print(f"  DEVIATION {r.cell.name}: {'; '.join(r.deviations)}", file=sys.stderr)
    return 1 if bad else 0


def _cells(args: argparse.Namespace, chosen: list[impls.Impl]) -> list:
    """The cells of the run: the matrix's (unless ``--cross-only``) and the implementation ×
    implementation ones of the implementations whose ``hello`` is known, filtered."""
    cells = [] if args.cross_only else matrix.select(args.full)
    cells += [c for c in cases.cross_cells(chosen, full=args.full) if args.full or c.ci]
    if args.only:
        cells = [c for c in cells if args.only.lower() in c.name.lower()]
    if args.skip:
        cells = [c for c in cells if args.skip.lower() not in c.name.lower()]
    return cells


def _list(args: argparse.Namespace, chosen: list[impls.Impl]) -> int:
    """``--list``: the implementations and the cells known without building or starting
    anything — this tree's ``hello`` is read in this process; another implementation's cells
    follow from its adapter's ``hello``, which only a run asks for."""
    from interop.node_ops import Nodes

    for i in chosen:
        if i.name == impls.HEAD:
            i.caps = {"adapter": 1, **Nodes().hello()}
        state = "this process's hello" if i.caps else \
            "not built or started; its cells are drawn from its hello when a run starts it"
        print(f"impl {i.name}: {i.unavailable or i.origin} [{state}]")
    for c in _cells(args, chosen):
        print(f"{'ci ' if c.ci else '   '}{c.group:10} {c.name}")
    return 0


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
