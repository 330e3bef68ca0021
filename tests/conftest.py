"""Helpers and fixtures shared by every test package: CURVE key pairs, waiting on a condition with
a deadline, closing nodes at teardown, polling control planes.

Tests order threads and processes by waiting on what they can observe (a counter, a state, an
event) with :func:`wait_for` and a generous deadline — never by sleeping a guessed interval, and
never by asserting how long something took: under load everything takes longer, and only the
deadline may run out.
"""

from __future__ import annotations

import gc
import selectors
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq

#: how long a test waits for something that normally happens at once (a counter moves, a pin is
#: dropped): generous, because a deadline that runs out is a failure and the machine may be busy
DEADLINE_S = 10.0


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, Z85 text (40 characters each)."""

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


def readable(obj: Any, timeout_s: float) -> bool:
    """Whether ``obj`` (a file object, socket or descriptor) has input within ``timeout_s``.

    Uses ``selectors`` (epoll/poll), not ``select.select``: a long test process holds
    descriptors above FD_SETSIZE (1024), which ``select`` cannot watch."""
    with selectors.DefaultSelector() as sel:
        sel.register(obj, selectors.EVENT_READ)
        return bool(sel.select(max(0.0, timeout_s)))


def wait_for(pred: Callable[[], Any], timeout_s: float = DEADLINE_S,
             interval_s: float = 0.02) -> bool:
    """Poll ``pred`` until it is true or ``timeout_s`` passes; returns its last value as a bool.

    The interval only spaces the polls; nothing is assumed to have happened after it."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return bool(pred())
        time.sleep(interval_s)


def wait_free(node, timeout_s: float = DEADLINE_S) -> bool:
    """Wait until a ConsumerNode's landing region is entirely free again (collecting garbage:
    a dropped ``Fetched`` returns its blocks when it is collected)."""

    def free() -> bool:
        gc.collect()
        return node.store.free_blocks == node.store.num_blocks

    return wait_for(free, timeout_s, 0.05)


@pytest.fixture
def closing() -> Iterator[Callable]:
    """``closing(node)`` registers a node (anything with ``close()``) to be closed at teardown,
    last registered first, even when the test fails; it returns the node."""
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


def poll_until(plane, pred: Callable[[Any], bool], timeout_s: float = DEADLINE_S,
               sink: list | None = None):
    """Poll a control plane (anything with ``poll(timeout_s) -> list[event]``) until an event
    matching ``pred`` arrives or ``timeout_s`` passes.

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


def pytest_configure(config: Any) -> None:
    """Let the test process hold many descriptors: every NIXL agent and UCX worker keeps some, and
    a whole run opens hundreds of them (the soft limit is raised up to the hard one, 65536 at
    most; CI machines start with a high limit anyway)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def sections(settings: Any, node: Any = None, **flat: Any) -> dict[str, Any]:
    """A test's shorthand node arguments as the typed sections a node takes: each flat key goes
    to the section that declares a field of that name — ``settings`` (a ConsumerSettings or
    ProducerSettings: the base), then ``node`` (NodeSettings); ``session_options`` (a dict)
    into ``settings``, ``control_options`` into ``control_settings``, ``plane_options`` (plane
    name → options) into ``plane_settings``; any other key is passed on as it is
    (``observer=``, ``control=``, ...)."""
    import msgspec

    from ectransport.settings_schema import (
        ConsumerSettings,
        ControlClientSettings,
        ControlServerSettings,
        NodeSettings,
        PlanesSettings,
    )

    node = node if node is not None else NodeSettings()
    flat = {**(flat.pop("session_options", None) or {}), **flat}
    if (control := flat.pop("control_options", None)) is not None:
        kind = ControlClientSettings if isinstance(settings, ConsumerSettings) \
            else ControlServerSettings
        flat["control_settings"] = kind(**control)
    if (planes := flat.pop("plane_options", None)) is not None:
        base = PlanesSettings()
        typed = {k: msgspec.structs.replace(getattr(base, k), **v) for k, v in planes.items()
                 if k in ("tcp", "ucx", "nixl")}
        flat["plane_settings"] = PlanesSettings(
            **typed, plugins={k: v for k, v in planes.items() if k not in typed})
    own = {f.name for f in msgspec.structs.fields(settings)}
    mine = {f.name for f in msgspec.structs.fields(node)}
    s = {k: flat.pop(k) for k in list(flat) if k in own}
    n = {k: flat.pop(k) for k in list(flat) if k in mine}
    return {"settings": msgspec.structs.replace(settings, **s),
            "node": msgspec.structs.replace(node, **n), **flat}
