"""BlockStore under fragmentation: bounded work per run, the ``max_runs`` bound, and a model check.

The allocator's answers are compared with a plain reference model (the original linear best-fit /
largest-first scatter over a boolean block map), so "faster" never means "different".
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ectransport.protocol.messages import MAX_GRANT_BYTES
from ectransport.store import AllocFailed, BlockStore, Run
from ectransport.store.blocks import _FreeExtents


def fragmented(holes: int, tail: int = 0, **kw) -> BlockStore:
    """``holes`` one-block holes between one-block NOT_READY entries ``f1, f3, ...``, then a free
    extent of ``tail`` blocks."""
    s = BlockStore(2 * holes + tail, 1, **kw)
    for i in range(2 * holes):
        s.alloc(f"f{i}", 1)
    for i in range(0, 2 * holes, 2):
        s.discard(f"f{i}")
    return s


class Counting:
    """Counts the free-extent index changes (each O(log n)) made by the store's allocator."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.ops = 0
        add, remove = _FreeExtents._add, _FreeExtents._remove

        def counted_add(ext, start, length):
            self.ops += 1
            return add(ext, start, length)

        def counted_remove(ext, start):
            self.ops += 1
            return remove(ext, start)

        monkeypatch.setattr(_FreeExtents, "_add", counted_add)
        monkeypatch.setattr(_FreeExtents, "_remove", counted_remove)


def heap_items(s: BlockStore) -> int:
    return sum(len(h) for h in s._extents._heaps.values())


def test_50k_holes_bounded_work_per_run(monkeypatch):
    # The former allocator scanned every extent per run (~35 s for this test); the op counts
    # below pin down that each run costs O(1) index changes, each O(log n).
    holes = 50_000
    s = fragmented(holes, tail=4096)
    count = Counting(monkeypatch)
    for r in range(20):
        before = count.ops
        e = s.alloc(f"p{r}", 4096 + 600)  # no extent holds it: the tail plus 600 holes
        assert len(e.runs) == 601 and e.runs[-1] == Run(2 * holes, 4096)
        assert [x.count for x in e.runs[:-1]] == [1] * 600
        assert count.ops - before <= 2 * len(e.runs)  # one remove (+ one add) per run taken
        before = count.ops
        s.discard(f"p{r}")
        assert count.ops - before <= 3 * len(e.runs)  # ≤ 2 merges + 1 add per run given back
        e = s.alloc(f"q{r}", 2)  # best fit: the tail (no 2-block hole), not a scan of holes
        assert e.runs == (Run(2 * holes, 2),)
        s.discard(f"q{r}")
    assert s.free_blocks == holes + 4096
    # lazy deletion keeps a bounded amount of garbage: ≤ 2 items per extent (+16 per length)
    assert heap_items(s) <= 2 * (holes + 1) + 16 * len(s._extents._heaps)
    s.check_invariants()


def test_more_runs_than_max_runs_is_refused_without_eviction():
    s = fragmented(2_000, max_runs=1024)  # 2000 one-block holes, nothing evictable
    r = s.alloc("big", 1025)
    assert isinstance(r, AllocFailed) and r.reason == "fragmented"
    assert (r.needed_blocks, r.free_blocks, r.evictable_blocks) == (1025, 2000, 0)
    assert len(s.alloc("ok", 1024).runs) == 1024  # exactly max_runs is allowed
    s.check_invariants()


def test_fragmented_evicts_oldest_ready_until_it_fits():
    s = fragmented(5, max_runs=2)  # holes at 0 2 4 6 8; f1 f3 f5 f7 f9 not ready
    s.mark_ready("f1")
    s.mark_ready("f5")
    e = s.alloc("x", 3)  # free 5 blocks but in five pieces; evicting f1 makes 0..2 one extent
    assert e.runs == (Run(0, 3),)
    assert "f1" not in s and "f5" in s and s.evictions == 1
    s.check_invariants()


def test_fragmented_after_evicting_everything_undoes_every_eviction():
    s = fragmented(6, max_runs=2)  # holes at 0 2 4 6 8 10
    for k in ("f1", "f3", "f7"):
        s.mark_ready(k)
    s.pin_if_ready("f3")  # ready order: f1, f3 (pinned), f7
    free, evictable = s.free_blocks, s.evictable_blocks
    r = s.alloc("x", 7)  # evicting f1 and f7 leaves extents 3,1,3,1: two runs give only 6
    assert isinstance(r, AllocFailed) and r.reason == "fragmented"
    assert (r.free_blocks, r.evictable_blocks) == (free, evictable) == (6, 2)
    assert all(f"f{i}" in s for i in (1, 3, 5, 7, 9, 11)) and s.evictions == 0
    assert (s.free_blocks, s.evictable_blocks) == (6, 2)
    s.check_invariants()
    e = s.alloc("y", 3)  # needs one eviction: still the oldest (f1), not f7
    assert e.runs == (Run(0, 3),) and "f1" not in s and "f7" in s
    s.check_invariants()


def test_max_runs_attribute_and_validation():
    assert BlockStore(4, 8).max_runs == 1024
    assert BlockStore(4, 8, max_runs=7).max_runs == 7
    with pytest.raises(ValueError, match="max_runs"):
        BlockStore(4, 8, max_runs=0)


def test_default_max_runs_descriptors_fit_a_grant_with_room_to_spare():
    # one (addr, length) descriptor per run, worst-case 64-bit values, msgpack as in NIXL grants
    descs = [(2**64 - 1, 2**40)] * BlockStore(1, 1).max_runs
    assert len(msgspec.msgpack.encode(descs)) * 100 < MAX_GRANT_BYTES


