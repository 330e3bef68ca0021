"""Session-binding checks of the conformance suite (plugin API 2 and later): what a compromised
producer must not be able to do to a consumer. Part of
:class:`~ectransport.testing.conformance.PlaneConformance`; see its module for how to run it."""

from __future__ import annotations

import msgspec
import pytest

from ectransport.plugin import (
    MAX_ENDPOINT_BYTES,
    MAX_LOCALITY_BYTES,
    SUPPORTED_API_VERSIONS,
    DataPlaneError,
    Run,
    XferState,
)
from ectransport.store import HostRegion
from ectransport.testing.conformance_kit import Kit
from ectransport.testing.helpers import (
    OTHER_PRODUCER_IDENTITY,
    PRODUCER_IDENTITY,
    Transfer,
    assert_same,
    pattern,
    read_runs,
)


class BindingChecks(Kit):
    """``endpoint``/``reachable`` (serving half), ``locality``/``bind_peer``/``unbind_peer`` and
    ``start``'s grant check (fetching half)."""

    def test_session_binding_declarations(self, pair):
        assert type(pair.producer).plugin_api_version in SUPPORTED_API_VERSIONS
        assert type(pair.consumer).plugin_api_version in SUPPORTED_API_VERSIONS
        endpoint, locality = pair.producer.endpoint(), pair.consumer.locality()
        assert isinstance(endpoint, bytes) and len(endpoint) <= MAX_ENDPOINT_BYTES
        assert isinstance(locality, bytes) and len(locality) <= MAX_LOCALITY_BYTES
        # both planes run in this process: the producer's plane must reach the consumer's
        assert pair.producer.reachable(locality) is True
        assert isinstance(pair.producer.reachable(b""), bool)  # an older consumer: no raise

    def test_bind_peer_accepts_the_producers_declaration(self, pair):
        again = self.bind(pair.consumer, pair.producer, PRODUCER_IDENTITY, peer="second:1")
        pair.consumer.unbind_peer(again)  # a second session of the same producer ends
        pair.consumer.unbind_peer(again)  # never raises
        pair.round_trip([Run(0, 2)], [Run(4, 2)], 2 * self.block_bytes - 1, seed=80)
        if pair.producer.endpoint():
            # insecure mode (no identity known) binds too
            pair.consumer.unbind_peer(self.bind(pair.consumer, pair.producer, "", "insecure:1"))

    def test_bind_peer_refuses_another_identity_and_bad_declarations(self, pair):
        endpoint = pair.producer.endpoint()
        if not endpoint:
            pytest.skip("the plane declares nothing (empty endpoint): nothing to bind")
        with pytest.raises(DataPlaneError):
            self.bind(pair.consumer, pair.producer, OTHER_PRODUCER_IDENTITY)
        for label, bad in {
            "garbage": b"\xc1\x00garbage",
            "other msgpack": msgspec.msgpack.encode({"hello": [1, 2, 3]}),
            "truncated": endpoint[: len(endpoint) // 2],
            "oversized": endpoint + b"\x00" * MAX_ENDPOINT_BYTES,
        }.items():
            try:
                binding = pair.consumer.bind_peer(bad, peer="bad:1", host=self.control_host,
                                                  identity=PRODUCER_IDENTITY)
            except DataPlaneError:
                continue
            pair.consumer.unbind_peer(binding)
            pytest.fail(f"declaration {label!r} was accepted")
        pair.round_trip([Run(0, 2)], [Run(4, 2)], 2 * self.block_bytes, seed=81)

    def test_start_refuses_a_grant_of_another_producer(self, pair, make_plane):
        """Producer A's binding must not carry producer B's grant: a compromised producer must not
        point the consumer at another producer. Refused before any I/O."""
        if not pair.producer.endpoint():
            pytest.skip("the plane declares nothing (empty endpoint): grants are not bound")
        region_b = HostRegion(16, self.block_bytes)
        producer_b = make_plane("conf-producer-b", region_b, OTHER_PRODUCER_IDENTITY)
        try:
            binding_b = self.bind(pair.consumer, producer_b, OTHER_PRODUCER_IDENTITY,
                                  peer="producer-b:1")
            nbytes = 2 * self.block_bytes - 3
            grant_b = producer_b.describe([Run(1, 2)], nbytes)
            with pytest.raises(DataPlaneError):
                handle = pair.consumer.start(pair.binding, grant_b, [Run(8, 2)], nbytes, b"x")
                pair.consumer.release(handle)
            grant_a = pair.producer.describe([Run(1, 2)], nbytes)
            with pytest.raises(DataPlaneError):
                handle = pair.consumer.start(binding_b, grant_a, [Run(8, 2)], nbytes, b"x")
                pair.consumer.release(handle)
            # each grant under its own producer's binding still works
            data = pattern(nbytes, 82)
            region_b.write([Run(1, 2)], data)
            handle = pair.consumer.start(binding_b, grant_b, [Run(8, 2)], nbytes, b"b")
            assert pair.finish(Transfer(grant_b, handle, [Run(1, 2)], [Run(8, 2)], nbytes, data,
                                        b"b")) is XferState.DONE
            assert_same(read_runs(pair.cons_region, [Run(8, 2)], nbytes), data)
            pair.consumer.unbind_peer(binding_b)
            pair.round_trip([Run(1, 2)], [Run(12, 2)], nbytes, seed=83, grant=grant_a)
        finally:
            producer_b.close()  # before its region goes away
            region_b.close()
