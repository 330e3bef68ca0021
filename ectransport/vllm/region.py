"""The host region shared by a vLLM engine's scheduler process and its worker processes.

One ``/dev/shm`` file per engine (``ectransport-vllm-<engine_id>-dp<rank>.region``, mode 0600),
created by the scheduler side, which registers it with the data plane (NIXL reads and writes the
scheduler's mapping); the workers map the same file and copy encoder outputs into it (producer) or
out of it (consumer). A block is one row of ``hidden × element_size`` bytes, as in vLLM's
ECCPUConnector.

**Liveness lock.** The creator holds an exclusive ``flock`` on the file for its lifetime; the
kernel drops it when the process dies, even by SIGKILL. At start-up every creator scans the
directory for ``ectransport-vllm-*.region`` files of its own user whose lock is free: their owner
died without cleaning up, so they are removed (vLLM's own region file leaks in that case).

Workers must not use :class:`~ectransport.store.HostRegion` to join: it pre-faults by writing a
zero into every page, which would corrupt entries already in the file. :class:`WorkerMapping`
maps without writing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import time

from ectransport.errors import ConfigError
from ectransport.store import HostRegion, Run

log = logging.getLogger("ectransport.vllm.region")

PREFIX = "ectransport-vllm-"
SUFFIX = ".region"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def region_path(shm_dir: str, engine_key: str) -> str:
    """The region file of one engine (``engine_key`` is sanitised to a file name)."""
    name = _UNSAFE.sub("_", engine_key)[:160] or "engine"
    return os.path.join(shm_dir, f"{PREFIX}{name}{SUFFIX}")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def reclaim_stale(shm_dir: str) -> list[str]:
    """Remove region files whose creator died (their lock is free). Returns the removed paths.

    Only regular files owned by this user are considered; a live engine's file is never touched.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError as e:
        raise ConfigError(f"cannot list {shm_dir} for stale regions: {e.strerror or e}") from e
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            if _try_lock(fd) and _same_file(fd, path):
                os.unlink(path)
                removed.append(path)
                log.warning("removed stale region %s: its process died without cleaning up", path)
        except OSError:
            continue
        finally:
            os.close(fd)  # drops the lock, if taken
    return removed


class SharedRegion:
    """The scheduler side's region file (see module docstring): created, locked, registered.

    Args:
        path: the file (see :func:`region_path`).
        num_blocks / block_bytes: size of the region.

    Raises:
        ConfigError: a live engine already uses this path, or the file cannot be created.
    """

    def __init__(self, path: str, num_blocks: int, block_bytes: int):
        self.path = path
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.nbytes = num_blocks * block_bytes
        self._lock_fd: int | None = None
        reclaim_stale(os.path.dirname(path) or ".")
        for _ in range(5):
            try:
                region = HostRegion(num_blocks, block_bytes, path=path, create=True)
            except FileExistsError:
                raise ConfigError(f"region file {path} belongs to a live engine with the same "
                                  "engine id; give each engine its own engine_id") from None
            except OSError as e:
                raise ConfigError(f"cannot create region file {path} ({self.nbytes} bytes): "
                                  f"{e.strerror or e}") from e
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            locked = False
            for _ in range(100):  # a concurrent reclaim_stale may hold it for a moment
                if _try_lock(fd):
                    locked = True
                    break
                time.sleep(0.01)
            if locked and _same_file(fd, path):
                self.region = region
                self._lock_fd = fd
                return
            os.close(fd)  # a reclaimer removed our fresh file (before we locked it): again
            region.close()
        raise ConfigError(f"could not create and lock region file {path}")

    def part(self, first_block: int, num_blocks: int) -> RegionPart:
        """Blocks ``[first_block, first_block + num_blocks)`` as a region of their own."""
        return RegionPart(self.region, first_block, num_blocks)

    def close(self) -> None:
        """Unlink the file and unmap it (workers keep their own mapping until they close).
        Idempotent."""
        self.region.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class RegionPart:
    """A block range of a :class:`HostRegion`, usable wherever a HostRegion is (nodes, planes).

    ``offset`` is its first byte in the file, which is what workers address.
    """

    mem_kind = "DRAM"
    path = None

    def __init__(self, region: HostRegion, first_block: int, num_blocks: int):
        if first_block < 0 or num_blocks < 1 or first_block + num_blocks > region.num_blocks:
            raise ValueError(f"blocks [{first_block}, +{num_blocks}) outside the region's "
                             f"{region.num_blocks}")
        self.block_bytes = region.block_bytes
        self.num_blocks = num_blocks
        self.nbytes = num_blocks * region.block_bytes
        self.offset = first_block * region.block_bytes
        self.buf = region.buf[self.offset: self.offset + self.nbytes]
        self.addr = region.addr + self.offset

    view = HostRegion.view
    write = HostRegion.write
    read = HostRegion.read

    def spans(self, runs: tuple[Run, ...], nbytes: int) -> list[tuple[int, int]]:
        """``(file offset, length)`` of the first ``nbytes`` bytes of ``runs``, in payload order."""
        out, left = [], nbytes
        for r in runs:
            if left <= 0:
                break
            n = min(left, r.count * self.block_bytes)
            out.append((self.offset + r.start * self.block_bytes, n))
            left -= n
        return out

    def close(self) -> None:
        """The owner of the whole region unmaps it; a part has nothing of its own."""


class WorkerMapping:
    """A worker's read/write mapping of the scheduler's region file (no pre-faulting writes).

    Raises:
        ConfigError: the file is missing, not a regular file of this user with mode 0600, or
            smaller than ``nbytes``.
    """

    def __init__(self, path: str, nbytes: int):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise ConfigError(f"cannot open region file {path}: {e.strerror or e}; the "
                              "scheduler side creates it") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or \
                    stat.S_IMODE(st.st_mode) & 0o077:
                raise ConfigError(f"region file {path} is not a private (0600) regular file of "
                                  "this user; refusing to map it")
            if st.st_size < nbytes:
                raise ConfigError(f"region file {path} has {st.st_size} bytes, expected {nbytes}")
            self._mmap = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path = path
        self.nbytes = nbytes

    def tensor(self):
        """The whole mapping as a 1-D ``torch.uint8`` CPU tensor (no copy)."""
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "buffer is not writable" does not apply to mmap
            return torch.frombuffer(self._mmap, dtype=torch.uint8)

    def close(self) -> None:
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
