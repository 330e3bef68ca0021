"""The shm plane across processes: round trip, SIGKILLed peers, stale-segment sweep, same-host."""

from __future__ import annotations

import os

import msgspec
import pytest
from ectransport.plugin import DataPlaneError, Run, XferState
from ectransport.store import HostRegion
from ectransport.testing.conformance import assert_same, pattern, read_runs, wait_state
from shm_child import CHILD_IDENTITY

from ectransport_shm import ShmGrant, ShmPlane
from ectransport_shm.segments import DEFAULT_SEGMENT_DIR, PREFIX, sweep_stale_segments

BLOCK_BYTES = 64 * 1024
DEADLINE_S = 10.0


@pytest.fixture
def consumer():
    region = HostRegion(1100, BLOCK_BYTES)
    region.buf[:] = 0xEE
    plane = ShmPlane(node_id="test-consumer", region=region, io_timeout_s=5.0)
    yield plane, region
    plane.close()
    region.close()


def _bind(plane: ShmPlane, endpoint: bytes, identity: str = CHILD_IDENTITY):
    return plane.bind_peer(endpoint, peer="producer:1", host="127.0.0.1", identity=identity)


def _start_child(spawn, *args: str):
    """A child producer: (child, grant, binding of the consumer fixture's plane to it)."""
    child = spawn("producer", *args)
    grant, endpoint = child.readline().split()
    return child, bytes.fromhex(grant), bytes.fromhex(endpoint)


def _fetch(plane: ShmPlane, binding, grant: bytes, runs: list[Run], nbytes: int) -> XferState:
    handle = plane.start(binding, grant, runs, nbytes, b"done-1")
    try:
        return wait_state(plane, handle, DEADLINE_S)
    finally:
        plane.release(handle)


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(DEFAULT_SEGMENT_DIR)
            if n.startswith(PREFIX) and f".{pid}." in n]


def test_cross_process_round_trip(spawn, consumer):
    plane, region = consumer
    nblocks = 141  # 8.8 MiB: one Qwen2-VL image embedding
    child, grant, endpoint = _start_child(spawn, "5", str(nblocks))
    binding = _bind(plane, endpoint)
    runs = [Run(500, 41), Run(10, 100)]  # scattered on the consumer side
    for _ in range(3):  # the second and third reuse the pooled connection and segment
        region.buf[:] = 0xEE
        assert _fetch(plane, binding, grant, runs, nblocks * BLOCK_BYTES) is XferState.DONE
        assert_same(read_runs(region, runs, nblocks * BLOCK_BYTES),
                    pattern(nblocks * BLOCK_BYTES, 5))
    child.send("notifs")
    assert child.readline().split(",") == [b"done-1".hex()] * 3
    assert _segments_of(child.proc.pid) == []  # unlinked as soon as created


def test_producer_sigkilled_mid_transfer(spawn, consumer):
    """The consumer's handle leaves PROC quickly and nothing of the dead producer stays."""
    plane, region = consumer
    child, grant, endpoint = _start_child(spawn, "9", "1024", "--small-ring")
    handle = plane.start(_bind(plane, endpoint), grant, [Run(0, 1024)], 1024 * BLOCK_BYTES, b"x")
    child.sigkill()
    state = wait_state(plane, handle, DEADLINE_S)  # bounded: PROC here would be a hang
    plane.release(handle)
    assert state in (XferState.DONE, XferState.ERR)
    sweep_stale_segments()
    assert _segments_of(child.proc.pid) == []
    # the consumer still works with a new producer
    _, grant2, endpoint2 = _start_child(spawn, "10", "4")
    state = _fetch(plane, _bind(plane, endpoint2), grant2, [Run(7, 4)], 4 * BLOCK_BYTES)
    assert state is XferState.DONE
    assert_same(read_runs(region, [Run(7, 4)], 4 * BLOCK_BYTES), pattern(4 * BLOCK_BYTES, 10))


def test_startup_sweeps_segment_of_sigkilled_process(spawn):
    """A process killed between creating and unlinking a segment leaves a file; the next plane
    start-up removes it."""
    child = spawn("hold-segment")
    path = child.readline()
    assert os.path.exists(path)
    assert path not in sweep_stale_segments()  # owner alive: kept
    child.sigkill()
    assert os.path.exists(path)
    region = HostRegion(4, BLOCK_BYTES)
    plane = ShmPlane(node_id="sweeper", region=region)
    try:
        assert not os.path.exists(path), "start-up did not sweep the dead owner's segment"
    finally:
        plane.close()
        region.close()


def test_close_sweeps_segment_of_sigkilled_process(spawn):
    region = HostRegion(4, BLOCK_BYTES)
    plane = ShmPlane(node_id="sweeper", region=region)
    try:
        child = spawn("hold-segment")
        path = child.readline()
        child.sigkill()
        assert os.path.exists(path)
    finally:
        plane.close()
        region.close()
    assert not os.path.exists(path), "close did not sweep the dead owner's segment"


def test_grant_from_another_host_fails_fast(consumer):
    plane, _ = consumer
    region = HostRegion(4, BLOCK_BYTES)
    producer = ShmPlane(node_id="p", region=region)
    binding = _bind(plane, producer.endpoint(), identity="")
    try:
        grant = msgspec.msgpack.decode(producer.describe([Run(0, 1)], 10), type=ShmGrant)
        foreign = msgspec.msgpack.encode(msgspec.structs.replace(
            grant, boot_id="00000000-0000-0000-0000-000000000000", host="elsewhere"))
        with pytest.raises(DataPlaneError, match="same-host only"):  # at once, before any I/O
            plane.start(binding, foreign, [Run(0, 1)], 10, b"")
        # a producer that is gone (same host, socket closed): ERR within the deadline
        good = producer.describe([Run(0, 1)], 10)
        producer.close()
        assert _fetch(plane, binding, good, [Run(0, 1)], 10) is XferState.ERR
    finally:
        producer.close()
        region.close()
