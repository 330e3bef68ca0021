"""Issue 13 point 1, with real processes on every plane: a consumer stopped (SIGSTOP) in the middle
of a fetch while the producer's lease runs out, its grace period ends and another entry takes the
very same blocks. On resume the fetch must end as a miss — never as ``Fetched`` with the other
entry's bytes (vLLM users know this class of bug as "HTTP 200 with garbage tokens").

The consumer stops itself at a chosen point (``tests/node/_stalling_consumer.py``), so the test
needs no timing guesses; the producer runs in this process with a 1 s lease.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ectransport.data.registry import try_load
from ectransport.node import Layout, ProducerNode, Security
from ectransport.settings_schema import NodeSettings, ProducerSettings
from tests.conftest import readable, wait_for

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
ROWS = 64
LEASE_S = 1.0
GRACE_S = 0.2
PLANES = [p for p in ("nixl", "tcp", "ucx", "shm") if try_load(p) is not None]


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)


def _line(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    r = readable(proc.stdout, timeout_s)
    line = proc.stdout.readline() if r else ""
    if not line:
        proc.kill()
        raise AssertionError(f"consumer child said nothing: {proc.communicate()[1][-3000:]}")
    return json.loads(line)


@pytest.mark.parametrize("stop_at", ["ack", "posted"])
@pytest.mark.parametrize("plane", PLANES)
def test_stopped_consumer_never_gets_another_entrys_bytes(closing, plane, stop_at):
    a, b = _rows(1), _rows(2)
    p = closing(
        ProducerNode(
            layout=LAYOUT,
            security=Security(insecure=True),
            settings=ProducerSettings(
                region_bytes=ROWS * LAYOUT.block_bytes,
                lease_s=LEASE_S,
                grace_s=GRACE_S,
                budget_bytes=ROWS * LAYOUT.block_bytes,
            ),
            node=NodeSettings(planes=(plane,)),
        )
    )
    assert p.put("entry-a", a)
    p.start()
    blocks_a = p.lookup("entry-a").runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.node._stalling_consumer", "127.0.0.1", str(p.port),
         "entry-a", plane, stop_at],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert _line(proc) == {"stopped": stop_at}
        # the lease runs out, the grace period ends, and entry-b takes entry-a's blocks
        assert wait_for(lambda: p.stats()["expired"] == 1, LEASE_S + 10.0), p.stats()
        assert wait_for(lambda: p.lookup("entry-a").pins == 0, GRACE_S + 10.0)
        assert p.put("entry-b", b)  # the region holds one entry: entry-a is evicted
        assert p.lookup("entry-a") is None and p.lookup("entry-b").runs == blocks_a
        os.kill(proc.pid, signal.SIGCONT)
        out = _line(proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()
            proc.stderr.close()
    sha_a = hashlib.sha256(a.tobytes()).hexdigest()
    assert not (out["ok"] and out["sha256"] != sha_a), f"wrong bytes reported as fetched: {out}"
    assert out["ok"] is False, out  # entry-a is gone: a miss is the only right answer
    assert out["reason"] in ("timeout", "missing", "internal"), out
