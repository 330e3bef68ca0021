"""Confirmed lease renewals (ECTP v2 §11) through both drivers on one fake clock (the memory
control pair and ``MemoryPlane``; the rig of ``test_node_logic.py``): a read slower than the
lease lands when the producer confirms the renewals, and is a miss — never wrong bytes — when it
does not; a dead consumer's pins come back at lease + grace."""

from __future__ import annotations

import numpy as np

from ectransport.node import Fetched, Miss, MissReason
from tests.node.test_node_logic import ADDR, GRACE_S, LEASE_S, Rig, _rows


def test_a_read_slower_than_the_lease_lands_on_confirmed_renewals(closing):
    rig = Rig(closing, validity_margin_s=0.25, read_timeout_s=30.0)
    data = _rows(41)
    assert rig.producer.put("a", data)
    sent = rig.clock()
    rig.fabric.delay_next(at=sent + 3 * LEASE_S)  # three leases long
    (fut,) = rig.fetch("a", timeout_s=60.0)
    rig.run(fut.done)
    out = fut.result(timeout=0)
    assert isinstance(out, Fetched) and np.array_equal(out.data, data.reshape(-1)), out
    session = next(iter(rig.consumer.sessions.values()))
    assert session.fetches.renewals.confirmed and rig.producer.stats()["expired"] == 0


def test_unanswered_renewals_do_not_stretch_the_window(closing):
    """The producer's control plane stops delivering (a hung producer, a dropped connection the
    consumer has not noticed): no RenewAck, so the read that completes after the request's
    window is discarded, whatever its bytes."""
    rig = Rig(closing, validity_margin_s=0.25, read_timeout_s=30.0)
    assert rig.producer.put("a", _rows(42))
    sent = rig.clock()
    rig.fabric.delay_next(at=sent + LEASE_S + 1.0)
    (fut,) = rig.fetch("a", timeout_s=60.0)
    rig.run(lambda: rig.producer.stats()["grants"] == 1)
    rig.consumer.parts.control.freeze(ADDR.key)  # the producer's frames are held from now on
    rig.run(fut.done)
    assert rig.producer.stats()["expired"] == 0  # the producer did renew: only unconfirmed
    out = fut.result(timeout=0)
    assert isinstance(out, Miss) and out.reason is MissReason.TIMEOUT, out


def test_a_dead_consumers_pins_return_at_lease_plus_grace(closing):
    """The consumer goes away mid-read (its connection drops): the producer holds the blocks
    until the lease deadline plus the grace period (a READ plane cannot revoke), then frees
    them."""
    rig = Rig(closing, read_timeout_s=30.0)
    assert rig.producer.put("a", _rows(43))
    rig.fabric.stall_next()
    (fut,) = rig.fetch("a", timeout_s=60.0)
    rig.run(lambda: rig.producer.stats()["grants"] == 1)
    t_grant = rig.clock()
    rig.consumer.parts.control.disconnect(ADDR.key)  # the producer sees the consumer go
    rig.run(lambda: rig.producer.stats()["released_peer_down"] == 1, dt_s=0.05)
    rig.run(lambda: rig.producer.lookup("a").pins == 0, dt_s=0.05)
    held = rig.clock() - t_grant
    assert LEASE_S + GRACE_S - 0.2 <= held <= LEASE_S + GRACE_S + 0.5, held
