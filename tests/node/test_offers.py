"""ECTP v2 §10 between real nodes: real CURVE sockets, real NIXL agents (one per node). An
announced entry is read on its ticket with no request (the producer sees no batch and no
XferReq), exactly; a ticket copied to a second consumer with its own NIXL agent works for it
too; a ticket naming another entry's hold, a forged hold id, a producer without holds and a
session that never asked for offers all fall back to a request and still land the right bytes.
The sans-I/O rules (windows, anchors, caps) are in ``tests/session/test_offers.py``."""

from __future__ import annotations

import msgspec
import pytest
import torch

from ectransport.node import (
    ConsumerNode,
    Fetched,
    Layout,
    ProducerAddress,
    ProducerNode,
    Security,
)
from ectransport.protocol import Ticket
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import new_keypair, sections, wait_for

pytest.importorskip("nixl")

LAYOUT = Layout(model_id="offers-test", hidden=256)  # 512-byte rows


def _entry(seed: int, rows: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, LAYOUT.hidden, generator=g).to(torch.bfloat16)


@pytest.fixture
def cluster(closing):
    """A NIXL producer (holds on) and a factory of NIXL consumers it allows."""
    pk = new_keypair()
    allowed: set[str] = set()
    producer = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=pk.public, secret_key=pk.secret, allow=lambda key: key in allowed
            ),
            settings=ProducerSettings(region_bytes=32 << 20, inline_max_bytes=0),
            node=NodeSettings(planes=("nixl",), node_id="offers-p"),
        ).start()
    )
    addr = ProducerAddress("127.0.0.1", producer.port, pk.public)

    def consumer(**kw) -> ConsumerNode:
        ck = new_keypair()
        allowed.add(ck.public)
        return closing(
            ConsumerNode(
                layout=LAYOUT,
                security=Security(public_key=ck.public, secret_key=ck.secret),
                **sections(
                    ConsumerSettings(region_bytes=16 << 20, inline_max_bytes=0),
                    NodeSettings(planes=("nixl",)),
                    **kw,
                ),
            )
        )

    return producer, addr, consumer


def _offered(c: ConsumerNode, n: int = 1) -> bool:
    return wait_for(lambda: c.stats()["offers_held"] >= n)


def _landed(out, want: torch.Tensor) -> bool:
    return isinstance(out, Fetched) and torch.equal(out.tensor(), want)


def test_a_ticket_is_read_with_no_request(cluster):
    producer, addr, consumer = cluster
    c = consumer()
    assert c.connect(addr) == "nixl"
    x = _entry(1)
    assert producer.put("a", x)
    ticket = producer.announce("a")
    assert ticket is not None and ticket.hold_id and ticket.producer == "offers-p"
    assert _offered(c)
    before = producer.stats()
    out = c.fetch(addr, "a", ticket=ticket)
    assert _landed(out, x), out
    assert c.stats()["offer_reads"] == 1
    assert wait_for(lambda: producer.stats()["hold_reads"] == 1)
    after = producer.stats()
    assert after["batches"] == before["batches"] and after["grants"] == before["grants"]
    assert after["active_holds"] == 1  # held until its window closes, whoever read it


def test_offers_of_holds_taken_before_the_session_are_replayed(cluster):
    producer, addr, consumer = cluster
    x = _entry(2)
    producer.put("early", x)
    ticket = producer.announce("early")
    c = consumer()
    c.connect(addr)
    assert _offered(c)
    assert _landed(c.fetch(addr, "early", ticket=ticket), x)
    assert c.stats()["offer_reads"] == 1


def test_a_copied_ticket_serves_a_second_consumer_with_its_own_agent(cluster):
    producer, addr, consumer = cluster
    c1, c2 = consumer(node_id="c1"), consumer(node_id="c2")
    c1.connect(addr)
    c2.connect(addr)
    x = _entry(3)
    producer.put("shared", x)
    ticket = producer.announce("shared")
    assert _offered(c1) and _offered(c2)
    assert _landed(c1.fetch(addr, "shared", ticket=ticket), x)
    assert _landed(c2.fetch(addr, "shared", ticket=ticket), x)
    assert c1.stats()["offer_reads"] == 1 and c2.stats()["offer_reads"] == 1


