"""Who drives a fetch: the node's I/O thread alone, whoever calls (the ownership rule of
``node/io_loop.py``). Real producer process, CURVE, NIXL (as in ``test_two_process_fetch``);
these tests fail if a caller drives the node itself, if one fetch waiting on a dead producer
holds up another, or if ``close()`` cannot stop a fetch a caller waits for.
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
from ectransport.settings_schema import ConsumerSettings, NodeSettings
from tests.conftest import sections, wait_for, wait_free  # noqa: E402
from tests.node.test_two_process_fetch import (  # noqa: E402, F401 - fixtures
    CONSUMER_REGION,
    ITEMS,
    LAYOUT,
    _expected_bytes,
    keys,
    producer,
)

#: deadline of a fetch stuck on a producer that never answers: the other fetch lands long before
STUCK_S = 8.0


def _consumer(key_dir, region_bytes: int = CONSUMER_REGION, **kw) -> ConsumerNode:
    return ConsumerNode(
        layout=LAYOUT,
        security=Security.from_files(str(key_dir / "keys" / "consumer.key_secret")),
        **sections(
            ConsumerSettings(region_bytes=region_bytes),
            NodeSettings(node_id=f"consumer-drive-{os.getpid()}"),
            **kw,
        ),
    )


def test_fetch_and_submit_are_both_driven_by_the_io_thread(producer, keys):  # noqa: F811 - fixtures
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
        fut = node.submit(addr, "one-row", timeout_s=15.0)
        assert fut.result(timeout=20.0).ok
        del fut
        # the ownership rule: the caller hands work over and waits; only the I/O thread drives
        assert seen == [f"ect-consumer-drive-{os.getpid()}"] * 6, seen
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
        stuck = node.submit(dead, "hundred-rows", timeout_s=STUCK_S)
        # the I/O thread has taken the stuck fetch: it now drives the loop, waiting on the dead
        # producer
        assert wait_for(lambda: node.stats()["in_flight"] == 1), node.stats()
        out = node.fetch(producer.address(), "one-row", timeout_s=STUCK_S)
        assert isinstance(out, Fetched), out
        # landed while the stuck fetch still waits for its deadline: not queued behind it
        assert not stuck.done(), "the fetch waited until the stuck one ended"
        miss = stuck.result(timeout=STUCK_S + 10.0)
        assert isinstance(miss, Miss) and miss.reason is not MissReason.INTERNAL, miss
        del out
    finally:
        node.close()


def test_close_ends_a_fetch_its_caller_waits_for(keys, silent_listener, producer):  # noqa: F811 - fixtures
    node = _consumer(keys)
    dead = ProducerAddress("127.0.0.1", silent_listener, producer.public_key)
    box: dict = {}

    def call() -> None:
        box["out"] = node.fetch(dead, "hundred-rows", timeout_s=60.0)

    t = threading.Thread(target=call)
    t.start()
    # the caller waits for its fetch (no answer will ever come)
    assert wait_for(lambda: node.stats()["in_flight"] == 1), node.stats()
    node.close()
    t.join(timeout=30.0)  # well before the fetch's own 60 s deadline
    assert not t.is_alive(), "fetch() did not return after close()"
    out = box["out"]
    # ended by close() ("consumer closed"), not by its deadline (that would be TIMEOUT)
    assert isinstance(out, Miss) and out.reason is MissReason.INTERNAL, out


def test_fetch_and_submit_after_close_miss_at_once(keys, producer):  # noqa: F811 - fixtures
    node = _consumer(keys)
    node.close()
    out = node.fetch(producer.address(), "one-row", timeout_s=20.0)
    fut = node.submit(producer.address(), "one-row", timeout_s=20.0)
    assert isinstance(out, Miss) and out.reason is MissReason.INTERNAL, out
    assert "closed" in out.detail, out  # refused, not left to its 20 s deadline
    assert fut.done() and fut.result().reason is MissReason.INTERNAL  # failed inside submit()


def test_calls_racing_close_end_promptly_and_later_calls_fail_at_once(producer, keys):  # noqa: F811 - fixtures
    from ectransport.errors import ECTransportError

    node = _consumer(keys)
    addr = producer.address()
    outcomes: list[str] = []
    stop = threading.Event()

    def worker(i: int) -> None:
        while not stop.is_set():
            if i % 2:
                out = node.fetch(addr, "one-row", timeout_s=60.0)
            else:
                out = node.submit(addr, "one-row", timeout_s=60.0).result(timeout=90.0)
            outcomes.append("ok" if out.ok else out.reason.name)
            del out

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert wait_for(lambda: len(outcomes) >= 4), outcomes  # the calls are under way
    node.close()
    stop.set()
    # every call ends well before its own 60 s deadline: close() ends them, none waits it out
    deadline = time.monotonic() + 30.0
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a call hung across close()"
    assert "TIMEOUT" not in outcomes, outcomes  # none was left to its deadline
    with pytest.raises(ECTransportError, match="closed"):
        node.connect(addr, timeout_s=5.0)
    fut = node.submit_held(addr, "one-row", timeout_s=5.0)
    assert fut.done(), "submit_held() after close() was queued instead of failing at once"
    held = fut.result()
    assert isinstance(held, Miss) and held.reason is MissReason.INTERNAL
