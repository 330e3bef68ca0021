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

Framing (:mod:`ectransport.data.tcp_wire`): every header is a 4-byte big-endian length
(1..:data:`MAX_HEADER_BYTES`) then a msgpack body with a required protocol version. A client that
sends an oversized, undecodable or wrong-version header gets ``STATUS_BAD_REQUEST`` and is
disconnected; one that stalls is disconnected after ``io_timeout_s`` (``idle_timeout_s`` between
requests). Neither crashes nor hangs the producer.

Binding grants to their producer (plugin API 2, issue 17; :mod:`ectransport.data.binding`): the
producer's :meth:`TcpPlane.endpoint` declares ``{v, host, port, node, identity}`` once per session;
the consumer's :meth:`TcpPlane.bind_peer` checks the identity and that the declared host is the host
it dialed for the control plane, and :meth:`TcpPlane.start` refuses, before connecting anywhere, a
grant that names another host, port or node. The consumer connects only to the checked addresses
and keeps each binding's pooled connections apart, so a hostile producer can neither redirect a
consumer nor disturb its transfers from other producers. A grant started without a binding (a
producer that declared nothing) is served as before, with a warning.

Stream hygiene (issue 17): every read is bounded by what the grant says (a reply announcing another
size is an error and its connection is closed), and a connection goes back to the pool only when
exactly the reply and its granted bytes were read and nothing else is waiting on it; bytes left
after the payload fail the transfer (the stream is out of sync), and a pooled connection found with
pending bytes or closed is dropped before use.

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
import socket
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from ectransport.data.base import (
    PLUGIN_API_VERSION,
    Capabilities,
    DataTransport,
    RegionLike,
    TransferModel,
    XferState,
)
from ectransport.data.binding import (
    ENDPOINT_VERSION,
    HostBinding,
    bind_host_endpoint,
    check_grant,
    endpoint_bytes,
)
from ectransport.data.options import SERVING_DEFAULTS, ServingOptions, reject_unknown
from ectransport.data.runs import check_runs, payload_spans, views
from ectransport.data.serving import (
    PREFIX_BYTES,
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
    shutdown_quietly,
    unread_state,
)
from ectransport.data.tcp_wire import (
    MAX_HEADER_BYTES,
    MAX_NOTIF_BYTES,
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_GRANT,
    TCP_WIRE_VERSION,
    TOKEN_BYTES,
    TcpEndpoint,
    TcpGrant,
    TcpReply,
    TcpRequest,
    endpoint_decoder,
    grant_decoder,
    recv_exact,
    reply_decoder,
    request_decoder,
)
from ectransport.errors import ConfigError, DataPlaneError
from ectransport.store import Run

__all__ = [
    "MAX_HEADER_BYTES", "MAX_NOTIF_BYTES", "STATUS_BAD_REQUEST", "STATUS_OK",
    "STATUS_UNKNOWN_GRANT", "TCP_WIRE_VERSION", "TOKEN_BYTES", "TcpEndpoint", "TcpGrant",
    "TcpPlane", "TcpReply", "TcpRequest",
]

_log = logging.getLogger(__name__)

_IOV_MAX = 512  # buffers per sendmsg call (POSIX guarantees IOV_MAX >= 16, Linux has 1024)
_JOIN_S = 2.0  # close(): how long to wait for each background thread
_REVOKE_GRACE_S = 0.05  # revoke(): wait this long for a sendmsg in progress before aborting it

_OPTIONS = {
    "host": "127.0.0.1",  # bind address of the listener
    "port": 0,  # 0 = any free port
    "advertise_host": None,  # address put in grants; default: host (required for 0.0.0.0 / ::)
    **SERVING_DEFAULTS,  # timeouts and thread/pool bounds
}


class _Served:
    """Producer side: one registered grant."""

    __slots__ = ("lock", "nbytes", "revoked", "senders", "views")

    def __init__(self, views: list[memoryview], nbytes: int):
        self.views = views
        self.nbytes = nbytes
        self.revoked = False
        self.senders: set[socket.socket] = set()  # connections sending it now
        self.lock = threading.Lock()  # held during each sendmsg of it


