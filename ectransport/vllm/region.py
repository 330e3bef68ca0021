"""The host region shared by a vLLM engine's scheduler process and its worker processes.

One ``/dev/shm`` file per engine (``ectransport-vllm-<engine_id>-dp<rank>.region``, mode 0600),
created by the scheduler side, which registers it with the data plane (NIXL reads and writes the
scheduler's mapping); the workers map the same file and copy encoder outputs into it (producer) or
out of it (consumer). A block is one row of ``hidden × element_size`` bytes, as in vLLM's
ECCPUConnector.

**Liveness lock.** The creator holds an exclusive ``flock`` on the file for its lifetime; the
kernel drops it when the process dies, even by SIGKILL. At start-up every creator scans the
directory for ``ectransport-vllm-*.region`` files of its own user whose lock is free: their owner
died without cleaning up, so they are removed (vLLM's own region file leaks in that case). A
file is published under its public name only once it is locked (:class:`SharedRegion`), so
engines starting at once never reclaim each other's regions. A clean shutdown unlinks the file
first (:meth:`SharedRegion.unlink`), before anything that may take time.

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
import secrets
import stat

import numpy as np

from ectransport.errors import ConfigError
from ectransport.store import HostRegion, Run

log = logging.getLogger("ectransport.vllm.region")

PREFIX = "ectransport-vllm-"
SUFFIX = ".region"
_TMP_PREFIX = ".ectransport-vllm-"
_TMP_SUFFIX = ".tmp"
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


def _is_ours(name: str) -> bool:
    """A region file, or the private name a region is created under before it is published."""
    return (name.startswith(PREFIX) and name.endswith(SUFFIX)) or \
        (name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX))


def _creator_alive(name: str) -> bool:
    """A private (not yet published) file whose creating process still runs: it may not have
    locked it yet, so it is left alone."""
    if not name.startswith(_TMP_PREFIX) or name.startswith(PREFIX):
        return False
    try:
        pid = int(name[len(_TMP_PREFIX):].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def reclaim_stale(shm_dir: str) -> list[str]:
    """Remove region files whose creator died (their lock is free). Returns the removed paths.

    Only regular files owned by this user are considered; a live engine's file is never touched:
    a region file only ever appears under its public name already locked by its creator (see
    :class:`SharedRegion`), so a free lock means a dead owner.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError as e:
        raise ConfigError(f"cannot list {shm_dir} for stale regions: {e.strerror or e}") from e
    for name in names:
        if not _is_ours(name) or _creator_alive(name):
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

    The file is created under a private name (``.ectransport-vllm-<pid>-<random>.tmp``, which no
    other engine opens), locked, and only then published under its public name with
    ``link(2)`` (which fails if the name exists). So no reclaimer can ever find a live engine's
    file unlocked: engines starting at once on one host (DP ranks, several instances) never
    remove each other's regions.

    After the ``num_blocks`` blocks the file holds ``mark_slots`` 8-byte **save marks**
    (:meth:`mark`): a worker writes the entry id of a save it completed into the slot the save
    order names, so the scheduler learns of completed saves even when vLLM drops the worker's
    reports (the V1 model runner does for an ``ec_producer``).

    Args:
        path: the file (see :func:`region_path`).
        num_blocks / block_bytes: size of the region.
        mark_slots: how many saves may be in flight at once.

    Raises:
        ConfigError: a live engine already uses this path, or the file cannot be created.
    """

    def __init__(self, path: str, num_blocks: int, block_bytes: int, mark_slots: int = 4096):
        self.path = path
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.nbytes = num_blocks * block_bytes
        self.mark_slots = mark_slots
        self.mark_offset = -(-self.nbytes // 64) * 64
        extra = -(-(self.mark_offset - self.nbytes + 8 * mark_slots) // block_bytes)
        self.file_bytes = (num_blocks + extra) * block_bytes
        self._lock_fd: int | None = None
        shm_dir = os.path.dirname(path) or "."
        reclaim_stale(shm_dir)
        tmp = os.path.join(shm_dir, f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
                                    f"{_TMP_SUFFIX}")
        try:
            region = HostRegion(num_blocks + extra, block_bytes, path=tmp, create=True)
        except OSError as e:
            raise ConfigError(f"cannot create region file {path} ({self.file_bytes} bytes): "
                              f"{e.strerror or e}") from e
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
            if not _try_lock(fd):  # nobody knows the private name: cannot happen
                os.close(fd)
                raise ConfigError(f"could not lock the new region file {tmp}")
            self._lock_fd = fd
            try:
                os.link(tmp, path)
            except FileExistsError:
                if not reclaim_stale(shm_dir) or not _link_again(tmp, path):
                    raise ConfigError(f"region file {path} belongs to a live engine with the "
                                      "same engine id; give each engine its own engine_id") \
                        from None
            except OSError as e:
                raise ConfigError(f"cannot publish region file {path}: {e.strerror or e}") from e
        except BaseException:
            region.close()  # unlinks the private name
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            raise
        os.unlink(tmp)
        region.path = path  # HostRegion.close unlinks the public name from now on
        self.region = region
        self.marks = np.frombuffer(region.buf[self.mark_offset:self.mark_offset + 8 * mark_slots],
                                   dtype=np.int64)

    def part(self, first_block: int, num_blocks: int) -> RegionPart:
        """Blocks ``[first_block, first_block + num_blocks)`` as a region of their own."""
        if first_block + num_blocks > self.num_blocks:
            raise ValueError(f"blocks [{first_block}, +{num_blocks}) outside the region's "
                             f"{self.num_blocks}")
        return RegionPart(self.region, first_block, num_blocks)

    def mark(self, slot: int) -> int:
        """The save mark in ``slot``: 0 none yet, ``entry_id`` saved, ``-entry_id`` failed."""
        return int(self.marks[slot])

    def clear_mark(self, slot: int) -> None:
        self.marks[slot] = 0

    def unlink(self) -> None:
        """Remove the file name now (mappings stay valid): the first step of a shutdown, so that
        a process killed during the rest of it leaves nothing behind. Idempotent."""
        if self.region.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.region.path)

    def close(self) -> None:
        """Unlink the file and unmap it (workers keep their own mapping until they close).
        Idempotent."""
        self.marks = np.empty(0, dtype=np.int64)
        self.region.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _link_again(tmp: str, path: str) -> bool:
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    return True


class RegionPart:
    """A block range of a :class:`HostRegion`, usable wherever a HostRegion is (nodes, planes):
    a :class:`~ectransport.store.BlockRegion`.

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
            self._mmap: mmap.mmap | None = mmap.mmap(fd, nbytes)
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
