"""Shared-memory segments of the shm plane: creation, naming, and the stale-segment sweep.

A segment is a POSIX shared-memory file in ``/dev/shm`` (the directory ``shm_open`` uses), made by
the *producer* plane for one connection and handed to the consumer as a read-only file descriptor
(``SCM_RIGHTS`` over the plane's Unix socket). Its name exists only for the few microseconds
between ``open(O_CREAT | O_EXCL)`` and ``unlink``, which :func:`create_segment` does before it
returns: from then on the memory lives exactly as long as some process maps it or holds its
descriptor, so the kernel frees it when both sides exit, SIGKILL included.

A process killed inside that window leaves a named file behind. Names carry the owner's identity,
``ectshm.<pidns>.<pid>.<starttime>.<random>`` (pid namespace inode, pid, process start time in
clock ticks since boot from ``/proc/<pid>/stat``), so :func:`sweep_stale_segments` (run by every
:class:`~ectransport_shm.ShmPlane` at start-up and at close) can unlink the leftovers of owners
that are dead, without mistaking a recycled pid or another pid namespace's process for the owner.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

_log = logging.getLogger(__name__)

#: Where segments are created (Linux: the tmpfs behind POSIX ``shm_open``).
DEFAULT_SEGMENT_DIR = "/dev/shm"
PREFIX = "ectshm."
_NAME_RE = re.compile(r"^ectshm\.(\d+)\.(\d+)\.(\d+)\.[0-9a-f]{16}$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start_ticks(pid: int) -> int | None:
    """Start time of live process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field
    22); None if no such process runs in this pid namespace (zombies count as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) is parenthesised and may contain spaces or parentheses
    fields = stat[stat.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def segment_name(pid: int | None = None) -> str:
    """A fresh segment file name owned by process ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    start = process_start_ticks(pid) or 0
    return f"{PREFIX}{_pid_namespace()}.{pid}.{start}.{secrets.token_hex(8)}"


@dataclass
class Segment:
    """A mapped segment: the producer's writable mapping and a read-only fd for the consumer.

    Attributes:
        nbytes: size, bytes.
        mm: the read-write ``MAP_SHARED`` mapping (pre-faulted).
        ro_fd: an ``O_RDONLY`` descriptor of the same memory to pass to the peer, or -1 once
            closed. The file's mode is 0400, so a non-root peer cannot re-open it for writing
            (through ``/proc/<pid>/fd``) to truncate it under the producer.
        path: the file name while it exists (only when created with ``unlink=False``), else None.
    """

    nbytes: int
    mm: mmap.mmap
    ro_fd: int
    path: str | None = None

    def close_fd(self) -> None:
        if self.ro_fd >= 0:
            os.close(self.ro_fd)
            self.ro_fd = -1

    def close(self) -> None:
        """Unmap and close; idempotent. A mapping still exported (a numpy view alive) is left to
        the garbage collector."""
        self.close_fd()
        try:
            self.mm.close()
        except BufferError:
            pass


def create_segment(nbytes: int, segment_dir: str = DEFAULT_SEGMENT_DIR, *,
                   unlink: bool = True) -> Segment:
    """Create, size, map (pre-faulted) and — unless ``unlink`` is False (tests only) — unlink a
    segment of ``nbytes`` bytes (> 0).

    Raises:
        OSError: the directory is missing or full, or the size cannot be mapped.
    """
    path = os.path.join(segment_dir, segment_name())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    ro_fd = -1
    try:
        os.ftruncate(fd, nbytes)
        ro_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        os.fchmod(fd, 0o400)
        if unlink:
            os.unlink(path)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, nbytes, flags=flags)
    except BaseException:
        if ro_fd >= 0:
            os.close(ro_fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(fd)
    return Segment(nbytes, mm, ro_fd, None if unlink else path)


def map_readonly(fd: int, nbytes: int) -> mmap.mmap:
    """Map a peer's segment descriptor read-only (pre-faulted); the caller closes ``fd``.

    Raises:
        OSError / ValueError: ``fd`` is not a regular file of at least ``nbytes`` bytes.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"the segment descriptor is not a regular file (mode {st.st_mode:o})")
    size = st.st_size
    if size < nbytes:
        raise ValueError(f"segment has {size} bytes, the peer announced {nbytes}")
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ)


def sweep_stale_segments(segment_dir: str = DEFAULT_SEGMENT_DIR) -> list[str]:
    """Unlink the segment files of this pid namespace whose owner process is dead; their paths.

    Never raises: an unreadable directory or a file of another user is skipped.
    """
    ns = _pid_namespace()
    removed = []
    try:
        entries = list(os.scandir(segment_dir))
    except OSError:
        return removed
    for entry in entries:
        m = _NAME_RE.match(entry.name)
        if m is None or int(m.group(1)) != ns:
            continue
        pid, start = int(m.group(2)), int(m.group(3))
        if process_start_ticks(pid) == start:
            continue  # owner alive (a recycled pid has another start time)
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
        _log.info("shm plane: removed stale segment %s of dead process %d", entry.path, pid)
    return removed
