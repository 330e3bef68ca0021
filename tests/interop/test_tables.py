"""The report's implementation × implementation tables (pure functions) and their place in
report.md / report.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from interop import tables
from interop.impls import HEAD, VLLM
from interop.spec import VLLM_STOCK, VLLM_WIRE, Cell, NodeSpec


def _cell(name: str, group: str, p: str, cs: tuple[str, ...], **pkw) -> Cell:
    prod = NodeSpec(role="producer", host="p1", adapter=p if p not in ("", VLLM) else "", **pkw)
    cons = tuple(NodeSpec(role="consumer", host=f"c{i}", adapter=c) for i, c in enumerate(cs))
    return Cell(name, group, "", prod, cons, (), ())


@dataclass
class R:
    cell: Cell
    passed: bool = True
    skipped: str = ""
    deviations: list[str] = field(default_factory=list)


def test_counts_per_pair_and_group():
    rows = [R(_cell("a", "transfer", "", ("",))),
            R(_cell("b", "transfer", "", ("ectp-c",))),
            R(_cell("c", "transfer", "", ("ectp-c",)), passed=False, deviations=["x"]),
            R(_cell("d", "transfer", "ectransport@d2f36d8", ("",))),
            R(_cell("e", "auth", "", ("ectp-c",)), passed=False, skipped="no build")]
    t = tables.tables(rows)
    tr = t["transfer"]
    assert tr["producers"] == [HEAD, "ectransport@d2f36d8"]
    assert tr["consumers"] == [HEAD, "ectp-c"]
    assert tr["pairs"][HEAD]["ectp-c"] == {"cells": 2, "passed": 1, "deviations": 1,
                                           "skipped": 0, "failed": ["c"]}
    assert tables.entry(tr["pairs"][HEAD][HEAD]) == "✓ 1"
    assert tables.entry(tr["pairs"][HEAD]["ectp-c"]) == "✗ 1/2"
    assert tables.entry(t["auth"]["pairs"][HEAD]["ectp-c"]) == "– 1 skipped"
    assert tables.entry(tr["pairs"]["ectransport@d2f36d8"].get("ectp-c")) == ""
    md = "\n".join(tables.markdown(t))
    assert "### transfer" in md and "| `ectransport@d2f36d8` | ✓ 1 |  |" in md


def test_a_cell_with_several_consumers_counts_once_per_implementation():
    t = tables.tables([R(_cell("fan", "fan-out", "", ("", "", "")))])
    assert t["fan-out"]["pairs"][HEAD][HEAD]["cells"] == 1


def test_labels_of_vllm_nodes():
    assert tables.impl_label(NodeSpec(role="consumer", host="v1", impl=VLLM_STOCK)) == VLLM
    assert tables.impl_label(NodeSpec(role="producer", host="p1", impl=VLLM_WIRE)) == \
        f"{HEAD}/vllm-wire"


def test_report_files_carry_the_tables_and_implementations(tmp_path):
    from interop.harness import CellResult
    from interop.impls import Impl
    from interop.report import write

    res = CellResult(_cell("transfer: x", "transfer", "", ("ectp-c",)))
    impl = Impl("ectp-c", [], origin="C", axis="client",
                caps={"roles": ["consumer"], "versions": [1, 2], "planes": ["tcp"],
                      "features": ["curve"]})
    gone = Impl("ectransport@0000000", [], origin="git", axis="release", unavailable="no rev")
    md, js = write([res], tmp_path, mode="loopback", mode_reason="", full=False, versions={},
                   wall_s=1.0, extra=[], impls=[impl, gone])
    data = json.loads(js.read_text())
    assert data["tables"]["transfer"]["pairs"][HEAD]["ectp-c"]["passed"] == 1
    assert [i["name"] for i in data["implementations"]] == ["ectp-c", "ectransport@0000000"]
    text = md.read_text()
    assert "## Implementation × implementation" in text and "### transfer" in text
    assert "| `ectp-c` | C | consumer | 1, 2 | tcp | curve |" in text
    assert "unavailable: no rev" in text
