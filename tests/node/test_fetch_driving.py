"""Who drives a fetch: a lone ``ConsumerNode.fetch`` runs the loop on the calling thread; anything
else goes through the node's I/O thread. Real producer process, CURVE, NIXL (as in
``test_two_process_fetch``); these tests fail if the caller-driven path is not taken, if it blocks
other callers, or if ``close()`` cannot stop it.
"""

from __future__ import annotations

import gc
import os
import random
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")

from ectransport.node import (  # noqa: E402
    ConsumerNode,
    Fetched,
    Miss,
    MissReason,
    ProducerAddress,
    Security,
)
from tests.node.conftest import wait_free  # noqa: E402
from tests.node.test_two_process_fetch import (  # noqa: E402, F401 - fixtures
    CONSUMER_REGION,
    ITEMS,
    LAYOUT,
    _expected_bytes,
    keys,
    producer,
)


def _consumer(key_dir, region_bytes: int = CONSUMER_REGION, **kw) -> ConsumerNode:
    return ConsumerNode(layout=LAYOUT, region_bytes=region_bytes,
                        security=Security.from_files(str(key_dir / "keys" / "consumer.key_secret")),
                        node_id=f"consumer-drive-{os.getpid()}", **kw)


def test_lone_fetch_runs_on_the_calling_thread_and_submit_on_the_io_thread(producer, keys):  # noqa: F811 - fixtures
    seen: list[str] = []
    node = _consumer(keys, observer=lambda ev, f: seen.append(threading.current_thread().name)
                     if ev == "fetch" else None)
    try:
        addr = producer.address()
        for _ in range(5):
            out = node.fetch(addr, "hundred-rows", timeout_s=15.0)
            assert isinstance(out, Fetched), out
            assert np.array_equal(out.data, _expected_bytes("hundred-rows"))
            del out
        # no hand-off to the I/O thread (a fetch may still fall back to it when it finds that
        # thread in a step: under heavy load the 5 ms wait for the lock can run out)
        me = threading.current_thread().name
        assert len(seen) == 5 and seen.count(me) >= 3, seen

        fut = node.submit(addr, "one-row", timeout_s=15.0)
        assert fut.result(timeout=20.0).ok
        assert seen[-1] == node._thread.name, seen  # submit() is the I/O thread's work
        del fut
        assert wait_free(node)
    finally:
        node.close()


def test_fetches_from_many_threads_with_submits_all_land_exactly(producer, keys):  # noqa: F811 - fixtures
    node = _consumer(keys, region_bytes=4 * CONSUMER_REGION)  # every thread's entry at once
    addr = producer.address()
    names = ["one-row", "hundred-rows", "qwen2vl-image"]
    errors: list[str] = []
    counts = {"fetch": 0, "submit": 0}
    lock = threading.Lock()

    def fetcher(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(6):
            name = rng.choice(names)
            out = node.fetch(addr, name, timeout_s=20.0)
            if not isinstance(out, Fetched) or not np.array_equal(out.data,
                                                                  _expected_bytes(name)):
                errors.append(f"fetch {name}: {out!r}")
            del out
            with lock:
                counts["fetch"] += 1

    def submitter() -> None:
        for k in range(6):
            name = names[k % 2]  # the small ones: the region holds every item at once
            fut = node.submit(addr, name, timeout_s=20.0)
            out = fut.result(timeout=30.0)
            if not isinstance(out, Fetched) or not np.array_equal(out.data,
                                                                  _expected_bytes(name)):
                errors.append(f"submit {name}: {out!r}")
            del out, fut
            with lock:
                counts["submit"] += 1

    threads = [threading.Thread(target=fetcher, args=(s,)) for s in range(3)]
    threads.append(threading.Thread(target=submitter))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120.0)
        assert not any(t.is_alive() for t in threads), "a fetching thread hung"
        assert errors == [], errors
        assert counts == {"fetch": 18, "submit": 6}
        gc.collect()
        assert wait_free(node), (node.store.free_blocks, node.store.num_blocks)
        assert node.stats()["in_flight"] == 0
        after = producer.wait_unpinned()
        assert after["pinned_bytes"] == 0 and after["active_grants"] == 0, after
    finally:
        node.close()


