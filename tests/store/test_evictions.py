"""BlockStore's eviction record (``take_evicted``): what the producer node withdraws from the
fleet directory. Every entry an allocation evicted is reported once, an undone eviction never,
a discard never (its caller knows it)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ectransport.store import AllocFailed, BlockStore


def _ready(s: BlockStore, key: str, nbytes: int) -> int:
    e = s.alloc(key, nbytes)
    assert not isinstance(e, AllocFailed)
    s.mark_ready(key)
    return e.entry_id


def test_evictions_are_reported_once_oldest_first():
    s = BlockStore(4, 16, track_evictions=True)
    ids = {k: _ready(s, k, 16) for k in "abcd"}
    assert s.take_evicted() == []
    _ready(s, "e", 32)  # evicts a and b
    assert s.take_evicted() == [("a", ids["a"]), ("b", ids["b"])]
    assert s.take_evicted() == []
    s.discard("c")
    assert s.take_evicted() == []  # a discard is the caller's own


def test_an_allocation_that_fails_reports_nothing_it_undid():
    s = BlockStore(4, 16, max_runs=1, track_evictions=True)
    _ready(s, "a", 16)
    s.alloc("pinned", 16)
    s.mark_ready("pinned")
    s.pin_if_ready("pinned")
    _ready(s, "c", 16)
    _ready(s, "d", 16)
    s.get("pinned")
    # blocks a, pinned, c, d: 3 blocks in one run need "pinned" gone: impossible, all undone
    out = s.alloc("big", 48)
    assert isinstance(out, AllocFailed) and out.reason == "fragmented"
    assert s.take_evicted() == [] and {"a", "c", "d"} <= {e.mm_hash for e in s.entries()}


def test_untracked_stores_keep_no_record():
    s = BlockStore(2, 16)
    _ready(s, "a", 32)
    _ready(s, "b", 32)
    assert s.evictions == 1 and s.take_evicted() == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(1, 5),
                          st.sampled_from(("put", "discard", "pin", "unpin"))), max_size=60))
def test_the_record_is_exactly_what_vanished_without_a_discard(ops):
    s = BlockStore(8, 16, track_evictions=True)
    live: dict[str, int] = {}
    pinned: dict[str, int] = {}
    evicted: list[tuple[str, int]] = []
    for key, blocks, op in ops:
        if op == "put" and key not in live:
            e = s.alloc(key, blocks * 16)
            if not isinstance(e, AllocFailed):
                s.mark_ready(key)
                live[key] = e.entry_id
        elif op == "discard" and key in live and key not in pinned:
            s.discard(key)
            del live[key]
        elif op == "pin" and key in live and key not in pinned:
            s.pin_if_ready(key)
            pinned[key] = live[key]
        elif op == "unpin" and key in pinned:
            s.unpin(key, pinned.pop(key))
        got = s.take_evicted()
        evicted += got
        gone = {k: i for k, i in live.items() if s.get(k) is None or s.get(k).entry_id != i}
        assert sorted(got) == sorted(gone.items())
        assert not set(gone) & set(pinned)  # a pinned entry is never evicted
        for k in gone:
            del live[k]
        s.check_invariants()
