"""Helpers of the plane conformance suite, usable on their own in a plane's tests: byte
patterns and comparisons, waiting on a transfer or a notification with a deadline, and
:class:`Pair` — a producer and a consumer plane over two host regions, driven as the nodes drive
them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ectransport.plugin import FetchingPlane, Run, ServingPlane, XferState, identity_of
from ectransport.store import HostRegion

KiB = 1024
MiB = 1024 * KiB
SENTINEL = 0xEE  # the consumer region's bytes before any transfer
#: identities of the kit's nodes (``identity_of`` of made-up Z85 CURVE public keys)
PRODUCER_IDENTITY = identity_of("conformance-producer-A".ljust(40, "a"))
OTHER_PRODUCER_IDENTITY = identity_of("conformance-producer-B".ljust(40, "b"))
CONSUMER_IDENTITY = identity_of("conformance-consumer".ljust(40, "c"))


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic pseudo-random ``uint8`` bytes, every 8-byte word distinct (so a misplaced
    block shows); cheap enough for 64 MiB on a loaded machine."""
    start = ((seed & 0xFFFFF) << 40) + 1
    words = np.arange(start, start + nbytes // 8 + 1, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)[:nbytes]


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Byte equality, naming the first differing offset (cheaper than numpy.testing)."""
    assert got.nbytes == want.nbytes, f"{got.nbytes} bytes, expected {want.nbytes}"
    if not np.array_equal(got, want):
        first = int(np.flatnonzero(got != want)[0])
        raise AssertionError(f"bytes differ from offset {first} (of {want.nbytes})")


def read_runs(region: HostRegion, runs: Sequence[Run], nbytes: int) -> np.ndarray:
    """A copy of the first ``nbytes`` bytes of ``runs`` (0 bytes allowed)."""
    views = region.view(list(runs), nbytes)
    return np.concatenate(views) if views else np.empty(0, dtype=np.uint8)


def gaps(region: HostRegion, runs: Sequence[Run]) -> list[tuple[int, int]]:
    """``(offset, length)`` of every byte range of ``region`` outside ``runs`` (whole blocks)."""
    out, pos = [], 0
    for r in sorted(runs, key=lambda r: r.start):
        if r.start * region.block_bytes > pos:
            out.append((pos, r.start * region.block_bytes - pos))
        pos = max(pos, (r.start + r.count) * region.block_bytes)
    if pos < region.nbytes:
        out.append((pos, region.nbytes - pos))
    return out


def untouched_outside(region: HostRegion, runs: Sequence[Run], value: int = SENTINEL) -> bool:
    """Whether every byte of ``region`` outside ``runs`` still equals ``value``."""
    return all(bool((region.buf[off:off + n] == value).all()) for off, n in gaps(region, runs))


def wait_state(plane: FetchingPlane, handle: Any, timeout_s: float) -> XferState:
    """Poll ``check`` until not PROC or ``timeout_s`` passed; the last state."""
    end = time.monotonic() + timeout_s
    while (state := plane.check(handle)) is XferState.PROC and time.monotonic() < end:
        time.sleep(0.0005)
    return state


def wait_notifs(plane: ServingPlane, want: int, timeout_s: float) -> list[bytes]:
    """Notifications of ``plane`` until ``want`` arrived or ``timeout_s`` passed."""
    got: list[bytes] = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got += plane.poll_notifications()
        time.sleep(0.001)
    return got


def notif_arrives(plane: ServingPlane, notif: bytes, timeout_s: float) -> bool:
    """Whether ``notif`` shows up among ``plane``'s notifications within ``timeout_s`` (others,
    e.g. late ones of cancelled transfers, are dropped)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if notif in plane.poll_notifications():
            return True
        time.sleep(0.001)
    return False


def blocks_for(nbytes: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` that hold ``nbytes`` (at least 1)."""
    return max(1, -(-nbytes // block_bytes))


@dataclass
class Transfer:
    """One transfer driven through the contract (see :meth:`Pair.begin`)."""

    grant: bytes
    handle: Any
    prod_runs: list[Run]
    cons_runs: list[Run]
    nbytes: int
    data: np.ndarray
    notif: bytes


@dataclass
class Pair:
    """A producer plane (a serving half) and a consumer plane (a fetching half), each over its own
    region."""

    producer: ServingPlane
    consumer: FetchingPlane
    prod_region: HostRegion
    cons_region: HostRegion
    deadline_s: float
    extra: list[ServingPlane | FetchingPlane] = field(default_factory=list)
    #: the consumer's ``bind_peer`` result for the producer (``start``'s ``prepared``)
    binding: Any = None

    def begin(self, prod_runs: Sequence[Run], cons_runs: Sequence[Run], nbytes: int, seed: int,
              notif: bytes | None = None, grant: bytes | None = None) -> Transfer:
        """Write a pattern into the producer's runs and start moving it, as the nodes do."""
        data = pattern(nbytes, seed)
        self.prod_region.write(list(prod_runs), data)
        notif = f"notif-{seed}".encode() if notif is None else notif
        if grant is None:
            grant = self.producer.describe(list(prod_runs), nbytes)
        handle = self.consumer.start(self.binding, grant, list(cons_runs), nbytes, notif)
        return Transfer(grant, handle, list(prod_runs), list(cons_runs), nbytes, data, notif)

    def finish(self, t: Transfer) -> XferState:
        """Wait for ``t`` (bounded), release its handle, return the consumer's final state."""
        try:
            return wait_state(self.consumer, t.handle, self.deadline_s)
        finally:
            self.consumer.release(t.handle)

    def round_trip(self, prod_runs: Sequence[Run], cons_runs: Sequence[Run], nbytes: int,
                   seed: int, grant: bytes | None = None) -> Transfer:
        """A complete transfer; asserts DONE and equal bytes."""
        t = self.begin(prod_runs, cons_runs, nbytes, seed, grant=grant)
        assert self.finish(t) is XferState.DONE, "transfer did not complete"
        assert_same(read_runs(self.cons_region, cons_runs, nbytes), t.data)
        return t