@pytest.fixture
def silent_listener():
    """A TCP port that accepts connections but never speaks ZMTP: a producer that hangs."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_fetch_is_not_held_up_by_another_fetch_waiting_on_a_dead_producer(producer, keys,  # noqa: F811 - fixtures
                                                                          silent_listener):
    node = _consumer(keys)
    try:
        dead = ProducerAddress("127.0.0.1", silent_listener, producer.public_key)
        stuck = node.submit(dead, "hundred-rows", timeout_s=4.0)
        time.sleep(0.2)  # the I/O thread now holds the loop, waiting on the dead producer
        t0 = time.monotonic()
        out = node.fetch(producer.address(), "one-row", timeout_s=10.0)
        took = time.monotonic() - t0
        assert isinstance(out, Fetched), out
        assert took < 2.0, f"fetch waited {took:.2f} s behind the stuck one"
        miss = stuck.result(timeout=10.0)
        assert isinstance(miss, Miss) and miss.reason is not MissReason.INTERNAL, miss
        del out
    finally:
        node.close()


def test_close_stops_a_fetch_driven_by_its_caller(keys, silent_listener, producer):  # noqa: F811 - fixtures
    node = _consumer(keys)
    dead = ProducerAddress("127.0.0.1", silent_listener, producer.public_key)
    box: dict = {}

    def call() -> None:
        t0 = time.monotonic()
        box["out"] = node.fetch(dead, "hundred-rows", timeout_s=30.0)
        box["took"] = time.monotonic() - t0

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)  # the caller is driving its fetch (no answer will ever come)
    t0 = time.monotonic()
    node.close()
    t.join(timeout=10.0)
    assert not t.is_alive(), "fetch() did not return after close()"
    assert time.monotonic() - t0 < 5.0
    out = box["out"]
    assert isinstance(out, Miss) and out.reason is MissReason.INTERNAL, out
    assert box["took"] < 10.0


def test_fetch_and_submit_after_close_miss_at_once(keys, producer):  # noqa: F811 - fixtures
    node = _consumer(keys)
    node.close()
    t0 = time.monotonic()
    out = node.fetch(producer.address(), "one-row", timeout_s=20.0)
    fut = node.submit(producer.address(), "one-row", timeout_s=20.0)
    assert isinstance(out, Miss) and out.reason is MissReason.INTERNAL, out
    assert fut.done() and fut.result().reason is MissReason.INTERNAL
    assert time.monotonic() - t0 < 1.0


def test_calls_racing_close_end_promptly_and_later_calls_fail_at_once(producer, keys):  # noqa: F811 - fixtures
    from ectransport.errors import ECTransportError

    node = _consumer(keys)
    addr = producer.address()
    took: list[float] = []
    stop = threading.Event()

    def worker(i: int) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            if i % 2:
                out = node.fetch(addr, "one-row", timeout_s=20.0)
            else:
                out = node.submit(addr, "one-row", timeout_s=20.0).result(timeout=30.0)
            took.append(time.monotonic() - t0)
            del out

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    node.close()
    stop.set()
    for t in threads:
        t.join(timeout=15.0)
    assert not any(t.is_alive() for t in threads), "a call hung across close()"
    assert took and max(took) < 5.0, max(took)
    t0 = time.monotonic()
    with pytest.raises(ECTransportError, match="closed"):
        node.connect(addr, timeout_s=5.0)
    held = node.submit_held(addr, "one-row", timeout_s=5.0).result(timeout=1.0)
    assert isinstance(held, Miss) and held.reason is MissReason.INTERNAL
    assert time.monotonic() - t0 < 1.0
