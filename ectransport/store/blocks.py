"""Block pool bookkeeping over one host region (no I/O, no memory: pure state).

The region is ``num_blocks`` fixed-size blocks of ``block_bytes`` each; a block is one row of
``hidden × element_size`` bytes, the layout vLLM's ECCPUConnector uses (one placeholder token per
block). Entries are keyed by mm_hash and move NOT_READY → READY → PINNED(n) → READY.

Allocation prefers one contiguous run of blocks (best fit), because every contiguous run becomes a
single data-plane descriptor, and descriptor count, not bytes, dominates small-block transfer cost.
When no single free extent holds an entry, it is scattered over the largest extents first, and at
most ``max_runs`` of them (a grant carries one descriptor per run and must fit the wire limit).
The free extents are indexed so that every run taken or given back costs O(log n) (see
:class:`_FreeExtents`): what a put costs depends on how many runs it gets, not on how many holes
the region has.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from ectransport.errors import StoreError


class EntryState(enum.Enum):
    """Lifecycle of an entry. PINNED means READY with at least one pin."""

    NOT_READY = "not_ready"  #: allocated; its bytes have not landed (save or fetch in flight)
    READY = "ready"  #: bytes valid, evictable while unpinned
    PINNED = "pinned"  #: bytes valid, held by ``pins`` readers; never evicted


@dataclass(frozen=True)
class Run:
    """A contiguous run of blocks: ``start`` (block index) and ``count`` (blocks)."""

    start: int
    count: int


@dataclass
class Entry:
    """One cached item.

    Attributes:
        mm_hash: the cache key.
        entry_id: unique per allocation (never reused), so a holder of an old id can tell that the
            blocks were re-allocated.
        nbytes: payload size in bytes (``num_tokens × hidden × element_size``).
        runs: the entry's blocks, in payload order.
        ready: bytes valid.
        pins: number of live pins (≥ 0).
    """

    mm_hash: str
    entry_id: int
    nbytes: int
    runs: tuple[Run, ...]
    ready: bool = False
    pins: int = 0

    @property
    def num_blocks(self) -> int:
        return sum(r.count for r in self.runs)

    @property
    def state(self) -> EntryState:
        if not self.ready:
            return EntryState.NOT_READY
        return EntryState.PINNED if self.pins else EntryState.READY


@dataclass(frozen=True)
class AllocFailed:
    """Typed allocation failure (nothing was evicted).

    ``reason`` is one of:

    - ``"full"``: free + evictable blocks < needed;
    - ``"too_large"``: more blocks than the region has;
    - ``"exists"``: the mm_hash already has an entry;
    - ``"fragmented"``: enough blocks are free or evictable, but even after evicting every
      evictable entry the free blocks lie in so many pieces that the entry would need more than
      ``BlockStore.max_runs`` runs (each run is one data-plane descriptor of the grant).
    """

    reason: str
    needed_blocks: int
    free_blocks: int
    evictable_blocks: int


class _FreeExtents:
    """The free blocks of a pool as maximal extents ``[start, start + length)`` (in blocks).

    Extents are always coalesced (no two touch). Indexes:

    - ``_len_at`` (start → length) and ``_start_at_end`` (end → start) find the neighbours of a run
      given back in O(1);
    - ``_heaps`` (length → min-heap of starts) and ``_count`` (length → number of extents) with
      ``_lengths`` (the distinct lengths, sorted) answer "smallest extent ≥ n, lowest start" (best
      fit) and "largest extent, lowest start" (scatter). Heaps use lazy deletion: an item ``s`` in
      ``_heaps[L]`` is live iff ``_len_at.get(s) == L``; stale items are skipped when they reach
      the top and compacted away when they outnumber the live ones.

    Complexity, with n free extents and N blocks: adding or removing an extent is O(log n) heap
    work, plus an O(D) list insert/delete (a memmove) when a length appears or disappears, where D,
    the number of distinct free lengths, is at most √(2N) because distinct positive lengths sum to
    at most N (D ≤ 5,800 for 16 M blocks), and does not grow with the number of holes. So taking
    or giving back one run is O(log n) plus at worst a memmove of √(2N) pointers; finding the
    best fit is O(log D).

    While ``journal`` is a list, every change is appended to it so :meth:`rollback` can undo them.
    """

    def __init__(self, num_blocks: int):
        self._len_at: dict[int, int] = {}
        self._start_at_end: dict[int, int] = {}
        self._heaps: dict[int, list[int]] = {}
        self._count: dict[int, int] = {}
        self._lengths: list[int] = []
        self.free = 0  # blocks
        self.journal: list[tuple[bool, int, int]] | None = None
        self._add(0, num_blocks)

    # -- primitive changes (journaled) ---------------------------------------------------------
    def _add(self, start: int, length: int) -> None:
        self._len_at[start] = length
        self._start_at_end[start + length] = start
        c = self._count.get(length, 0)
        if c == 0:
            bisect.insort(self._lengths, length)
            self._heaps[length] = [start]
        else:
            heap = self._heaps[length]
            heapq.heappush(heap, start)
            if len(heap) > 2 * c + 16:  # mostly stale: compact (amortised O(1) per push)
                live = {s for s in heap if self._len_at.get(s) == length}
                heap[:] = sorted(live)
        self._count[length] = c + 1
        self.free += length
        if self.journal is not None:
            self.journal.append((True, start, length))

    def _remove(self, start: int) -> int:
        length = self._len_at.pop(start)
        del self._start_at_end[start + length]
        c = self._count[length] - 1
        if c == 0:
            del self._count[length], self._heaps[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]
        else:
            self._count[length] = c
        self.free -= length
        if self.journal is not None:
            self.journal.append((False, start, length))
        return length

    def _lowest_start(self, length: int) -> int:
        """Lowest start of the extents of exactly ``length`` blocks (there must be one)."""
        heap = self._heaps[length]
        while self._len_at.get(heap[0]) != length:
            heapq.heappop(heap)
        return heap[0]

    # -- operations ------------------------------------------------------------------------------
    def give(self, start: int, count: int) -> None:
        """Return ``count`` blocks at ``start`` (all owned until now), merging with neighbours."""
        end = start + count
        nxt = self._len_at.get(end)
        if nxt is not None:
            self._remove(end)
            end += nxt
        prv = self._start_at_end.get(start)
        if prv is not None:
            self._remove(prv)
            start = prv
        self._add(start, end - start)

    def fits(self, n: int, max_runs: int) -> bool:
        """Whether :meth:`take` of ``n`` blocks would need at most ``max_runs`` runs.

        O(1) when one extent holds ``n``; else O(min(max_runs, D)) over the largest lengths.
        """
        if self.free < n:
            return False
        if self._lengths[-1] >= n:
            return True
        need, left = n, max_runs
        for length in reversed(self._lengths):
            k = min(self._count[length], left)
            need -= k * length
            left -= k
            if need <= 0:
                return True
            if left == 0:
                return False
        return False  # pragma: no cover (free >= n)

    def take(self, n: int) -> tuple[Run, ...]:
        """Take ``n`` blocks (``free >= n``): the best fit — the smallest extent that holds ``n``,
        lowest start among equals — or, when none does, the largest extents first (lowest start
        among equals; the last one cut from its start), returned sorted by start."""
        i = bisect.bisect_left(self._lengths, n)
        if i < len(self._lengths):
            length = self._lengths[i]
            return (self._cut(self._lowest_start(length), length, n),)
        runs = []
        need = n
        while need:
            length = self._lengths[-1]
            runs.append(self._cut(self._lowest_start(length), length, min(need, length)))
            need -= runs[-1].count
        runs.sort(key=lambda r: r.start)
        return tuple(runs)

    def _cut(self, start: int, length: int, n: int) -> Run:
        self._remove(start)
        if n < length:
            self._add(start + n, length - n)
        return Run(start, n)

    def rollback(self) -> None:
        """Undo every change recorded in ``journal`` (newest first); stops journaling."""
        journal, self.journal = self.journal or [], None
        for added, start, length in reversed(journal):
            if added:
                self._remove(start)
            else:
                self._add(start, length)

    def extents(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every free extent, by start (O(n log n); for checks)."""
        return sorted(self._len_at.items())

    def check(self) -> None:
        """Assert the indexes agree with each other (O(n log n + stale heap items))."""
        ext = self.extents()
        assert self.free == sum(n for _, n in ext)
        assert all(n > 0 for _, n in ext)
        assert all(s + n < t for (s, n), (t, _) in zip(ext, ext[1:])), "free extents not coalesced"
        assert self._start_at_end == {s + n: s for s, n in ext}
        counts: dict[int, int] = {}
        for _, n in ext:
            counts[n] = counts.get(n, 0) + 1
        assert self._count == counts and self._lengths == sorted(counts)
        assert set(self._heaps) == set(counts)
        in_heap = {(s, n) for n, heap in self._heaps.items() for s in heap}
        assert in_heap.issuperset(ext), "a free extent is missing from its length's heap"
        for heap in self._heaps.values():
            assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "not a heap"


