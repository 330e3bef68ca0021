"""The ``shm`` data plane: same-host transfers through a POSIX shared-memory segment.

Both nodes' regions are plain host memory (:class:`ectransport.store.HostRegion`, anonymous), so
neither side can map the other's blocks. The plane is therefore PUSH-model (see
:mod:`ectransport.data.base`) with a shared bounce buffer:

1. Producer, at construction: listens on a Linux *abstract* Unix socket
   (``@ectransport-shm.<pid>.<random>``; nothing in the file system, nothing to leak), served by
   an accept thread and one thread per connection (at most ``max_connections``).
2. Producer, :meth:`ShmPlane.describe`: registers a random 128-bit token → the granted blocks and
   returns a msgpack :class:`ShmGrant` (socket name, this machine's boot id and host name, token,
   sizes). No region address leaves the producer.
3. Consumer, :meth:`ShmPlane.start`: refuses a grant from another machine (boot id differs) with
   :class:`~ectransport.errors.DataPlaneError` at once; else a background thread takes a pooled
   connection to the producer's socket (or opens one) and sends :class:`ShmRequest`
   ``{token, notif}``.
4. Producer: the first request on a connection creates the connection's segment
   (``segment_bytes``, default 16 MiB, in ``/dev/shm``; see :mod:`ectransport_shm.segments`) and
   passes a read-only descriptor of it with the :class:`ShmReply` (``SCM_RIGHTS``). The segment is
   a ring of ``segment_bytes // chunk_bytes`` slots: the producer copies chunk *i* of the granted
   runs into slot *i mod K* and sends its end offset (8 bytes); the consumer copies the slot into
   its local runs and, when the producer will need that slot again, answers one ack byte. The
   producer checks ``revoke`` before every chunk, and queues ``notif`` for
   :meth:`ShmPlane.poll_notifications` after the last chunk (it no longer reads the region then).
5. The connection and its mapped segment stay pooled on both sides for the next transfer, so a
   steady-state transfer maps nothing and faults no page.

Copies: **two memcpy per byte** (region → segment by the producer, segment → runs by the
consumer), pipelined chunk by chunk across the two processes, so the wall time of a large
transfer approaches one memcpy plus one chunk. A single-copy design would need one side to write
the other's anonymous memory (``process_vm_writev``/CMA, ptrace-permission dependent) or a
shared region; this plane trades one copy for needing nothing but ``/dev/shm``.

Robustness: segments are unlinked before anyone uses them and live as long as a mapping or
descriptor does, so a SIGKILLed peer leaks nothing; the creation window is covered by a sweep of
dead owners' segments at every plane start-up and close. The producer maps only segments it
created; the consumer gets a read-only descriptor of a 0400 file, so a (non-root) consumer cannot
truncate the segment under the producer (which would SIGBUS it). Every socket wait is bounded by
``io_timeout_s``; a vanished peer (EOF) ends the transfer in ERR.

Same-host only, Linux only (abstract sockets, ``SCM_RIGHTS``, ``/proc``).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import secrets
import shutil
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
from ectransport.data.base import (
    PLUGIN_API_VERSION,
    Capabilities,
    DataTransport,
    RegionLike,
    TransferModel,
    XferState,
)
from ectransport.data.options import SERVING_DEFAULTS, ServingOptions, reject_unknown
from ectransport.data.runs import check_runs, payload_spans
from ectransport.data.serving import (
    PREFIX_BYTES,
    TOKEN_BYTES,
    Acceptor,
    ConnectionPool,
    Notifications,
    PeerClosed,
    Receive,
    Receives,
    close_quietly,
    frame,
    grant_token,
    new_token,
    receive_state,
)
from ectransport.errors import ConfigError, DataPlaneError
from ectransport.store import Run

from ectransport_shm import segments

_log = logging.getLogger(__name__)

#: Version of the shm plane's own wire format (request/reply headers), checked on every header.
SHM_WIRE_VERSION = 1
MAX_HEADER_BYTES = 4096
MAX_NOTIF_BYTES = 2048

STATUS_OK = 0
STATUS_UNKNOWN_GRANT = 1  #: never granted, revoked, or the plane is closing
STATUS_BAD_REQUEST = 2
STATUS_INTERNAL = 3  #: e.g. the producer cannot create a segment (/dev/shm full)

_PROGRESS = 8  # bytes of one progress record (big-endian end offset)
_JOIN_S = 2.0

_OPTIONS = {
    "segment_dir": segments.DEFAULT_SEGMENT_DIR,  # where segments are created
    "segment_bytes": 16 << 20,  # producer: ring segment per connection
    "chunk_bytes": 2 << 20,  # producer: ring slot (pipelining unit)
    **SERVING_DEFAULTS,  # timeouts and thread/pool bounds (io_timeout_s: one header, chunk or ack)
}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class ShmGrant(msgspec.Struct, frozen=True, tag="shm/1", forbid_unknown_fields=True):
    """The ``plane_grant`` of the shm plane (msgpack; opaque to everything but this module).

    Attributes:
        socket: abstract Unix socket name of the producer's plane (without the leading NUL).
        boot_id: the producer machine's ``/proc/sys/kernel/random/boot_id`` (same-host check).
        host: the producer's host name, for error messages.
        token: 128-bit random capability naming the granted blocks at the producer.
        nbytes: payload bytes.
        runs_bytes: bytes of the granted blocks (``count × block_bytes`` summed).
        node: the producer's node id (for :meth:`ShmPlane.forget_peer`).
    """

    socket: Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    host: Annotated[str, msgspec.Meta(max_length=255)]
    token: Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    runs_bytes: Annotated[int, msgspec.Meta(ge=0)]
    node: Annotated[str, msgspec.Meta(max_length=256)] = ""


class ShmRequest(msgspec.Struct, frozen=True, tag="req", forbid_unknown_fields=True):
    """Consumer → producer: copy the blocks of ``token`` through the segment; then ``notif``."""

    v: int
    token: bytes
    notif: Annotated[bytes, msgspec.Meta(max_length=MAX_NOTIF_BYTES)]


class ShmReply(msgspec.Struct, frozen=True, tag="rep", forbid_unknown_fields=True):
    """Producer → consumer. On OK, ``ceil(nbytes / chunk_bytes)`` progress records follow.

    ``fd_attached``: this header carries (``SCM_RIGHTS``) a read-only descriptor of a new segment
    of ``segment_bytes`` bytes that replaces the connection's previous one.
    """

    v: int
    status: int
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    segment_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    chunk_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    fd_attached: bool = False
    detail: str = ""


_grant_decoder = msgspec.msgpack.Decoder(ShmGrant)
_request_decoder = msgspec.msgpack.Decoder(ShmRequest)
_reply_decoder = msgspec.msgpack.Decoder(ShmReply)


def _recv_exact(sock: socket.socket, n: int, timeout_s: float, first: bytes = b"") -> bytes:
    buf = bytearray(first)
    sock.settimeout(timeout_s)
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerClosed(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv_header(sock: socket.socket, first_timeout_s: float, timeout_s: float,
                 want_fds: bool) -> tuple[bytes, list[int]]:
    """One length-prefixed header body and the descriptors that came with it."""
    sock.settimeout(first_timeout_s)
    fds: list[int] = []
    if want_fds:
        data, fds, _flags, _addr = socket.recv_fds(sock, PREFIX_BYTES, 4,
                                                   socket.MSG_CMSG_CLOEXEC)
    else:
        data = sock.recv(PREFIX_BYTES)
    try:
        if not data:
            raise PeerClosed("peer closed before a header")
        head = _recv_exact(sock, PREFIX_BYTES, timeout_s, data)
        length = int.from_bytes(head, "big")
        if not 0 < length <= MAX_HEADER_BYTES:
            raise ValueError(f"header length {length} not in 1..{MAX_HEADER_BYTES}")
        return _recv_exact(sock, length, timeout_s), fds
    except BaseException:
        _close_fds(fds)
        raise


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _payload_views(mem: np.ndarray, runs: Sequence[Run], block_bytes: int,
                   nbytes: int) -> list[tuple[int, np.ndarray]]:
    """``(payload offset, view)`` covering the first ``nbytes`` bytes of ``runs``, adjacent runs
    merged."""
    out, pos = [], 0
    for off, n in payload_spans(runs, block_bytes, nbytes):
        out.append((pos, mem[off:off + n]))
        pos += n
    return out


def _copy_span(views: list[tuple[int, np.ndarray]], lo: int, hi: int, seg: np.ndarray,
               seg_off: int, to_seg: bool) -> None:
    """Copy payload bytes ``[lo, hi)`` between ``views`` and ``seg[seg_off:]`` (numpy copies
    release the GIL)."""
    for vo, v in views:
        if vo >= hi:
            break
        a, b = max(lo, vo), min(hi, vo + v.nbytes)
        if a >= b:
            continue
        s = seg[seg_off + a - lo: seg_off + b - lo]
        if to_seg:
            np.copyto(s, v[a - vo:b - vo])
        else:
            np.copyto(v[a - vo:b - vo], s)


class _Served:
    """Producer side: one registered grant."""

    __slots__ = ("lock", "nbytes", "revoked", "views")

    def __init__(self, views: list[tuple[int, np.ndarray]], nbytes: int):
        self.views = views
        self.nbytes = nbytes
        self.revoked = False
        self.lock = threading.Lock()  # held during each chunk copy out of the region


class _Chan:
    """Consumer side: a connection to a producer and the segment it mapped for us."""

    __slots__ = ("chunk_bytes", "mm", "seg", "sock")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.mm = None
        self.seg: np.ndarray | None = None
        self.chunk_bytes = 0

    def set_segment(self, fd: int, nbytes: int, chunk_bytes: int) -> None:
        self.drop_segment()
        self.mm = segments.map_readonly(fd, nbytes)
        self.seg = np.frombuffer(self.mm, dtype=np.uint8)
        self.chunk_bytes = chunk_bytes

    def drop_segment(self) -> None:
        self.seg = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # a slice is still alive somewhere; the collector unmaps it
            self.mm = None

    def close(self) -> None:
        close_quietly(self.sock)
        self.drop_segment()


class ShmPlane(DataTransport):
    """Same-host PUSH plane through a pooled POSIX shared-memory ring (see the module docstring).

    Args:
        node_id: this node's id (put in grants).
        region: the node's DRAM region (``buf`` if present, else ``addr``/``nbytes``); it must
            outlive the plane.
        segment_dir ["/dev/shm"]: where segments are created.
        segment_bytes [16 MiB] / chunk_bytes [2 MiB]: ring size and slot size; segment_bytes a
            multiple of chunk_bytes.
        connect_timeout_s [5], io_timeout_s [10], idle_timeout_s [60]: socket waits, seconds.
        max_connections [64], max_inflight [64], max_idle_per_peer [8]: thread and pool bounds.

    Thread safety: every method may be called from any thread.

    Raises:
        ConfigError: unknown or invalid option, a non-DRAM region.
        PlaneUnavailable: never (probe() says whether the plane can run here).
    """

    name = "shm"
    plugin_api_version = PLUGIN_API_VERSION
    capabilities = Capabilities(
        transfer_model=TransferModel.PUSH,
        mem_kinds=frozenset({"DRAM"}),
        max_transfer_bytes=None,
        notifications=True,
    )

    def __init__(self, *, node_id: str, region: RegionLike, **options: Any):
        reject_unknown("shm plane", options, _OPTIONS)
        opts = {**_OPTIONS, **options}
        if getattr(region, "mem_kind", "DRAM") != "DRAM":
            raise ConfigError(f"shm plane moves DRAM only, region is {region.mem_kind!r}")
        try:
            self._segment_dir = str(opts["segment_dir"])
            self._segment_bytes = int(opts["segment_bytes"])
            self._chunk_bytes = int(opts["chunk_bytes"])
            self._opt = ServingOptions.parse(opts)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid shm plane option: {exc}") from exc
        if self._chunk_bytes <= 0 or self._segment_bytes < self._chunk_bytes or \
                self._segment_bytes % self._chunk_bytes:
            raise ConfigError(f"shm plane segment_bytes ({self._segment_bytes}) must be a positive "
                              f"multiple of chunk_bytes ({self._chunk_bytes})")
        self._opt.check("shm plane")
        if not os.path.isdir(self._segment_dir):
            raise ConfigError(f"shm plane segment_dir {self._segment_dir!r} is not a directory")

        self.node_id = node_id
        self._block_bytes = int(region.block_bytes)
        self._num_blocks = int(region.nbytes) // self._block_bytes
        buf = getattr(region, "buf", None)
        if buf is not None:
            mem = np.frombuffer(buf, dtype=np.uint8)
        else:
            mem = np.ctypeslib.as_array((ctypes.c_ubyte * int(region.nbytes)).from_address(
                int(region.addr)))
        if mem.nbytes < self._num_blocks * self._block_bytes:
            raise ConfigError(f"region buffer has {mem.nbytes} bytes, expected "
                              f"{self._num_blocks * self._block_bytes}")
        self._mem: np.ndarray | None = mem
        self._boot_id = _boot_id()
        self._host = socket.gethostname()
        segments.sweep_stale_segments(self._segment_dir)

        self._lock = threading.Lock()
        self._closed = False
        # producer state
        self._grants: dict[bytes, _Served] = {}
        self._notifs = Notifications()
        self.stats: collections.Counter[str] = collections.Counter()
        # consumer state
        self._receives = Receives(self._lock, self._opt.max_inflight, "shm plane")
        self._pool: ConnectionPool[str, _Chan] = ConnectionPool(self._lock,
                                                                self._opt.max_idle_per_peer)

        self.socket_name = f"ectransport-shm.{os.getpid()}.{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self.socket_name)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise ConfigError(f"shm plane cannot listen on @{self.socket_name}: {exc}") from exc
        self._acceptor = Acceptor(
            listener, self._serve, lock=self._lock, stats=self.stats,
            max_connections=self._opt.max_connections, log=_log, what="shm plane",
            accept_name="ectransport-shm-accept", serve_name="ectransport-shm-serve")

    # -- discovery --------------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """Linux with abstract Unix sockets, ``SCM_RIGHTS`` and a writable ``/dev/shm``."""
        if not sys.platform.startswith("linux"):
            return False, f"Linux only (this is {sys.platform})"
        if not hasattr(socket, "send_fds"):
            return False, "Python without socket.send_fds"
        d = segments.DEFAULT_SEGMENT_DIR
        if not (os.path.isdir(d) and os.access(d, os.W_OK)):
            return False, f"{d} is missing or not writable"
        free = shutil.disk_usage(d).free
        return True, f"POSIX shm in {d} ({free / 2**30:.1f} GiB free), same host only"

    def describe_transport(self) -> str:
        return (f"shm ring {self._segment_bytes >> 20} MiB/{self._chunk_bytes >> 10} KiB chunks "
                f"in {self._segment_dir}, 2 copies, @{self.socket_name}")

    # -- producer side ----------------------------------------------------------------------------
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """Register a fresh token for exactly ``runs`` and return the msgpack :class:`ShmGrant`.

        Raises:
            DataPlaneError: the plane is closed, ``runs`` is empty or leaves the region, or
                ``nbytes`` exceeds the runs.
        """
        blocks = self._check_runs(runs, nbytes)
        views = _payload_views(self._mem_or_raise(), runs, self._block_bytes, nbytes)
        token = new_token()
        with self._lock:
            if self._closed:
                raise DataPlaneError("shm plane is closed")
            self._grants[token] = _Served(views, nbytes)
        return msgspec.msgpack.encode(ShmGrant(self.socket_name, self._boot_id, self._host,
                                               token, nbytes, blocks * self._block_bytes,
                                               self.node_id))

    def revoke(self, plane_grant: bytes) -> None:
        """Stop serving ``plane_grant``: later requests get UNKNOWN_GRANT; a transfer in progress
        copies no further chunk once this returns (it waits out at most one chunk copy).
        Unknown or malformed grants: no-op."""
        token = grant_token(_grant_decoder, plane_grant)
        if token is None:
            return
        with self._lock:
            served = self._grants.pop(token, None)
        if served is None:
            return
        with served.lock:
            served.revoked = True

    def poll_notifications(self) -> list[bytes]:
        return self._notifs.drain()

    # -- consumer side ----------------------------------------------------------------------------
    def start(self, prepared: Any, plane_grant: bytes, runs: Sequence[Run], nbytes: int,
              notif: bytes) -> Receive:
        """Request the granted blocks and copy them into local ``runs`` (background thread).

        Raises:
            DataPlaneError: malformed grant, a grant from another machine, runs/nbytes that do
                not match it, an oversized ``notif``, too many receives, or the plane is closed.
        """
        try:
            grant = _grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError) as exc:
            raise DataPlaneError(f"malformed shm grant ({len(plane_grant)} bytes): {exc}") from exc
        if grant.boot_id != self._boot_id:
            raise DataPlaneError(
                f"shm grant comes from host {grant.host!r} (boot id {grant.boot_id}), this is "
                f"{self._host!r} (boot id {self._boot_id}): the shm plane is same-host only; "
                f"negotiate tcp/ucx for remote producers")
        blocks = self._check_runs(runs, nbytes)
        local_bytes = blocks * self._block_bytes
        if grant.runs_bytes != local_bytes or grant.nbytes != nbytes:
            raise DataPlaneError(
                f"shm grant covers {grant.nbytes} bytes in {grant.runs_bytes} bytes of blocks, "
                f"the local transfer is {nbytes} bytes in {local_bytes}; both sides must use the "
                f"same block_bytes and block count")
        if len(notif) > MAX_NOTIF_BYTES:
            raise DataPlaneError(f"notif is {len(notif)} bytes, at most {MAX_NOTIF_BYTES}")
        views = _payload_views(self._mem_or_raise(), runs, self._block_bytes, nbytes)
        handle = Receive(nbytes)
        request = frame(ShmRequest(SHM_WIRE_VERSION, grant.token, bytes(notif)))
        with self._lock:
            if self._closed:
                raise DataPlaneError("shm plane is closed")
            self._receives.admit_locked(handle)
            if grant.node:
                self._pool.note_locked(grant.node, grant.socket)
            handle.start(self._receive, (handle, grant.socket, request, views),
                         "ectransport-shm-recv")
        return handle

    def check(self, handle: Any) -> XferState:
        """PROC, DONE or ERR; a released handle keeps its last state (ERR if it was in flight)."""
        return receive_state(handle)

    def release(self, handle: Any) -> None:
        """Cancel and forget a receive; idempotent. When this returns no more bytes land in the
        handle's local blocks."""
        self._receives.release(handle)

    def forget_peer(self, peer: str) -> None:
        """Close the pooled connections (and unmap the segments) of producer node ``peer``."""
        for c in self._pool.forget(peer):
            c.close()

    def close(self) -> None:
        """Stop serving, cancel every receive, close sockets and segments, join threads, sweep
        stale segments; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            grants = list(self._grants.values())
            self._grants.clear()
            self._acceptor.close_locked()
            handles = self._receives.snapshot_locked()
            pooled = self._pool.close_locked()
        for served in grants:
            with served.lock:
                served.revoked = True
        self._acceptor.stop()
        for h in handles:
            self.release(h)
        for c in pooled:
            c.close()
        self._acceptor.join_and_close([h.thread for h in handles if h.thread], _JOIN_S)
        self._notifs.clear()
        self._mem = None
        segments.sweep_stale_segments(self._segment_dir)

    # -- producer internals -----------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        """One connection (on its :class:`Acceptor` thread, which closes it): requests until EOF,
        error, abort or idle timeout."""
        seg: segments.Segment | None = None
        try:
            while not self._closed:
                try:
                    body, _ = _recv_header(conn, self._opt.idle_timeout_s,
                                           self._opt.io_timeout_s, False)
                    req = _request_decoder.decode(body)
                except (OSError, PeerClosed):
                    return
                except (ValueError, msgspec.DecodeError) as exc:
                    self._reply_error(conn, STATUS_BAD_REQUEST, f"bad request: {exc}")
                    return
                if req.v != SHM_WIRE_VERSION:
                    self._reply_error(conn, STATUS_BAD_REQUEST,
                                      f"shm wire version {req.v}, expected {SHM_WIRE_VERSION}")
                    return
                with self._lock:
                    served = self._grants.get(req.token)
                if served is None:
                    self._count("unknown")
                    if not self._reply_error(conn, STATUS_UNKNOWN_GRANT,
                                             "unknown or revoked grant"):
                        return
                    continue
                new_seg = None
                if served.nbytes > 0 and seg is None:
                    try:
                        new_seg = seg = segments.create_segment(self._segment_bytes,
                                                                self._segment_dir)
                    except OSError as exc:
                        self._reply_error(conn, STATUS_INTERNAL, f"cannot create segment: {exc}")
                        return
                if not self._send_grant(conn, req, served, seg, new_seg):
                    return
        finally:
            if seg is not None:
                seg.close()

    def _reply_error(self, conn: socket.socket, status: int, detail: str) -> bool:
        if status != STATUS_UNKNOWN_GRANT:
            self._count("bad")
            _log.debug("shm plane: %s", detail)
        try:
            conn.settimeout(self._opt.io_timeout_s)
            conn.sendall(frame(ShmReply(SHM_WIRE_VERSION, status, 0, detail=detail[:200])))
            return True
        except OSError:
            return False

    def _send_grant(self, conn: socket.socket, req: ShmRequest, served: _Served,
                    seg: segments.Segment | None, new_seg: segments.Segment | None) -> bool:
        """Stream one grant through the ring; True if the connection can take another request."""
        nbytes, chunk = served.nbytes, self._chunk_bytes
        head = frame(ShmReply(SHM_WIRE_VERSION, STATUS_OK, nbytes,
                               seg.nbytes if seg else 0, chunk, new_seg is not None))
        try:
            conn.settimeout(self._opt.io_timeout_s)
            if new_seg is not None:
                sent = socket.send_fds(conn, [head], [new_seg.ro_fd])
                new_seg.close_fd()  # the consumer holds its own copy now
                if sent < len(head):
                    conn.sendall(head[sent:])
            else:
                conn.sendall(head)
            if nbytes:
                slots = seg.nbytes // chunk
                ring = np.frombuffer(seg.mm, dtype=np.uint8)
                total = -(-nbytes // chunk)
                acked = 0
                for i in range(total):
                    while i - acked >= slots:  # slot i % slots still holds chunk i - slots
                        got = conn.recv(min(64, total - slots - acked))
                        if not got:
                            raise PeerClosed("consumer closed while the ring was full")
                        acked += len(got)
                    lo, hi = i * chunk, min(nbytes, (i + 1) * chunk)
                    with served.lock:
                        if served.revoked or self._closed:
                            self._count("aborted")
                            return False
                        _copy_span(served.views, lo, hi, ring, (i % slots) * chunk, True)
                    conn.sendall(hi.to_bytes(_PROGRESS, "big"))
                del ring
        except OSError as exc:
            self._count("aborted")
            _log.debug("shm plane: transfer aborted: %s", exc)
            return False
        self._count("served")
        self._notifs.push(req.notif)
        return True

    # -- consumer internals -----------------------------------------------------------------------
    def _receive(self, handle: Receive, name: str, request: bytes,
                 views: list[tuple[int, np.ndarray]]) -> None:
        """Receive thread: request, reply, chunks into ``views``; sets DONE or ERR."""
        chan: _Chan | None = None
        try:
            for attempt in (0, 1):
                chan, reused = self._channel(name, fresh=attempt > 0)
                with handle.sock_lock:
                    if handle.cancelled:
                        return
                    handle.sock = chan.sock
                try:
                    chan.sock.settimeout(self._opt.io_timeout_s)
                    chan.sock.sendall(request)
                    body, fds = _recv_header(chan.sock, self._opt.io_timeout_s,
                                             self._opt.io_timeout_s, True)
                    break
                except (PeerClosed, ConnectionResetError, BrokenPipeError):
                    if not reused or handle.cancelled:
                        raise
                    chan.close()  # a stale pooled connection: retry once on a fresh one
                    chan = None
            try:
                reply = _reply_decoder.decode(body)
                if reply.status != STATUS_OK:
                    handle.detail = f"producer refused: status {reply.status} ({reply.detail})"
                    if reply.status == STATUS_UNKNOWN_GRANT:  # the stream is in sync: reusable
                        self._give_back(name, chan, handle)
                        chan = None
                    return
                if reply.fd_attached:
                    if len(fds) != 1:
                        raise DataPlaneError(f"producer announced a segment, sent {len(fds)} fds")
                    if reply.chunk_bytes <= 0 or reply.segment_bytes < reply.chunk_bytes:
                        raise DataPlaneError(f"bad segment geometry {reply.segment_bytes}/"
                                             f"{reply.chunk_bytes}")
                    chan.set_segment(fds[0], reply.segment_bytes, reply.chunk_bytes)
                elif fds:
                    raise DataPlaneError("producer sent an unannounced descriptor")
            finally:
                _close_fds(fds)
            if reply.nbytes != handle.nbytes:
                raise DataPlaneError(f"producer sends {reply.nbytes} bytes, expected "
                                     f"{handle.nbytes}")
            if handle.nbytes:
                self._drain(handle, chan, views)
            with handle.io_lock:
                if handle.cancelled:
                    return
                handle.state = XferState.DONE
            self._give_back(name, chan, handle)
            chan = None
        except (OSError, ValueError, msgspec.DecodeError, DataPlaneError) as exc:
            handle.detail = f"{type(exc).__name__}: {exc}"
            _log.debug("shm plane: receive from @%s failed: %s", name, exc)
        except Exception:
            handle.detail = "internal error"
            _log.exception("shm plane: receive thread failed")
        finally:
            if chan is not None:
                chan.close()
            handle.settle()

    def _drain(self, handle: Receive, chan: _Chan, views: list[tuple[int, np.ndarray]]) -> None:
        """Copy every chunk out of the ring as its progress record arrives; ack reused slots."""
        seg, chunk, sock = chan.seg, chan.chunk_bytes, chan.sock
        if seg is None:
            raise DataPlaneError("producer streams data but never sent a segment")
        slots = seg.nbytes // chunk
        nbytes = handle.nbytes
        total = -(-nbytes // chunk)
        done, pending = 0, b""
        sock.settimeout(self._opt.io_timeout_s)
        while done < total:
            data = sock.recv(_PROGRESS * (total - done) - len(pending))
            if not data:
                raise PeerClosed(f"producer closed after {done} of {total} chunks")
            pending += data
            while len(pending) >= _PROGRESS:
                end = int.from_bytes(pending[:_PROGRESS], "big")
                pending = pending[_PROGRESS:]
                lo, hi = done * chunk, min(nbytes, (done + 1) * chunk)
                if end != hi:
                    raise DataPlaneError(f"producer progress {end}, expected {hi}")
                with handle.io_lock:
                    if handle.cancelled:
                        return
                    _copy_span(views, lo, hi, seg, (done % slots) * chunk, False)
                if done + slots < total:
                    sock.sendall(b"\x01")  # slot free for chunk done + slots
                done += 1

    def _channel(self, name: str, fresh: bool) -> tuple[_Chan, bool]:
        if not fresh:
            idle = self._pool.take(name)
            if idle is not None:
                return idle, True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._opt.connect_timeout_s)
            sock.connect("\0" + name)
        except OSError:
            sock.close()
            raise
        return _Chan(sock), False

    def _give_back(self, name: str, chan: _Chan, handle: Receive) -> None:
        with handle.sock_lock:
            reusable, handle.sock = not handle.cancelled, None
        if not self._pool.put(name, chan, keep=reusable):
            chan.close()

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    # -- shared -----------------------------------------------------------------------------------
    def _mem_or_raise(self) -> np.ndarray:
        mem = self._mem
        if mem is None or self._closed:
            raise DataPlaneError("shm plane is closed")
        return mem

    def _check_runs(self, runs: Sequence[Run], nbytes: int) -> int:
        if self._closed:
            raise DataPlaneError("shm plane is closed")
        return check_runs(runs, nbytes, self._num_blocks, self._block_bytes)
