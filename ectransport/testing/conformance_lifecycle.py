"""Lifecycle checks of the conformance suite: deadlines, cancel, peer death, revoke and teardown.
Part of :class:`~ectransport.testing.conformance.PlaneConformance`; see its module for how to run
it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ectransport.plugin import DataPlaneError, Run, XferState
from ectransport.testing.conformance_kit import Kit
from ectransport.testing.helpers import (
    CONSUMER_IDENTITY,
    PRODUCER_IDENTITY,
    Pair,
    notif_arrives,
    wait_state,
)


class LifecycleChecks(Kit):
    """What happens to transfers that end early, and to planes that close."""

    def test_deadline_expiry_releases_cleanly(self, pair):
        """The node's consumer releases a transfer whose deadline passed (here: 1 ms)."""
        n = 1024
        t = pair.begin([Run(0, n)], [Run(10, n)], n * self.block_bytes, seed=11)
        wait_state(pair.consumer, t.handle, 0.001)
        pair.consumer.release(t.handle)
        pair.consumer.release(t.handle)  # idempotent
        if self._revocable(pair.producer):
            pair.producer.revoke(t.grant)  # the producer's lease/notification ends the grant
        state = pair.consumer.check(t.handle)
        assert state in (XferState.DONE, XferState.ERR)
        if self.release_stops_landing:
            snapshot = pair.cons_region.buf.copy()
            time.sleep(0.2)  # a window for a late write to show (no ordering relies on it)
            assert np.array_equal(pair.cons_region.buf, snapshot), "bytes landed after release"
        assert pair.consumer.check(t.handle) is state  # final states stay
        pair.round_trip([Run(0, 4)], [Run(1050, 4)], 4 * self.block_bytes, seed=12)

    def test_cancel_leaves_both_planes_usable(self, pair):
        transfers = [pair.begin([Run(i * 256, 256)], [Run(i * 256 + 20, 256)],
                                256 * self.block_bytes, seed=20 + i) for i in range(4)]
        for t in transfers:
            pair.consumer.release(t.handle)
            if self._revocable(pair.producer):
                pair.producer.revoke(t.grant)
        for t in transfers:
            assert pair.consumer.check(t.handle) in (XferState.DONE, XferState.ERR)
        t = pair.round_trip([Run(1030, 3)], [Run(1060, 3)], 3 * self.block_bytes, seed=30)
        if pair.producer.capabilities.notifications:
            assert notif_arrives(pair.producer, t.notif, self.deadline_s)

    def test_peer_death_ends_the_transfer(self, pair, make_plane):
        n = 1024
        t = pair.begin([Run(0, n)], [Run(10, n)], n * self.block_bytes, seed=40)
        pair.producer.close()
        start = time.monotonic()
        state = wait_state(pair.consumer, t.handle, self.deadline_s)
        assert state is not XferState.PROC, f"still PROC {self.deadline_s} s after peer death"
        assert time.monotonic() - start < self.deadline_s
        pair.consumer.release(t.handle)
        # the consumer still works, with a restarted producer
        pair.producer = make_plane("conf-producer", pair.prod_region, PRODUCER_IDENTITY)
        pair.consumer.unbind_peer(pair.binding)  # the node: session ended, new session
        pair.binding = self.bind(pair.consumer, pair.producer, PRODUCER_IDENTITY)
        pair.round_trip([Run(5, 3)], [Run(1070, 3)], 3 * self.block_bytes - 1, seed=41)

    def test_revoke(self, pair):
        if not self._revocable(pair.producer):
            pytest.skip("plane cannot revoke (inherits ServingPlane.revoke)")
        if not self.revoke_refuses:
            pytest.skip("the plane's revoke does not refuse later transfers here "
                        "(revoke_refuses=False)")
        pair.producer.revoke(b"")  # garbage: no-op
        pair.producer.revoke(b"\xc1garbage")
        runs = [Run(0, 4)]
        grant = pair.producer.describe(runs, 4 * self.block_bytes)
        pair.producer.revoke(grant)
        pair.producer.revoke(grant)  # twice: no-op
        try:
            t = pair.begin(runs, [Run(100, 4)], 4 * self.block_bytes, seed=60, grant=grant)
        except DataPlaneError:
            pass
        else:
            assert pair.finish(t) is XferState.ERR, "a revoked grant was served"
        pair.round_trip(runs, [Run(100, 4)], 4 * self.block_bytes, seed=61)

    def test_close_is_idempotent_and_releases_everything(self, roles, plane_options, regions):
        serving, fetching = roles
        prod_region, cons_region = regions
        before = threading.active_count()
        producer = serving(node_id="conf-producer", region=prod_region,
                           identity=PRODUCER_IDENTITY, **plane_options)
        consumer = fetching(node_id="conf-consumer", region=cons_region,
                            identity=CONSUMER_IDENTITY, **plane_options)
        pair = Pair(producer, consumer, prod_region, cons_region, self.deadline_s)
        try:
            pair.binding = self.bind(consumer, producer, PRODUCER_IDENTITY)
            done = pair.round_trip([Run(0, 2)], [Run(0, 2)], 2 * self.block_bytes, seed=70)
            in_flight = pair.begin([Run(10, 512)], [Run(10, 512)], 512 * self.block_bytes,
                                   seed=71)
        finally:
            consumer.close()
            consumer.close()
            producer.close()
            producer.close()
        consumer.release(done.handle)  # after close: no error
        consumer.release(in_flight.handle)
        assert consumer.check(in_flight.handle) in (XferState.DONE, XferState.ERR)
        assert producer.poll_notifications() == []
        with pytest.raises(DataPlaneError):
            producer.describe([Run(0, 1)], self.block_bytes)
        with pytest.raises(DataPlaneError):
            consumer.start(pair.binding, done.grant, [Run(0, 2)], 2 * self.block_bytes, b"")
        end = time.monotonic() + self.deadline_s
        while threading.active_count() > before and time.monotonic() < end:
            time.sleep(0.01)
        assert threading.active_count() <= before, \
            f"threads left after close: {[t.name for t in threading.enumerate()]}"
