"""The ``shm`` data plane: same-host transfers through a POSIX shared-memory segment.

Both nodes' regions are plain host memory (:class:`ectransport.store.HostRegion`, anonymous), so
neither side can map the other's blocks. The plane is therefore PUSH-model (see
:mod:`ectransport.plugin`) with a shared bounce buffer:

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
   binding (:class:`~ectransport.plugin.DataPlaneError`); else a background thread takes a pooled
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
``/proc``).

Plugin API 3: the plane has both halves (``ServingPlane`` for the producer, ``FetchingPlane`` for
the consumer) in one class, a ``DataTransport``. It is built on
``ectransport.plugin.SocketServingPlane`` (this plugin imports nothing of ectransport but
``ectransport.plugin``), shared with the TCP plane: the grant registry and its revoke rule (a
revoked grant is refused from then on; a chunk copy in progress is waited out, so no byte of the
region is read for it once ``revoke`` returns), the accept and receive threads, the connection
pool and its "nothing unread" rule, framing and bounded reads, and teardown. This module adds the
abstract socket and its proof, the session binding, and the ring.
"""

from __future__ import annotations

import hmac
import os
import secrets
import shutil
import socket
import sys
from collections.abc import Hashable
from typing import Any

import msgspec
import numpy as np
from ectransport.plugin import (
    PLUGIN_API_VERSION,
    STATUS_OK,
    Capabilities,
    Channel,
    ConfigError,
    DataPlaneError,
    PeerClosed,
    Receive,
    RegionLike,
    RequestLike,
    ServedGrant,
    SocketServingPlane,
    TransferModel,
    frame,
)

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
    MAX_HEADER_BYTES,
    MAX_NOTIF_BYTES,
    PROGRESS_BYTES,
    SHM_WIRE_VERSION,
    STATUS_BAD_REQUEST,
    STATUS_INTERNAL,
    ShmGrant,
    ShmHello,
    ShmProof,
    ShmReply,
    ShmRequest,
    hello_decoder,
    proof_decoder,
    recv_header,
)

__all__ = ["MAX_NOTIF_BYTES", "SHM_WIRE_VERSION", "ShmGrant", "ShmPlane"]


def _arrays(views: list[memoryview]) -> list[tuple[int, np.ndarray]]:
    """``(payload offset, uint8 array)`` of each view (no copy), in payload order."""
    out, pos = [], 0
    for v in views:
        out.append((pos, np.frombuffer(v, dtype=np.uint8)))
        pos += v.nbytes
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


class _ServerConn:
    """Producer side: one accepted connection's state (its ring segment, made at the first
    non-empty grant)."""

    __slots__ = ("seg",)

    def __init__(self) -> None:
        self.seg: segments.Segment | None = None


class _Chan(Channel):
    """Consumer side: a connection to a producer and the segment it mapped for us."""

    __slots__ = ("chunk_bytes", "mm", "seg")

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
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
        super().close()
        self.drop_segment()


