"""The environment of the child Pythons these tests start (a module of its own: ``conftest`` is
not importable by that name from every test directory)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(*paths: str) -> dict[str, str]:
    """``os.environ`` with the checkout under test first on ``PYTHONPATH`` (then ``paths``), so
    that a child started as a script imports the same ``ectransport`` as this process, whatever
    the interpreter has installed."""
    old = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, *paths, *([old] if old else [])])}
