"""Shared helpers for node tests: real ZMQ sockets on 127.0.0.1, real CURVE keys, real NIXL."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import zmq

pytest.importorskip("nixl")


@dataclass(frozen=True)
class KeyPair:
    public: str
    secret: str


def new_keypair() -> KeyPair:
    pub, sec = zmq.curve_keypair()
    return KeyPair(pub.decode("ascii"), sec.decode("ascii"))


def wait_for(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll ``pred`` until it is true or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return bool(pred())
        time.sleep(interval_s)


def wait_free(node, timeout_s: float = 5.0) -> bool:
    """Wait until a ConsumerNode's landing region is entirely free again (collecting garbage)."""

    def free() -> bool:
        gc.collect()
        return node.store.free_blocks == node.store.num_blocks

    return wait_for(free, timeout_s, 0.05)


@pytest.fixture
def closing() -> Iterator[Callable]:
    """``closing(node)`` registers a node (anything with ``close()``) to be closed at teardown,
    last registered first, even when the test fails."""
    nodes: list = []

    def add(node):
        nodes.append(node)
        return node

    yield add
    for n in reversed(nodes):
        try:
            n.close()
        except Exception:  # noqa: BLE001 - teardown must close the rest
            pass
