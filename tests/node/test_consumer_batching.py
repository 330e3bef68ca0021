"""The consumer's per-batch costs (8 x 1 MiB in one batch): the READs of an answer are posted back
to back, its control frames leave after its READs and outcomes — every plane answer fed back
iteratively, never by a nested call — and batch after batch from a caller is driven by the
node's I/O thread alone."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from ectransport.control.memory import (
    MemoryControlClient,
    MemoryNetwork,
)
from ectransport.data.base import XferState
from ectransport.errors import DataPlaneError
from ectransport.node import (
    ConsumerDriver,
    ConsumerNode,
    Fetched,
    Layout,
    Miss,
    MissReason,
    ProducerAddress,
    ProducerNode,
    Security,
)
from ectransport.node.driver import Observers, Parts
from ectransport.session import ConsumerConfig, PostRead, Release, Report, Send
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from ectransport.store import BlockStore, HostRegion, Run
from tests.conftest import new_keypair

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
BB = LAYOUT.block_bytes
HOST, PORT = "127.0.0.1", 5611
BATCHES = 60
ADDR = ProducerAddress(HOST, PORT)


class _Plane:
    """A data plane whose READs complete inside ``start`` (as NIXL's cma copy does); a grant
    ``b"bad"`` is refused."""

    def __init__(self, events: list):
        self.events = events

    def start(self, prepared, plane_grant, runs, nbytes, notif):
        if plane_grant == b"bad":
            raise DataPlaneError("refused")
        self.events.append(("read", plane_grant))
        return plane_grant  # the handle

    def check(self, handle) -> XferState:
        return XferState.DONE

    def error_detail(self, handle) -> str:
        return ""

    def release(self, handle) -> None:
        self.events.append(("release", handle))

    def close(self) -> None:
        pass


class _Session:
    """The commands a consumer session returns around a READ: outcome, release, XferDone."""

    conn = "p:1"
    session_id = "s"
    plane = "stub"

    def __init__(self, events: list, broken: str = ""):
        self.events = events
        self.broken = broken

    def on_read_posted(self, key, handle, now):
        self.events.append(("posted", key))
        if key == self.broken:
            raise RuntimeError("a bug")
        return []

    def on_read_state(self, key, state, now, detail=""):
        assert state == "done"
        return [Report(Miss(key, MissReason.INTERNAL, "stub")), Release(key.encode()),
                Send(self.conn, b"done-" + key.encode())]

    def on_read_failed(self, key, detail, now):
        self.events.append(("failed", key, detail))
        return [Report(Miss(key, MissReason.INTERNAL, detail)),
                Send(self.conn, b"not-done-" + key.encode())]


class _Control(MemoryControlClient):
    """Records what is sent."""

    def __init__(self, events: list):
        super().__init__(MemoryNetwork())
        self.events = events

    def send(self, conn: str, data: bytes) -> bool:
        self.events.append(("send", data))
        return True


def _stub_driver(events: list) -> ConsumerDriver:
    region = HostRegion(8, BB)
    planes: Any = {"stub": _Plane(events)}
    return ConsumerDriver(Parts(_Control(events), planes, region, True),
                          BlockStore(region.num_blocks, BB), LAYOUT,
                          ConsumerConfig(node_id="c", compat_hash=LAYOUT.compat_hash),
                          observers=Observers(lambda ev, f: events.append((ev, f["mm_hash"]))))


def _read(key: str, grant: bytes) -> PostRead:
    return PostRead(key, grant, (Run(0, 1),), BB, b"")


def test_a_batch_posts_its_reads_first_and_sends_its_frames_last_in_order():
    """The READs of one command list are posted back to back; then each is handed to the
    session in order (posted, its outcome, release); the frames (the request first) leave
    after all of that, in command order; nothing is held back once the loop is done. A READ
    that cannot be posted fails alone, in its place."""
    events: list[Any] = []
    d = _stub_driver(events)
    s: Any = _Session(events)
    d._run(s, [Send("p:1", b"req"), _read("a", b"a"), _read("x", b"bad"), _read("b", b"b")],
           0.0)
    assert events == [("read", b"a"), ("read", b"b"),
                      ("posted", "a"), ("fetch", "a"), ("release", b"a"),
                      ("failed", "x", "refused"), ("fetch", "x"),
                      ("posted", "b"), ("fetch", "b"), ("release", b"b"),
                      ("send", b"req"), ("send", b"done-a"), ("send", b"not-done-x"),
                      ("send", b"done-b")]
    d._run(s, [Send("p:1", b"next")], 0.0)
    assert events[-1] == ("send", b"next")
    d.shutdown()
    d.parts.close()


def test_reads_not_handed_to_the_session_yet_are_released_if_it_fails():
    """A bug while the session takes up the first READ: the READs posted after it, which the
    session never saw, are released (not leaked), and the error propagates (the driver's step
    logs it)."""
    events: list[Any] = []
    d = _stub_driver(events)
    with pytest.raises(RuntimeError, match="a bug"):
        d._run(_Session(events, broken="a"),
               [_read("a", b"a"), _read("b", b"b"), _read("c", b"c")], 0.0)
    assert events == [("read", b"a"), ("read", b"b"), ("read", b"c"), ("posted", "a"),
                      ("release", b"b"), ("release", b"c")]
    d.shutdown()
    d.parts.close()


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def test_back_to_back_batches_are_driven_by_the_io_thread_alone(closing):
    """fetch_many after fetch_many over real CURVE sockets, each result dropped before the next
    (so its blocks' releases are queued by finalizers while the I/O thread works): every
    outcome is produced on the I/O thread, and every entry lands exactly."""
    pk, ck = new_keypair(), new_keypair()
    p = closing(ProducerNode(
        layout=LAYOUT, security=Security(public_key=pk.public, secret_key=pk.secret,
                                         allow=lambda key: key == ck.public),
        settings=ProducerSettings(region_bytes=1 << 20), node=NodeSettings(planes=("nixl",)),
    ).start())
    addr = ProducerAddress("127.0.0.1", p.port, pk.public)
    keys = [f"k{i}" for i in range(4)]
    rows = {k: _rows(i, 4) for i, k in enumerate(keys)}
    for k in keys:
        assert p.put(k, rows[k])
    drivers: list[str] = []
    c = closing(ConsumerNode(
        layout=LAYOUT, security=Security(public_key=ck.public, secret_key=ck.secret),
        observer=lambda ev, f: drivers.append(threading.current_thread().name)
        if ev == "fetch" else None,
        settings=ConsumerSettings(region_bytes=64 * BB, inline_max_bytes=0),
        node=NodeSettings(planes=("nixl",), node_id="batches")))
    c.connect(addr, timeout_s=10.0)
    for _ in range(BATCHES):  # 64 blocks: 60 batches of 16 only fit if every release happens
        outs = c.fetch_many(addr, keys, timeout_s=10.0)
        for k, out in zip(keys, outs, strict=True):
            assert isinstance(out, Fetched), out
            assert np.array_equal(out.data, rows[k].reshape(-1))
        del outs, out
    assert drivers == ["ect-batches"] * (BATCHES * len(keys))
