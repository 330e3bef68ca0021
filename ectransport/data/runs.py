"""Block runs as byte spans of a region: the arithmetic every data plane shares.

A run is :class:`ectransport.store.Run` (block index + count) of a region of ``num_blocks`` blocks
of ``block_bytes`` bytes. A *span* is ``(offset, length)`` in bytes (offsets relative to the
region, or absolute addresses when a ``base`` is given). Lists of spans are in payload order.

Pure functions, no I/O: planes call them on their hot paths (``describe``/``start``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TypeVar

from ectransport.errors import DataPlaneError
from ectransport.store import Run

Span = tuple[int, int]  # (offset or address, length), bytes
_Buf = TypeVar("_Buf")


def check_runs(runs: Sequence[Run], nbytes: int, num_blocks: int, block_bytes: int) -> int:
    """Validate ``runs``/``nbytes`` against a region of ``num_blocks`` blocks; the block count.

    Raises:
        DataPlaneError: ``runs`` is empty, a run leaves the region or is empty, or ``nbytes`` is
            negative or more than the runs hold.
    """
    if not runs:
        raise DataPlaneError("no blocks given (runs is empty)")
    total = 0
    for r in runs:
        if r.count <= 0 or r.start < 0 or r.start + r.count > num_blocks:
            raise DataPlaneError(f"run {r} is outside the region's {num_blocks} blocks")
        total += r.count
    if nbytes < 0 or nbytes > total * block_bytes:
        raise DataPlaneError(f"nbytes {nbytes} does not fit {total} blocks of {block_bytes} bytes")
    return total


def merge_runs(runs: Sequence[Run], block_bytes: int, base: int = 0) -> list[Span]:
    """``runs`` as ``(base + offset, length)`` spans of whole blocks, adjacent runs merged."""
    out: list[Span] = []
    for r in runs:
        addr = base + r.start * block_bytes
        length = r.count * block_bytes
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((addr, length))
    return out


def payload_spans(runs: Sequence[Run], block_bytes: int, nbytes: int) -> list[Span]:
    """The spans holding the first ``nbytes`` payload bytes of ``runs`` (adjacent runs merged,
    the last span cut at ``nbytes``; none for ``nbytes == 0``)."""
    out: list[Span] = []
    left = nbytes
    for off, length in merge_runs(runs, block_bytes):
        if left <= 0:
            break
        n = min(left, length)
        out.append((off, n))
        left -= n
    return out


def views(mem: _Buf, spans: Sequence[Span]) -> list[_Buf]:
    """Slices ``mem[off:off + length]`` of a memoryview or 1-D uint8 array, one per span."""
    return [mem[off:off + n] for off, n in spans]  # type: ignore[index]


def union_cuts(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Segment lengths at the union of the boundaries of two partitions of the same total."""
    cuts = sorted(set(itertools.accumulate(a)) | set(itertools.accumulate(b)))
    return [y - x for x, y in zip([0, *cuts], cuts, strict=False) if y > x]


def split_spans(spans: Sequence[Span], segs: Sequence[int]) -> list[Span] | None:
    """Cut ``spans`` into ``segs`` lengths; None if a segment would straddle two spans or the
    lengths do not cover the spans exactly."""
    out: list[Span] = []
    i, (off, n) = 0, spans[0] if spans else (0, 0)
    for s in segs:
        if i >= len(spans) or s > n:
            return None
        out.append((off, s))
        off, n = off + s, n - s
        if n == 0:
            i += 1
            if i < len(spans):
                off, n = spans[i]
    return out if i == len(spans) else None


def segment_pair(a: Sequence[Span], b: Sequence[Span]) -> tuple[list[Span], list[Span]]:
    """Split two span lists at the union of their boundaries so that pair ``i`` has equal lengths.

    Both lists must cover the same number of bytes with positive lengths (checked by the caller).
    """
    segs = union_cuts([n for _, n in a], [n for _, n in b])
    out_a, out_b = split_spans(a, segs), split_spans(b, segs)
    assert out_a is not None and out_b is not None, "span lists of different totals"
    return out_a, out_b
