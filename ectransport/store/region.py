"""Host memory regions that back a :class:`~ectransport.store.blocks.BlockStore`.

A region is one contiguous, pre-faulted host buffer (so the first transfer does not pay page
faults): anonymous memory, or a ``/dev/shm`` file shared by several processes of one node.
"""

from __future__ import annotations

import mmap
import os
from typing import Protocol

import numpy as np

from ectransport.store.blocks import Run


class BlockRegion(Protocol):
    """What a node needs of its region: ``num_blocks × block_bytes`` bytes of host memory at
    ``addr``, read and written by block runs.

    :class:`HostRegion` is one; so is a block range of one (``ectransport.vllm``'s
    ``RegionPart``, a node's share of a region that several nodes split). It also satisfies what a
    data plane needs (:class:`ectransport.data.base.RegionLike`).
    """

    num_blocks: int
    block_bytes: int
    nbytes: int
    addr: int  # base address, for data-plane registration
    mem_kind: str
    buf: np.ndarray  # the whole region as a 1-D uint8 array

    def view(self, runs: tuple[Run, ...] | list[Run], nbytes: int) -> list[np.ndarray]: ...

    def write(self, runs: tuple[Run, ...] | list[Run], data: np.ndarray) -> None: ...

    def read(self, runs: tuple[Run, ...] | list[Run], nbytes: int) -> np.ndarray: ...

    def close(self) -> None: ...


class HostRegion:
    """``num_blocks × block_bytes`` bytes of host (DRAM) memory.

    Attributes:
        buf: the whole region as a 1-D ``uint8`` numpy array.
        addr: its base address (int), for data-plane registration.
        path: the backing ``/dev/shm`` file when shared, else None.
    """

    mem_kind = "DRAM"

    def __init__(self, num_blocks: int, block_bytes: int, *, path: str | None = None,
                 create: bool = True):
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.nbytes = num_blocks * block_bytes
        self.path = path
        self._owner = create
        self._mmap: mmap.mmap | None = None
        if path is None:
            self.buf = np.empty(self.nbytes, dtype=np.uint8)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            fd = os.open(path, flags, 0o600)
            try:
                if create:
                    os.ftruncate(fd, self.nbytes)
                elif os.fstat(fd).st_size < self.nbytes:
                    raise ValueError(f"{path} is smaller than {self.nbytes} bytes")
                self._mmap = mmap.mmap(fd, self.nbytes)
            finally:
                os.close(fd)
            self.buf = np.frombuffer(self._mmap, dtype=np.uint8)
        if create:
            self.buf[::4096] = 0  # pre-fault every page (the memory is new: nothing to keep)
        elif self._mmap is not None:
            # joining a live region: fault pages in without writing (other processes' entries)
            try:
                self._mmap.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
            except (OSError, ValueError):
                pass  # older kernels: pages fault in on first use
        self.addr = int(self.buf.ctypes.data)

    def view(self, runs: tuple[Run, ...] | list[Run], nbytes: int) -> list[np.ndarray]:
        """The first ``nbytes`` bytes of ``runs`` as a list of ``uint8`` views (one per run)."""
        out = []
        left = nbytes
        for r in runs:
            if left <= 0:
                break
            off = r.start * self.block_bytes
            n = min(left, r.count * self.block_bytes)
            out.append(self.buf[off : off + n])
            left -= n
        return out

    def write(self, runs: tuple[Run, ...] | list[Run], data: np.ndarray) -> None:
        """Copy ``data`` (1-D uint8, C-contiguous) into the blocks of ``runs``, in order."""
        pos = 0
        for v in self.view(runs, data.nbytes):
            np.copyto(v, data[pos : pos + v.nbytes])
            pos += v.nbytes

    def read(self, runs: tuple[Run, ...] | list[Run], nbytes: int) -> np.ndarray:
        """A fresh 1-D uint8 array holding the first ``nbytes`` bytes of ``runs``."""
        views = self.view(runs, nbytes)
        if len(views) == 1:
            return views[0].copy()
        return np.concatenate(views)

    def close(self) -> None:
        """Release the mapping; the creator of a shared region also unlinks its file. Idempotent."""
        if self.path is not None and self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._owner = False
        if self._mmap is not None:
            self.buf = np.empty(0, dtype=np.uint8)
            try:
                self._mmap.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with it
            self._mmap = None
