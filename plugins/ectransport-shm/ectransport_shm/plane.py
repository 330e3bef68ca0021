"""The ``shm`` data plane: same-host transfers through a POSIX shared-memory segment.

Both nodes' regions are plain host memory (:class:`ectransport.store.HostRegion`, anonymous), so
neither side can map the other's blocks. The plane is therefore PUSH-model (see
:mod:`ectransport.data.base`) with a shared bounce buffer:

1. Producer, at construction: listens on a Linux *abstract* Unix socket
   (``@ectransport-shm.<identity>.<pid>.<random>``; nothing in the file system, nothing to leak),
   served by an accept thread and one thread per connection (at most ``max_connections``).
2. Session binding (plugin API 2, :mod:`ectransport_shm.locality`): the consumer's
   :meth:`ShmPlane.locality` says which kernel and network namespace it is in; the producer's
   :meth:`ShmPlane.reachable` accepts only its own (the abstract socket exists only in its network
   namespace), so shm is never negotiated where it cannot work. The producer declares
   (:meth:`ShmPlane.endpoint`) its socket, identity and a random plane key; the consumer's
   :meth:`ShmPlane.bind_peer` checks the declaration against the authenticated identity and its
   own locality, and every grant of the session must name that socket.
3. Producer, :meth:`ShmPlane.describe`: registers a random 128-bit token → the granted blocks and
   returns a msgpack :class:`~ectransport_shm.wire.ShmGrant` (socket name, boot id, token, sizes).
   No region address leaves the producer.
4. Consumer, :meth:`ShmPlane.start`: refuses, before any I/O, a grant not covered by the session's
   binding (:class:`~ectransport.errors.DataPlaneError`); else a background thread takes a pooled
   connection to the bound socket (or opens one, and checks the listener's proof of the plane
   key) and sends :class:`~ectransport_shm.wire.ShmRequest` ``{token, notif}``.
5. Producer: the first request on a connection creates the connection's segment
   (``segment_bytes``, default 16 MiB, in ``/dev/shm``; see :mod:`ectransport_shm.segments`) and
   passes a read-only descriptor of it with the reply (``SCM_RIGHTS``). The segment is a ring of
   ``segment_bytes // chunk_bytes`` slots: the producer copies chunk *i* of the granted runs into
   slot *i mod K* and sends its end offset (8 bytes); the consumer copies the slot into its local
   runs and, when the producer will need that slot again, answers one ack byte. The producer
   checks ``revoke`` before every chunk, and queues ``notif`` for
   :meth:`ShmPlane.poll_notifications` after the last chunk (it no longer reads the region then).
6. The connection and its mapped segment stay pooled on both sides for the next transfer, so a
   steady-state transfer maps nothing and faults no page. A connection is pooled (and reused)
   only if nothing unexpected waits on it; see :mod:`ectransport_shm.wire` for the stream rules.

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

Same host and same network namespace only, Linux only (abstract sockets, ``SCM_RIGHTS``,
``/proc``). The request-serving skeleton (accept loop, receive handles, pool) is shared with the
TCP plane through :mod:`ectransport.data.serving`; the framing and stream checks here still
duplicate the TCP plane's in spirit (see the plugin README).
"""

from __future__ import annotations

import collections
import ctypes
import hmac
import logging
import os
import secrets
import shutil
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

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

from ectransport_shm import locality, segments
from ectransport_shm.locality import (
    IDENTITY_RE,
    KEY_BYTES,
    NONCE_BYTES,
    ShmBinding,
    ShmEndpoint,
    decode_endpoint,
    decode_locality,
    names_identity,
    proof,
)
from ectransport_shm.wire import (
    ACK,
    MAX_NOTIF_BYTES,
    PROGRESS_BYTES,
    SHM_WIRE_VERSION,
    STATUS_BAD_REQUEST,
    STATUS_INTERNAL,
    STATUS_OK,
    STATUS_UNKNOWN_GRANT,
    ShmGrant,
    ShmHello,
    ShmProof,
    ShmReply,
    ShmRequest,
    close_fds,
    grant_decoder,
    hello_decoder,
    proof_decoder,
    quiet,
    recv_header,
    reply_decoder,
    request_decoder,
)

__all__ = ["MAX_NOTIF_BYTES", "SHM_WIRE_VERSION", "ShmGrant", "ShmPlane"]

_log = logging.getLogger(__name__)

