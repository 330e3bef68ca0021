"""NixlPlane's plugin-API-2 binding and grant scope, against real NIXL agents (UCX, loopback).

Issue 13: a grant exposes only the granted blocks (a consumer's own NIXL agent, loading what it
was given, cannot read other blocks), and its registration ends with the grant. Issue 17: a grant
is bound to the producer that declared the agent on its authenticated session; a hostile producer
cannot point a consumer at another producer's agent or outside its declared region, and a failed
READ only affects the producer that caused it.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from ectransport.testing.conformance import wait_state

pytest.importorskip("nixl")

from ectransport.data.base import XferState, identity_of
from ectransport.data.nixl import NixlEndpoint, NixlGrant, NixlPlane, metadata_agent
from ectransport.errors import DataPlaneError
from ectransport.store import Run
from ectransport.store.region import HostRegion

BLOCK = 4096
NUM_BLOCKS = 32
DEADLINE_S = 10.0
KEY_P = "P" * 40  # stand-ins for Z85 CURVE public keys: identity_of() only hashes them
KEY_H = "H" * 40


@pytest.fixture
def trio():
    """An honest producer P, a hostile producer H (another key), one consumer C."""
    regions = [HostRegion(NUM_BLOCKS, BLOCK) for _ in range(3)]
    for i, r in enumerate(regions):
        r.buf[:] = np.random.default_rng(i).integers(0, 256, r.buf.nbytes, dtype=np.uint8)
    p = NixlPlane(node_id="enc", region=regions[0], identity=identity_of(KEY_P))
    h = NixlPlane(node_id="evil", region=regions[1], identity=identity_of(KEY_H))
    c = NixlPlane(node_id="pd", region=regions[2])
    yield p, h, c, regions
    for plane in (c, h, p):
        plane.close()
    for r in regions:
        r.close()


def _read(c, binding, grant, runs, nbytes):
    handle = c.start(binding, grant, runs, nbytes, b"")
    try:
        return wait_state(c, handle, DEADLINE_S)
    finally:
        c.release(handle)


def test_bound_fetch_lands_the_granted_bytes(trio):
    p, _, c, (rp, _, rc) = trio
    b = c.bind_peer(p.endpoint(), peer="p:1", host="127.0.0.1", identity=identity_of(KEY_P))
    assert _read(c, b, p.describe([Run(3, 2)], 2 * BLOCK), [Run(10, 2)], 2 * BLOCK) \
        is XferState.DONE
    np.testing.assert_array_equal(rc.read([Run(10, 2)], 2 * BLOCK), rp.read([Run(3, 2)], 2 * BLOCK))


def test_endpoint_of_another_identity_is_refused(trio):
    p, h, c, _ = trio
    with pytest.raises(DataPlaneError, match="not declared by the producer key"):
        c.bind_peer(p.endpoint(), peer="h:1", host="127.0.0.1", identity=identity_of(KEY_H))
    # H re-declares P's agent under its own identity: the agent name does not carry H's identity
    ep = msgspec.msgpack.decode(p.endpoint(), type=NixlEndpoint)
    forged = msgspec.msgpack.encode(msgspec.structs.replace(ep, identity=identity_of(KEY_H)))
    with pytest.raises(DataPlaneError, match="not declared by the producer key"):
        c.bind_peer(forged, peer="h:1", host="127.0.0.1", identity=identity_of(KEY_H))


@pytest.mark.parametrize("attack", ["other_agent", "outside_region", "overflow", "foreign_meta"])
def test_grants_outside_the_binding_are_refused_before_any_io(trio, attack):
    """The hostile producer's grants: another agent, descriptors outside its declared region (or
    wrapping around), metadata of another agent — each refused; the honest binding still works."""
    p, h, c, (rp, _, rc) = trio
    bp = c.bind_peer(p.endpoint(), peer="p:1", host="127.0.0.1", identity=identity_of(KEY_P))
    bh = c.bind_peer(h.endpoint(), peer="h:1", host="127.0.0.1", identity=identity_of(KEY_H))
    honest = msgspec.msgpack.decode(p.describe([Run(0, 1)], BLOCK), type=NixlGrant)
    mine = msgspec.msgpack.decode(h.describe([Run(0, 1)], BLOCK), type=NixlGrant)
    forged = {
        "other_agent": msgspec.structs.replace(honest, descs=[((1 << 63) - 1, BLOCK)]),
        "outside_region": msgspec.structs.replace(mine, descs=[(honest.descs[0][0], BLOCK)]),
        "overflow": msgspec.structs.replace(mine, descs=[(mine.descs[0][0], 1 << 62)]),
        "foreign_meta": msgspec.structs.replace(mine, meta=honest.meta),
    }[attack]
    with pytest.raises(DataPlaneError):
        c.start(bh, msgspec.msgpack.encode(forged), [Run(5, 1)], BLOCK, b"")
    assert _read(c, bp, p.describe([Run(1, 1)], BLOCK), [Run(6, 1)], BLOCK) is XferState.DONE
    np.testing.assert_array_equal(rc.read([Run(6, 1)], BLOCK), rp.read([Run(1, 1)], BLOCK))


def test_a_failing_producer_does_not_cut_the_consumer_off_from_an_honest_one(trio):
    """H's READ fails (its agent is gone); only H's remote agent is dropped — P keeps serving."""
    p, h, c, (rp, _, rc) = trio
    bp = c.bind_peer(p.endpoint(), peer="p:1", host="127.0.0.1", identity=identity_of(KEY_P))
    bh = c.bind_peer(h.endpoint(), peer="h:1", host="127.0.0.1", identity=identity_of(KEY_H))
    grant_h = h.describe([Run(0, 4)], 4 * BLOCK)
    h.close()  # H vanishes with a grant outstanding
    try:
        state = _read(c, bh, grant_h, [Run(0, 4)], 4 * BLOCK)
    except DataPlaneError:
        state = XferState.ERR
    assert state is XferState.ERR
    for i in range(3):
        assert _read(c, bp, p.describe([Run(i, 2)], 2 * BLOCK), [Run(20, 2)], 2 * BLOCK) \
            is XferState.DONE
        np.testing.assert_array_equal(rc.read([Run(20, 2)], 2 * BLOCK),
                                      rp.read([Run(i, 2)], 2 * BLOCK))


def test_a_consumers_own_agent_reads_only_the_granted_blocks(trio):
    """Grant scope: a raw NIXL agent loading the grant's metadata reads the grant's blocks and is
    refused any other block of the region (vLLM's whole-region metadata would allow it)."""
    from nixl._api import nixl_agent, nixl_agent_config

    p, _, _, (rp, _, _) = trio
    grant = msgspec.msgpack.decode(p.describe([Run(4, 2)], 2 * BLOCK), type=NixlGrant)
    assert metadata_agent(grant.meta) == p.agent_name
    dst = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    spy = nixl_agent("spy-1", nixl_agent_config(backends=["UCX"]))
    spy.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    spy.add_remote_agent(grant.meta)

    def read(addr: int, n: int) -> str:
        try:
            xfer = spy.initialize_xfer("READ", spy.get_xfer_descs([(dst.ctypes.data, n, 0)], "DRAM"),
                                       spy.get_xfer_descs([(addr, n, 0)], "DRAM"), p.agent_name)
        except Exception as e:  # noqa: BLE001 - NIXL's native errors share no base class
            return f"refused: {type(e).__name__}"
        state = spy.transfer(xfer)
        for _ in range(1_000_000):
            if state != "PROC":
                break
            state = spy.check_xfer_state(xfer)
        spy.release_xfer_handle(xfer)
        return state

    base = rp.addr
    assert read(grant.descs[0][0], 2 * BLOCK) == "DONE"
    np.testing.assert_array_equal(dst[: 2 * BLOCK], rp.read([Run(4, 2)], 2 * BLOCK))
    assert read(base, BLOCK).startswith("refused")  # a block before the grant
    assert read(base + 6 * BLOCK, BLOCK).startswith("refused")  # the next entry
    assert read(base, NUM_BLOCKS * BLOCK).startswith("refused")  # the whole region
    assert read(grant.descs[0][0], 3 * BLOCK).startswith("refused")  # one block past the grant


def test_grant_registrations_end_with_the_last_grant(trio):
    p, *_ = trio
    g1 = p.describe([Run(0, 2)], 2 * BLOCK)
    g2 = p.describe([Run(0, 2)], 2 * BLOCK)  # a second consumer, same entry: shared
    g3 = p.describe([Run(8, 1)], BLOCK)
    assert p.exposed_registrations == 2
    p.revoke(g1)
    assert p.exposed_registrations == 2
    p.revoke(g2)
    p.revoke(g3)
    p.revoke(g3)  # a duplicate revoke is harmless
    assert p.exposed_registrations == 0


def test_region_scope_is_still_available():
    r1, r2 = HostRegion(8, BLOCK), HostRegion(8, BLOCK)
    p = NixlPlane(node_id="enc", region=r1, grant_scope="region")
    c = NixlPlane(node_id="pd", region=r2)
    try:
        b = c.bind_peer(p.endpoint(), peer="p:1", host="127.0.0.1", identity="")
        r1.buf[:] = 7
        assert _read(c, b, p.describe([Run(1, 1)], BLOCK), [Run(2, 1)], BLOCK) is XferState.DONE
        assert r2.read([Run(2, 1)], BLOCK).tolist() == [7] * BLOCK
        assert p.exposed_registrations == 0
    finally:
        c.close()
        p.close()
        r1.close()
        r2.close()
