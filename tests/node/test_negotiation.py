"""Plane negotiation between nodes with different plane sets (real CURVE sockets, real planes).

The negotiation logic itself is tested over the in-memory control pair in ``test_driver.py``;
these cases prove the same with real sockets."""

from __future__ import annotations

import numpy as np
import pytest

from ectransport.errors import NoCommonPlane
from ectransport.node import ConsumerNode, Layout, ProducerAddress, ProducerNode, Security
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import new_keypair

LAYOUT = Layout(model_id="negotiation-test", hidden=64)


def _nodes(closing, producer_planes, consumer_planes):
    pk, ck = new_keypair(), new_keypair()
    producer = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=pk.public, secret_key=pk.secret, allow=lambda key: key == ck.public
            ),
            settings=ProducerSettings(region_bytes=4 << 20),
            node=NodeSettings(planes=producer_planes),
        ).start()
    )
    consumer = closing(
        ConsumerNode(
            layout=LAYOUT,
            security=Security(public_key=ck.public, secret_key=ck.secret),
            settings=ConsumerSettings(region_bytes=4 << 20),
            node=NodeSettings(planes=consumer_planes),
        )
    )
    return producer, consumer, ProducerAddress("127.0.0.1", producer.port, pk.public)


@pytest.mark.parametrize(("producer_planes", "consumer_planes", "chosen"), [
    (("ucx", "tcp", "nixl"), ("ucx", "nixl"), "ucx"),
])
def test_best_common_plane_is_chosen_and_moves_the_bytes(closing, producer_planes,
                                                          consumer_planes, chosen):
    producer, consumer, addr = _nodes(closing, producer_planes, consumer_planes)
    rows = np.random.default_rng(5).integers(0, 256, (37, LAYOUT.block_bytes), dtype=np.uint8)
    assert producer.put("m", rows)
    assert consumer.connect(addr) == chosen
    got = consumer.fetch(addr, "m", timeout_s=15)
    assert got.ok, got
    assert got.plane == chosen
    assert np.array_equal(got.data, rows.reshape(-1))


def test_disjoint_planes_are_a_typed_error_naming_both_lists(closing):
    producer, consumer, addr = _nodes(closing, ("nixl",), ("tcp",))
    with pytest.raises(NoCommonPlane) as err:
        consumer.connect(addr)
    assert "nixl" in str(err.value) and "tcp" in str(err.value)
    miss = consumer.fetch(addr, "m", timeout_s=5)
    assert not miss.ok and miss.reason.value == "incompatible"
    assert producer.stats()["grants"] == 0


def test_wildcard_bind_with_hosted_planes_needs_an_advertised_address():
    from ectransport.errors import ConfigError

    with pytest.raises(ConfigError, match="advertise_host"):
        ProducerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            settings=ProducerSettings(region_bytes=1 << 20, host="0.0.0.0"),
            node=NodeSettings(planes=("tcp",)),
        )
    node = ProducerNode(
        layout=LAYOUT,
        security=Security(insecure=True),
        settings=ProducerSettings(region_bytes=1 << 20, host="0.0.0.0", advertise_host="127.0.0.1"),
        node=NodeSettings(planes=("tcp", "nixl")),
    )
    try:
        assert node.plane_transports()["tcp"].startswith("tcp 127.0.0.1:")  # what grants name
    finally:
        node.close()