class ShmPlane(SocketServingPlane[ShmGrant, ShmBinding, _Chan]):
    """Same-host PUSH plane through a pooled POSIX shared-memory ring (see the module docstring).

    Args:
        node_id: this node's id (put in grants and in the declaration).
        region: the node's DRAM region (``buf`` if present, else ``addr``/``nbytes``); it must
            outlive the plane.
        identity: the node's authenticated identity (``ectransport.plugin.identity_of`` of its
            CURVE public key; ``""`` in insecure mode): lower-case hex, at most 64 digits.
            It is part of the socket name and of the declaration, so a consumer can check that the
            socket belongs to the producer it authenticated.
        segment_dir ["/dev/shm"]: where segments are created.
        segment_bytes [16 MiB] / chunk_bytes [2 MiB]: ring size and slot size; segment_bytes a
            multiple of chunk_bytes.
        connect_timeout_s [5], io_timeout_s [10], idle_timeout_s [60]: socket waits, seconds
            (io_timeout_s: one header, chunk or ack).
        max_connections [64], max_inflight [64], max_idle_per_peer [8]: thread and pool bounds.

    Thread safety: every method may be called from any thread.

    ``stats`` counts what ``SocketServingPlane`` counts (``accepted``/``refused`` connections,
    ``served``/``aborted``/``unknown`` grants, ``bad`` requests, ``stale``/``stray``
    connections not reused) and ``proof_failed`` listeners (consumer).

    Raises:
        ConfigError: unknown or invalid option or identity, a non-DRAM region.
        PlaneUnavailable: never (probe() says whether the plane can run here).
    """

    name = "shm"
    plugin_api_version = PLUGIN_API_VERSION  # 3: both halves (a DataTransport)
    capabilities = Capabilities(
        transfer_model=TransferModel.PUSH,
        mem_kinds=frozenset({"DRAM"}),
        max_transfer_bytes=None,
        notifications=True,
    )
    wire_version = SHM_WIRE_VERSION
    grant_type = ShmGrant
    request_type = ShmRequest
    reply_type = ShmReply
    max_header_bytes = MAX_HEADER_BYTES
    max_notif_bytes = MAX_NOTIF_BYTES
    fds_with_replies = True
    stray_bytes_fail = False  # the payload comes through the segment, never from the stream
    option_defaults = {
        "segment_dir": segments.DEFAULT_SEGMENT_DIR,  # where segments are created
        "segment_bytes": 16 << 20,  # producer: ring segment per connection
        "chunk_bytes": 2 << 20,  # producer: ring slot (pipelining unit)
    }

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        super().__init__(node_id=node_id, region=region, identity=identity, **options)
        if not isinstance(identity, str) or not IDENTITY_RE.match(identity):
            raise ConfigError(f"shm plane identity must be lower-case hex of at most 64 digits "
                              f"(identity_of(public_key)) or empty, got {identity!r}")
        opts = self._opts
        try:
            self._segment_dir = str(opts["segment_dir"])
            self._segment_bytes = int(opts["segment_bytes"])
            self._chunk_bytes = int(opts["chunk_bytes"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid shm plane option: {exc}") from exc
        if self._chunk_bytes <= 0 or self._segment_bytes < self._chunk_bytes or \
                self._segment_bytes % self._chunk_bytes:
            raise ConfigError(f"shm plane segment_bytes ({self._segment_bytes}) must be a positive "
                              f"multiple of chunk_bytes ({self._chunk_bytes})")
        if not os.path.isdir(self._segment_dir):
            raise ConfigError(f"shm plane segment_dir {self._segment_dir!r} is not a directory")

        self._where = locality.here()  # None: /proc unreadable, shm reaches nobody
        self._locality = msgspec.msgpack.encode(self._where) if self._where else b""
        self._boot_id = self._where.boot_id if self._where else locality.boot_id()
        self._host = socket.gethostname()
        self._key = secrets.token_bytes(KEY_BYTES)
        self._bound: dict[tuple[str, bytes], int] = {}  # pool key -> live bindings
        segments.sweep_stale_segments(self._segment_dir)

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
        self._listen(listener)

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

    # -- producer hooks ---------------------------------------------------------------------------
    def _grant(self, token: bytes, nbytes: int, runs_bytes: int) -> ShmGrant:
        return ShmGrant(self.socket_name, self._boot_id, self._host[:255], token, nbytes,
                        runs_bytes, self.node_id[:256])

    def _open_connection(self, conn: socket.socket) -> _ServerConn | None:
        """Prove to a new connection that this is the plane the session declared (plane key);
        None (close it) if the hello is missing or wrong."""
        try:
            body, _ = recv_header(conn, self._opt.io_timeout_s, self._opt.io_timeout_s)
            hello = hello_decoder.decode(body)
        except (OSError, PeerClosed):
            return None
        except (ValueError, msgspec.DecodeError) as exc:
            self._reply_error(conn, STATUS_BAD_REQUEST, f"expected a hello: {exc}")
            return None
        if hello.v != SHM_WIRE_VERSION:
            self._reply_error(conn, STATUS_BAD_REQUEST,
                              f"shm wire version {hello.v}, expected {SHM_WIRE_VERSION}")
            return None
        mac = proof(self._key, hello.nonce, self.socket_name, self.identity)
        try:
            conn.settimeout(self._opt.io_timeout_s)
            conn.sendall(frame(ShmProof(SHM_WIRE_VERSION, mac)))
        except OSError:
            return None
        return _ServerConn()

    def _close_connection(self, state: _ServerConn) -> None:
        if state.seg is not None:
            state.seg.close()

    def _send_grant(self, conn: socket.socket, state: _ServerConn, req: RequestLike,
                    served: ServedGrant) -> bool:
        """Stream one grant through the connection's ring (created, and its descriptor sent with
        the reply, at the first non-empty grant); each chunk copy is one revocable step."""
        nbytes, chunk = served.nbytes, self._chunk_bytes
        new_seg = None
        if nbytes > 0 and state.seg is None:
            try:
                new_seg = state.seg = segments.create_segment(self._segment_bytes,
                                                              self._segment_dir)
            except OSError as exc:
                self._reply_error(conn, STATUS_INTERNAL, f"cannot create segment: {exc}")
                return False
        seg = state.seg
        head = frame(ShmReply(SHM_WIRE_VERSION, STATUS_OK, nbytes, seg.nbytes if seg else 0,
                              chunk, new_seg is not None))
        conn.settimeout(self._opt.io_timeout_s)
        if new_seg is not None:
            sent = socket.send_fds(conn, [head], [new_seg.ro_fd])
            new_seg.close_fd()  # the consumer holds its own copy now
            if sent < len(head):
                conn.sendall(head[sent:])
        else:
            conn.sendall(head)
        if nbytes and seg is not None:
            payload = _arrays(served.views)
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
                        self._log.debug("shm plane: consumer sent %r instead of ack bytes", got)
                        return False
                    acked += len(got)
                lo, hi = i * chunk, min(nbytes, (i + 1) * chunk)
                with served.step() as go:
                    if not go:
                        self._count("aborted")
                        return False
                    _copy_span(payload, lo, hi, ring, (i % slots) * chunk, True)
                conn.sendall(hi.to_bytes(PROGRESS_BYTES, "big"))
            del ring
        return True

    # -- consumer hooks ---------------------------------------------------------------------------
    def _route(self, prepared: Any, grant: ShmGrant) -> ShmBinding:
        """``prepared`` must be the session's :meth:`bind_peer` result; the grant must come from
        this host and name the socket and node it declared.

        Raises:
            DataPlaneError: no binding, a grant from another machine or not covered by the
                binding.
        """
        if not isinstance(prepared, ShmBinding):
            raise DataPlaneError(
                f"shm plane: start() needs the session's binding (bind_peer's result), got "
                f"{type(prepared).__name__}: an unbound grant could name any local socket")
        binding = prepared
        if grant.boot_id != self._boot_id:
            raise DataPlaneError(
                f"shm grant comes from host {grant.host!r} (boot id {grant.boot_id}), this is "
                f"{self._host!r} (boot id {self._boot_id}): the shm plane is same-host only; "
                f"negotiate tcp/ucx for remote producers")
        if grant.socket != binding.socket or grant.node != binding.node:
            raise DataPlaneError(
                f"shm grant names @{grant.socket} (node {grant.node!r}), but the session with "
                f"{binding.peer} declared @{binding.socket} (node {binding.node!r}): refused")
        return binding

    def _admit_locked(self, route: ShmBinding, grant: ShmGrant) -> None:
        if route.ended:
            raise DataPlaneError(f"the shm session with {route.peer} has ended (unbound)")

    def _pool_key(self, route: ShmBinding) -> Hashable:
        return route.pool_key

    def _may_pool_locked(self, route: ShmBinding) -> bool:
        return not route.ended

    def _connect(self, route: ShmBinding) -> _Chan:
        """A new connection to the bound socket whose listener proved it holds the declared
        plane key."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._opt.connect_timeout_s)
            sock.connect("\0" + route.socket)
            self._check_proof(sock, route)
        except BaseException:
            sock.close()
            raise
        return _Chan(sock)

    def _check_proof(self, sock: socket.socket, binding: ShmBinding) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sock.settimeout(self._opt.io_timeout_s)
        sock.sendall(frame(ShmHello(SHM_WIRE_VERSION, nonce)))
        body, _ = recv_header(sock, self._opt.io_timeout_s, self._opt.io_timeout_s)
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

    def _accept_reply(self, chan: _Chan, reply: ShmReply, fds: list[int]) -> None:
        """Map the segment an OK reply announced (``fd_attached``: exactly one descriptor)."""
        if reply.fd_attached:
            if len(fds) != 1:
                raise DataPlaneError(f"producer announced a segment, sent {len(fds)} fds")
            if reply.chunk_bytes <= 0 or reply.segment_bytes < reply.chunk_bytes:
                raise DataPlaneError(f"bad segment geometry {reply.segment_bytes}/"
                                     f"{reply.chunk_bytes}")
            chan.set_segment(fds[0], reply.segment_bytes, reply.chunk_bytes)
        elif fds:
            raise DataPlaneError("producer sent an unannounced descriptor")

    def _receive_payload(self, handle: Receive, chan: _Chan, reply: ShmReply,
                         local: list[memoryview]) -> None:
        """Copy every chunk out of the ring as its progress record arrives; ack reused slots.
        Reads at most the progress records this grant announced (never the next reply)."""
        seg, chunk, sock = chan.seg, chan.chunk_bytes, chan.sock
        if seg is None:
            raise DataPlaneError("producer streams data but never sent a segment")
        views = _arrays(local)
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

    # -- teardown hooks ---------------------------------------------------------------------------
    def _close_locked(self) -> None:
        self._bound.clear()

    def _after_close(self) -> None:
        """Sweep the segments of dead owners (a crash inside a creation window)."""
        segments.sweep_stale_segments(self._segment_dir)
