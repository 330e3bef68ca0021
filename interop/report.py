"""``report.md`` (one row per cell) and ``report.json`` from the cell results."""

from __future__ import annotations

import datetime as _dt
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from interop.harness import CellResult
from interop.tables import markdown, tables


def _cell_json(r: CellResult, mode: str) -> dict[str, Any]:
    c = r.cell
    return {
        "name": c.name, "group": c.group, "proves": c.proves, "ci": c.ci,
        "producer": c.producer.to_json(), "consumers": [x.to_json() for x in c.consumers],
        "entries": [e.__dict__ for e in c.entries],
        "passed": r.passed, "skipped": r.skipped, "seconds": round(r.seconds, 3),
        "vectors": r.vectors, "notes": r.notes, "deviations": r.deviations,
        "steps": [{"op": s.step.op, "who": s.step.who, "mm_hash": s.step.mm_hash,
                   "expected": s.expected, "observed": s.observed.outcome,
                   "plane": s.observed.plane, "seconds": round(s.observed.seconds, 4),
                   "bytes_ok": s.observed.bytes_ok, "detail": s.observed.detail,
                   "deviation": s.deviation} for s in r.steps],
    }


def _impl_json(i: Any) -> dict[str, Any]:
    caps = i.caps or {}
    libs = caps.get("libs", {})
    return {"name": i.name, "origin": i.origin, "axis": i.axis, "unavailable": i.unavailable,
            "impl": caps.get("impl"), "roles": caps.get("roles", []),
            "versions": caps.get("versions", []), "planes": caps.get("planes", []),
            "features": caps.get("features", []), "libs": libs,
            "pinned_libs": {n: libs.get(n) for n in getattr(i, "pinned_libs", {})}}


def _esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def write(results: list[CellResult], out_dir: Path, *, mode: str, mode_reason: str, full: bool,
          versions: dict[str, dict[str, str]], wall_s: float,
          extra: list[str], impls: Sequence[Any] = ()) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` under ``out_dir``; their paths.

    ``impls``: the run's :class:`~interop.impls.Impl` objects (name, origin, what their adapter
    declared, or why they could not run), listed in both files."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    passed = sum(r.passed for r in results)
    skipped = [r for r in results if r.skipped]
    failed = [r for r in results if not r.passed and not r.skipped]
    tabs = tables(results)
    data = {"date": now, "matrix": "full" if full else "reduced", "topology": mode,
            "topology_note": mode_reason, "host": platform.platform(), "versions": versions,
            "wall_s": round(wall_s, 1), "cells": len(results), "passed": passed,
            "skipped": len(skipped), "deviations": len(failed), "notes": extra,
            "implementations": [_impl_json(i) for i in impls],
            "tables": tabs,
            "results": [_cell_json(r, mode) for r in results]}
    jpath = out_dir / "report.json"
    jpath.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")

    lines = [f"# Interop report ({data['matrix']} matrix)", "",
             f"- date: {now}; wall time {wall_s:.0f} s; host `{platform.platform()}`",
             f"- topology: **{mode}**" + (f" ({mode_reason})" if mode_reason else "") +
             (": one network namespace and address per node slot, joined by veth pairs on a "
              "bridge; the `lo-*` slots share one more namespace on 127.0.0.N addresses"
              if mode == "netns" else ""),
             f"- cells: {len(results)}; passed {passed}; deviations {len(failed)}; "
             f"skipped {len(skipped)}"]
    for k, v in sorted(versions.items()):
        lines.append(f"- `{k}`: " + ", ".join(f"{n} {x}" for n, x in sorted(v.items())))
    for n in extra:
        lines.append(f"- {n}")
    if impls:
        lines += ["", "## Implementations", "", "| implementation | what | roles | ECTP | planes | "
                  "features |", "|---|---|---|---|---|---|"]
        for i in impls:
            j = _impl_json(i)
            if j["unavailable"]:
                lines.append(f"| `{j['name']}` | {_esc(j['origin'])} | unavailable: "
                             f"{_esc(j['unavailable'])[:200]} | | | |")
                continue
            what = j["origin"]
            if j["pinned_libs"]:  # the library axis: what its adapter reported loading
                what += "; loads " + ", ".join(f"{n} {v}" for n, v in j["pinned_libs"].items())
            lines.append(f"| `{j['name']}` | {_esc(what)} | {', '.join(j['roles'])} | "
                         f"{', '.join(map(str, j['versions']))} | {', '.join(j['planes'])} | "
                         f"{', '.join(j['features'])} |")
    lines += ["", *markdown(tabs)]
    lines += ["", "## Cells", "", "Outcomes: `ok` = bytes verified (SHA-256) or connected; `miss:R` = "
              "`Miss(reason=R)`; `error:E` = exception `E` raised; `refused:E` = the node could "
              "not start (`E`); `vllm:*` = the state vLLM's own ConsumerSession ended in. "
              "`v2*` = an emulated version claim. `ok via P`: the step must have used plane "
              "`P` (the negotiated plane, reported by the node; the `plane` column).", "",
              "| # | cell | producer → consumer(s) | expected | observed | plane | time s | "
              "result |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        c = r.cell
        who = c.producer.brief() + " → " + (", ".join(sorted({x.brief() for x in c.consumers}))
                                            if c.consumers else "—")
        if len(c.consumers) > 1:
            who += f" ×{len(c.consumers)}"
        if r.skipped:
            lines.append(f"| {i} | {_esc(c.name)} | {_esc(who)} | | | | | skipped: "
                         f"{_esc(r.skipped)} |")
            continue
        exp = _runs(f"{s.step.op}={s.expected.split(' (consumer')[0]}" for s in r.steps)
        obs = _runs(f"{s.step.op}={s.observed.outcome}" for s in r.steps)
        planes = ",".join(_uniq(s.observed.plane for s in r.steps if s.observed.plane)) or "—"
        res = "pass" if r.passed else "**DEVIATION**: " + _esc("; ".join(r.deviations))[:300]
        lines.append(f"| {i} | {_esc(c.name)} | {_esc(who)} | {_esc(exp)} | {_esc(obs)} | "
                     f"{planes} | {r.seconds:.1f} | {res} |")
    if failed:
        lines += ["", "## Deviations", ""]
        for r in failed:
            lines.append(f"- **{r.cell.name}**: " + "; ".join(r.deviations))
            for s in r.steps:
                if s.deviation and s.observed.detail:
                    lines.append(f"  - {s.step.op}: {s.observed.detail[:300]}")
    lines += ["", "## Golden-vector checks", ""]
    seen = set()
    for r in results:
        for tag, v in r.vectors.items():
            line = f"- {r.cell.name} / {tag}: {v}"
            key = (tag.startswith("consumer"), v)
            if key in seen and "FAIL" not in v:
                continue
            seen.add(key)
            lines.append(line)
    mpath = out_dir / "report.md"
    mpath.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return mpath, jpath


def _uniq(items) -> list[str]:
    return list(dict.fromkeys(items))


def _runs(items) -> str:
    """Consecutive equal items once, with a count: ``fetch=ok ×3; kill_producer=ok``."""
    out: list[list] = []
    for it in items:
        if out and out[-1][0] == it:
            out[-1][1] += 1
        else:
            out.append([it, 1])
    return "; ".join(it if n == 1 else f"{it} ×{n}" for it, n in out)
