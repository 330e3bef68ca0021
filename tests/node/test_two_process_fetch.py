"""Producer and consumer in two OS processes: CURVE + allow-list on the control plane, NIXL
one-sided READs on the data plane, bytes compared exactly with the producer's deterministic data.

The producer is ``tests/node/_producer_proc.py`` run with ``subprocess``; its key pair and the
consumer's allow-list entry are real zcert files (``generate_keypair`` / ``allow_key``).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ectransport.control.keys import allow_key, generate_keypair  # noqa: E402
from ectransport.node import (  # noqa: E402
    ConsumerNode,
    Fetched,
    Layout,
    Miss,
    MissReason,
    ProducerAddress,
    Security,
)
from ectransport.settings_schema import ConsumerSettings, NodeSettings
from tests.conftest import readable, wait_for, wait_free  # noqa: E402
from tests.node._producer_proc import make_rows, make_tensor  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 3584
LAYOUT = Layout(hidden=HIDDEN, dtype="bfloat16")
ROW_BYTES = HIDDEN * 2
#: name -> (rows, seed). 1228 rows x 3584 bf16 = 8.8 MB, one Qwen2-VL image.
ITEMS = {"one-row": (1, 11), "hundred-rows": (100, 12), "qwen2vl-image": (1228, 13)}
START_TIMEOUT_S = 60.0
CONSUMER_REGION = 24 << 20  # 3428 rows: room for all three items at once


class ProducerProc:
    """Handle on the child producer: its address and a stats() query over its stdin/stdout."""

    def __init__(self, proc: subprocess.Popen, stderr_path: Path, info: dict):
        self.proc = proc
        self.stderr_path = stderr_path
        self.port = info["port"]
        self.public_key = info["public_key"]

    def address(self) -> ProducerAddress:
        return ProducerAddress("127.0.0.1", self.port, self.public_key)

    def stats(self, timeout_s: float = 5.0) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(_readline(self.proc, timeout_s, self.stderr_path))

    def wait_unpinned(self, timeout_s: float = 5.0) -> dict:
        """Poll the child until nothing is pinned; returns the last stats."""
        last: dict = {}

        def unpinned() -> bool:
            nonlocal last
            last = self.stats()
            return last["pinned_bytes"] == 0 and last["active_grants"] == 0

        wait_for(unpinned, timeout_s, 0.05)
        return last


def _readline(proc: subprocess.Popen, timeout_s: float, stderr_path: Path) -> str:
    r = readable(proc.stdout, timeout_s)
    line = proc.stdout.readline() if r else ""
    if not line:
        err = stderr_path.read_text()[-3000:] if stderr_path.exists() else ""
        raise AssertionError(f"producer process silent for {timeout_s}s "
                             f"(rc={proc.poll()}); stderr:\n{err}")
    return line


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    generate_keypair(d / "keys", "producer")
    generate_keypair(d / "keys", "consumer")
    generate_keypair(d / "keys", "stranger")
    allow_key(d / "allow", d / "keys" / "consumer.key")
    return d


@pytest.fixture(scope="module")
def producer(keys) -> ProducerProc:
    cmd = [sys.executable, "-m", "tests.node._producer_proc", "--hidden", str(HIDDEN),
           "--key", str(keys / "keys" / "producer.key_secret"),
           "--allow-dir", str(keys / "allow")]
    for name, (rows, seed) in ITEMS.items():
        cmd += ["--item", f"{name}:{rows}:{seed}"]
    stderr_path = keys / "producer.stderr"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        info = json.loads(_readline(proc, START_TIMEOUT_S, stderr_path))
        assert info.get("ready") is True, info
        yield ProducerProc(proc, stderr_path, info)
    finally:
        try:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def consumer(keys):
    node = ConsumerNode(
        layout=LAYOUT,
        security=Security.from_files(str(keys / "keys" / "consumer.key_secret")),
        settings=ConsumerSettings(region_bytes=CONSUMER_REGION),
        node=NodeSettings(node_id=f"consumer-test-{os.getpid()}"),
    )
    try:
        yield node
    finally:
        node.close()


def _expected_bytes(name: str) -> np.ndarray:
    rows, seed = ITEMS[name]
    return make_rows(rows, HIDDEN, seed).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("name", list(ITEMS))
def test_fetch_matches_producer_bytes(producer, consumer, name):
    rows, seed = ITEMS[name]
    before = producer.stats()
    assert before["pins"][name] == 0

    out = consumer.fetch(producer.address(), name, timeout_s=15.0)
    assert isinstance(out, Fetched), out
    assert out.ok and out.plane == "nixl"
    assert out.nbytes == rows * ROW_BYTES
    assert np.array_equal(out.data, _expected_bytes(name))

    t = out.tensor()
    assert t.dtype == torch.bfloat16
    assert tuple(t.shape) == (rows, HIDDEN)
    assert torch.equal(t, make_tensor(rows, HIDDEN, seed))
    # "posted": the READ was posted (none for an entry answered inline, ECTP v2)
    assert set(out.timings) >= {"req", "ack", "landed", "total"}

    # The landing blocks are held while the Fetched (or anything over its data) lives.
    num = consumer.store.num_blocks
    assert consumer.store.free_blocks == num - rows
    del out
    gc.collect()
    # a release queued by a wrongly dropped buffer is handled by the next turn of the loop: make
    # one (a whole fetch of another item) before looking
    other = "one-row" if name != "one-row" else "hundred-rows"
    probe = consumer.fetch(producer.address(), other, timeout_s=15.0)
    assert isinstance(probe, Fetched), probe
    del probe
    assert wait_for(lambda: (gc.collect(), consumer.store.free_blocks)[1] == num - rows)
    assert consumer.store.free_blocks == num - rows, "tensor() view dropped its blocks early"
    assert torch.equal(t[-1], make_tensor(rows, HIDDEN, seed)[-1])
    del t
    assert wait_free(consumer), (consumer.store.free_blocks, num)

    after = producer.wait_unpinned()
    assert after["pinned_bytes"] == 0 and after["active_grants"] == 0, after
    assert after["pins"][name] == 0, after
    # the item and the probe, each by a grant or (ECTP v2, small entries) inline
    assert after["grants"] + after.get("inline", 0) == \
        before["grants"] + before.get("inline", 0) + 2
    assert after["completed"] - before["completed"] == after["grants"] - before["grants"]
    assert after["expired"] == before["expired"]


def test_concurrent_fetches_of_all_sizes(producer, consumer):
    before = producer.stats()
    futs = {name: consumer.submit(producer.address(), name, timeout_s=15.0) for name in ITEMS}
    outs = {name: f.result(timeout=25.0) for name, f in futs.items()}
    del futs  # a Future keeps its result (and so the landing blocks) alive
    for name, out in outs.items():
        assert isinstance(out, Fetched), (name, out)
        assert np.array_equal(out.data, _expected_bytes(name)), name
    total_rows = sum(r for r, _ in ITEMS.values())
    assert consumer.store.free_blocks == consumer.store.num_blocks - total_rows
    # dropping one result frees exactly its blocks
    del outs["hundred-rows"], out
    gc.collect()
    assert wait_for(lambda: consumer.store.free_blocks
                    == consumer.store.num_blocks - total_rows + 100, 5.0)
    outs.clear()
    assert wait_free(consumer)
    after = producer.wait_unpinned()
    # each by a grant or (ECTP v2, small entries) inline
    assert after["grants"] + after.get("inline", 0) == \
        before["grants"] + before.get("inline", 0) + len(ITEMS)
    assert after["pinned_bytes"] == 0 and set(after["pins"].values()) == {0}, after


def test_fetched_outlives_closed_consumer(producer, keys):
    """A held Fetched stays readable after its ConsumerNode is closed and dropped."""
    node = ConsumerNode(
        layout=LAYOUT,
        security=Security.from_files(str(keys / "keys" / "consumer.key_secret")),
        settings=ConsumerSettings(region_bytes=CONSUMER_REGION),
    )
    try:
        out = node.fetch(producer.address(), "qwen2vl-image", timeout_s=15.0)
    finally:
        node.close()
    assert isinstance(out, Fetched), out
    # closing right after the fetch still gave the grant back (its completion left before the
    # control socket closed): else it stays pinned until the lease (30 s) ends
    assert producer.wait_unpinned()["pinned_bytes"] == 0
    del node
    gc.collect()
    junk = [np.full(9 << 20, 0xAB, dtype=np.uint8) for _ in range(4)]  # reuse freed memory
    assert np.array_equal(out.data, _expected_bytes("qwen2vl-image"))
    del junk


def test_stranger_key_is_refused_by_the_child(producer, keys):
    """A consumer whose key is not in the child's allow-dir gets Miss(AUTH); no grant is made."""
    before = producer.wait_unpinned()
    node = ConsumerNode(
        layout=LAYOUT,
        security=Security.from_files(str(keys / "keys" / "stranger.key_secret")),
        settings=ConsumerSettings(region_bytes=1 << 20),
    )
    try:
        out = node.fetch(producer.address(), "one-row", timeout_s=10.0)
    finally:
        node.close()
    # refused by the handshake (AUTH), not left to the fetch deadline (that would be TIMEOUT)
    assert isinstance(out, Miss) and out.reason is MissReason.AUTH, out
    after = producer.stats()
    assert after["grants"] == before["grants"] and after["pinned_bytes"] == 0


