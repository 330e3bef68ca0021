"""Block pool bookkeeping over one host region (no I/O, no memory: pure state).

The region is ``num_blocks`` fixed-size blocks of ``block_bytes`` each; a block is one row of
``hidden × element_size`` bytes, the layout vLLM's ECCPUConnector uses (one placeholder token per
block). Entries are keyed by mm_hash and move NOT_READY → READY → PINNED(n) → READY.

Allocation prefers one contiguous run of blocks (best fit), because every contiguous run becomes a
single data-plane descriptor, and descriptor count, not bytes, dominates small-block transfer cost.
"""

from __future__ import annotations

import bisect
import enum
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

    ``reason`` is ``"full"`` (free + evictable blocks < needed), ``"too_large"`` (more blocks than
    the region has) or ``"exists"`` (the mm_hash already has an entry).
    """

    reason: str
    needed_blocks: int
    free_blocks: int
    evictable_blocks: int


class BlockStore:
    """Entries over a pool of ``num_blocks`` blocks of ``block_bytes`` bytes.

    Not thread-safe: the owner (a session or a node) serialises access.

    Eviction: only READY, unpinned entries are evicted, oldest ``mark_ready`` first, and only when an
    allocation can then succeed (fail fast otherwise: vLLM's EmbeddingCache behaves the same).
    """

    def __init__(self, num_blocks: int, block_bytes: int):
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError(
                f"num_blocks and block_bytes must be positive ({num_blocks}, {block_bytes})"
            )
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._entries: dict[str, Entry] = {}
        self._ready_order: OrderedDict[str, None] = OrderedDict()  # ready entries, oldest first
        self._starts: list[int] = [0]  # free extents, sorted by start
        self._lens: list[int] = [num_blocks]
        self._free = num_blocks
        self._evictable = 0  # blocks of ready, unpinned entries
        self._ids = itertools.count(1)
        self.evictions = 0

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
        return self._free

    @property
    def evictable_blocks(self) -> int:
        return self._evictable

    @property
    def pinned_blocks(self) -> int:
        return sum(e.num_blocks for e in self._entries.values() if e.pins)

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def blocks_for(self, nbytes: int) -> int:
        """Blocks needed for ``nbytes`` (at least one, so a 0-byte entry still has an address)."""
        return max(1, -(-nbytes // self.block_bytes))

    # -- allocation ----------------------------------------------------------------------------
    def alloc(self, mm_hash: str, nbytes: int) -> Entry | AllocFailed:
        """Allocate a NOT_READY entry of ``nbytes`` bytes, evicting old ready entries if needed."""
        n = self.blocks_for(nbytes)
        if mm_hash in self._entries:
            return AllocFailed("exists", n, self._free, self._evictable)
        if n > self.num_blocks:
            return AllocFailed("too_large", n, self._free, self._evictable)
        if self._free + self._evictable < n:
            return AllocFailed("full", n, self._free, self._evictable)
        while self._free < n:
            self._evict_oldest()
        entry = Entry(mm_hash, next(self._ids), nbytes, self._take(n))
        self._entries[mm_hash] = entry
        return entry

    def mark_ready(self, mm_hash: str) -> Entry:
        """NOT_READY → READY. Raises StoreError if unknown or already ready."""
        e = self._require(mm_hash)
        if e.ready:
            raise StoreError(f"entry {mm_hash[:16]} is already ready")
        e.ready = True
        self._ready_order[mm_hash] = None
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

    def _evict_oldest(self) -> None:
        for key in self._ready_order:
            e = self._entries[key]
            if e.pins == 0:
                self._remove(e)
                self.evictions += 1
                return
        raise StoreError("eviction invariant broken: no evictable entry")  # pragma: no cover

    def _remove(self, e: Entry) -> None:
        del self._entries[e.mm_hash]
        if e.ready:
            self._ready_order.pop(e.mm_hash, None)
            if e.pins == 0:
                self._evictable -= e.num_blocks
        for r in e.runs:
            self._give(r)

    def _take(self, n: int) -> tuple[Run, ...]:
        # best fit: the smallest single extent that holds n blocks
        best = -1
        for i, length in enumerate(self._lens):
            if length >= n and (best < 0 or length < self._lens[best]):
                best = i
                if length == n:
                    break
        if best >= 0:
            return (self._cut(best, n),)
        # scatter: largest extents first, so the entry has as few runs as possible
        runs = []
        need = n
        while need:
            i = max(range(len(self._lens)), key=self._lens.__getitem__)
            runs.append(self._cut(i, min(need, self._lens[i])))
            need -= runs[-1].count
        return tuple(sorted(runs, key=lambda r: r.start))

    def _cut(self, i: int, n: int) -> Run:
        run = Run(self._starts[i], n)
        if self._lens[i] == n:
            del self._starts[i], self._lens[i]
        else:
            self._starts[i] += n
            self._lens[i] -= n
        self._free -= n
        return run

    def _give(self, run: Run) -> None:
        i = bisect.bisect_left(self._starts, run.start)
        start, length = run.start, run.count
        # merge with the following extent
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lens[i]
            del self._starts[i], self._lens[i]
        # merge with the preceding extent
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:
            self._lens[i - 1] += length
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, length)
        self._free += run.count

    def check_invariants(self) -> None:
        """Assert internal consistency (used by tests): no block both free and owned, counters right."""
        owned = [0] * self.num_blocks
        for e in self._entries.values():
            assert e.pins >= 0
            for r in e.runs:
                for b in range(r.start, r.start + r.count):
                    owned[b] += 1
        for s, n in zip(self._starts, self._lens):
            for b in range(s, s + n):
                owned[b] += 1
        assert all(c == 1 for c in owned), "a block is both free and owned, or lost"
        assert self._free == sum(self._lens)
        assert self._evictable == sum(
            e.num_blocks for e in self._entries.values() if e.ready and e.pins == 0
        )
