"""The TCP data plane: the portable plane of last resort (stdlib sockets and threads only).

Model (a consumer-initiated request, the producer sends):

1. Producer, at construction: binds a listening socket (``host``/``port`` options) served by an
   accept thread and one thread per connection (at most ``max_connections``).
2. Producer, :meth:`TcpPlane.describe`: registers a fresh random 128-bit token → the granted blocks
   and returns a msgpack :class:`TcpGrant` (``host``, ``port``, ``token``, ``nbytes``,
   ``runs_bytes``); no region address leaves the producer.
3. Consumer, :meth:`TcpPlane.start`: a background thread takes a pooled connection to that producer
   endpoint (or opens one), sends a :class:`TcpRequest` ``{token, notif}`` and ``recv_into``\\ s the
   reply's payload straight into the local block views (no intermediate copy).
4. Producer: answers a :class:`TcpReply` ``{status, nbytes}`` followed by the bytes, sent with
   ``socket.sendmsg`` from memoryviews of the region (no intermediate copy), and queues ``notif``
   for :meth:`TcpPlane.poll_notifications` once every byte was handed to the kernel (from then on
   the region is no longer read for this grant, so the producer may unpin).
5. Producer, :meth:`TcpPlane.revoke`: unregisters the token; a later request gets
   ``STATUS_UNKNOWN_GRANT``, and a send in progress stops before ``revoke`` returns (at its next
   ``sendmsg``, or, if blocked on a full socket buffer for 50 ms, by shutting its connection down),
   so no byte of a possibly re-allocated block is ever read after it. Revoking a grant whose send
   finished keeps the (pooled) connection.

Framing: every header is a 4-byte big-endian length (1..:data:`MAX_HEADER_BYTES`) then a msgpack
body with a required protocol version. A client that sends an oversized, undecodable or
wrong-version header gets ``STATUS_BAD_REQUEST`` and is disconnected; one that stalls is
disconnected after ``io_timeout_s`` (``idle_timeout_s`` between requests). Neither crashes nor
hangs the producer.

Security: the token is a capability secret that travels inside the CURVE-encrypted control plane,
but the payload itself crosses TCP in clear text. The default bind is loopback; binding another
address logs a warning. Use NIXL/UCX (or a network you trust) for confidential data.

As the PUSH model of :mod:`ectransport.data.base` says, the consumer's :meth:`TcpPlane.start`
sends the request and the bytes flow producer → consumer.
"""

from __future__ import annotations

import collections
import ctypes
import ipaddress
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from ectransport.data.base import (
    Capabilities,
    DataTransport,
    RegionLike,
    TransferModel,
    XferState,
)
from ectransport.errors import ConfigError, DataPlaneError
from ectransport.store import Run

_log = logging.getLogger(__name__)

#: Version of the TCP plane's own wire format (request/reply headers), checked on every header.
TCP_WIRE_VERSION = 1
#: Largest header body (request or reply), bytes; a longer length prefix is a bad request.
MAX_HEADER_BYTES = 4096
#: Largest ``notif`` a request may carry, bytes.
MAX_NOTIF_BYTES = 2048
TOKEN_BYTES = 16

STATUS_OK = 0
STATUS_UNKNOWN_GRANT = 1  #: never granted, revoked, or the plane is closing
STATUS_BAD_REQUEST = 2

_IOV_MAX = 512  # buffers per sendmsg call (POSIX guarantees IOV_MAX >= 16, Linux has 1024)
_PREFIX = 4
_JOIN_S = 2.0  # close(): how long to wait for each background thread
_REVOKE_GRACE_S = 0.05  # revoke(): wait this long for a sendmsg in progress before aborting it