class TcpPlane(DataTransport):
    """Producer-sends plane over plain TCP for one node and one DRAM region.

    Args:
        node_id: this node's id (put in grants and in :meth:`endpoint`).
        identity: this node's control-plane identity (``identity_of`` its CURVE public key; ``""``
            in insecure mode), declared in :meth:`endpoint`.
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
    plugin_api_version = PLUGIN_API_VERSION
    capabilities = Capabilities(
        transfer_model=TransferModel.PUSH,
        mem_kinds=frozenset({"DRAM"}),
        max_transfer_bytes=None,
        notifications=True,
        address_options=frozenset({"host", "advertise_host"}),
    )

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        reject_unknown("tcp plane", options, _OPTIONS)
        opts = {**_OPTIONS, **options}
        mem_kind = getattr(region, "mem_kind", "DRAM")
        if mem_kind != "DRAM":
            raise ConfigError(f"tcp plane moves DRAM only, region is {mem_kind!r}")
        try:
            self._opt = ServingOptions.parse(opts)
            port = int(opts["port"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid tcp plane option: {exc}") from exc
        self._opt.check("tcp plane")
        host = str(opts["host"])
        advertise = opts["advertise_host"] or host
        if advertise in ("", "0.0.0.0", "::"):
            raise ConfigError(f"tcp plane binds the wildcard {host!r}: set advertise_host to the "
                              f"address consumers should connect to")

        self.node_id = node_id
        self.identity = str(identity)
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
        self._notifs = Notifications()
        # accepted, refused, served, aborted, unknown, bad
        self.stats: collections.Counter[str] = collections.Counter()
        # consumer state
        self._receives = Receives(self._lock, self._opt.max_inflight, "tcp plane")
        # pooled connections per (binding scope, host, port); scope 0 = unbound grants
        self._pool: ConnectionPool[tuple[int, str, int], socket.socket] = ConnectionPool(
            self._lock, self._opt.max_idle_per_peer)
        self._bound: set[int] = set()  # scopes of the bindings not yet unbound
        self._warned_unbound = False

        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            family, _, _, _, addr = infos[0]
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(addr)
                listener.listen(128)
            except OSError:
                listener.close()
                raise
        except OSError as exc:
            raise ConfigError(f"tcp plane cannot listen on {host}:{port}: {exc}") from exc
        self.host = advertise
        self.port = int(listener.getsockname()[1])
        if not _is_loopback(host):
            _log.warning("tcp plane listens on %s:%d: payloads cross the network in clear text",
                         host, self.port)
        self._acceptor = Acceptor(
            listener, self._serve, lock=self._lock, stats=self.stats,
            max_connections=self._opt.max_connections, log=_log, what="tcp plane",
            accept_name=f"ectransport-tcp-accept-{self.port}",
            serve_name=f"ectransport-tcp-serve-{self.port}", nodelay=True)

    # -- discovery --------------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "stdlib sockets"

    def describe_transport(self) -> str:
        return f"tcp {self.host}:{self.port}"

    # -- session binding (API 2) -------------------------------------------------------------------
    def endpoint(self) -> bytes:
        """Producer side: the msgpack :class:`TcpEndpoint` ``{v, host, port, node, identity}``
        (about 80 bytes) that every grant of a session must match."""
        return endpoint_bytes(TcpEndpoint(ENDPOINT_VERSION, self.host, self.port, self.node_id,
                                          self.identity))

    def bind_peer(self, endpoint: bytes, *, peer: str, host: str, identity: str
                  ) -> HostBinding | None:
        """Consumer side: check a producer's :meth:`endpoint` and return the session's binding.

        ``b""`` (a producer that declares nothing) gives None: that session's grants are not bound
        (``start`` warns once). Rules: :mod:`ectransport.data.binding`.

        Raises:
            DataPlaneError: oversized, malformed or wrong-version declaration; an identity other
                than ``identity`` (when non-empty); a host other than the dialed ``host``.
        """
        binding = bind_host_endpoint(self.name, endpoint_decoder, endpoint, peer=peer, host=host,
                                     identity=identity)
        if binding is not None:
            with self._lock:
                if self._closed:
                    raise DataPlaneError("tcp plane is closed")
                self._bound.add(binding.scope)
        return binding

    def unbind_peer(self, binding: Any) -> None:
        """Consumer side: close the idle pooled connections of ``binding``'s session; receives in
        flight finish but do not pool their connection afterwards. Never raises."""
        if not isinstance(binding, HostBinding):
            return
        with self._lock:
            self._bound.discard(binding.scope)
            idle = self._pool.drop_where_locked(lambda key: key[0] == binding.scope)
        for s in idle:
            close_quietly(s)

    # -- producer side ----------------------------------------------------------------------------
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """Register a fresh token for exactly ``runs`` and return the msgpack :class:`TcpGrant`.

        Raises:
            DataPlaneError: the plane is closed, ``runs`` is empty or leaves the region, or
                ``nbytes`` exceeds the runs.
        """
        blocks = self._check_runs(runs, nbytes)
        region_views = views(self._mem_or_raise(), payload_spans(runs, self._block_bytes, nbytes))
        token = new_token()
        with self._lock:
            if self._closed:
                raise DataPlaneError("tcp plane is closed")
            self._grants[token] = _Served(region_views, nbytes)
        return msgspec.msgpack.encode(TcpGrant(self.host, self.port, token, nbytes,
                                               blocks * self._block_bytes, self.node_id))

    def revoke(self, plane_grant: bytes) -> None:
        """Stop serving ``plane_grant``: later requests get UNKNOWN_GRANT, a send in progress is
        aborted (its connection shut down) before this returns. Unknown or malformed grants: no-op.
        """
        token = grant_token(grant_decoder, plane_grant)
        if token is None:
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
                shutdown_quietly(sock)
            if not served.lock.acquire(timeout=self._opt.io_timeout_s):  # pragma: no cover
                _log.error("tcp plane: a send of a revoked grant did not stop")
                return
        served.lock.release()

    def poll_notifications(self) -> list[bytes]:
        return self._notifs.drain()

    # -- consumer side ----------------------------------------------------------------------------
    def start(self, prepared: Any, plane_grant: bytes, runs: Sequence[Run], nbytes: int,
              notif: bytes) -> Receive:
        """Request the granted blocks and receive them into local ``runs`` (background thread).

        ``prepared`` is the session's :meth:`bind_peer` result: the grant must name exactly the
        declared host, port and node, and the connection goes to the checked addresses only.
        None (a producer that declared nothing): the grant's host is used as is (logged once).

        Raises:
            DataPlaneError: malformed grant, a grant not covered by ``prepared`` (nothing was
                connected), runs/nbytes that do not match it, an oversized ``notif``, too many
                receives in flight, or the plane is closed.
        """
        try:
            grant = grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError) as exc:
            raise DataPlaneError(f"malformed tcp grant ({len(plane_grant)} bytes): {exc}") from exc
        addrs: tuple[str, ...]
        if prepared is None:
            self._warn_unbound(grant)
            key, addrs, node = (0, grant.host, grant.port), (grant.host,), grant.node
        else:
            binding = check_grant(prepared, self.name, grant.host, grant.port, grant.node)
            key, addrs, node = (binding.scope, grant.host, grant.port), binding.addrs, binding.node
        blocks = self._check_runs(runs, nbytes)
        local_bytes = blocks * self._block_bytes
        if grant.runs_bytes != local_bytes or grant.nbytes != nbytes:
            raise DataPlaneError(
                f"tcp grant of {grant.host}:{grant.port} covers {grant.nbytes} bytes in "
                f"{grant.runs_bytes} bytes of blocks, the local transfer is {nbytes} bytes in "
                f"{local_bytes}; both sides must use the same block_bytes and block count")
        if len(notif) > MAX_NOTIF_BYTES:
            raise DataPlaneError(f"notif is {len(notif)} bytes, at most {MAX_NOTIF_BYTES}")
        local = views(self._mem_or_raise(), payload_spans(runs, self._block_bytes, nbytes))
        handle = Receive(nbytes)
        request = frame(TcpRequest(TCP_WIRE_VERSION, grant.token, bytes(notif)))
        with self._lock:
            if self._closed:
                raise DataPlaneError("tcp plane is closed")
            self._receives.admit_locked(handle)
            if node:
                self._pool.note_locked(node, key)
            handle.start(self._receive, (handle, key, addrs, request, local),
                         f"ectransport-tcp-recv-{grant.port}")
        return handle

    def check(self, handle: Any) -> XferState:
        """PROC, DONE or ERR; a released handle keeps its last state (ERR if it was in flight)."""
        return receive_state(handle)

    def release(self, handle: Any) -> None:
        """Cancel (shut its connection down if mid-transfer) and forget a receive; idempotent.

        When this returns no more bytes land in the handle's local blocks.
        """
        self._receives.release(handle)

    def forget_peer(self, peer: str) -> None:
        """Close the pooled connections to producer node ``peer``; unknown names: no-op."""
        for s in self._pool.forget(peer):
            close_quietly(s)

    def close(self) -> None:
        """Stop serving, cancel every receive, close every socket, join threads; idempotent."""
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
            served.revoked = True
        self._acceptor.stop()
        for h in handles:
            self.release(h)
        for s in pooled:
            close_quietly(s)
        self._acceptor.join_and_close([h.thread for h in handles if h.thread], _JOIN_S)
        self._notifs.clear()
        self._mem = None  # views held by finished transfers keep the buffer alive on their own

    # -- producer internals -----------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        """One connection (on its :class:`Acceptor` thread, which closes it): read request
        headers until EOF, error or idle timeout."""
        while not self._closed:
            try:
                head = recv_exact(conn, PREFIX_BYTES, self._opt.idle_timeout_s,
                                  self._opt.io_timeout_s)
            except (OSError, ValueError):
                return  # EOF, reset, idle or stalled: just close
            length = int.from_bytes(head, "big")
            if not 0 < length <= MAX_HEADER_BYTES:
                self._refuse(conn, f"header length {length} not in 1..{MAX_HEADER_BYTES}")
                return
            try:
                body = recv_exact(conn, length, self._opt.io_timeout_s, self._opt.io_timeout_s)
            except (OSError, ValueError):
                return
            try:
                req = request_decoder.decode(body)
            except (msgspec.DecodeError, TypeError) as exc:
                self._refuse(conn, f"bad request: {exc}")
                return
            if req.v != TCP_WIRE_VERSION:
                self._refuse(conn, f"tcp wire version {req.v}, expected {TCP_WIRE_VERSION}")
                return
            if not self._send_grant(conn, req):
                return

    def _refuse(self, conn: socket.socket, detail: str) -> None:
        self._count("bad")
        _log.debug("tcp plane: %s", detail)
        try:
            conn.settimeout(self._opt.io_timeout_s)
            conn.sendall(frame(TcpReply(TCP_WIRE_VERSION, STATUS_BAD_REQUEST, 0, detail[:200])))
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
                conn.settimeout(self._opt.io_timeout_s)
                conn.sendall(frame(TcpReply(TCP_WIRE_VERSION, STATUS_UNKNOWN_GRANT, 0,
                                            "unknown or revoked grant")))
            except OSError:
                return False
            return True
        try:
            head = memoryview(frame(TcpReply(TCP_WIRE_VERSION, STATUS_OK, served.nbytes)))
            bufs = [head, *served.views]
            conn.settimeout(self._opt.io_timeout_s)
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
        self._notifs.push(req.notif)
        return True

    # -- consumer internals -----------------------------------------------------------------------
    def _receive(self, handle: Receive, key: tuple[int, str, int], addrs: tuple[str, ...],
                 request: bytes, views: list[memoryview]) -> None:
        """Receive thread: request, reply header, payload into ``views``; sets DONE or ERR.

        Reads are bounded: the reply header by :data:`MAX_HEADER_BYTES`, the payload by the
        grant's ``nbytes`` (a reply announcing another size fails). The connection is pooled
        again only if nothing is left unread on it (:func:`unread_state`).
        """
        sock = None
        endpoint = key[1:]
        try:
            for attempt in (0, 1):
                sock, reused = self._connection(key, addrs, fresh=attempt > 0)
                with handle.sock_lock:
                    if handle.cancelled:
                        return
                    handle.sock = sock
                try:
                    sock.sendall(request)
                    head = recv_exact(sock, PREFIX_BYTES, self._opt.io_timeout_s,
                                      self._opt.io_timeout_s)
                    break
                except (PeerClosed, ConnectionResetError, BrokenPipeError):
                    if not reused or handle.cancelled:
                        raise
                    close_quietly(sock)  # a stale pooled connection: retry once on a fresh one
                    sock = None
            # the second attempt is on a fresh connection, whose failure re-raises: the loop
            # only ends by a break, with a connection
            assert sock is not None
            length = int.from_bytes(head, "big")
            if not 0 < length <= MAX_HEADER_BYTES:
                raise DataPlaneError(f"producer reply header of {length} bytes")
            reply = reply_decoder.decode(
                recv_exact(sock, length, self._opt.io_timeout_s, self._opt.io_timeout_s))
            if reply.status != STATUS_OK:
                handle.detail = f"producer refused: status {reply.status} ({reply.detail})"
                if reply.status == STATUS_UNKNOWN_GRANT:  # the stream is in sync: reusable
                    with handle.sock_lock:
                        reusable, handle.sock = not handle.cancelled, None
                    if reusable and unread_state(sock) == "clean":
                        self._give_back(key, sock)
                        sock = None
                return
            if reply.nbytes != handle.nbytes:
                raise DataPlaneError(f"producer sends {reply.nbytes} bytes, expected "
                                     f"{handle.nbytes}")
            sock.settimeout(self._opt.io_timeout_s)
            for view in views:
                got, n = 0, len(view)
                while got < n:
                    with handle.io_lock:
                        if handle.cancelled:
                            return
                        k = sock.recv_into(view[got:])
                    if k == 0:
                        raise PeerClosed(f"producer closed after {got} of {n} bytes of a run")
                    got += k
            left = unread_state(sock)
            if left == "pending":  # which bytes were the reply's? fail rather than guess
                raise DataPlaneError(f"producer sent more than the {handle.nbytes} bytes granted "
                                     f"(unread bytes follow the payload); connection closed")
            with handle.io_lock, handle.sock_lock:
                if handle.cancelled:
                    return
                handle.sock = None  # ours alone now: a later release cannot shut it down
                handle.state = XferState.DONE
            if left == "clean":
                self._give_back(key, sock)
                sock = None
        except (OSError, ValueError, msgspec.DecodeError, DataPlaneError) as exc:
            handle.detail = f"{type(exc).__name__}: {exc}"
            _log.debug("tcp plane: receive from %s:%d failed: %s", *endpoint, exc)
        except Exception:
            handle.detail = "internal error"
            _log.exception("tcp plane: receive thread failed")
        finally:
            close_quietly(sock)
            handle.settle()

    def _connection(self, key: tuple[int, str, int], addrs: tuple[str, ...], fresh: bool
                    ) -> tuple[socket.socket, bool]:
        """A pooled connection of ``key`` that has nothing pending (others are closed), or a new
        one to the first of ``addrs`` that answers on ``key``'s port; ``(sock, reused)``."""
        while not fresh:
            idle = self._pool.take(key)
            if idle is None:
                break
            if unread_state(idle) == "clean":
                return idle, True
            _log.debug("tcp plane: pooled connection to %s:%d had unread bytes or was closed",
                       key[1], key[2])
            close_quietly(idle)
        error: OSError | None = None
        for addr in addrs:
            try:
                sock = socket.create_connection((addr, key[2]),
                                                timeout=self._opt.connect_timeout_s)
                break
            except OSError as exc:
                error = exc
        else:
            raise error or OSError(f"no address to connect to for {key[1]}:{key[2]}")
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        sock.settimeout(self._opt.io_timeout_s)
        return sock, False

    def _give_back(self, key: tuple[int, str, int], sock: socket.socket) -> None:
        """Pool ``sock`` unless its binding was unbound meanwhile (or the pool is full)."""
        with self._lock:
            pooled = (key[0] == 0 or key[0] in self._bound) and self._pool.put_locked(key, sock)
        if not pooled:
            close_quietly(sock)

    def _warn_unbound(self, grant: TcpGrant) -> None:
        if not self._warned_unbound:
            self._warned_unbound = True
            _log.warning(
                "tcp plane %s: grant for %s:%d started without a session binding (the producer "
                "declared no endpoint, e.g. an older node): its grants are not bound to it, so "
                "a compromised producer could point this consumer elsewhere (issue 17); logged "
                "once", self.node_id, grant.host, grant.port)

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
        return check_runs(runs, nbytes, self._num_blocks, self._block_bytes)


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