class BlockStore:
    """Entries over a pool of ``num_blocks`` blocks of ``block_bytes`` bytes.

    Not thread-safe: the owner (a session or a node) serialises access.

    Args:
        num_blocks: blocks in the pool.
        block_bytes: bytes per block.
        max_runs: the most runs (contiguous pieces) one entry may be scattered over. Every run
            becomes one data-plane descriptor in the entry's grant (NIXL: one ``(addr, length)``
            pair, ~20 bytes msgpacked) and a grant must fit ``MAX_GRANT_BYTES`` (4 MiB) on the
            wire; unbounded scattering once produced a 4.4 MB grant. 1024 runs ≈ 20 KB of
            descriptors. An allocation that would need more runs evicts more (see :meth:`alloc`)
            or fails with ``AllocFailed("fragmented")``.

    Eviction: only READY, unpinned entries are evicted, oldest ``mark_ready`` first, and only when an
    allocation can then succeed (fail fast otherwise: vLLM's EmbeddingCache behaves the same).
    The store does no I/O and calls nobody: what an allocation evicted is recorded, and the owner
    reads it with :meth:`take_evicted` (a producer node withdraws those entries from the fleet
    directory). The record is kept only while ``track_evictions`` is set.

    Cost: allocating or freeing an entry of k runs is O(k log n) for n free extents (see
    :class:`_FreeExtents`), independent of how fragmented the pool is.
    """

    def __init__(self, num_blocks: int, block_bytes: int, *, max_runs: int = 1024,
                 track_evictions: bool = False):
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError(
                f"num_blocks and block_bytes must be positive ({num_blocks}, {block_bytes})"
            )
        if max_runs < 1:
            raise ValueError(f"max_runs must be at least 1 (got {max_runs})")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.max_runs = max_runs
        self._entries: dict[str, Entry] = {}
        # ready entries, oldest first → their mark_ready sequence number (to restore the order)
        self._ready_order: OrderedDict[str, int] = OrderedDict()
        self._ready_seq = itertools.count()
        self._extents = _FreeExtents(num_blocks)
        self._evictable = 0  # blocks of ready, unpinned entries
        self._ids = itertools.count(1)
        self.evictions = 0
        #: ``(mm_hash, entry_id)`` of the entries evicted since the last :meth:`take_evicted`
        #: (kept only with ``track_evictions``; an eviction that was undone is not in it)
        self._evicted: list[tuple[str, int]] | None = [] if track_evictions else None

    # -- queries -------------------------------------------------------------------------------
    def get(self, mm_hash: str) -> Entry | None:
        return self._entries.get(mm_hash)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    @property
    def free_blocks(self) -> int:
        return self._extents.free

    @property
    def evictable_blocks(self) -> int:
        return self._evictable

    @property
    def pinned_blocks(self) -> int:
        return sum(e.num_blocks for e in self._entries.values() if e.pins)

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def take_evicted(self) -> list[tuple[str, int]]:
        """``(mm_hash, entry_id)`` of every entry evicted by an allocation since the last call,
        oldest first, and forget them (``[]`` without ``track_evictions``). Discards are not in
        it: the caller of :meth:`discard` knows them."""
        if not self._evicted:
            return []
        out, self._evicted = self._evicted, []
        return out

    def blocks_for(self, nbytes: int) -> int:
        """Blocks needed for ``nbytes`` (at least one, so a 0-byte entry still has an address)."""
        return max(1, -(-nbytes // self.block_bytes))

    # -- allocation ----------------------------------------------------------------------------
    def alloc(self, mm_hash: str, nbytes: int) -> Entry | AllocFailed:
        """Allocate a NOT_READY entry of ``nbytes`` bytes, evicting old ready entries if needed.

        The entry gets one run (best fit) when a free extent holds it, else the largest free
        extents, at most :attr:`max_runs` of them. If the free blocks do not suffice, or lie in
        more than ``max_runs`` pieces, READY unpinned entries are evicted oldest first until the
        entry fits; if it still does not fit once none is left, every eviction is undone and
        ``AllocFailed("fragmented")`` is returned — a failed alloc never evicts anything.

        Returns:
            The entry, or AllocFailed (``exists``, ``too_large``, ``full``, ``fragmented``).
        """
        n = self.blocks_for(nbytes)
        free = self._extents.free
        if mm_hash in self._entries:
            return AllocFailed("exists", n, free, self._evictable)
        if n > self.num_blocks:
            return AllocFailed("too_large", n, free, self._evictable)
        if free + self._evictable < n:
            return AllocFailed("full", n, free, self._evictable)
        if not self._extents.fits(n, self.max_runs) and not self._evict_until_fits(n):
            return AllocFailed("fragmented", n, free, self._evictable)
        entry = Entry(mm_hash, next(self._ids), nbytes, self._extents.take(n))
        self._entries[mm_hash] = entry
        return entry

    def mark_ready(self, mm_hash: str) -> Entry:
        """NOT_READY → READY. Raises StoreError if unknown or already ready."""
        e = self._require(mm_hash)
        if e.ready:
            raise StoreError(f"entry {mm_hash[:16]} is already ready")
        e.ready = True
        self._ready_order[mm_hash] = next(self._ready_seq)
        self._evictable += e.num_blocks
        return e

    def pin_if_ready(self, mm_hash: str) -> Entry | None:
        """Pin a READY entry and return it; None if absent or not ready (no pin taken)."""
        e = self._entries.get(mm_hash)
        if e is None or not e.ready:
            return None
        if e.pins == 0:
            self._evictable -= e.num_blocks
        e.pins += 1
        return e

    def unpin(self, mm_hash: str, entry_id: int) -> Entry:
        """Drop one pin of the entry with this ``entry_id``.

        Raises:
            StoreError: the entry is gone, was re-allocated (different id) or is not pinned — a
                caller bug (double unpin); the pin count never goes below zero.
        """
        e = self._require(mm_hash)
        if e.entry_id != entry_id or e.pins <= 0:
            raise StoreError(
                f"unpin of {mm_hash[:16]} (entry {entry_id}): entry {e.entry_id} has {e.pins} pins"
            )
        e.pins -= 1
        if e.pins == 0:
            self._evictable += e.num_blocks
        return e

    def discard(self, mm_hash: str) -> bool:
        """Free an unpinned entry (not-ready or ready). False if absent; StoreError if pinned."""
        e = self._entries.get(mm_hash)
        if e is None:
            return False
        if e.pins:
            raise StoreError(f"cannot discard {mm_hash[:16]}: {e.pins} pins held")
        self._remove(e)
        return True

    # -- internals -----------------------------------------------------------------------------
    def _require(self, mm_hash: str) -> Entry:
        e = self._entries.get(mm_hash)
        if e is None:
            raise StoreError(f"no entry for mm_hash {mm_hash[:16]}")
        return e

    def _evict_until_fits(self, n: int) -> bool:
        """Evict oldest evictable entries until ``n`` blocks fit in ``max_runs`` runs.

        All or nothing: if they never fit, the evictions are undone (the free extents from a
        journal, the entries and their ready order from the evicted list) and False is returned.
        """
        ext = self._extents
        ext.journal = []
        evicted: list[tuple[Entry, int]] = []
        try:
            while not ext.fits(n, self.max_runs):
                if self._evictable == 0:
                    ext.rollback()
                    for e, _ in evicted:
                        self._entries[e.mm_hash] = e
                        self._evictable += e.num_blocks
                    self.evictions -= len(evicted)
                    order = [*self._ready_order.items(), *((e.mm_hash, q) for e, q in evicted)]
                    self._ready_order = OrderedDict(sorted(order, key=lambda kv: kv[1]))
                    return False
                evicted.append(self._evict_oldest())
            if self._evicted is not None:
                self._evicted += [(e.mm_hash, e.entry_id) for e, _ in evicted]
            return True
        finally:
            ext.journal = None

    def _evict_oldest(self) -> tuple[Entry, int]:
        """Evict the oldest ready unpinned entry; return it and its ready sequence number."""
        for key, seq in self._ready_order.items():
            e = self._entries[key]
            if e.pins == 0:
                self._remove(e)
                self.evictions += 1
                return e, seq
        raise StoreError("eviction invariant broken: no evictable entry")  # pragma: no cover

    def _remove(self, e: Entry) -> None:
        del self._entries[e.mm_hash]
        if e.ready:
            self._ready_order.pop(e.mm_hash, None)
            if e.pins == 0:
                self._evictable -= e.num_blocks
        for r in e.runs:
            self._extents.give(r.start, r.count)

    def check_invariants(self) -> None:
        """Assert internal consistency (used by tests; O(num_blocks)): every block is free or
        owned by exactly one entry, entries have 1..max_runs runs, indexes and counters agree."""
        self._extents.check()
        owned = [0] * self.num_blocks
        for e in self._entries.values():
            assert e.pins >= 0
            assert 1 <= len(e.runs) <= self.max_runs, f"{e.mm_hash}: {len(e.runs)} runs"
            for r in e.runs:
                for b in range(r.start, r.start + r.count):
                    owned[b] += 1
        for s, n in self._extents.extents():
            for b in range(s, s + n):
                owned[b] += 1
        assert all(c == 1 for c in owned), "a block is both free and owned, or lost"
        ready = [k for k, e in self._entries.items() if e.ready]
        assert sorted(self._ready_order) == sorted(ready)
        seqs = list(self._ready_order.values())
        assert seqs == sorted(seqs), "ready order is not oldest first"
        assert self._evictable == sum(
            e.num_blocks for e in self._entries.values() if e.ready and e.pins == 0
        )
