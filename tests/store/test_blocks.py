"""BlockStore: allocation, eviction order, pins, fail-fast, contiguity; HostRegion round trip."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ectransport.errors import StoreError
from ectransport.store import AllocFailed, BlockStore, EntryState, HostRegion, Run


def test_states_and_pins():
    s = BlockStore(8, 16)
    e = s.alloc("a", 33)
    assert e.num_blocks == 3 and e.state is EntryState.NOT_READY
    assert s.pin_if_ready("a") is None  # not ready: no pin
    s.mark_ready("a")
    assert s.pin_if_ready("a").state is EntryState.PINNED
    s.pin_if_ready("a")
    assert s.get("a").pins == 2
    s.unpin("a", e.entry_id)
    s.unpin("a", e.entry_id)
    assert s.get("a").state is EntryState.READY
    with pytest.raises(StoreError):
        s.unpin("a", e.entry_id)  # never below zero
    with pytest.raises(StoreError):
        s.mark_ready("a")
    s.check_invariants()


def test_eviction_oldest_ready_unpinned_first():
    s = BlockStore(6, 1)
    for k in "abc":
        s.alloc(k, 2)
        s.mark_ready(k)
    s.pin_if_ready("a")  # oldest, but pinned
    s.alloc("d", 2)
    assert "a" in s and "b" not in s and "c" in s
    s.mark_ready("d")
    s.alloc("e", 2)
    assert "c" not in s and "d" in s
    assert s.evictions == 2
    s.check_invariants()


def test_alloc_fails_fast_and_evicts_nothing():
    s = BlockStore(4, 1)
    s.alloc("a", 2)  # not ready: not evictable
    s.alloc("b", 1)
    s.mark_ready("b")
    r = s.alloc("c", 3)
    assert isinstance(r, AllocFailed) and r.reason == "full" and r.needed_blocks == 3
    assert "b" in s  # nothing evicted
    assert s.alloc("a", 1).reason == "exists"
    assert s.alloc("z", 5).reason == "too_large"
    s.check_invariants()


def test_prefers_contiguous_runs_and_coalesces_on_free():
    s = BlockStore(10, 1)
    for k in "abcde":
        s.alloc(k, 2)
    s.discard("b")
    s.discard("d")
    e = s.alloc("f", 4)  # no contiguous 4: two runs
    assert e.runs == (Run(2, 2), Run(6, 2))
    s.discard("f")
    s.discard("c")
    e = s.alloc("g", 6)  # b+c+d coalesced back into one extent
    assert e.runs == (Run(2, 6),)
    s.check_invariants()


def test_zero_byte_entry_gets_one_block():
    s = BlockStore(2, 8)
    assert s.alloc("z", 0).num_blocks == 1


def test_discard_pinned_refused():
    s = BlockStore(2, 8)
    s.alloc("a", 8)
    s.mark_ready("a")
    s.pin_if_ready("a")
    with pytest.raises(StoreError):
        s.discard("a")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "ready", "pin", "unpin", "discard"]),
                          st.integers(0, 7), st.integers(0, 40)), max_size=60))
def test_random_operations_keep_invariants(ops):
    s = BlockStore(16, 4)
    pins: dict[str, list[int]] = {}
    for op, k, n in ops:
        key = f"k{k}"
        e = s.get(key)
        if op == "alloc":
            s.alloc(key, n)
        elif op == "ready" and e is not None and not e.ready:
            s.mark_ready(key)
        elif op == "pin" and s.pin_if_ready(key) is not None:
            pins.setdefault(key, []).append(s.get(key).entry_id)
        elif op == "unpin" and pins.get(key):
            s.unpin(key, pins[key].pop())
        elif op == "discard" and e is not None and e.pins == 0:
            s.discard(key)
        s.check_invariants()
        for key, ids in pins.items():
            if ids:
                assert s.get(key).pins == len(ids)  # pinned entries are never evicted


def test_region_write_read_scattered():
    r = HostRegion(8, 4)
    data = np.arange(20, dtype=np.uint8)
    runs = (Run(5, 2), Run(0, 3))
    r.write(runs, data)
    assert (r.read(runs, 20) == data).all()
    assert (r.buf[20:28] == data[:8]).all() and (r.buf[0:12] == data[8:]).all()
    r.close()


def test_shared_region_file_mode_and_unlink(tmp_path):
    import os
    import stat

    path = str(tmp_path / "ect.mmap")
    r = HostRegion(4, 8, path=path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    other = HostRegion(4, 8, path=path, create=False)
    r.buf[:4] = 7
    assert (other.buf[:4] == 7).all()
    other.close()
    r.close()
    assert not os.path.exists(path)
