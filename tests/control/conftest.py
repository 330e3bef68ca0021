"""Shared helpers for control-plane tests: real sockets on 127.0.0.1, real CURVE keys."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import zmq

from ectransport.control.base import Event


@dataclass(frozen=True)
class KeyPair:
    public: str
    secret: str


def new_keypair() -> KeyPair:
    pub, sec = zmq.curve_keypair()
    return KeyPair(pub.decode("ascii"), sec.decode("ascii"))


@pytest.fixture
def server_keys() -> KeyPair:
    return new_keypair()


@pytest.fixture
def client_keys() -> KeyPair:
    return new_keypair()


def poll_until(
    plane, pred: Callable[[Event], bool], timeout_s: float, sink: list[Event] | None = None
) -> Event | None:
    """Poll ``plane`` until an event matching ``pred`` arrives or ``timeout_s`` passes.

    Every event seen is appended to ``sink``. Returns the matching event or None.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        for ev in plane.poll(min(0.05, left)):
            if sink is not None:
                sink.append(ev)
            if pred(ev):
                return ev


def pump(planes, duration_s: float, sinks) -> None:
    """Poll several planes round-robin for ``duration_s``, collecting events per plane."""
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        for plane, sink in zip(planes, sinks):
            sink.extend(plane.poll(0.01))