_OPTIONS = {
    "host": "127.0.0.1",  # bind address of the listener
    "port": 0,  # 0 = any free port
    "advertise_host": None,  # address put in grants; default: host (required for 0.0.0.0 / ::)
    "connect_timeout_s": 5.0,
    "io_timeout_s": 10.0,  # longest stall of one socket operation during a transfer or header
    "idle_timeout_s": 60.0,  # producer: a connection idle this long between requests is closed
    "max_connections": 64,  # producer: concurrent connections served (one thread each)
    "max_inflight": 64,  # consumer: concurrent receives (one thread each)
    "max_idle_per_peer": 8,  # consumer: pooled idle connections kept per producer endpoint
}


class TcpGrant(msgspec.Struct, frozen=True, tag="tcp/1", forbid_unknown_fields=True):
    """The ``plane_grant`` of the TCP plane (msgpack; opaque to everything but this module).

    Attributes:
        host / port: where the producer's listener accepts requests.
        token: 128-bit random capability naming the granted blocks at the producer.
        nbytes: payload bytes the producer will send.
        runs_bytes: bytes of the granted blocks (``count × block_bytes`` summed), so the consumer
            can check that its runs have the same shape.
        node: the producer's node id (for :meth:`TcpPlane.forget_peer`).
    """

    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    token: Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    runs_bytes: Annotated[int, msgspec.Meta(ge=0)]
    node: Annotated[str, msgspec.Meta(max_length=256)] = ""


class TcpRequest(msgspec.Struct, frozen=True, tag="req", forbid_unknown_fields=True):
    """Consumer → producer: send me the blocks of ``token``; deliver ``notif`` when done."""

    v: int
    token: bytes
    notif: Annotated[bytes, msgspec.Meta(max_length=MAX_NOTIF_BYTES)]


class TcpReply(msgspec.Struct, frozen=True, tag="rep", forbid_unknown_fields=True):
    """Producer → consumer: ``status``; on OK, exactly ``nbytes`` payload bytes follow."""

    v: int
    status: int
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    detail: str = ""


_encoder = msgspec.msgpack.Encoder()
_grant_decoder = msgspec.msgpack.Decoder(TcpGrant)
_request_decoder = msgspec.msgpack.Decoder(TcpRequest)
_reply_decoder = msgspec.msgpack.Decoder(TcpReply)


