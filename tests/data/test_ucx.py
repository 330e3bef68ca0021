"""UcxPlane against real ucxx workers on loopback; no fakes.

Two planes over separate HostRegions play producer and consumer in one process; one test runs the
producer in a spawned process and passes the grant over a pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import msgspec
import numpy as np
import pytest

from ectransport.testing.conformance import wait_notifs, wait_state

pytest.importorskip("ucxx")

from ectransport.data.base import TransferModel, XferState  # noqa: E402
from ectransport.data.ucx import UcxGrant, UcxPlane  # noqa: E402
from ectransport.errors import ConfigError, DataPlaneError  # noqa: E402
from ectransport.store import Run  # noqa: E402
from ectransport.store.region import HostRegion  # noqa: E402

pytestmark = pytest.mark.timeout(30)

BLOCK = 64 * 1024
NUM_BLOCKS = 1100
DEADLINE_S = 10.0


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _wait(plane: UcxPlane, handle, timeout_s: float = DEADLINE_S) -> XferState:
    return wait_state(plane, handle, timeout_s)


def _wait_notifs(plane: UcxPlane, want: int = 1, timeout_s: float = DEADLINE_S) -> list[bytes]:
    return wait_notifs(plane, want, timeout_s)


@pytest.fixture
def regions():
    prod, cons = HostRegion(NUM_BLOCKS, BLOCK), HostRegion(NUM_BLOCKS, BLOCK)
    cons.buf[:] = 0xEE
    yield prod, cons
    prod.close()
    cons.close()


@pytest.fixture
def planes(regions):
    prod_region, cons_region = regions
    producer = UcxPlane(node_id="enc0", region=prod_region, transfer_timeout_s=5.0)
    consumer = UcxPlane(node_id="pd0", region=cons_region, transfer_timeout_s=5.0)
    yield producer, consumer, prod_region, cons_region
    consumer.close()
    producer.close()


def _transfer(
    producer, consumer, prod_region, cons_region, prod_runs, cons_runs, nbytes, seed, notif=b""
):
    data = _pattern(nbytes, seed)
    prod_region.write(prod_runs, data)
    handle = consumer.start(None, producer.describe(prod_runs, nbytes), cons_runs, nbytes, notif)
    try:
        assert _wait(consumer, handle) is XferState.DONE, handle.detail
    finally:
        consumer.release(handle)
    got = cons_region.read(cons_runs, nbytes) if nbytes else np.empty(0, np.uint8)
    return data, got


def test_declarations():
    assert UcxPlane.name == "ucx"
    assert UcxPlane.capabilities.transfer_model is TransferModel.PUSH
    assert "DRAM" in UcxPlane.capabilities.mem_kinds
    assert UcxPlane.capabilities.notifications is True
    ok, why = UcxPlane.probe()
    assert ok is True and why.startswith("ucxx")


def test_describe_transport_names_the_transports(planes):
    text = planes[0].describe_transport()
    assert text.startswith("ucx (tls=") and "tcp" in text and "intra-node bulk" in text


@pytest.mark.parametrize(
    ("prod_runs", "cons_runs", "nbytes"),
    [
        ([Run(0, 1)], [Run(5, 1)], BLOCK),  # one block
        ([Run(0, 1)], [Run(0, 1)], 100),  # a partial block
        ([Run(0, 1)], [Run(3, 1)], 0),  # zero bytes
        ([Run(2, 40)], [Run(100, 40)], 40 * BLOCK - 7),  # many blocks, contiguous
        (
            [Run(3 * i, 1) for i in range(256)],
            [Run(1 + 2 * i, 1) for i in reversed(range(256))],
            256 * BLOCK - 3,
        ),  # 256 single-block runs each side
        ([Run(3, 2), Run(10, 5), Run(40, 1)], [Run(0, 1), Run(20, 4), Run(50, 3)], 8 * BLOCK),
        ([Run(5, 2), Run(7, 3), Run(30, 1)], [Run(60, 4), Run(1, 1), Run(40, 1)], 6 * BLOCK - 1),
        ([Run(0, 1024)], [Run(10, 1024)], 64 * 1024 * 1024),  # 64 MiB
    ],
    ids=["one-block", "partial", "zero", "contiguous", "many", "scattered", "adjacent", "64MiB"],
)
def test_round_trip(planes, prod_runs, cons_runs, nbytes):
    producer, consumer, prod_region, cons_region = planes
    sent, got = _transfer(
        producer,
        consumer,
        prod_region,
        cons_region,
        prod_runs,
        cons_runs,
        nbytes,
        seed=nbytes % 1000,
    )
    np.testing.assert_array_equal(got, sent)
    mask = np.ones(cons_region.nbytes, dtype=bool)
    for r in cons_runs:
        mask[r.start * BLOCK : (r.start + r.count) * BLOCK] = False
    assert (cons_region.buf[mask] == 0xEE).all()


@pytest.mark.parametrize("host", ["127.0.0.2", "127.0.0.3"])
def test_producer_on_another_loopback_address(regions, host):
    """Regression: a producer with host=127.0.0.N (N != 1) timed out. UCX's TCP connection
    manager only accepts on addresses assigned to an interface, and 127.0.0.N is routed to lo,
    not assigned to it; the consumer now dials 127.0.0.1 for any IPv4 loopback host."""
    prod_region, cons_region = regions
    producer = UcxPlane(node_id="p", region=prod_region, host=host, transfer_timeout_s=5.0)
    consumer = UcxPlane(node_id="c", region=cons_region, transfer_timeout_s=5.0)
    try:
        assert msgspec.msgpack.decode(producer.describe([Run(0, 1)], 1), type=UcxGrant).host \
            == host
        binding = consumer.bind_peer(producer.endpoint(), peer=f"{host}:1", host=host,
                                     identity="")
        assert binding.addrs == (host,)
        for prepared, seed in ((binding, 5), (None, 6)):  # bound, and as an older node would
            data = _pattern(4 * BLOCK - 3, seed)
            prod_region.write([Run(0, 4)], data)
            h = consumer.start(prepared, producer.describe([Run(0, 4)], data.nbytes),
                               [Run(8, 4)], data.nbytes, b"")
            try:
                assert _wait(consumer, h) is XferState.DONE, h.detail
            finally:
                consumer.release(h)
            np.testing.assert_array_equal(cons_region.read([Run(8, 4)], data.nbytes), data)
    finally:
        consumer.close()
        producer.close()


def test_round_trip_with_peer_error_handling(regions):
    prod_region, cons_region = regions
    producer = UcxPlane(node_id="p", region=prod_region, peer_error_handling=True)
    consumer = UcxPlane(node_id="c", region=cons_region, peer_error_handling=True)
    try:
        assert "tcp" in producer.describe_transport()
        sent, got = _transfer(
            producer,
            consumer,
            prod_region,
            cons_region,
            [Run(0, 16)],
            [Run(16, 16)],
            16 * BLOCK,
            seed=3,
        )
        np.testing.assert_array_equal(got, sent)
    finally:
        consumer.close()
        producer.close()


def test_notification_reaches_producer_once(planes):
    notif = b"\x00grant:7\xff" + bytes(range(40))
    _transfer(*planes, [Run(0, 2)], [Run(4, 2)], 2 * BLOCK, seed=1, notif=notif)
    assert _wait_notifs(planes[0]) == [notif]
    assert planes[0].poll_notifications() == []


def test_grant_exposes_only_lengths_of_granted_runs(planes):
    producer = planes[0]
    grant = msgspec.msgpack.decode(
        producer.describe([Run(3, 2), Run(5, 1), Run(20, 4)], 7 * BLOCK), type=UcxGrant
    )
    assert grant.lens == [3 * BLOCK, 4 * BLOCK] and grant.blocks == 7
    assert (grant.host, grant.port) == ("127.0.0.1", producer.port) and len(grant.token) == 16


def test_revoked_grant_is_refused(planes):
    producer, consumer, prod_region, cons_region = planes
    grant = producer.describe([Run(0, 2)], 2 * BLOCK)
    producer.revoke(grant)
    producer.revoke(b"garbage")  # no-op
    handle = consumer.start(None, grant, [Run(10, 2)], 2 * BLOCK, b"n")
    assert _wait(consumer, handle) is XferState.ERR
    assert "revoked" in handle.detail
    consumer.release(handle)
    assert (cons_region.buf == 0xEE).all()
    assert producer.poll_notifications() == []
    _transfer(*planes, [Run(0, 2)], [Run(10, 2)], 2 * BLOCK, seed=2)  # still usable


@pytest.mark.parametrize("grant", [b"", b"\xc1\x00garbage", msgspec.msgpack.encode({"a": 1})])
def test_malformed_grant_raises(planes, grant):
    with pytest.raises(DataPlaneError, match="malformed"):
        planes[1].start(None, grant, [Run(0, 1)], BLOCK, b"")


def test_mismatched_grant_raises(planes):
    producer, consumer, *_ = planes
    grant = producer.describe([Run(0, 2)], 2 * BLOCK)
    with pytest.raises(DataPlaneError, match="blocks"):
        consumer.start(None, grant, [Run(8, 3)], 2 * BLOCK, b"")
    with pytest.raises(DataPlaneError, match="bytes"):
        consumer.start(None, grant, [Run(8, 2)], 2 * BLOCK - 1, b"")
    with pytest.raises(DataPlaneError, match="outside"):
        producer.describe([Run(NUM_BLOCKS - 1, 2)], BLOCK)


def test_unreachable_producer_is_err(regions):
    consumer = UcxPlane(node_id="c", region=regions[1], transfer_timeout_s=2.0)
    try:
        grant = msgspec.msgpack.encode(UcxGrant("127.0.0.1", 1, b"t" * 16, BLOCK, 1, [BLOCK]))
        handle = consumer.start(None, grant, [Run(0, 1)], BLOCK, b"")
        assert _wait(consumer, handle, 5.0) is XferState.ERR
        consumer.release(handle)
    finally:
        consumer.close()


def test_producer_closed_mid_transfer_ends_in_err(planes):
    producer, consumer, prod_region, cons_region = planes
    n = 1024
    handle = consumer.start(
        None, producer.describe([Run(0, n)], n * BLOCK), [Run(10, n)], n * BLOCK, b""
    )
    producer.close()
    start = time.monotonic()
    state = _wait(consumer, handle, DEADLINE_S)
    assert state is not XferState.PROC
    assert time.monotonic() - start < 6.0  # transfer_timeout_s=5 at worst
    consumer.release(handle)


def test_release_in_flight_stops_landing(planes):
    producer, consumer, prod_region, cons_region = planes
    n = 1024
    handle = consumer.start(
        None, producer.describe([Run(0, n)], n * BLOCK), [Run(10, n)], n * BLOCK, b""
    )
    consumer.release(handle)
    assert consumer.check(handle) in (XferState.DONE, XferState.ERR)
    snapshot = cons_region.buf.copy()
    time.sleep(0.2)
    assert np.array_equal(cons_region.buf, snapshot)
    _transfer(*planes, [Run(0, 2)], [Run(1050, 2)], 2 * BLOCK, seed=9)


def test_close_is_idempotent_and_leaves_no_thread(regions):
    before = threading.active_count()
    producer = UcxPlane(node_id="p", region=regions[0])
    consumer = UcxPlane(node_id="c", region=regions[1])
    _transfer(producer, consumer, *regions, [Run(0, 2)], [Run(0, 2)], 2 * BLOCK, seed=4)
    grant = producer.describe([Run(0, 1)], BLOCK)
    for plane in (consumer, consumer, producer, producer):
        plane.close()
    assert threading.active_count() <= before
    with pytest.raises(DataPlaneError):
        producer.describe([Run(0, 1)], BLOCK)
    with pytest.raises(DataPlaneError):
        consumer.start(None, grant, [Run(0, 1)], BLOCK, b"")


def test_bad_options():
    region = HostRegion(4, BLOCK)
    try:
        with pytest.raises(ConfigError, match="unknown"):
            UcxPlane(node_id="x", region=region, bogus=1)
        with pytest.raises(ConfigError, match="transfer_timeout_s"):
            UcxPlane(node_id="x", region=region, transfer_timeout_s=0)
    finally:
        region.close()


def _producer_main(conn, nbytes: int) -> None:
    region = HostRegion(64, BLOCK)
    plane = UcxPlane(node_id="remote", region=region)
    try:
        runs = [Run(2, 3), Run(20, 5)]
        region.write(runs, _pattern(nbytes, 77))
        conn.send(plane.describe(runs, nbytes))
        conn.send(_wait_notifs(plane, 1, DEADLINE_S))
        conn.recv()  # until the parent is done
    finally:
        plane.close()
        region.close()


def test_separate_process_producer(regions):
    nbytes = 8 * BLOCK - 5
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_main, args=(child, nbytes), daemon=True)
    proc.start()
    consumer = UcxPlane(node_id="c", region=regions[1])
    try:
        assert parent.poll(20), "producer process did not start"
        grant = parent.recv()
        runs = [Run(100, 1), Run(7, 4), Run(300, 3)]
        handle = consumer.start(None, grant, runs, nbytes, b"from-child")
        assert _wait(consumer, handle) is XferState.DONE, handle.detail
        consumer.release(handle)
        np.testing.assert_array_equal(regions[1].read(runs, nbytes), _pattern(nbytes, 77))
        assert parent.poll(DEADLINE_S) and parent.recv() == [b"from-child"]
        parent.send("bye")
    finally:
        consumer.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 0


def test_ucx_plane_leaves_the_process_environment_alone():
    """ucxx's import writes UCX_* variables that every later UCX context (NIXL's too) would
    read — an RNDV threshold that made NIXL READs ~30x slower. The plane must not leak them."""
    import os
    import subprocess
    import sys

    code = (
        "import os; from ectransport.store import HostRegion; "
        "from ectransport.data.ucx import UcxPlane; "
        "p = UcxPlane(node_id='env', region=HostRegion(4, 64)); p.close(); "
        "print(sorted(k for k in os.environ if k.startswith('UCX_')))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
