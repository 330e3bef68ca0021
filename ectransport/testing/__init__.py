"""Test helpers for node, plane and plugin authors (front-end layer).

* :mod:`ectransport.testing.memory`: ``MemoryPlane`` (and its halves ``MemoryServingPlane`` /
  ``MemoryFetchingPlane``, the PUSH form ``MemoryPushPlane``), an in-memory data plane whose
  transfers a :class:`~ectransport.testing.memory_fabric.MemoryFabric` can delay, fail, stall and
  reorder, so node logic is tested without sockets; importable from here
  (``from ectransport.testing import MemoryFabric, MemoryPlane``), loaded on first use.
* :mod:`ectransport.testing.conformance`: ``PlaneConformance``, the conformance suite every data
  plane (built-in or plugin) must pass (needs pytest).
* :mod:`ectransport.testing.helpers`: its helpers on their own (byte patterns, waits with a
  deadline, a producer/consumer :class:`~ectransport.testing.helpers.Pair` of planes).
* :mod:`ectransport.testing.imports`: which ectransport modules a plugin imports (the plugin
  contract allows only :mod:`ectransport.plugin`).

Importing this package imports nothing else.
"""

from __future__ import annotations

from typing import Any

_MEMORY = ("Complete", "Delay", "Fail", "ManualClock", "MemoryBinding", "MemoryFabric",
           "MemoryFetchingPlane", "MemoryPlane", "MemoryPushPlane", "MemoryServingPlane",
           "MemoryTransfer", "Reorder", "Stall")

__all__ = list(_MEMORY)


def __getattr__(name: str) -> Any:
    if name in _MEMORY:
        from ectransport.testing import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'ectransport.testing' has no attribute {name!r}")