# -- model check -------------------------------------------------------------------------------
class Model:
    """The original allocator, written for clarity: a boolean map of free blocks."""

    def __init__(self, num_blocks: int, max_runs: int):
        self.free = [True] * num_blocks
        self.max_runs = max_runs
        self.entries: dict[str, tuple[tuple[Run, ...], list]] = {}  # key → (runs, [ready, pins])
        self.ready: list[str] = []  # mark_ready order
        self.evictions = 0

    @staticmethod
    def extents(free: list[bool]) -> list[list[int]]:
        out: list[list[int]] = []
        for b, f in enumerate(free):
            if f and out and out[-1][0] + out[-1][1] == b:
                out[-1][1] += 1
            elif f:
                out.append([b, 1])
        return out

    def plan(self, free: list[bool], n: int) -> tuple[Run, ...] | None:
        if sum(free) < n:
            return None
        ext = self.extents(free)
        fits = [x for x in ext if x[1] >= n]
        if fits:
            best = min(fits, key=lambda x: (x[1], x[0]))
            return (Run(best[0], n),)
        runs = []
        while n:
            big = max(ext, key=lambda x: (x[1], -x[0]))
            c = min(n, big[1])
            runs.append(Run(big[0], c))
            big[0] += c
            big[1] -= c
            n -= c
        return tuple(sorted(runs, key=lambda r: r.start)) if len(runs) <= self.max_runs else None

    def alloc(self, key: str, n: int) -> tuple[Run, ...] | str:
        if key in self.entries:
            return "exists"
        if n > len(self.free):
            return "too_large"
        evictable = [k for k in self.ready if self.entries[k][1][1] == 0]
        if sum(self.free) + sum(sum(r.count for r in self.entries[k][0]) for k in evictable) < n:
            return "full"
        free = list(self.free)
        gone = []
        while (runs := self.plan(free, n)) is None:
            if not evictable:
                return "fragmented"
            gone.append(evictable.pop(0))
            for r in self.entries[gone[-1]][0]:
                free[r.start : r.start + r.count] = [True] * r.count
        for k in gone:
            del self.entries[k]
            self.ready.remove(k)
        self.evictions += len(gone)
        for r in runs:
            free[r.start : r.start + r.count] = [False] * r.count
        self.free = free
        self.entries[key] = (runs, [False, 0])
        return runs

    def discard(self, key: str) -> None:
        runs, _ = self.entries.pop(key)
        if key in self.ready:
            self.ready.remove(key)
        for r in runs:
            self.free[r.start : r.start + r.count] = [True] * r.count


KEYS = st.sampled_from([f"k{i}" for i in range(10)])


class StoreMatchesModel(RuleBasedStateMachine):
    """Random alloc / mark_ready / pin / unpin / discard: same answers as the model, and
    ``check_invariants()`` holds after every step."""

    @initialize(num_blocks=st.integers(1, 40), max_runs=st.integers(1, 5))
    def setup(self, num_blocks, max_runs):
        self.store = BlockStore(num_blocks, 1, max_runs=max_runs)
        self.model = Model(num_blocks, max_runs)
        self.pins: dict[str, list[int]] = {}

    @rule(key=KEYS, nbytes=st.integers(0, 45))
    def alloc(self, key, nbytes):
        got = self.store.alloc(key, nbytes)
        want = self.model.alloc(key, max(1, nbytes))
        if isinstance(got, AllocFailed):
            assert got.reason == want
        else:
            assert got.runs == want
            self.pins.pop(key, None)  # a new entry (an old one of this key was evicted)
        assert set(self.store._entries) == set(self.model.entries)
        assert self.store.evictions == self.model.evictions

    @rule(key=KEYS)
    def mark_ready(self, key):
        e = self.store.get(key)
        if e is not None and not e.ready:
            self.store.mark_ready(key)
            self.model.entries[key][1][0] = True
            self.model.ready.append(key)

    @rule(key=KEYS)
    def pin(self, key):
        e = self.store.pin_if_ready(key)
        if e is not None:
            self.pins.setdefault(key, []).append(e.entry_id)
            self.model.entries[key][1][1] += 1

    @rule(key=KEYS)
    def unpin(self, key):
        if self.pins.get(key):
            self.store.unpin(key, self.pins[key].pop())
            self.model.entries[key][1][1] -= 1

    @rule(key=KEYS)
    def discard(self, key):
        e = self.store.get(key)
        if e is not None and e.pins == 0:
            assert self.store.discard(key)
            self.model.discard(key)

    @invariant()
    def consistent(self):
        self.store.check_invariants()
        assert self.store.free_blocks == sum(self.model.free)
        for key, ids in self.pins.items():
            if ids:
                assert self.store.get(key).pins == len(ids)  # pinned entries are never evicted


StoreMatchesModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                               deadline=None)
test_store_matches_model = StoreMatchesModel.TestCase


def test_best_fit_skips_an_extent_that_grew_since_it_was_indexed():
    s = BlockStore(13, 1)
    for i in range(13):
        s.alloc(f"b{i}", 1)
    for k in ("b0", "b1", "b10", "b11", "b2"):  # holes 0..1 and 10..11, then 0..1 grows to 0..2
        s.discard(k)
    assert s.alloc("x", 2).runs == (Run(10, 2),)  # the 2-block hole, not the 3-block one
    assert s.alloc("y", 3).runs == (Run(0, 3),)
    s.check_invariants()