def _frame(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return len(body).to_bytes(_PREFIX, "big") + body


class _PeerClosed(ConnectionError):
    """EOF before the expected bytes."""


def _recv_exact(sock: socket.socket, n: int, first_timeout_s: float, timeout_s: float) -> bytes:
    """``n`` bytes; the first byte may take ``first_timeout_s``, the rest ``timeout_s`` in all."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    sock.settimeout(first_timeout_s)
    deadline = None
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"header stalled after {got} of {n} bytes")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise _PeerClosed(f"peer closed after {got} of {n} bytes")
        got += k
        if deadline is None:
            deadline = time.monotonic() + timeout_s
    return bytes(buf)


def _merged_views(mem: memoryview, runs: Sequence[Run], block_bytes: int,
                  nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` bytes of ``runs`` as views of ``mem``, adjacent runs merged."""
    spans: list[list[int]] = []
    for r in runs:
        off, length = r.start * block_bytes, r.count * block_bytes
        if spans and spans[-1][0] + spans[-1][1] == off:
            spans[-1][1] += length
        else:
            spans.append([off, length])
    out = []
    left = nbytes
    for off, length in spans:
        if left <= 0:
            break
        n = min(left, length)
        out.append(mem[off:off + n])
        left -= n
    return out


def _shutdown(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.close()
    except OSError:
        pass


class _Served:
    """Producer side: one registered grant."""

    __slots__ = ("lock", "nbytes", "revoked", "senders", "views")

    def __init__(self, views: list[memoryview], nbytes: int):
        self.views = views
        self.nbytes = nbytes
        self.revoked = False
        self.senders: set[socket.socket] = set()  # connections sending it now
        self.lock = threading.Lock()  # held during each sendmsg of it


class _Recv:
    """Consumer side: one receive (the handle returned by :meth:`TcpPlane.start`)."""

    __slots__ = ("cancelled", "detail", "io_lock", "nbytes", "sock", "sock_lock", "state",
                 "thread")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.state = XferState.PROC
        self.detail = ""
        self.cancelled = False
        self.sock: socket.socket | None = None
        self.io_lock = threading.Lock()  # held during each recv_into into the local blocks
        self.sock_lock = threading.Lock()  # guards sock/cancelled; never held across I/O
        self.thread: threading.Thread | None = None



class TcpPlane(DataTransport):
    """Producer-sends plane over plain TCP for one node and one DRAM region.

    Args:
        node_id: this node's id (put in grants).
        region: the node's region (``addr``, ``nbytes``, ``block_bytes``, ``mem_kind`` DRAM; a
            ``buf`` exposing the buffer protocol is used when present, else ``addr`` is mapped
            with ctypes). It must outlive the plane.
        host / port: listener bind address [127.0.0.1, 0 = any free port].
        advertise_host: address put in grants [host]; required when host is a wildcard.
        connect_timeout_s [5], io_timeout_s [10], idle_timeout_s [60]: see the module docstring.
        max_connections [64], max_inflight [64], max_idle_per_peer [8]: thread and pool bounds.

    Thread safety: every method may be called from any thread.

    Raises:
        ConfigError: unknown or invalid option, a non-DRAM region, or the address cannot be bound.
    """

    name = "tcp"
    capabilities = Capabilities(
        transfer_model=TransferModel.PUSH,
        mem_kinds=frozenset({"DRAM"}),
        max_transfer_bytes=None,
        notifications=True,
    )

    def __init__(self, *, node_id: str, region: RegionLike, **options: Any):
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown tcp plane option(s) {sorted(unknown)}; "
                              f"expected some of {sorted(_OPTIONS)}")
        opts = {**_OPTIONS, **options}
        mem_kind = getattr(region, "mem_kind", "DRAM")
        if mem_kind != "DRAM":
            raise ConfigError(f"tcp plane moves DRAM only, region is {mem_kind!r}")
        try:
            self._connect_timeout_s = float(opts["connect_timeout_s"])
            self._io_timeout_s = float(opts["io_timeout_s"])
            self._idle_timeout_s = float(opts["idle_timeout_s"])
            self._max_connections = int(opts["max_connections"])
            self._max_inflight = int(opts["max_inflight"])
            self._max_idle_per_peer = int(opts["max_idle_per_peer"])
            port = int(opts["port"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid tcp plane option: {exc}") from exc
        if min(self._connect_timeout_s, self._io_timeout_s, self._idle_timeout_s) <= 0 or min(
                self._max_connections, self._max_inflight) <= 0 or self._max_idle_per_peer < 0:
            raise ConfigError("tcp plane timeouts and max_connections/max_inflight must be > 0")
        host = str(opts["host"])
        advertise = opts["advertise_host"] or host
        if advertise in ("", "0.0.0.0", "::"):
            raise ConfigError(f"tcp plane binds the wildcard {host!r}: set advertise_host to the "
                              f"address consumers should connect to")

        self.node_id = node_id
        self._block_bytes = int(region.block_bytes)
        self._num_blocks = int(region.nbytes) // self._block_bytes
        buf = getattr(region, "buf", None)
        if buf is not None:
            self._mem: memoryview | None = memoryview(buf).cast("B")
        else:
            self._mem = memoryview((ctypes.c_ubyte * int(region.nbytes)).from_address(
                int(region.addr))).cast("B")
        if self._mem.nbytes < self._num_blocks * self._block_bytes:
            raise ConfigError(f"region buffer has {self._mem.nbytes} bytes, expected "
                              f"{self._num_blocks * self._block_bytes}")

        self._lock = threading.Lock()
        self._closed = False
        # producer state
        self._grants: dict[bytes, _Served] = {}
        self._conns: set[socket.socket] = set()
        self._serve_threads: set[threading.Thread] = set()
        self._notifs: collections.deque[bytes] = collections.deque()
        self.stats = collections.Counter()  # accepted, refused, served, aborted, unknown, bad
        # consumer state
        self._handles: set[_Recv] = set()
        self._pool: dict[tuple[str, int], list[socket.socket]] = {}
        self._peer_endpoints: dict[str, set[tuple[str, int]]] = {}

        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            family, _, _, _, addr = infos[0]
            self._listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._listener.bind(addr)
                self._listener.listen(128)
            except OSError:
                self._listener.close()
                raise
        except OSError as exc:
            raise ConfigError(f"tcp plane cannot listen on {host}:{port}: {exc}") from exc
        self.host = advertise
        self.port = int(self._listener.getsockname()[1])
        if not _is_loopback(host):
            _log.warning("tcp plane listens on %s:%d: payloads cross the network in clear text",
                         host, self.port)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"ectransport-tcp-accept-{self.port}")
        self._accept_thread.start()

    # -- discovery --------------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "stdlib sockets"

    def describe_transport(self) -> str:
        return f"tcp {self.host}:{self.port}"

    # -- producer side ----------------------------------------------------------------------------
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """Register a fresh token for exactly ``runs`` and return the msgpack :class:`TcpGrant`.

        Raises:
            DataPlaneError: the plane is closed, ``runs`` is empty or leaves the region, or
                ``nbytes`` exceeds the runs.
        """
        blocks = self._check_runs(runs, nbytes)
        views = _merged_views(self._mem_or_raise(), runs, self._block_bytes, nbytes)
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            if self._closed:
                raise DataPlaneError("tcp plane is closed")
            self._grants[token] = _Served(views, nbytes)
        return _encoder.encode(TcpGrant(self.host, self.port, token, nbytes,
                                        blocks * self._block_bytes, self.node_id))

    def revoke(self, plane_grant: bytes) -> None:
        """Stop serving ``plane_grant``: later requests get UNKNOWN_GRANT, a send in progress is
        aborted (its connection shut down) before this returns. Unknown or malformed grants: no-op.
        """
        try:
            token = _grant_decoder.decode(plane_grant).token
        except (msgspec.DecodeError, TypeError):
            _log.debug("tcp plane: revoke of a malformed grant ignored")
            return
        with self._lock:
            served = self._grants.pop(token, None)
            if served is None:
                return
            served.revoked = True  # a sender checks it under served.lock before each sendmsg
        # A sender between two sendmsg calls (or done) frees served.lock at once and then stops;
        # one blocked on a full socket buffer (a slow or gone consumer) is woken by a shutdown.
        if not served.lock.acquire(timeout=_REVOKE_GRACE_S):
            with self._lock:
                senders = list(served.senders)
            for sock in senders:
                _shutdown(sock)
            if not served.lock.acquire(timeout=self._io_timeout_s):  # pragma: no cover
                _log.error("tcp plane: a send of a revoked grant did not stop")
                return
        served.lock.release()

    def poll_notifications(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self._notifs.popleft())
            except IndexError:
                return out

    # -- consumer side ----------------------------------------------------------------------------
    def start(self, prepared: Any, plane_grant: bytes, runs: Sequence[Run], nbytes: int,
              notif: bytes) -> _Recv:
        """Request the granted blocks and receive them into local ``runs`` (background thread).

        Raises:
            DataPlaneError: malformed grant, runs/nbytes that do not match it, an oversized
                ``notif``, too many receives in flight, or the plane is closed.
        """
        try:
            grant = _grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError) as exc:
            raise DataPlaneError(f"malformed tcp grant ({len(plane_grant)} bytes): {exc}") from exc
        blocks = self._check_runs(runs, nbytes)
        local_bytes = blocks * self._block_bytes
        if grant.runs_bytes != local_bytes or grant.nbytes != nbytes:
            raise DataPlaneError(
                f"tcp grant of {grant.host}:{grant.port} covers {grant.nbytes} bytes in "
                f"{grant.runs_bytes} bytes of blocks, the local transfer is {nbytes} bytes in "
                f"{local_bytes}; both sides must use the same block_bytes and block count")
        if len(notif) > MAX_NOTIF_BYTES:
            raise DataPlaneError(f"notif is {len(notif)} bytes, at most {MAX_NOTIF_BYTES}")
        views = _merged_views(self._mem_or_raise(), runs, self._block_bytes, nbytes)
        handle = _Recv(nbytes)
        request = _frame(TcpRequest(TCP_WIRE_VERSION, grant.token, bytes(notif)))
        endpoint = (grant.host, grant.port)
        with self._lock:
            if self._closed:
                raise DataPlaneError("tcp plane is closed")
            if len(self._handles) >= self._max_inflight:
                raise DataPlaneError(f"tcp plane has {len(self._handles)} receives in flight "
                                     f"(max_inflight={self._max_inflight})")
            self._handles.add(handle)
            if grant.node:
                self._peer_endpoints.setdefault(grant.node, set()).add(endpoint)
            handle.thread = threading.Thread(
                target=self._receive, args=(handle, endpoint, request, views), daemon=True,
                name=f"ectransport-tcp-recv-{grant.port}")
            handle.thread.start()
        return handle

    def check(self, handle: Any) -> XferState:
        """PROC, DONE or ERR; a released handle keeps its last state (ERR if it was in flight)."""
        if not isinstance(handle, _Recv):
            return XferState.ERR
        return handle.state

    def release(self, handle: Any) -> None:
        """Cancel (shut its connection down if mid-transfer) and forget a receive; idempotent.

        When this returns no more bytes land in the handle's local blocks.
        """
        if not isinstance(handle, _Recv):
            return
        with handle.sock_lock:
            handle.cancelled = True
            _shutdown(handle.sock)  # wakes a recv_into blocked in the receive thread
        with handle.io_lock:  # waits out a recv_into in progress
            if handle.state is XferState.PROC:
                handle.state = XferState.ERR
                handle.detail = handle.detail or "released while in flight"
        with self._lock:
            self._handles.discard(handle)

    def forget_peer(self, peer: str) -> None:
        """Close the pooled connections to producer node ``peer``; unknown names: no-op."""
        with self._lock:
            socks = [s for ep in self._peer_endpoints.pop(peer, ()) for s in
                     self._pool.pop(ep, [])]
        for s in socks:
            _close(s)

    def close(self) -> None:
        """Stop serving, cancel every receive, close every socket, join threads; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            grants = list(self._grants.values())
            self._grants.clear()
            conns = list(self._conns)
            handles = list(self._handles)
            pooled = [s for socks in self._pool.values() for s in socks]
            self._pool.clear()
            self._peer_endpoints.clear()
        for served in grants:
            served.revoked = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        for sock in conns:
            _shutdown(sock)
        for h in handles:
            self.release(h)
        for s in pooled:
            _close(s)
        deadline = time.monotonic() + _JOIN_S
        self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            threads = list(self._serve_threads) + [h.thread for h in handles if h.thread]
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        for s in (self._listener, self._wake_r, self._wake_w):
            _close(s)
        self._selector.close()
        self._notifs.clear()
        self._mem = None  # views held by finished transfers keep the buffer alive on their own

    # -- producer internals -----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                events = self._selector.select(1.0)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.fileobj is self._wake_r:
                    return
                try:
                    conn, _addr = self._listener.accept()
                except OSError:
                    continue
                self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed or len(self._conns) >= self._max_connections:
                self.stats["refused"] += 1
                _close(conn)
                return
            self.stats["accepted"] += 1
            self._conns.add(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name=f"ectransport-tcp-serve-{self.port}")
            self._serve_threads.add(t)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        t.start()

    def _serve(self, conn: socket.socket) -> None:
        """One connection: read request headers until EOF, error or idle timeout; never raises."""
        try:
            while not self._closed:
                try:
                    head = _recv_exact(conn, _PREFIX, self._idle_timeout_s, self._io_timeout_s)
                except (OSError, ValueError):
                    return  # EOF, reset, idle or stalled: just close
                length = int.from_bytes(head, "big")
                if not 0 < length <= MAX_HEADER_BYTES:
                    self._refuse(conn, f"header length {length} not in 1..{MAX_HEADER_BYTES}")
                    return
                try:
                    body = _recv_exact(conn, length, self._io_timeout_s, self._io_timeout_s)
                except (OSError, ValueError):
                    return
                try:
                    req = _request_decoder.decode(body)
                except (msgspec.DecodeError, TypeError) as exc:
                    self._refuse(conn, f"bad request: {exc}")
                    return
                if req.v != TCP_WIRE_VERSION:
                    self._refuse(conn, f"tcp wire version {req.v}, expected {TCP_WIRE_VERSION}")
                    return
                if not self._send_grant(conn, req):
                    return
        except Exception:  # a bug in here must not leak the thread's connection silently
            _log.exception("tcp plane: connection handler failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._serve_threads.discard(threading.current_thread())
            _close(conn)

    def _refuse(self, conn: socket.socket, detail: str) -> None:
        self._count("bad")
        _log.debug("tcp plane: %s", detail)
        try:
            conn.settimeout(self._io_timeout_s)
            conn.sendall(_frame(TcpReply(TCP_WIRE_VERSION, STATUS_BAD_REQUEST, 0, detail[:200])))
        except OSError:
            pass

    def _send_grant(self, conn: socket.socket, req: TcpRequest) -> bool:
        """Serve one request; True if the connection can take another."""
        with self._lock:
            served = self._grants.get(req.token)
            if served is not None:
                served.senders.add(conn)
        if served is None:
            self._count("unknown")
            try:
                conn.settimeout(self._io_timeout_s)
                conn.sendall(_frame(TcpReply(TCP_WIRE_VERSION, STATUS_UNKNOWN_GRANT, 0,
                                             "unknown or revoked grant")))
            except OSError:
                return False
            return True
        try:
            head = memoryview(_frame(TcpReply(TCP_WIRE_VERSION, STATUS_OK, served.nbytes)))
            bufs = [head, *served.views]
            conn.settimeout(self._io_timeout_s)
            i = 0
            while i < len(bufs):
                with served.lock:
                    if served.revoked or self._closed:
                        self._count("aborted")
                        return False
                    sent = _send_some(conn, bufs, i)
                while sent:  # advance past what went out
                    n = len(bufs[i])
                    if sent >= n:
                        sent -= n
                        i += 1
                    else:
                        bufs[i] = bufs[i][sent:]
                        sent = 0
        except OSError as exc:
            self._count("aborted")
            _log.debug("tcp plane: send aborted: %s", exc)
            return False
        finally:
            with self._lock:
                served.senders.discard(conn)
        self._count("served")
        self._notifs.append(req.notif)
        return True

    # -- consumer internals -----------------------------------------------------------------------
    def _receive(self, handle: _Recv, endpoint: tuple[str, int], request: bytes,
                 views: list[memoryview]) -> None:
        """Receive thread: request, reply header, payload into ``views``; sets DONE or ERR."""
        sock = None
        try:
            for attempt in (0, 1):
                sock, reused = self._connection(endpoint, fresh=attempt > 0)
                with handle.sock_lock:
                    if handle.cancelled:
                        return
                    handle.sock = sock
                try:
                    sock.sendall(request)
                    head = _recv_exact(sock, _PREFIX, self._io_timeout_s, self._io_timeout_s)
                    break
                except (_PeerClosed, ConnectionResetError, BrokenPipeError):
                    if not reused or handle.cancelled:
                        raise
                    _close(sock)  # a stale pooled connection: retry once on a fresh one
                    sock = None
            length = int.from_bytes(head, "big")
            if not 0 < length <= MAX_HEADER_BYTES:
                raise DataPlaneError(f"producer reply header of {length} bytes")
            reply = _reply_decoder.decode(
                _recv_exact(sock, length, self._io_timeout_s, self._io_timeout_s))
            if reply.status != STATUS_OK:
                handle.detail = f"producer refused: status {reply.status} ({reply.detail})"
                if reply.status == STATUS_UNKNOWN_GRANT:  # the stream is in sync: reusable
                    with handle.sock_lock:
                        reusable, handle.sock = not handle.cancelled, None
                    if reusable:
                        self._give_back(endpoint, sock)
                        sock = None
                return
            if reply.nbytes != handle.nbytes:
                raise DataPlaneError(f"producer sends {reply.nbytes} bytes, expected "
                                     f"{handle.nbytes}")
            sock.settimeout(self._io_timeout_s)
            for view in views:
                got, n = 0, len(view)
                while got < n:
                    with handle.io_lock:
                        if handle.cancelled:
                            return
                        k = sock.recv_into(view[got:])
                    if k == 0:
                        raise _PeerClosed(f"producer closed after {got} of {n} bytes of a run")
                    got += k
            with handle.io_lock, handle.sock_lock:
                if handle.cancelled:
                    return
                handle.sock = None  # ours alone now: a later release cannot shut it down
                handle.state = XferState.DONE
            self._give_back(endpoint, sock)
            sock = None
        except (OSError, ValueError, msgspec.DecodeError, DataPlaneError) as exc:
            handle.detail = f"{type(exc).__name__}: {exc}"
            _log.debug("tcp plane: receive from %s:%d failed: %s", *endpoint, exc)
        except Exception:
            handle.detail = "internal error"
            _log.exception("tcp plane: receive thread failed")
        finally:
            _close(sock)
            with handle.sock_lock:
                handle.sock = None
            with handle.io_lock:
                if handle.state is XferState.PROC:
                    handle.state = XferState.ERR
                    handle.detail = handle.detail or "cancelled"

    def _connection(self, endpoint: tuple[str, int], fresh: bool) -> tuple[socket.socket, bool]:
        if not fresh:
            with self._lock:
                idle = self._pool.get(endpoint)
                if idle:
                    return idle.pop(), True
        sock = socket.create_connection(endpoint, timeout=self._connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        sock.settimeout(self._io_timeout_s)
        return sock, False

    def _give_back(self, endpoint: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            idle = self._pool.setdefault(endpoint, [])
            if not self._closed and len(idle) < self._max_idle_per_peer:
                idle.append(sock)
                return
        _close(sock)

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    # -- shared -----------------------------------------------------------------------------------
    def _mem_or_raise(self) -> memoryview:
        mem = self._mem
        if mem is None or self._closed:
            raise DataPlaneError("tcp plane is closed")
        return mem

    def _check_runs(self, runs: Sequence[Run], nbytes: int) -> int:
        """Validate ``runs``/``nbytes`` against the region; the number of blocks."""
        if self._closed:
            raise DataPlaneError("tcp plane is closed")
        if not runs:
            raise DataPlaneError("no blocks given (runs is empty)")
        total = 0
        for r in runs:
            if r.count <= 0 or r.start < 0 or r.start + r.count > self._num_blocks:
                raise DataPlaneError(f"run {r} is outside the region's {self._num_blocks} blocks")
            total += r.count
        if nbytes < 0 or nbytes > total * self._block_bytes:
            raise DataPlaneError(
                f"nbytes {nbytes} does not fit {total} blocks of {self._block_bytes} bytes")
        return total


def _send_some(sock: socket.socket, bufs: list[memoryview], i: int) -> int:
    """One send of ``bufs[i:]`` (at most :data:`_IOV_MAX` buffers); bytes sent."""
    if hasattr(sock, "sendmsg"):
        return sock.sendmsg(bufs[i:i + _IOV_MAX])
    return sock.send(bufs[i])  # pragma: no cover - platforms without sendmsg (Windows)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
