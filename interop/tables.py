"""Implementation × implementation tables of a run, one per case group (as the QUIC interop
runner draws client × server tables): rows are producer implementations, columns consumer
implementations, each entry counts that pair's cells of the group. Pure functions over
:class:`~interop.harness.CellResult`-like objects (``cell``, ``passed``, ``skipped``,
``deviations``); unit-tested.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from interop.impls import HEAD, VLLM
from interop.spec import VLLM_STOCK, VLLM_WIRE, NodeSpec


def impl_label(spec: NodeSpec) -> str:
    """The implementation column/row a node belongs to (``ectransport-HEAD/vllm-wire`` for our
    node speaking vLLM's wire)."""
    if spec.adapter:
        return spec.adapter
    if spec.impl == VLLM_STOCK:
        return VLLM
    return f"{HEAD}/vllm-wire" if spec.impl == VLLM_WIRE else HEAD


def tables(results: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Group → ``{"producers": [...], "consumers": [...], "pairs": {P: {C: counts}}}``; counts
    are ``{"cells", "passed", "deviations", "skipped", "failed": [cell names]}``. A cell with
    several consumers counts once per distinct consumer implementation."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        c = r.cell
        g = out.setdefault(c.group, {"producers": [], "consumers": [], "pairs": {}})
        p = impl_label(c.producer)
        consumers = sorted({impl_label(x) for x in c.consumers}) or ["—"]
        if p not in g["producers"]:
            g["producers"].append(p)
        for cl in consumers:
            if cl not in g["consumers"]:
                g["consumers"].append(cl)
            n = g["pairs"].setdefault(p, {}).setdefault(
                cl, {"cells": 0, "passed": 0, "deviations": 0, "skipped": 0, "failed": []})
            n["cells"] += 1
            if r.skipped:
                n["skipped"] += 1
            elif r.passed:
                n["passed"] += 1
            else:
                n["deviations"] += 1
                n["failed"].append(c.name)
    for g in out.values():
        g["producers"].sort(key=_order)
        g["consumers"].sort(key=_order)
    return out


def _order(name: str) -> tuple[int, str]:
    """This tree first, then releases, then the rest, alphabetically."""
    if name.startswith(HEAD):
        return (0 if name == HEAD else 1, name)
    if name.startswith("ectransport@"):
        return (2, name)
    return (3, name)


def entry(n: dict[str, Any] | None) -> str:
    """One table entry: ``✓ 5`` (all passed), ``✗ 1/5`` (deviations), ``– 3`` (skipped), blank
    when the pair has no cell in the group."""
    if not n:
        return ""
    ran = n["cells"] - n["skipped"]
    if n["deviations"]:
        return f"✗ {n['deviations']}/{ran}"
    if ran:
        return f"✓ {n['passed']}" + (f" (+{n['skipped']} skipped)" if n["skipped"] else "")
    return f"– {n['skipped']} skipped"


def markdown(tabs: dict[str, dict[str, Any]]) -> list[str]:
    """The tables as markdown lines, one section per group."""
    lines = ["## Implementation × implementation", "",
             "Rows: producer; columns: consumer. `✓ n`: all n cells of the pair met their "
             "expectation; `✗ k/n`: k of n deviated (listed under Deviations); `– n skipped`; "
             "blank: the pair has no cell in this group (a role, plane, version or feature one "
             "side lacks).", ""]
    for group, g in tabs.items():
        cols = g["consumers"]
        lines += [f"### {group}", "",
                  "| producer ↓ / consumer → | " + " | ".join(f"`{c}`" for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for p in g["producers"]:
            row = g["pairs"].get(p, {})
            lines.append(f"| `{p}` | " + " | ".join(entry(row.get(c)) for c in cols) + " |")
        lines.append("")
    return lines
