"""Confirmed renewals (ECTP v2 §11) with real processes: a read in flight longer than the lease
lands on its renewals; a consumer stopped (SIGSTOP) after a confirmed renewal, while its
renewed lease runs out, its grace period ends and another entry takes the same blocks, never
reports the other entry's bytes on resume.

The consumer (``tests/node/_renewing_consumer.py``) keeps its read "in progress" itself, and
stops itself right after a RenewAck moved its window, so the test needs no timing guesses. The
producer runs here with a 1 s lease and a 0.2 s grace period.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys

import pytest

from ectransport.data.registry import try_load
from ectransport.node import ProducerNode, Security
from ectransport.settings_schema import NodeSettings, ProducerSettings
from tests.conftest import wait_for
from tests.node.test_stale_grants import LAYOUT, ROOT, ROWS, _line, _rows

LEASE_S = 1.0
GRACE_S = 0.2
PLANES = [p for p in ("nixl", "tcp") if try_load(p) is not None]


def _producer(closing, plane: str) -> ProducerNode:
    return closing(ProducerNode(
        layout=LAYOUT, security=Security(insecure=True),
        settings=ProducerSettings(region_bytes=ROWS * LAYOUT.block_bytes, lease_s=LEASE_S,
                                  grace_s=GRACE_S, budget_bytes=ROWS * LAYOUT.block_bytes),
        node=NodeSettings(planes=(plane,))))


def _consumer(port: int, plane: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.node._renewing_consumer", "127.0.0.1", str(port),
         "entry-a", plane, mode], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("plane", PLANES)
def test_a_read_three_leases_long_lands_on_confirmed_renewals(closing, plane):
    a = _rows(1)
    p = _producer(closing, plane)
    assert p.put("entry-a", a)
    p.start()
    proc = _consumer(p.port, plane, "slow")
    try:
        out = _line(proc)
    finally:
        _end(proc)
    assert out["ok"], out
    assert out["sha256"] == hashlib.sha256(a.tobytes()).hexdigest()
    assert len(out["windows"]) >= 3, out  # the window moved, again and again
    assert p.stats()["expired"] == 0  # the lease never ran out while the consumer renewed


@pytest.mark.parametrize("plane", PLANES)
def test_a_consumer_stopped_after_a_renewal_never_gets_another_entrys_bytes(closing, plane):
    a, b = _rows(1), _rows(2)
    p = _producer(closing, plane)
    assert p.put("entry-a", a)
    p.start()
    blocks_a = p.lookup("entry-a").runs
    proc = _consumer(p.port, plane, "stop")
    try:
        assert _line(proc) == {"stopped": "renewed"}
        # no more renewals: the renewed lease runs out, the grace period ends, entry-b moves in
        assert wait_for(lambda: p.stats()["expired"] == 1, LEASE_S + 10.0), p.stats()
        assert wait_for(lambda: p.lookup("entry-a").pins == 0, GRACE_S + 10.0)
        assert p.put("entry-b", b)  # the region holds one entry: entry-a is evicted
        assert p.lookup("entry-a") is None and p.lookup("entry-b").runs == blocks_a
        os.kill(proc.pid, signal.SIGCONT)
        out = _line(proc)
    finally:
        _end(proc)
    sha_a = hashlib.sha256(a.tobytes()).hexdigest()
    assert not (out["ok"] and out["sha256"] != sha_a), f"wrong bytes reported as fetched: {out}"
    assert out["ok"] is False and out["reason"] in ("timeout", "internal"), out
    assert out["windows"], out  # it was renewed (and confirmed) before it stopped
