"""A producer that stops, dies or restarts (real processes): typed misses within the deadlines,
fail-fast while quarantined, recovery once it is back.

Which deadline ended a fetch is told by its outcome, not by a stopwatch: a miss the producer is
blamed for (no ack by the ack deadline, connection lost) quarantines it (the consumer reports
``peer_quarantined``; the next fetch is ``QUARANTINED`` at once), while a fetch that merely ran
out of its own deadline blames nobody.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ectransport.node import ConsumerNode, Layout, MissReason, ProducerAddress, Security
from ectransport.settings_schema import ConsumerSettings
from tests.conftest import readable, sections, wait_for

from ._producer_proc import make_rows

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
    r = readable(proc.stdout, 60)
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


def _consumer(**kw) -> ConsumerNode:
    return ConsumerNode(
        layout=LAYOUT,
        security=Security(insecure=True),
        **sections(
            ConsumerSettings(region_bytes=8 << 20, ack_timeout_s=1.0, read_timeout_s=2.0), **kw
        ),
    )


@pytest.fixture
def consumer():
    node = _consumer()
    yield node
    node.close()


def _blames(node: ConsumerNode) -> list[str]:
    """The reasons of every quarantine ``node`` puts a producer in from now on."""
    why: list[str] = []
    node.add_observer(lambda ev, f: why.append(f.get("why", "")) if ev == "peer_quarantined"
                      else None)
    return why


def _expected() -> np.ndarray:
    return make_rows(50, HIDDEN, 3).reshape(-1).view(np.uint8)


def _served_again(consumer, addr, timeout_s: float, allowed: tuple[MissReason, ...] = ()):
    """Fetch until one lands (the producer is back and its quarantine over); every miss meanwhile
    must be one of ``allowed`` (any, if empty). Returns the Fetched."""
    outs: list = []

    def served() -> bool:
        outs.append(consumer.fetch(addr, "x", timeout_s=5))
        return outs[-1].ok

    assert wait_for(served, timeout_s, 0.2), outs[-3:]
    if allowed:
        assert all(o.reason in allowed for o in outs[:-1]), outs
    return outs[-1]


@pytest.mark.parametrize("versions", [(1, 2), (1,)], ids=["v2", "v1"])
def test_stopped_producer_misses_fast_then_recovers(tmp_path, closing, versions):
    # a first quarantine long enough that the fetch right after the miss still finds it on a
    # busy machine. The ack deadline (1 s) detects the stopped producer, well before the control
    # heartbeat (PEER_DOWN) or the fetch deadline: on v1 the XferReq gets no XferAck; on v2
    # (the default) the ReqBatch item is neither answered nor named in a Parked frame — a
    # producer that parks an item says so at once, so the consumer's long answer deadline
    # (wait + ack timeout) applies only to items a live producer parked (ECTP v2 §6).
    consumer = closing(_consumer(session_options={"peer_backoff_s": 5.0}, versions=versions))
    blamed = _blames(consumer)
    proc, info = _spawn(tmp_path)
    try:
        addr = ProducerAddress("127.0.0.1", info["port"])
        assert consumer.fetch(addr, "x", timeout_s=10).ok  # warm: connected and welcomed
        session = consumer.session(addr)
        assert session is not None and session.version == max(versions)
        _freeze(proc.pid)
        miss = consumer.fetch(addr, "x", timeout_s=60)
        assert not miss.ok and miss.reason is MissReason.TIMEOUT, miss
        # the ack deadline (1 s) ended it, not the fetch deadline (60 s): the producer is blamed
        assert blamed and "ack" in blamed[0], blamed
        fast = consumer.fetch(addr, "x", timeout_s=60)
        assert not fast.ok and fast.reason is MissReason.QUARANTINED, fast  # fails at once
        os.kill(proc.pid, signal.SIGCONT)
        got = _served_again(consumer, addr, 60.0, (MissReason.QUARANTINED, MissReason.TIMEOUT,
                                                   MissReason.PEER_DOWN))
        assert np.array_equal(got.data, _expected())
    finally:
        _stop(proc)


def test_killed_producer_is_a_typed_miss_and_a_restart_on_the_same_port_serves(tmp_path,
                                                                                  consumer):
    proc, info = _spawn(tmp_path)
    addr = ProducerAddress("127.0.0.1", info["port"])
    blamed = _blames(consumer)
    try:
        assert consumer.fetch(addr, "x", timeout_s=10).ok
        proc.kill()
        proc.wait(timeout=10)
        miss = consumer.fetch(addr, "x", timeout_s=60)
        assert not miss.ok and miss.reason in (MissReason.PEER_DOWN, MissReason.TIMEOUT,
                                               MissReason.QUARANTINED), miss
        # ended by the connection loss or the ack deadline (both blame the producer; QUARANTINED:
        # it was blamed already), not by the 60 s fetch deadline (that blames nobody)
        assert blamed, miss
        proc, _ = _spawn(tmp_path, port=info["port"])  # a new process: new NIXL agent
        got = _served_again(consumer, addr, 60.0)
        assert np.array_equal(got.data, _expected())
    finally:
        _stop(proc)


def test_unreachable_producer_is_reported_as_such(consumer):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    miss = consumer.fetch(ProducerAddress("127.0.0.1", port), "x", timeout_s=60)
    # reported as unreachable (connection refused), not left to the 60 s fetch deadline
    assert not miss.ok and miss.reason is MissReason.PEER_DOWN and "unreachable" in miss.detail
