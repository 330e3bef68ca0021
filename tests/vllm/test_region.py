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
from _children import child_env

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
        assert os.path.getsize(path) >= 16 * 128  # + the save marks
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
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=child_env())
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


def _owner(shm: str, i: int, go, ready, done) -> None:
    """One region owner (an engine's scheduler side) in its own process."""
    try:
        go.wait(30)
        r = SharedRegion(region_path(shm, f"engine-{i}-dp0"), 32, 256)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        ready.put((i, f"{type(e).__name__}: {e}"))
        return
    ready.put((i, None))
    done.wait(60)
    r.close()


@pytest.mark.parametrize("round_", range(3))
def test_twenty_owners_starting_at_once_all_start(shm, round_):
    """Issue 14: B created its file but had not locked it when A's stale-file reclaim removed it;
    B then failed (FileNotFoundError). Twenty owners, with dead owners' files lying around so
    every start reclaims, must all start and keep their files."""
    import multiprocessing as mp

    for k in range(3):  # files of owners that died: every starting owner reclaims them
        subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import os
            from ectransport.vllm.region import SharedRegion, region_path
            SharedRegion(region_path({shm!r}, "dead-{k}"), 8, 128)
            os._exit(0)
        """)], check=True, timeout=60, env=child_env())
    ctx = mp.get_context("fork")
    go, done, ready = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_owner, args=(shm, i, go, ready, done)) for i in range(20)]
    for p in procs:
        p.start()
    try:
        go.set()
        results = dict(ready.get(timeout=60) for _ in procs)
        failed = {i: why for i, why in results.items() if why}
        assert not failed, f"owners that did not start: {failed}"
        names = sorted(n for n in os.listdir(shm) if n.startswith("ectransport-vllm-engine-"))
        assert len(names) == 20, names
        assert not [n for n in os.listdir(shm) if "dead-" in n or n.endswith(".tmp")]
    finally:
        done.set()
        for p in procs:
            p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    assert not [n for n in os.listdir(shm) if "ectransport-vllm" in n], os.listdir(shm)


def test_marks_live_after_the_blocks(shm):
    r = SharedRegion(region_path(shm, "marks"), 10, 100, mark_slots=16)
    try:
        assert r.nbytes == 1000 and r.mark_offset == 1024
        assert os.path.getsize(r.path) == r.file_bytes >= 1024 + 16 * 8
        m = WorkerMapping(r.path, r.file_bytes)
        t = m.tensor()
        import torch

        t[r.mark_offset + 8 * 3: r.mark_offset + 8 * 4].view(torch.int64)[0] = 42
        assert r.mark(3) == 42 and r.mark(2) == 0
        r.clear_mark(3)
        assert r.mark(3) == 0
        with pytest.raises(ValueError):
            r.part(5, 6)  # the mark area is never handed out as blocks
        m.close()
        r.unlink()
        assert not os.path.exists(r.path)
    finally:
        r.close()
