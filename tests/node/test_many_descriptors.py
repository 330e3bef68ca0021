"""A busy process holds file descriptors above FD_SETSIZE (1024): every plane must keep working.
Found by a CI run: the ucx plane's service thread waited with select(2), which raises for such
descriptors — the thread died and every ucx transfer of that process timed out."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest

from ectransport.data.registry import try_load
from ectransport.node import ConsumerNode, Fetched, Layout, ProducerAddress, ProducerNode, Security
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings

LAYOUT = Layout(hidden=256, dtype="bfloat16")
PLANES = [p for p in ("ucx", "tcp", "nixl") if try_load(p) is not None]


@pytest.fixture
def high_descriptors():
    """Occupy descriptors so that everything opened next is numbered above 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2048
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        yield
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("plane", PLANES)
def test_fetch_with_descriptors_above_fd_setsize(closing, high_descriptors, plane):
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            settings=ProducerSettings(region_bytes=1 << 20),
            node=NodeSettings(planes=(plane,)),
        )
    )
    rows = np.random.default_rng(3).integers(0, 256, (8, LAYOUT.block_bytes), dtype=np.uint8)
    assert p.put("m", rows)
    p.start()
    c = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            settings=ConsumerSettings(region_bytes=1 << 20),
            node=NodeSettings(planes=(plane,)),
        )
    )
    out = c.fetch(ProducerAddress("127.0.0.1", p.port), "m", timeout_s=15)
    assert isinstance(out, Fetched), out
    assert np.array_equal(out.data, rows.reshape(-1))
