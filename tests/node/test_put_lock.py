"""ProducerNode.put copies bytes into the region outside the node lock the serving loop needs.

No timing: the region's copy is hooked, and the hook asks another thread for ``stats()`` and
``lookup()`` (both take the lock) while the copy is in progress: they answer only if put does not
hold the lock meanwhile (the deadline only bounds the wait of a failing run). The nodes here are
never started and need no socket: their control plane is the in-memory one.
"""

from __future__ import annotations

import threading

import numpy as np

from ectransport.control.memory import MemoryControlServer, MemoryNetwork
from ectransport.node import Layout, ProducerNode, Security
from ectransport.settings_schema import NodeSettings, ProducerSettings
from tests.conftest import DEADLINE_S

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows


def test_put_copies_outside_the_node_lock(closing, monkeypatch):
    node = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            control=MemoryControlServer(MemoryNetwork()),
            settings=ProducerSettings(region_bytes=1 << 20),
            node=NodeSettings(planes=("tcp",)),
        )
    )
    seen = []
    write = node.region.write

    def hooked_write(runs, data):
        answered = threading.Event()
        got: list = []

        def ask() -> None:  # blocks on the node lock if put holds it during the copy
            got.append((node.stats()["entries"], node.lookup("big").ready))
            answered.set()

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        seen.append(got[0] if answered.wait(DEADLINE_S) else None)
        write(runs, data)
        t.join(DEADLINE_S)

    monkeypatch.setattr(node.region, "write", hooked_write)
    rows = np.random.default_rng(1).integers(0, 256, (1000, LAYOUT.block_bytes), dtype=np.uint8)
    assert node.put("big", rows)
    assert seen == [(1, False)]  # lock free during the copy; the entry exists but is NOT_READY
    assert node.lookup("big").ready
    assert node.stats()["entries"] == 1


def test_pin_local_keeps_an_entry_from_eviction_until_unpinned():
    """A local reader (vLLM's worker loading from the region) pins through the public API."""
    layout = Layout(hidden=256, dtype="bfloat16")
    rows = np.zeros((8, layout.block_bytes), dtype=np.uint8)
    p = ProducerNode(
        layout=layout,
        security=Security(insecure=True),
        control=MemoryControlServer(MemoryNetwork()),
        settings=ProducerSettings(region_bytes=8 * layout.block_bytes),
    )
    try:
        assert p.pin_local("nope") is None
        assert p.put("a", rows)
        e = p.pin_local("a")
        assert e is not None and e.pins == 1
        assert not p.put("b", rows)  # "a" is pinned: nothing to evict, the region is full
        assert p.unpin_local("a", e.entry_id) and not p.unpin_local("a", e.entry_id)
        assert p.put("b", rows) and p.lookup("a") is None  # now "a" could be evicted
    finally:
        p.close()
