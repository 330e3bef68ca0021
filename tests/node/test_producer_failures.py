"""A producer that stops, dies or restarts (real processes): typed misses within the deadlines,
fail-fast while quarantined, recovery once it is back."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ectransport.node import ConsumerNode, Layout, MissReason, ProducerAddress, Security

from ._producer_proc import make_rows
from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 256
LAYOUT = Layout(hidden=HIDDEN, dtype="bfloat16")


def _spawn(tmp_path: Path, port: int = 0, insecure: bool = True) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "tests.node._producer_proc", "--hidden", str(HIDDEN),
           "--item", "x:50:3", "--port", str(port), "--insecure"]
    err = open(tmp_path / f"producer-{time.monotonic_ns()}.stderr", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=err, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    err.close()
    r, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if r else ""
    if not line:
        proc.kill()
        raise AssertionError("producer child did not start")
    return proc, json.loads(line)


def _freeze(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped: a thread still running
    when the next request goes out could answer it (seen under load: the XferAck arrived, the
    fetch then missed on the read deadline instead of the ack deadline)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            states = [open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                      for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return False
        return all(st in ("T", "t") for st in states)

    assert wait_for(stopped, timeout_s, 0.005), "the producer did not stop"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def consumer():
    node = ConsumerNode(layout=LAYOUT, region_bytes=8 << 20, security=Security(insecure=True),
                        ack_timeout_s=1.0, read_timeout_s=2.0)
    yield node
    node.close()


def _expected() -> np.ndarray:
    return make_rows(50, HIDDEN, 3).reshape(-1).view(np.uint8)


def test_stopped_producer_misses_fast_then_recovers(tmp_path, consumer):
    proc, info = _spawn(tmp_path)
    try:
        addr = ProducerAddress("127.0.0.1", info["port"])
        assert consumer.fetch(addr, "x", timeout_s=10).ok  # warm: connected and welcomed
        _freeze(proc.pid)
        t0 = time.monotonic()
        miss = consumer.fetch(addr, "x", timeout_s=10)
        waited = time.monotonic() - t0
        assert not miss.ok and miss.reason is MissReason.TIMEOUT, miss
        assert waited < 1.0 + 1.0  # the ack deadline (1 s), not the fetch deadline (10 s)
        t0 = time.monotonic()
        fast = consumer.fetch(addr, "x", timeout_s=10)
        assert not fast.ok and fast.reason is MissReason.QUARANTINED, fast
        assert time.monotonic() - t0 < 0.2  # fails fast instead of waiting
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        got = None
        while time.monotonic() < deadline:
            got = consumer.fetch(addr, "x", timeout_s=5)
            if got.ok:
                break
            assert got.reason in (MissReason.QUARANTINED, MissReason.TIMEOUT,
                                  MissReason.PEER_DOWN), got
            time.sleep(0.2)
        assert got is not None and got.ok, got
        assert np.array_equal(got.data, _expected())
    finally:
        _stop(proc)


def test_killed_producer_is_a_typed_miss_and_a_restart_on_the_same_port_serves(tmp_path,
                                                                                  consumer):
    proc, info = _spawn(tmp_path)
    addr = ProducerAddress("127.0.0.1", info["port"])
    try:
        assert consumer.fetch(addr, "x", timeout_s=10).ok
        proc.kill()
        proc.wait(timeout=10)
        t0 = time.monotonic()
        miss = consumer.fetch(addr, "x", timeout_s=10)
        assert not miss.ok and miss.reason in (MissReason.PEER_DOWN, MissReason.TIMEOUT,
                                               MissReason.QUARANTINED), miss
        assert time.monotonic() - t0 < 3.0
        proc, _ = _spawn(tmp_path, port=info["port"])  # a new process: new NIXL agent
        deadline = time.monotonic() + 20
        got = None
        while time.monotonic() < deadline:
            got = consumer.fetch(addr, "x", timeout_s=5)
            if got.ok:
                break
            time.sleep(0.2)
        assert got is not None and got.ok, got
        assert np.array_equal(got.data, _expected())
    finally:
        _stop(proc)


def test_unreachable_producer_is_reported_as_such(consumer):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    t0 = time.monotonic()
    miss = consumer.fetch(ProducerAddress("127.0.0.1", port), "x", timeout_s=10)
    assert not miss.ok and miss.reason is MissReason.PEER_DOWN and "unreachable" in miss.detail
    assert time.monotonic() - t0 < 3.0
