"""The /dev/shm region shared by the scheduler and the workers: mode 0600, liveness lock, stale
files of dead processes reclaimed, workers map without touching the bytes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ectransport.errors import ConfigError
from ectransport.store import Run
from ectransport.vllm.region import (
    SharedRegion,
    WorkerMapping,
    reclaim_stale,
    region_path,
)


@pytest.fixture
def shm(tmp_path):
    return str(tmp_path)


def test_create_lock_map_and_remove(shm):
    path = region_path(shm, "engine/../x-dp0")
    assert os.path.dirname(path) == shm and "/" not in os.path.basename(path)
    r = SharedRegion(path, 16, 128)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.path.getsize(path) == 16 * 128
        part = r.part(4, 8)
        part.write((Run(1, 2),), np.arange(200, dtype=np.uint8))
        assert part.spans((Run(1, 2),), 200) == [((4 + 1) * 128, 200)]
        m = WorkerMapping(path, 16 * 128)
        t = m.tensor()
        assert t[(5 * 128):(5 * 128 + 200)].tolist() == list(range(200))
        m.close()
        # a live owner's file is never reclaimed, and its path cannot be taken twice
        assert reclaim_stale(shm) == []
        with pytest.raises(ConfigError, match="live engine"):
            SharedRegion(path, 16, 128)
    finally:
        r.close()
    assert not os.path.exists(path)
    r.close()  # idempotent


def test_joining_worker_does_not_touch_the_bytes(shm):
    r = SharedRegion(region_path(shm, "e"), 64, 4096)
    try:
        r.region.buf[:] = 7
        m = WorkerMapping(r.path, r.nbytes)
        assert int(m.tensor().min()) == 7, "a joining mapping must not pre-fault by writing"
        m.close()
    finally:
        r.close()


def test_stale_file_of_a_dead_process_is_reclaimed(shm):
    path = region_path(shm, "dead-engine")
    code = textwrap.dedent(f"""
        import os
        from ectransport.vllm.region import SharedRegion
        SharedRegion({path!r}, 8, 128)
        os._exit(0)  # dies without cleaning up, like SIGKILL
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert os.path.exists(path)
    other = path.replace("dead-engine", "unrelated")
    with open(other, "w"):
        pass
    os.chmod(other, 0o600)
    new = SharedRegion(region_path(shm, "new"), 8, 128)  # start-up reclaims dead files
    try:
        assert not os.path.exists(path) and not os.path.exists(other)
    finally:
        new.close()


def test_worker_refuses_a_file_others_can_read(shm):
    path = os.path.join(shm, "ectransport-vllm-x.region")
    with open(path, "wb") as f:
        f.truncate(4096)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="not a private"):
        WorkerMapping(path, 4096)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="expected 8192"):
        WorkerMapping(path, 8192)
    with pytest.raises(ConfigError, match="scheduler side creates it"):
        WorkerMapping(path + ".missing", 4096)
