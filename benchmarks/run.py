"""Run the ectransport benchmark (same as ``ectransport bench``).

    python benchmarks/run.py           # full: JSON + PNG in benchmarks/results, docs/performance.md
    python benchmarks/run.py --quick   # < 3 min subset, prints the ratio table only
    python benchmarks/run.py --from-json benchmarks/results/results.json   # re-render only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import report  # noqa: E402
from common import Config  # noqa: E402

DEFAULT_OUT = HERE / "results"


def main(quick: bool = False, out: Path | None = None, write_docs: bool | None = None,
         json_only: bool = False) -> dict:
    """Run, print the tables; write JSON (+ PNG and docs/performance.md for a full run) to out."""
    cfg = Config.quick() if quick else Config.full()
    res = harness.run(cfg)
    if not quick:  # N consumer processes on one producer (issue 16 item 7): benchmarks/fanout.py
        import fanout  # noqa: PLC0415

        res["fanout"] = fanout.run(fanout.FanoutConfig.full(), res)
    report.print_tables(res)
    if out is None and not quick:
        out = DEFAULT_OUT
    if out is not None:
        out = Path(out)
        prev = out / "results.json"
        if not quick and prev.exists():  # the before/after table of docs/performance.md
            prev.replace(out / "results-previous.json")
        jp = report.write_json(res, out)
        print(f"wrote {jp}")
        png = None
        if not json_only:
            png = report.plot(res, out)
            print(f"wrote {png}")
        if write_docs if write_docs is not None else not quick:
            doc = report.REPO / "docs" / "performance.md"
            doc.write_text(report.markdown(res, png, jp))
            print(f"wrote {doc}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true")
    g.add_argument("--full", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/performance.md")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="do not measure: re-render tables, plot and docs from a results.json")
    a = ap.parse_args()
    if a.from_json:
        import json

        res = json.loads(a.from_json.read_text())
        report.print_tables(res)
        out = a.out or a.from_json.parent
        png = report.plot(res, out)
        if not a.no_docs:
            (report.REPO / "docs" / "performance.md").write_text(
                report.markdown(res, png, a.from_json))
        sys.exit(0)
    main(quick=a.quick, out=a.out, write_docs=False if a.no_docs else None)
