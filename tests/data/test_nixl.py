"""NixlPlane against real NIXL agents (UCX backend) on loopback; no fakes.

Two planes over separate HostRegions play producer and consumer in one process; one test runs the
producer in a spawned process and passes the grant over a pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from ectransport.testing.conformance import wait_notifs, wait_state

pytest.importorskip("nixl")

from ectransport.data.base import TransferModel, XferState
from ectransport.data.nixl import NixlGrant, NixlPlane
from ectransport.errors import ConfigError, DataPlaneError
from ectransport.store import Run
from ectransport.store.region import HostRegion

BLOCK = 4096
NUM_BLOCKS = 64
DEADLINE_S = 10.0


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _wait(plane: NixlPlane, handle, timeout_s: float = DEADLINE_S) -> XferState:
    return wait_state(plane, handle, timeout_s)


def _wait_notifs(plane: NixlPlane, want: int = 1, timeout_s: float = DEADLINE_S) -> list[bytes]:
    return wait_notifs(plane, want, timeout_s)


@pytest.fixture
def region_pair():
    prod, cons = HostRegion(NUM_BLOCKS, BLOCK), HostRegion(NUM_BLOCKS, BLOCK)
    cons.buf[:] = 0xEE  # anything not read stays 0xEE
    yield prod, cons
    prod.close()
    cons.close()


@pytest.fixture
def planes(region_pair):
    prod_region, cons_region = region_pair
    producer = NixlPlane(node_id="enc0", region=prod_region)
    consumer = NixlPlane(node_id="pd0", region=cons_region)
    yield producer, consumer, prod_region, cons_region
    consumer.close()
    producer.close()


def _transfer(producer, consumer, prod_region, cons_region, prod_runs, cons_runs, nbytes, seed):
    """Write a pattern into the producer's runs, READ it into the consumer's, return both."""
    data = _pattern(nbytes, seed)
    prod_region.write(prod_runs, data)
    grant = producer.describe(prod_runs, nbytes)
    handle = consumer.start(None, grant, cons_runs, nbytes, f"n{seed}".encode())
    try:
        assert _wait(consumer, handle) is XferState.DONE
    finally:
        consumer.release(handle)
    return data, cons_region.read(cons_runs, nbytes)


# -- round trips ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prod_runs", "cons_runs", "nbytes"),
    [
        ([Run(0, 1)], [Run(5, 1)], BLOCK),  # one block
        ([Run(0, 1)], [Run(0, 1)], 100),  # a partial block
        ([Run(2, 40)], [Run(10, 40)], 40 * BLOCK - 7),  # many blocks, contiguous
        # scattered on both sides, boundaries at different places
        ([Run(3, 2), Run(10, 5), Run(40, 1)], [Run(0, 1), Run(20, 4), Run(50, 3)], 8 * BLOCK),
        # adjacent runs (merged into one descriptor) against a scattered destination
        ([Run(5, 2), Run(7, 3), Run(30, 1)], [Run(60, 4), Run(1, 1), Run(40, 1)], 6 * BLOCK - 1),
    ],
)
def test_round_trip(planes, prod_runs, cons_runs, nbytes):
    producer, consumer, prod_region, cons_region = planes
    sent, got = _transfer(
        producer, consumer, prod_region, cons_region, prod_runs, cons_runs, nbytes, seed=nbytes
    )
    np.testing.assert_array_equal(got, sent)
    # nothing outside the consumer's runs was written
    mask = np.ones(cons_region.nbytes, dtype=bool)
    for r in cons_runs:
        mask[r.start * BLOCK : (r.start + r.count) * BLOCK] = False
    assert (cons_region.buf[mask] == 0xEE).all()


def test_notification_reaches_producer_with_exact_bytes(planes):
    producer, consumer, *_ = planes
    notif = b"\x00grant:7\xff" + bytes(range(40))
    producer.poll_notifications()  # drain
    handle = consumer.start(
        None, producer.describe([Run(0, 2)], 2 * BLOCK), [Run(4, 2)], 2 * BLOCK, notif
    )
    assert _wait(consumer, handle) is XferState.DONE
    consumer.release(handle)
    assert _wait_notifs(producer) == [notif]
    assert producer.poll_notifications() == []  # delivered once


def test_grant_describes_only_granted_runs(planes):
    producer, _, prod_region, _ = planes
    runs = [Run(3, 2), Run(5, 1), Run(20, 4)]  # the first two are adjacent: one descriptor
    grant = msgspec.msgpack.decode(producer.describe(runs, 7 * BLOCK), type=NixlGrant)
    base = prod_region.addr
    assert grant.descs == [(base + 3 * BLOCK, 3 * BLOCK), (base + 20 * BLOCK, 4 * BLOCK)]
    assert grant.agent == producer.agent_name
    assert grant.agent.startswith("enc0-") and len(grant.agent) == len("enc0-") + 8
    assert grant.mem_kind == "DRAM"
    assert len(grant.meta) > 0


def test_describe_rejects_runs_outside_region(planes):
    producer = planes[0]
    with pytest.raises(DataPlaneError, match="outside"):
        producer.describe([Run(NUM_BLOCKS - 1, 2)], BLOCK)
    with pytest.raises(DataPlaneError):
        producer.describe([], 0)
    with pytest.raises(DataPlaneError, match="nbytes"):
        producer.describe([Run(0, 1)], BLOCK + 1)


# -- bad grants -------------------------------------------------------------------------------------
def _bad_grants(producer: NixlPlane, other_meta: bytes) -> dict[str, bytes]:
    good = msgspec.msgpack.decode(producer.describe([Run(0, 2)], 2 * BLOCK), type=NixlGrant)
    enc = msgspec.msgpack.encode
    return {
        "empty": b"",
        "garbage": b"\xc1\x00garbage",
        "wrong type": enc({"agent": "x"}),
        "missing field": enc({"type": "nixl/1", "agent": good.agent, "meta": good.meta}),
        "negative length": enc(
            {
                "type": "nixl/1",
                "agent": good.agent,
                "meta": good.meta,
                "mem_kind": "DRAM",
                "dev_id": 0,
                "descs": [[good.descs[0][0], -1]],
            }
        ),
        "no descs": enc(msgspec.structs.replace(good, descs=[])),
        "bad mem kind": enc(msgspec.structs.replace(good, mem_kind="FILE")),
        "length mismatch": enc(msgspec.structs.replace(good, descs=[(good.descs[0][0], BLOCK)])),
        "garbage metadata": enc(msgspec.structs.replace(good, agent="ghost", meta=b"nope")),
        "agent name lies": enc(msgspec.structs.replace(good, agent="ghost", meta=other_meta)),
        # right length, but outside what the producer registered: NIXL refuses to post it
        "unregistered memory": enc(
            msgspec.structs.replace(
                good, descs=[(good.descs[0][0] + NUM_BLOCKS * BLOCK, 2 * BLOCK)]
            )
        ),
    }


def test_bad_grants_raise_and_leave_plane_usable(planes):
    producer, consumer, prod_region, cons_region = planes
    third_region = HostRegion(4, BLOCK)
    third = NixlPlane(node_id="other", region=third_region)
    try:
        other_meta = msgspec.msgpack.decode(third.describe([Run(0, 1)], BLOCK), type=NixlGrant).meta
        bad = _bad_grants(producer, other_meta)
        for label, grant in bad.items():
            with pytest.raises(DataPlaneError):
                consumer.start(None, grant, [Run(8, 2)], 2 * BLOCK, b"bad")
                pytest.fail(f"grant {label!r} was accepted")
        # a grant that does not match the local runs' length
        with pytest.raises(DataPlaneError, match="bytes"):
            consumer.start(
                None, producer.describe([Run(0, 2)], 2 * BLOCK), [Run(8, 3)], 2 * BLOCK, b"bad"
            )
        # local runs outside the consumer's region
        with pytest.raises(DataPlaneError, match="outside"):
            consumer.start(
                None,
                producer.describe([Run(0, 2)], 2 * BLOCK),
                [Run(NUM_BLOCKS - 1, 2)],
                2 * BLOCK,
                b"bad",
            )
        # still healthy: a good transfer works and only its notification arrives
        producer.poll_notifications()
        sent, got = _transfer(
            producer,
            consumer,
            prod_region,
            cons_region,
            [Run(0, 2)],
            [Run(8, 2)],
            2 * BLOCK,
            seed=99,
        )
        np.testing.assert_array_equal(got, sent)
        assert _wait_notifs(producer) == [b"n99"]
    finally:
        third.close()
        third_region.close()


# -- peers, restart, reload -----------------------------------------------------------------------
def test_restarted_producer_is_a_new_agent_and_works(region_pair):
    prod_region, cons_region = region_pair
    consumer = NixlPlane(node_id="pd0", region=cons_region)
    first = NixlPlane(node_id="enc0", region=prod_region)
    try:
        sent, got = _transfer(
            first, consumer, prod_region, cons_region, [Run(0, 3)], [Run(0, 3)], 3 * BLOCK, seed=1
        )
        np.testing.assert_array_equal(got, sent)
        first.close()
        second = NixlPlane(node_id="enc0", region=prod_region)  # same node, restarted
        try:
            assert second.agent_name != first.agent_name
            sent, got = _transfer(
                second,
                consumer,
                prod_region,
                cons_region,
                [Run(10, 3)],
                [Run(0, 3)],
                3 * BLOCK,
                seed=2,
            )
            np.testing.assert_array_equal(got, sent)
            assert _wait_notifs(second) == [b"n2"]
            # the restarted producer's old agent is dropped, never reused
            assert set(consumer._peers) == {second.agent_name}
        finally:
            second.close()
        consumer.forget_peer(first.agent_name)
        consumer.forget_peer("never-seen")  # no-op
    finally:
        first.close()
        consumer.close()


# -- handles and lifecycle --------------------------------------------------------------------------
def test_release_is_idempotent_and_check_keeps_final_state(planes):
    producer, consumer, *_ = planes
    handle = consumer.start(
        None, producer.describe([Run(0, 4)], 4 * BLOCK), [Run(0, 4)], 4 * BLOCK, b"x"
    )
    assert _wait(consumer, handle) is XferState.DONE
    consumer.release(handle)
    consumer.release(handle)
    assert consumer.check(handle) is XferState.DONE


def test_close_is_idempotent(region_pair):
    prod_region, cons_region = region_pair
    producer = NixlPlane(node_id="enc0", region=prod_region)
    consumer = NixlPlane(node_id="pd0", region=cons_region)
    grant = producer.describe([Run(0, 1)], BLOCK)
    handle = consumer.start(None, grant, [Run(0, 1)], BLOCK, b"c")
    _wait(consumer, handle)
    consumer.close()
    consumer.close()
    producer.close()
    producer.close()
    consumer.release(handle)  # after close: no error
    assert consumer.check(handle) in (XferState.DONE, XferState.ERR)
    assert producer.poll_notifications() == []
    with pytest.raises(DataPlaneError, match="closed"):
        producer.describe([Run(0, 1)], BLOCK)
    with pytest.raises(DataPlaneError, match="closed"):
        consumer.start(None, grant, [Run(0, 1)], BLOCK, b"")


def test_declarations_and_options(region_pair):
    caps = NixlPlane.capabilities
    assert caps.transfer_model is TransferModel.READ
    assert "DRAM" in caps.mem_kinds and caps.notifications and caps.max_transfer_bytes is None
    ok, why = NixlPlane.probe()
    assert ok and why.startswith("nixl ") and "UCX" in why
    with pytest.raises(ConfigError, match="bogus"):
        NixlPlane(node_id="x", region=region_pair[0], bogus=1)
    plane = NixlPlane(node_id="x", region=region_pair[0])
    try:
        assert plane.describe_transport().startswith("nixl/UCX")
    finally:
        plane.close()


def test_importing_the_module_does_not_import_nixl():
    code = (
        "import sys, ectransport.data.nixl as m; "
        "assert 'nixl' not in sys.modules, 'nixl imported'; print(m.NixlPlane.name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "nixl"


def test_opening_a_plane_imports_torch_only_for_a_gpu_build():
    """nixl's meta package imports all of torch to learn that a CPU-only torch has no CUDA (~2 s
    per fresh process); the plane's import tells it the answer instead (nixl_agent docstring)."""
    from ectransport.data.nixl_agent import _torch_build

    build = _torch_build()
    if build is None or build != (None, None):
        pytest.skip(f"needs an installed CPU-only torch build (found {build})")
    code = (
        "import sys\n"
        "from ectransport.data.nixl import NixlPlane\n"
        "from ectransport.store.region import HostRegion\n"
        "p = NixlPlane(node_id='x', region=HostRegion(4, 4096))\n"
        "print(sorted(p.capabilities.mem_kinds), 'torch' in sys.modules)\n"
        "p.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['DRAM'] False"


# -- producer in another process ------------------------------------------------------------------
def _producer_process(conn, num_blocks: int, block_bytes: int, seed: int) -> None:
    """Child: serve one grant, report the notifications it received, exit when told."""
    region = HostRegion(num_blocks, block_bytes)
    plane = NixlPlane(node_id="enc-child", region=region)
    try:
        runs = [Run(1, 3), Run(9, 2)]
        nbytes = 5 * block_bytes - 11
        region.write(runs, _pattern(nbytes, seed))
        conn.send((plane.describe(runs, nbytes), nbytes))
        conn.send(_wait_notifs(plane, timeout_s=30.0))
        conn.poll(30.0)  # keep the memory registered until the consumer is done
    finally:
        plane.close()
        region.close()
        conn.close()


@pytest.mark.slow
def test_read_from_a_producer_in_another_process(region_pair):
    _, cons_region = region_pair
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_process, args=(child, 16, BLOCK, 1234), daemon=True)
    proc.start()
    consumer = NixlPlane(node_id="pd0", region=cons_region)
    try:
        assert parent.poll(60.0), "producer process sent no grant within 60 s"
        grant, nbytes = parent.recv()
        cons_runs = [Run(40, 1), Run(20, 4)]  # different boundaries than the producer's
        handle = consumer.start(None, grant, cons_runs, nbytes, b"cross-process")
        assert _wait(consumer, handle, timeout_s=30.0) is XferState.DONE
        consumer.release(handle)
        np.testing.assert_array_equal(cons_region.read(cons_runs, nbytes), _pattern(nbytes, 1234))
        assert parent.poll(35.0), "producer process reported no notifications"
        assert parent.recv() == [b"cross-process"]
        parent.send("bye")
        proc.join(30.0)
        assert proc.exitcode == 0
    finally:
        consumer.close()
        if proc.is_alive():
            proc.terminate()
            proc.join(10.0)
        parent.close()


def test_idle_agent_does_not_burn_a_core():
    """NIXL's wrapper starts agents whose progress thread spins (a full core while idle); the
    plane sets a progress delay so an idle node leaves the CPU to others."""
    import subprocess
    import sys

    code = (
        "import time; from ectransport.store import HostRegion; "
        "from ectransport.data.nixl import NixlPlane; "
        "p = NixlPlane(node_id='idle', region=HostRegion(4, 64)); "
        "t0, w0 = time.process_time(), time.time(); time.sleep(1.5); "
        "print((time.process_time() - t0) / (time.time() - w0)); p.close()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 0.5  # spinning measures ~1.0