def test_scattered_landing_blocks_are_read_exactly(producer, keys):
    """A fragmented consumer region lands one entry in two runs (1 + 1227 rows): NIXL reads both
    and the result (one copy, contiguous) still matches exactly; the blocks return at once."""
    node = ConsumerNode(
        layout=LAYOUT,
        security=Security.from_files(str(keys / "keys" / "consumer.key_secret")),
        settings=ConsumerSettings(region_bytes=1328 * ROW_BYTES),
    )
    try:
        first = node.fetch(producer.address(), "one-row", timeout_s=15.0)
        second = node.fetch(producer.address(), "hundred-rows", timeout_s=15.0)
        assert isinstance(first, Fetched) and isinstance(second, Fetched), (first, second)
        del first  # frees block 0: the free space is now [0, 1) + [101, 1328)
        assert wait_for(lambda: (gc.collect(), node.store.free_blocks)[1] == 1328 - 100, 5.0)
        big = node.fetch(producer.address(), "qwen2vl-image", timeout_s=15.0)
        assert isinstance(big, Fetched), big
        assert big.data.flags["C_CONTIGUOUS"] and big.nbytes == 1228 * ROW_BYTES
        assert np.array_equal(big.data, _expected_bytes("qwen2vl-image"))
        # scattered landings are copied out: their blocks are free again right away
        assert wait_for(lambda: node.store.free_blocks == 1328 - 100, 2.0), node.store.free_blocks
        assert np.array_equal(second.data, _expected_bytes("hundred-rows"))
        del second
        assert wait_free(node)
    finally:
        node.close()
    assert producer.wait_unpinned()["pinned_bytes"] == 0
