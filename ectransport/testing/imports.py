"""Which ectransport modules a plugin's source imports: the plugin contract says a plane outside
ectransport imports nothing of it but :data:`PUBLIC_MODULE` (:mod:`ectransport.plugin`).
:func:`private_imports` lists every other import, with file and line, for a test to assert empty.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PUBLIC_MODULE = "ectransport.plugin"


def ectransport_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``source`` (Python text) of an ectransport module
    other than :data:`PUBLIC_MODULE`: ``import ectransport.x``, ``from ectransport.x import y``,
    ``from ectransport import x`` (x not ``plugin``), ``import ectransport``. Relative imports
    and strings are not imports; ``importlib.import_module`` calls are not seen.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    def private(module: str) -> bool:
        return module == "ectransport" or (module.startswith("ectransport.")
                                           and module != PUBLIC_MODULE)

    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ectransport":
                out += [(node.lineno, f"ectransport.{a.name}") for a in node.names
                        if f"ectransport.{a.name}" != PUBLIC_MODULE]
            elif private(node.module):
                out.append((node.lineno, node.module))
    return out


def package_files(package: str) -> list[Path]:
    """The ``.py`` files of an importable package (or the one file of a module), sorted.

    Raises:
        ModuleNotFoundError: no such package.
    """
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ModuleNotFoundError(f"no package {package!r}")
    if spec.submodule_search_locations:
        return sorted(p for d in spec.submodule_search_locations for p in Path(d).rglob("*.py"))
    return [Path(spec.origin)] if spec.origin else []


def private_imports(package: str) -> list[str]:
    """``"path:line: module"`` for every import of ectransport internals (anything but
    :data:`PUBLIC_MODULE`, see :func:`ectransport_imports`) in the source of ``package``.

    Raises:
        ModuleNotFoundError: no such package.
    """
    return [f"{path}:{line}: {module}" for path in package_files(package)
            for line, module in ectransport_imports(path.read_text())]

