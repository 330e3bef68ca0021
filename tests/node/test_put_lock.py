"""ProducerNode.put copies bytes into the region outside the node lock the serving loop needs.

No timing: the region's copy is hooked, and the hook checks that the lock is free and that
``stats()`` (which takes the lock) answers while the copy is in progress.
"""

from __future__ import annotations

import numpy as np

from ectransport.node import Layout, ProducerNode, Security

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows


def test_put_copies_outside_the_node_lock(closing, monkeypatch):
    node = closing(ProducerNode(layout=LAYOUT, region_bytes=1 << 20, planes=("tcp",),
                                security=Security(insecure=True)))
    seen = []
    write = node.region.write

    def hooked_write(runs, data):
        free = node._lock.acquire(blocking=False)
        if free:
            node._lock.release()
            stats = node.stats()  # would deadlock if put held the (non-reentrant) lock here
            seen.append((stats["entries"], node.lookup("big").ready))
        else:
            seen.append(None)
        write(runs, data)

    monkeypatch.setattr(node.region, "write", hooked_write)
    rows = np.random.default_rng(1).integers(0, 256, (1000, LAYOUT.block_bytes), dtype=np.uint8)
    assert node.put("big", rows)
    assert seen == [(1, False)]  # lock free during the copy; the entry exists but is NOT_READY
    assert node.lookup("big").ready
    assert node.stats()["entries"] == 1