_JOIN_S = 2.0

_OPTIONS = {
    "segment_dir": segments.DEFAULT_SEGMENT_DIR,  # where segments are created
    "segment_bytes": 16 << 20,  # producer: ring segment per connection
    "chunk_bytes": 2 << 20,  # producer: ring slot (pipelining unit)
    **SERVING_DEFAULTS,  # timeouts and thread/pool bounds (io_timeout_s: one header, chunk or ack)
}


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
        node_id: this node's id (put in grants and in the declaration).
        region: the node's DRAM region (``buf`` if present, else ``addr``/``nbytes``); it must
            outlive the plane.
        identity: the node's authenticated identity (:func:`ectransport.data.base.identity_of`
            of its CURVE public key; ``""`` in insecure mode): lower-case hex, at most 64 digits.
            It is part of the socket name and of the declaration, so a consumer can check that the
            socket belongs to the producer it authenticated.
        segment_dir ["/dev/shm"]: where segments are created.
        segment_bytes [16 MiB] / chunk_bytes [2 MiB]: ring size and slot size; segment_bytes a
            multiple of chunk_bytes.
        connect_timeout_s [5], io_timeout_s [10], idle_timeout_s [60]: socket waits, seconds.
        max_connections [64], max_inflight [64], max_idle_per_peer [8]: thread and pool bounds.

    Thread safety: every method may be called from any thread.

    ``stats`` counts ``accepted``/``refused`` connections, ``served``/``aborted``/``unknown``
    grants and ``bad`` requests (producer), and ``stale``/``stray`` connections not reused and
    ``proof_failed`` listeners (consumer).

    Raises:
        ConfigError: unknown or invalid option or identity, a non-DRAM region.
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

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        reject_unknown("shm plane", options, _OPTIONS)
        opts = {**_OPTIONS, **options}
        if getattr(region, "mem_kind", "DRAM") != "DRAM":
            raise ConfigError(f"shm plane moves DRAM only, region is {region.mem_kind!r}")
        if not isinstance(identity, str) or not IDENTITY_RE.match(identity):
            raise ConfigError(f"shm plane identity must be lower-case hex of at most 64 digits "
                              f"(identity_of(public_key)) or empty, got {identity!r}")
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
        self._identity = identity
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
        self._where = locality.here()  # None: /proc unreadable, shm reaches nobody
        self._locality = msgspec.msgpack.encode(self._where) if self._where else b""
        self._boot_id = self._where.boot_id if self._where else locality.boot_id()
        self._host = socket.gethostname()
        self._key = secrets.token_bytes(KEY_BYTES)
        segments.sweep_stale_segments(self._segment_dir)

        self._lock = threading.Lock()
        self._closed = False
        # producer state
        self._grants: dict[bytes, _Served] = {}
        self._notifs = Notifications()
        self.stats: collections.Counter[str] = collections.Counter()
        # consumer state
        self._receives = Receives(self._lock, self._opt.max_inflight, "shm plane")
        self._pool: ConnectionPool[tuple[str, bytes], _Chan] = ConnectionPool(
            self._lock, self._opt.max_idle_per_peer)
        self._bound: dict[tuple[str, bytes], int] = {}  # pool key -> live bindings

        self.socket_name = locality.socket_name(identity, os.getpid(), secrets.token_hex(8))
        self._endpoint = b"" if self._where is None else msgspec.msgpack.encode(ShmEndpoint(
            self.socket_name, self._where, identity, self._key, node_id[:256], self._host[:255]))
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

    # -- session binding (plugin API 2) -----------------------------------------------------------
    def locality(self) -> bytes:
        """Consumer side: this node's kernel (boot id) and network namespace (device and inode
        of ``/proc/self/ns/net``) as a msgpack :class:`~ectransport_shm.locality.ShmLocality`
        (about 70 bytes); ``b""`` if ``/proc`` cannot tell (then no producer finds it reachable)."""
        return self._locality

    def reachable(self, locality: bytes) -> bool:
        """Producer side: True only if the consumer is on this kernel and in this plane's network
        namespace (where its abstract socket exists). ``b""`` (a node from before plugin API 2)
        and malformed tokens: False, so the next common plane is negotiated. Never raises."""
        try:
            other = decode_locality(locality)
            return other is not None and self._where is not None and other == self._where
        except Exception:  # noqa: BLE001 - the contract says never raise
            return False

    def endpoint(self) -> bytes:
        """Producer side: the msgpack :class:`~ectransport_shm.locality.ShmEndpoint` (socket,
        locality, identity, plane key, node id); ``b""`` if this plane reaches nobody."""
        return self._endpoint

    def bind_peer(self, endpoint: bytes, *, peer: str, host: str, identity: str) -> ShmBinding:
        """Consumer side: accept a producer's declaration; the binding names only its socket.

        Raises:
            DataPlaneError: an empty or malformed declaration; one made under another identity
                than ``identity`` (what the control plane authenticated; ``""`` in insecure mode,
                where there is nothing to compare) or naming a socket of another identity than
                its own; a producer on another host or in another network namespace; a closed
                plane.
        """
        if not endpoint:
            raise DataPlaneError(
                f"the producer at {peer} declared no shm endpoint (a node from before plugin API "
                f"2?): shm grants cannot be bound to it; offer another plane")
        try:
            ep = decode_endpoint(endpoint)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise DataPlaneError(f"malformed shm endpoint from {peer} ({len(endpoint)} bytes): "
                                 f"{exc}") from exc
        if identity and ep.identity != identity:  # "": insecure mode, no identity to check
            raise DataPlaneError(
                f"the shm endpoint from {peer} is declared for identity {ep.identity or '(none)'}, "
                f"but the control plane authenticated {identity or '(none)'}: refused")
        if not names_identity(ep.socket, ep.identity):
            raise DataPlaneError(f"the shm endpoint from {peer} names socket @{ep.socket}, which "
                                 f"is not a socket of identity {ep.identity or '(none)'}: refused")
        if self._where is None or ep.where != self._where:
            what = "host" if ep.where.boot_id != self._boot_id else "network namespace"
            raise DataPlaneError(
                f"the shm plane of {peer} (host {ep.host!r}) is in another {what} than this "
                f"consumer: shm works within one host and network namespace only, and should "
                f"not have been negotiated")
        binding = ShmBinding(ep, peer)
        with self._lock:
            if self._closed:
                raise DataPlaneError("shm plane is closed")
            self._bound[binding.pool_key] = self._bound.get(binding.pool_key, 0) + 1
            if ep.node:
                self._pool.note_locked(ep.node, binding.pool_key)
        return binding

    def unbind_peer(self, binding: Any) -> None:
        """Consumer side: the session ended; its binding refuses new grants, and the pooled
        connections to its socket are closed once no other binding uses them. Never raises."""
        if not isinstance(binding, ShmBinding):
            return
        with self._lock:
            if binding.ended:
                return
            binding.ended = True
            left = self._bound.get(binding.pool_key, 0) - 1
            if left > 0:
                self._bound[binding.pool_key] = left
                return
            self._bound.pop(binding.pool_key, None)
        while (chan := self._pool.take(binding.pool_key)) is not None:
            chan.close()

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
        return msgspec.msgpack.encode(ShmGrant(self.socket_name, self._boot_id, self._host[:255],
                                               token, nbytes, blocks * self._block_bytes,
                                               self.node_id[:256]))

    def revoke(self, plane_grant: bytes) -> None:
        """Stop serving ``plane_grant``: later requests get UNKNOWN_GRANT; a transfer in progress
        copies no further chunk once this returns (it waits out at most one chunk copy).
        Unknown or malformed grants: no-op."""
        token = grant_token(grant_decoder, plane_grant)
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

        ``prepared`` must be the session's :meth:`bind_peer` result; the grant must name the
        socket and node it declared.

        Raises:
            DataPlaneError: no binding or an ended one, a malformed grant, a grant from another
                machine or not covered by the binding, runs/nbytes that do not match it, an
                oversized ``notif``, too many receives, or the plane is closed.
        """
        if not isinstance(prepared, ShmBinding):
            raise DataPlaneError(
                f"shm plane: start() needs the session's binding (bind_peer's result), got "
                f"{type(prepared).__name__}: an unbound grant could name any local socket")
        binding = prepared
        try:
            grant = grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError) as exc:
            raise DataPlaneError(f"malformed shm grant ({len(plane_grant)} bytes): {exc}") from exc
        if grant.boot_id != self._boot_id:
            raise DataPlaneError(
                f"shm grant comes from host {grant.host!r} (boot id {grant.boot_id}), this is "
                f"{self._host!r} (boot id {self._boot_id}): the shm plane is same-host only; "
                f"negotiate tcp/ucx for remote producers")
        if grant.socket != binding.socket or grant.node != binding.node:
            raise DataPlaneError(
                f"shm grant names @{grant.socket} (node {grant.node!r}), but the session with "
                f"{binding.peer} declared @{binding.socket} (node {binding.node!r}): refused")
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
            if binding.ended:
                raise DataPlaneError(f"the shm session with {binding.peer} has ended (unbound)")
            self._receives.admit_locked(handle)
            handle.start(self._receive, (handle, binding, request, views),
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
            self._bound.clear()
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
        """One connection (on its :class:`Acceptor` thread, which closes it): the challenge, then
        requests until EOF, error, abort or idle timeout."""
        if not self._answer_hello(conn):
            return
        seg: segments.Segment | None = None
        try:
            while not self._closed:
                try:
                    body, _ = recv_header(conn, self._opt.idle_timeout_s,
                                          self._opt.io_timeout_s, False)
                    req = request_decoder.decode(body)
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

    def _answer_hello(self, conn: socket.socket) -> bool:
        """Prove to a new connection that this is the plane the session declared (plane key)."""
        try:
            body, _ = recv_header(conn, self._opt.io_timeout_s, self._opt.io_timeout_s, False)
            hello = hello_decoder.decode(body)
        except (OSError, PeerClosed):
            return False
        except (ValueError, msgspec.DecodeError) as exc:
            self._reply_error(conn, STATUS_BAD_REQUEST, f"expected a hello: {exc}")
            return False
        if hello.v != SHM_WIRE_VERSION:
            self._reply_error(conn, STATUS_BAD_REQUEST,
                              f"shm wire version {hello.v}, expected {SHM_WIRE_VERSION}")
            return False
        mac = proof(self._key, hello.nonce, self.socket_name, self._identity)
        try:
            conn.settimeout(self._opt.io_timeout_s)
            conn.sendall(frame(ShmProof(SHM_WIRE_VERSION, mac)))
        except OSError:
            return False
        return True

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
                        if got.count(ACK) != len(got):
                            self._count("bad")
                            _log.debug("shm plane: consumer sent %r instead of ack bytes", got)
                            return False
                        acked += len(got)
                    lo, hi = i * chunk, min(nbytes, (i + 1) * chunk)
                    with served.lock:
                        if served.revoked or self._closed:
                            self._count("aborted")
                            return False
                        _copy_span(served.views, lo, hi, ring, (i % slots) * chunk, True)
                    conn.sendall(hi.to_bytes(PROGRESS_BYTES, "big"))
                del ring
        except OSError as exc:
            self._count("aborted")
            _log.debug("shm plane: transfer aborted: %s", exc)
            return False
        self._count("served")
        self._notifs.push(req.notif)
        return True

    # -- consumer internals -----------------------------------------------------------------------
    def _receive(self, handle: Receive, binding: ShmBinding, request: bytes,
                 views: list[tuple[int, np.ndarray]]) -> None:
        """Receive thread: request, reply, chunks into ``views``; sets DONE or ERR."""
        chan: _Chan | None = None
        try:
            for attempt in (0, 1):
                chan, reused = self._channel(binding, fresh=attempt > 0)
                with handle.sock_lock:
                    if handle.cancelled:
                        return
                    handle.sock = chan.sock
                try:
                    chan.sock.settimeout(self._opt.io_timeout_s)
                    chan.sock.sendall(request)
                    body, fds = recv_header(chan.sock, self._opt.io_timeout_s,
                                            self._opt.io_timeout_s, True)
                    break
                except (PeerClosed, ConnectionResetError, BrokenPipeError):
                    if not reused or handle.cancelled:
                        raise
                    chan.close()  # a stale pooled connection: retry once on a fresh one
                    chan = None
            try:
                reply = reply_decoder.decode(body)
                if reply.v != SHM_WIRE_VERSION:
                    raise DataPlaneError(f"shm wire version {reply.v}, expected "
                                         f"{SHM_WIRE_VERSION}")
                if reply.status != STATUS_OK:
                    handle.detail = f"producer refused: status {reply.status} ({reply.detail})"
                    if reply.status == STATUS_UNKNOWN_GRANT and not fds:  # stream in sync
                        self._give_back(binding, chan, handle)
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
                close_fds(fds)
            if reply.nbytes != handle.nbytes:
                raise DataPlaneError(f"producer sends {reply.nbytes} bytes, expected "
                                     f"{handle.nbytes}")
            if handle.nbytes:
                self._drain(handle, chan, views)
            with handle.io_lock:
                if handle.cancelled:
                    return
                handle.state = XferState.DONE
            self._give_back(binding, chan, handle)
            chan = None
        except (OSError, ValueError, msgspec.DecodeError, DataPlaneError) as exc:
            handle.detail = f"{type(exc).__name__}: {exc}"
            _log.debug("shm plane: receive from @%s failed: %s", binding.socket, exc)
        except Exception:
            handle.detail = "internal error"
            _log.exception("shm plane: receive thread failed")
        finally:
            if chan is not None:
                chan.close()
            handle.settle()

    def _drain(self, handle: Receive, chan: _Chan, views: list[tuple[int, np.ndarray]]) -> None:
        """Copy every chunk out of the ring as its progress record arrives; ack reused slots.
        Reads at most the progress records this grant announced (never the next reply)."""
        seg, chunk, sock = chan.seg, chan.chunk_bytes, chan.sock
        if seg is None:
            raise DataPlaneError("producer streams data but never sent a segment")
        slots = seg.nbytes // chunk
        nbytes = handle.nbytes
        total = -(-nbytes // chunk)
        done, pending = 0, b""
        sock.settimeout(self._opt.io_timeout_s)
        while done < total:
            data = sock.recv(PROGRESS_BYTES * (total - done) - len(pending))
            if not data:
                raise PeerClosed(f"producer closed after {done} of {total} chunks")
            pending += data
            while len(pending) >= PROGRESS_BYTES:
                end = int.from_bytes(pending[:PROGRESS_BYTES], "big")
                pending = pending[PROGRESS_BYTES:]
                lo, hi = done * chunk, min(nbytes, (done + 1) * chunk)
                if end != hi:
                    raise DataPlaneError(f"producer progress {end}, expected {hi}")
                with handle.io_lock:
                    if handle.cancelled:
                        return
                    _copy_span(views, lo, hi, seg, (done % slots) * chunk, False)
                if done + slots < total:
                    sock.sendall(ACK)  # slot free for chunk done + slots
                done += 1

    def _channel(self, binding: ShmBinding, fresh: bool) -> tuple[_Chan, bool]:
        """A pooled connection to the bound socket with nothing waiting on it, or a new one whose
        listener proved it holds the declared plane key."""
        if not fresh:
            while (idle := self._pool.take(binding.pool_key)) is not None:
                if quiet(idle.sock):
                    return idle, True
                self._count("stale")  # EOF or stray bytes: never reuse it
                idle.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._opt.connect_timeout_s)
            sock.connect("\0" + binding.socket)
            self._check_proof(sock, binding)
        except BaseException:
            sock.close()
            raise
        return _Chan(sock), False

    def _check_proof(self, sock: socket.socket, binding: ShmBinding) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sock.settimeout(self._opt.io_timeout_s)
        sock.sendall(frame(ShmHello(SHM_WIRE_VERSION, nonce)))
        body, _ = recv_header(sock, self._opt.io_timeout_s, self._opt.io_timeout_s, False)
        try:
            answer = proof_decoder.decode(body)
        except (msgspec.DecodeError, TypeError) as exc:
            answer = None
            why = f"no proof ({exc})"
        else:
            why = f"wire version {answer.v}" if answer.v != SHM_WIRE_VERSION else "wrong proof"
        want = proof(binding.key, nonce, binding.socket, binding.identity)
        if answer is None or answer.v != SHM_WIRE_VERSION or \
                not hmac.compare_digest(answer.mac, want):
            self._count("proof_failed")
            raise DataPlaneError(
                f"the process listening on @{binding.socket} is not the shm plane that "
                f"{binding.peer} declared ({why}): refused")

    def _give_back(self, binding: ShmBinding, chan: _Chan, handle: Receive) -> None:
        """Pool ``chan`` if the receive was not cancelled, the session is bound and nothing
        unexpected waits on the stream; else close it."""
        with handle.sock_lock:
            reusable, handle.sock = not handle.cancelled, None
        if reusable and not quiet(chan.sock):
            self._count("stray")
            reusable = False
        if binding.ended:
            reusable = False
        if not reusable or not self._pool.put(binding.pool_key, chan):
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
