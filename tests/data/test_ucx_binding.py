"""UcxPlane under plugin API 2 (issue 17): grants bound to the producer that declared them, one
UCX endpoint per binding, and unguessable transfer tags (UCX matches tag receives per worker, so a
hostile producer connected to the consumer could otherwise fill another producer's transfer)."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pytest

from ectransport.testing.conformance import wait_state

pytest.importorskip("ucxx")

from ectransport.data import ucx as ucx_mod  # noqa: E402
from ectransport.data.base import MAX_ENDPOINT_BYTES, XferState, identity_of  # noqa: E402
from ectransport.data.ucx import UcxEndpoint, UcxGrant, UcxPlane  # noqa: E402
from ectransport.errors import DataPlaneError  # noqa: E402
from ectransport.store import HostRegion, Run  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BLOCK = 64 * 1024
DEADLINE_S = 10.0
HONEST_ID = identity_of("H" * 40)
EVIL_ID = identity_of("E" * 40)


@pytest.fixture
def trio():
    """An honest producer, a hostile one (its own plane, patched below) and a consumer."""
    regions = [HostRegion(64, BLOCK) for _ in range(3)]
    regions[2].buf[:] = 0xEE
    honest = UcxPlane(node_id="enc0", region=regions[0], identity=HONEST_ID,
                      transfer_timeout_s=5.0)
    evil = UcxPlane(node_id="evil", region=regions[1], identity=EVIL_ID, transfer_timeout_s=5.0)
    consumer = UcxPlane(node_id="pd0", region=regions[2], transfer_timeout_s=5.0)
    yield honest, evil, consumer, regions
    for plane in (consumer, evil, honest):
        plane.close()
    for r in regions:
        r.close()


def _bind(consumer: UcxPlane, producer: UcxPlane, identity: str, host: str = "127.0.0.1"):
    return consumer.bind_peer(producer.endpoint(), peer=f"{host}:{producer.port + 1}", host=host,
                              identity=identity)


def _fetch(consumer, binding, producer, prod_region, cons_region, prod_runs, cons_runs, nbytes,
           value):
    prod_region.write(prod_runs, np.full(nbytes, value, np.uint8))
    h = consumer.start(binding, producer.describe(prod_runs, nbytes), cons_runs, nbytes, b"")
    try:
        assert wait_state(consumer, h, DEADLINE_S) is XferState.DONE, h.detail
    finally:
        consumer.release(h)
    return cons_region.read(cons_runs, nbytes)


def test_endpoint_declares_where_and_who(trio):
    honest = trio[0]
    raw = honest.endpoint()
    assert isinstance(raw, bytes) and len(raw) <= MAX_ENDPOINT_BYTES
    decl = msgspec.msgpack.decode(raw, type=UcxEndpoint)
    assert (decl.v, decl.host, decl.port, decl.node, decl.identity) == (
        1, "127.0.0.1", honest.port, "enc0", HONEST_ID)


def test_bind_refuses_wrong_identity_host_or_garbage(trio):
    honest, _, consumer, _ = trio
    with pytest.raises(DataPlaneError, match="identity"):
        _bind(consumer, honest, EVIL_ID)
    with pytest.raises(DataPlaneError, match="dialed"):
        _bind(consumer, honest, HONEST_ID, host="192.0.2.77")
    with pytest.raises(DataPlaneError, match="malformed"):
        consumer.bind_peer(b"\x01junk", peer="x:1", host="127.0.0.1", identity=HONEST_ID)
    with pytest.raises(DataPlaneError, match="malformed"):  # a tcp declaration is not a ucx one
        consumer.bind_peer(msgspec.msgpack.encode({"type": "tcp-ep", "v": 1, "host": "127.0.0.1",
                                                   "port": 1, "node": "", "identity": HONEST_ID}),
                           peer="x:1", host="127.0.0.1", identity=HONEST_ID)
    assert consumer.bind_peer(b"", peer="x:1", host="127.0.0.1", identity=HONEST_ID) is None


def test_a_grant_outside_the_binding_never_connects(trio):
    honest, evil, consumer, regions = trio
    evil_binding = _bind(consumer, evil, EVIL_ID)
    forged = {
        "another producer": honest.describe([Run(0, 1)], BLOCK),
        "unrelated port": msgspec.msgpack.encode(UcxGrant("127.0.0.1", 1, b"t" * 16, BLOCK, 1,
                                                          [BLOCK])),
        "same port, other host": msgspec.msgpack.encode(UcxGrant("localhost", evil.port,
                                                                 b"t" * 16, BLOCK, 1, [BLOCK])),
    }
    for label, grant in forged.items():
        with pytest.raises(DataPlaneError, match="declared"):
            consumer.start(evil_binding, grant, [Run(0, 1)], BLOCK, b"")
        assert label
    assert not consumer._cmds and not consumer._eps  # noqa: SLF001 - nothing was even queued
    with pytest.raises(DataPlaneError, match="not a binding"):
        consumer.start(object(), honest.describe([Run(0, 1)], BLOCK), [Run(0, 1)], BLOCK, b"")
    got = _fetch(consumer, _bind(consumer, honest, HONEST_ID), honest, regions[0], regions[2],
                 [Run(0, 1)], [Run(1, 1)], BLOCK, 0x11)
    assert (got == 0x11).all()


def test_hostile_producer_cannot_fill_another_producers_transfer(trio):
    """The hostile producer answers its own request, then sends forged headers and segments on
    the tags of the next transfer ids (sequential ids made this land in the honest producer's
    transfer: measured before the fix) and on its own id's neighbours. Neither the honest
    producer's transfer nor the hostile producer's next one takes them."""
    honest, evil, consumer, regions = trio
    serve = evil._serve  # noqa: SLF001 - the hostile producer is a patched plane
    forged_seg = np.full(BLOCK, 0x66, np.uint8)

    def hostile_serve(conn, data):
        req = ucx_mod._request_decoder.decode(data)  # noqa: SLF001
        serve(conn, data)
        api, array = evil._api, evil._Array  # noqa: SLF001
        for xid in [x for x in range(req.xid - 8, req.xid + 9) if x > 0 and x != req.xid]:
            base = xid << ucx_mod._SEG_BITS  # noqa: SLF001
            bufs = [array(ucx_mod._header(ucx_mod._OK)), array(forged_seg)]  # noqa: SLF001
            reqs = [conn.ep.tag_send(bufs[0], api.UCXXTag(base)),
                    conn.ep.tag_send(bufs[1], api.UCXXTag(base | 1))]
            evil._served.append(ucx_mod._Served(conn, reqs, bufs, None))  # noqa: SLF001

    evil._serve = hostile_serve  # noqa: SLF001
    evil_binding, honest_binding = _bind(consumer, evil, EVIL_ID), _bind(consumer, honest,
                                                                          HONEST_ID)
    got = _fetch(consumer, evil_binding, evil, regions[1], regions[2], [Run(0, 1)], [Run(0, 1)],
                 BLOCK, 0x22)
    assert (got == 0x22).all()
    for i in range(3):
        got = _fetch(consumer, honest_binding, honest, regions[0], regions[2], [Run(i, 1)],
                     [Run(10 + i, 1)], BLOCK, 0x30 + i)
        assert (got == 0x30 + i).all(), "the honest producer's transfer took forged bytes"
        got = _fetch(consumer, evil_binding, evil, regions[1], regions[2], [Run(i, 1)],
                     [Run(20 + i, 1)], BLOCK, 0x40 + i)
        assert (got == 0x40 + i).all(), "bytes pushed ahead were taken for the next fetch"
    assert not (regions[2].buf == 0x66).any()


def test_one_endpoint_per_binding_and_unbind_closes_it(trio):
    honest, _, consumer, regions = trio
    first, second = _bind(consumer, honest, HONEST_ID), _bind(consumer, honest, HONEST_ID)
    for i, b in enumerate((first, second)):
        got = _fetch(consumer, b, honest, regions[0], regions[2], [Run(i, 1)], [Run(i, 1)],
                     BLOCK, 0x50 + i)
        assert (got == 0x50 + i).all()
    assert {k[0] for k in consumer._eps} == {first.scope, second.scope}  # noqa: SLF001
    consumer.unbind_peer(first)
    consumer.unbind_peer(None)  # not a binding: no-op
    got = _fetch(consumer, second, honest, regions[0], regions[2], [Run(5, 1)], [Run(5, 1)],
                 BLOCK, 0x55)  # the service thread ran the unbind before this start
    assert (got == 0x55).all()
    assert {k[0] for k in consumer._eps} == {second.scope}  # noqa: SLF001


def test_unbound_grants_are_served_with_one_warning(trio, caplog):
    honest, _, consumer, regions = trio
    with caplog.at_level(logging.WARNING, logger="ectransport.data.ucx"):
        for i in range(2):
            got = _fetch(consumer, None, honest, regions[0], regions[2], [Run(i, 1)],
                         [Run(i, 1)], BLOCK, 0x60 + i)
            assert (got == 0x60 + i).all()
    assert sum("without a session binding" in r.getMessage() for r in caplog.records) == 1
