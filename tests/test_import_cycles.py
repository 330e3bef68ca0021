"""No import cycles: among the modules of ``ectransport/`` and among those of ``benchmarks/``.

A cycle means two modules that can only be understood (and imported) together; its usual cure is
a leaf module that both import (``benchmarks/common.py``, ``ectransport/cli/app.py``). Every
``import`` statement counts — at module level, inside a function (a "lazy" import) or under
``TYPE_CHECKING`` — as it does for import-linter, since each is a dependency a reader must follow.
The graph is read from the sources with :mod:`ast`: ``benchmarks/`` is a folder of scripts that
import each other by bare name, not a package that grimp could build a graph of.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_names(root: Path, package: str | None) -> dict[str, Path]:
    """``{module name: file}`` for the ``.py`` files under ``root``: dotted names under
    ``package`` (``__init__.py`` names the package itself), or bare file stems for a folder of
    scripts (``package=None``, not recursive)."""
    if package is None:
        return {p.stem: p for p in sorted(root.glob("*.py"))}
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((package, *parts))] = p
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return files[name].name == "__init__.py"


def _longest_known(name: str, files: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in files:
            return ".".join(parts[:n])
    return None


def imports_of(name: str, files: dict[str, Path]) -> set[str]:
    """The modules of ``files`` that module ``name`` imports (any ``import`` statement in it)."""
    tree = ast.parse(files[name].read_text(), str(files[name]))
    here = name if _is_package(name, files) else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _longest_known(alias.name, files)
                if target is not None:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".") if here else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}" if mod else alias.name
                target = sub if sub in files else _longest_known(mod, files) if mod else None
                if target is not None:
                    out.add(target)
    out.discard(name)
    return out


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imports_of(name, files) for name in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module
    (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(comp)
    return sorted(_a_cycle_in(c, graph) for c in comps)


def _a_cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the smallest name of ``comp`` (breadth first)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is not strongly connected")


def _report(found: list[list[str]], where: str) -> str:
    return (f"import cycles among the modules of {where} (break each with a leaf module both "
            "sides import):\n" + "\n".join("  " + " -> ".join(c) for c in found))


def test_no_import_cycle_in_the_package():
    files = module_names(REPO / "ectransport", "ectransport")
    assert len(files) > 50
    found = cycles(import_graph(files))
    assert not found, _report(found, "ectransport/")


def test_no_import_cycle_in_the_benchmarks():
    files = module_names(REPO / "benchmarks", None)
    assert {"harness", "scope", "vllm_p2p", "server", "common"} <= set(files)
    found = cycles(import_graph(files))
    assert not found, _report(found, "benchmarks/")


def test_the_detector_finds_lazy_relative_and_type_checking_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b  # lazy\n")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "sub" / "b.py").write_text("from .c import X\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\nX = 1\n")
    (pkg / "leaf.py").write_text("import pkg.sub.c\nimport os\n")
    graph = import_graph(module_names(pkg, "pkg"))
    assert graph["pkg.sub.b"] == {"pkg.sub.c"} and graph["pkg.sub"] == {"pkg.sub.c"}
    assert graph["pkg.leaf"] == {"pkg.sub.c"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "x.py").write_text("import y\n")
    (scripts / "y.py").write_text("def g():\n    from x import h\n")
    (scripts / "z.py").write_text("import x, numpy\n")
    assert cycles(import_graph(module_names(scripts, None))) == [["x", "y", "x"]]


def test_the_cli_group_is_a_leaf_and_main_names_every_subcommand_module():
    """``ectransport.cli.app`` alone has no subcommand; ``ectransport.cli.main`` imports, by
    name, every module that adds commands (one that uses a group's ``command``/``group``
    decorator), so the command set does not depend on what happened to be imported."""
    code = ("import sys, ectransport.cli.app as app;"
            "print(sorted(app.cli.commands), sorted(m for m in sys.modules"
            " if m.startswith('ectransport.cli.') and m not in"
            " ('ectransport.cli.app', 'ectransport.cli.options')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] []"

    from ectransport.cli import main

    adding = set()
    for path in sorted((REPO / "ectransport" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                    and d.func.attr in ("command", "group") and isinstance(d.func.value, ast.Name)
                    and d.func.value.id != "click" for d in node.decorator_list):
                adding.add(f"ectransport.cli.{path.stem}")
    assert "ectransport.cli.commands" in adding and "ectransport.cli.app" not in adding
    assert adding == {m.__name__ for m in main.SUBCOMMAND_MODULES}
    assert {"bench", "config", "demo", "doctor", "fetch", "keys", "planes", "serve"} <= \
        set(main.cli.commands)
