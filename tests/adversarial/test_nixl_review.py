"""Adversarial review of NixlPlane's consumer-side agent bookkeeping (real NIXL, loopback)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("nixl")

from ectransport.data.base import identity_of
from ectransport.data.nixl import NixlPlane
from ectransport.store import Run
from ectransport.store.region import HostRegion
from ectransport.testing.conformance import wait_state

BLOCK = 4096
KEY_P = "P" * 40


def test_a_restarted_producers_old_agent_is_dropped_once_its_last_read_is_released():
    """A producer restarts (same node_id and key, new agent) while a READ of its old agent is
    still held by the consumer (a quarantined transfer). bind_peer of the new agent keeps the old
    one (busy); the node then unbinds the old session: ``_drop_when_idle_locked`` marks it
    ``_dirty``. When the READ is finally released (it completed, or the quarantine settled it),
    nothing looks at ``_dirty`` again — only ``_load_bound_locked`` of that very agent does, and
    no grant will ever name it. The remote agent (and its UCX endpoint) stays loaded for the
    consumer's lifetime: one leaked agent per such restart."""
    regions = [HostRegion(8, BLOCK) for _ in range(3)]
    for i, r in enumerate(regions):
        r.buf[:] = np.random.default_rng(i).integers(0, 256, r.buf.nbytes, dtype=np.uint8)
    ident = identity_of(KEY_P)
    p1 = NixlPlane(node_id="enc", region=regions[0], identity=ident)
    c = NixlPlane(node_id="pd", region=regions[2])
    p2 = None
    try:
        b1 = c.bind_peer(p1.endpoint(), peer="127.0.0.1:1", host="127.0.0.1", identity=ident)
        h = c.start(b1, p1.describe([Run(0, 2)], 2 * BLOCK), [Run(4, 2)], 2 * BLOCK, b"")
        wait_state(c, h, 10.0)  # landed, but the session still holds the handle
        old = p1.agent_name
        p2 = NixlPlane(node_id="enc", region=regions[1], identity=ident)  # the restart
        b2 = c.bind_peer(p2.endpoint(), peer="127.0.0.1:1", host="127.0.0.1", identity=ident)
        c.unbind_peer(b1)  # node/consumer.py _bind: the old binding of the session
        c.release(h)  # the transfer is settled
        assert b2 is not None
        assert old not in c._peers, (
            f"the restarted producer's old agent {old!r} is still loaded on the consumer "
            f"(dirty={sorted(c._dirty)}) after its last READ was released")
    finally:
        for plane in (c, p2, p1):
            if plane is not None:
                plane.close()
        for r in regions:
            r.close()


def test_remote_sections_stay_bounded_while_a_read_of_the_agent_is_in_flight():
    """MAX_REMOTE_SECTIONS (4096) is meant to bound what a consumer's NIXL agent keeps loaded per
    producer (each scoped grant adds a section; NIXL cannot remove one). But the reset in
    ``_load_bound_locked`` only happens when no READ of that agent is in flight. Under pipelined
    fetches from one producer (or while one READ sits in quarantine for 60 s) there is always one,
    so sections grow without bound (measured: 8001 after 8000 fetches)."""
    from ectransport.data.nixl import MAX_REMOTE_SECTIONS

    rp, rc = HostRegion(64, BLOCK), HostRegion(64, BLOCK)
    ident = identity_of(KEY_P)
    p = NixlPlane(node_id="enc", region=rp, identity=ident)
    c = NixlPlane(node_id="pd", region=rc)
    try:
        b = c.bind_peer(p.endpoint(), peer="127.0.0.1:1", host="127.0.0.1", identity=ident)
        held = c.start(b, p.describe([Run(0, 1)], BLOCK), [Run(0, 1)], BLOCK, b"")
        wait_state(c, held, 10.0)  # another fetch of this producer, not released yet
        for i in range(MAX_REMOTE_SECTIONS + 100):
            g = p.describe([Run(1 + i % 60, 1)], BLOCK)
            h = c.start(b, g, [Run(1 + i % 60, 1)], BLOCK, b"")
            wait_state(c, h, 10.0)
            c.release(h)
            p.revoke(g)
        assert c._sections[p.agent_name] <= MAX_REMOTE_SECTIONS, c._sections
        c.release(held)
    finally:
        c.close()
        p.close()
        rp.close()
        rc.close()