def test_wrong_or_forged_tickets_fall_back_to_a_request(cluster):
    producer, addr, consumer = cluster
    c = consumer()
    c.connect(addr)
    xa, xb = _entry(4), _entry(5)
    producer.put("a", xa)
    producer.put("b", xb)
    ta, tb = producer.announce("a"), producer.announce("b")
    assert _offered(c, 2)
    swapped = msgspec.structs.replace(tb, mm_hash="a")  # b's hold, presented for a
    forged = Ticket(producer=ta.producer, hold_id=12345, mm_hash="a")
    other = Ticket(producer="someone-else", hold_id=ta.hold_id, mm_hash="a")
    for bad in (swapped, forged, other):
        assert _landed(c.fetch(addr, "a", ticket=bad), xa)
    assert c.stats()["offer_reads"] == 0
    assert producer.stats()["grants"] == 3  # each one asked for it


def test_no_offers_for_a_consumer_that_does_not_ask_or_speaks_v1(cluster):
    producer, addr, consumer = cluster
    quiet = consumer(session_options={"offers": False})
    v1 = consumer(versions=(1,))
    x = _entry(6)
    producer.put("a", x)
    ticket = producer.announce("a")
    for c in (quiet, v1):
        c.connect(addr)
        assert _landed(c.fetch(addr, "a", ticket=ticket), x)
        assert c.stats()["offer_reads"] == 0 and c.stats()["offers_held"] == 0
    assert producer.stats()["offers"] == 0


def test_an_announcement_naming_a_consumer_is_offered_to_it_alone(closing):
    """ECTP v2 §10.4 between real nodes: a producer that does not broadcast offers an
    announcement naming consumer A (by node id) to A's session only; B, connected to the same
    producer with offers on, is offered nothing and fetches the same ticket with a request."""
    pk = new_keypair()
    allowed: set[str] = set()
    producer = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(
                public_key=pk.public, secret_key=pk.secret, allow=lambda key: key in allowed
            ),
            settings=ProducerSettings(
                region_bytes=32 << 20, inline_max_bytes=0, broadcast_offers=False
            ),
            node=NodeSettings(planes=("nixl",), node_id="targeted-p"),
        ).start()
    )
    addr = ProducerAddress("127.0.0.1", producer.port, pk.public)
    consumers = []
    for name in ("pd-a", "pd-b"):
        ck = new_keypair()
        allowed.add(ck.public)
        c = closing(
            ConsumerNode(
                layout=LAYOUT,
                security=Security(public_key=ck.public, secret_key=ck.secret),
                **sections(
                    ConsumerSettings(region_bytes=16 << 20, inline_max_bytes=0),
                    NodeSettings(planes=("nixl",), node_id=name),
                ),
            )
        )
        assert c.connect(addr) == "nixl"
        consumers.append(c)
    a, b = consumers
    x = _entry(7)
    assert producer.put("t", x)
    ticket = producer.announce("t", to="pd-a")
    assert ticket is not None and ticket.hold_id
    assert _offered(a)
    before = producer.stats()
    assert _landed(b.fetch(addr, "t", ticket=ticket), x)  # asked for: B holds no offer
    assert b.stats()["offer_reads"] == 0 and b.stats()["offers_held"] == 0
    asked = producer.stats()
    assert asked["batches"] + asked["grants"] > before["batches"] + before["grants"]
    assert _landed(a.fetch(addr, "t", ticket=ticket), x)  # read on its offer
    assert a.stats()["offer_reads"] == 1
    after = producer.stats()
    assert after["batches"] == asked["batches"] and after["grants"] == asked["grants"]
    assert after["offers_targeted"] == 1
    assert b.stats()["offers_held"] == 0
