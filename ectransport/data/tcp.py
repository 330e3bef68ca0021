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
   finished keeps the (pooled) connection. (The rule of every
   :class:`~ectransport.data.socketplane.SocketServingPlane`.)

Framing (:mod:`ectransport.data.tcp_wire`): every header is a 4-byte big-endian length
(1..:data:`MAX_HEADER_BYTES`) then a msgpack body with a required protocol version. A client that
sends an oversized, undecodable or wrong-version header gets ``STATUS_BAD_REQUEST`` and is
disconnected; one that stalls is disconnected after ``io_timeout_s`` (``idle_timeout_s`` between
requests). Neither crashes nor hangs the producer.

Binding grants to their producer (plugin API 2; :mod:`ectransport.data.binding`): the
producer's :meth:`TcpPlane.endpoint` declares ``{v, host, port, node, identity}`` once per session;
the consumer's :meth:`TcpPlane.bind_peer` checks the identity and that the declared host is the host
it dialed for the control plane, and :meth:`TcpPlane.start` refuses, before connecting anywhere, a
grant that names another host, port or node. The consumer connects only to the checked addresses
and keeps each binding's pooled connections apart, so a hostile producer can neither redirect a
consumer nor disturb its transfers from other producers. A grant started without a binding (a
producer that declared nothing) is served as before, with a warning.

Stream hygiene: every read is bounded by what the grant says (a reply announcing another
size is an error and its connection is closed), and a connection goes back to the pool only when
exactly the reply and its granted bytes were read and nothing else is waiting on it; bytes left
after the payload fail the transfer (the stream is out of sync), and a pooled connection found with
pending bytes or closed is dropped before use.

Security: the token is a capability secret that travels inside the CURVE-encrypted control plane,
but the payload itself crosses TCP in clear text. The default bind is loopback; binding another
address logs a warning. Use NIXL/UCX (or a network you trust) for confidential data.

As the PUSH model of :mod:`ectransport.data.base` says, the consumer's :meth:`TcpPlane.start`
sends the request and the bytes flow producer → consumer. Grant registry, revoke, accept and
receive threads, pooling and framing are :class:`~ectransport.data.socketplane.SocketServingPlane`'s
(shared with the shm plugin); this module adds the TCP listener and connections, the
:class:`TcpGrant`, the host:port binding, and the zero-copy send/receive of the payload.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ectransport.data.base import PLUGIN_API_VERSION, Capabilities, RegionLike, TransferModel
from ectransport.data.binding import (
    HostBinding,
    HostEndpointPlane,
    check_grant,
)
from ectransport.data.framing import PeerClosed, frame
from ectransport.data.serving import Channel, Receive, ServedGrant
from ectransport.data.socketplane import RequestLike, SocketServingPlane
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
)
from ectransport.errors import ConfigError, DataPlaneError
from ectransport.settings_schema import API

__all__ = [
    "MAX_HEADER_BYTES", "MAX_NOTIF_BYTES", "STATUS_BAD_REQUEST", "STATUS_OK",
    "STATUS_UNKNOWN_GRANT", "TCP_WIRE_VERSION", "TOKEN_BYTES", "TcpEndpoint", "TcpGrant",
    "TcpPlane", "TcpReply", "TcpRequest",
]

_log = logging.getLogger(__name__)

_IOV_MAX = 512  # buffers per sendmsg call (POSIX guarantees IOV_MAX >= 16, Linux has 1024)


@dataclass(frozen=True)
class _Route:
    """Consumer side: where a grant's receive connects. ``key`` = (binding scope, host, port),
    scope 0 for an unbound grant; ``addrs`` the addresses it may connect to."""

    key: tuple[int, str, int]
    addrs: tuple[str, ...]
    node: str


class TcpPlane(HostEndpointPlane, SocketServingPlane[TcpGrant, _Route, Channel]):
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
    plugin_api_version = PLUGIN_API_VERSION  # 3: both halves (a DataTransport)
    endpoint_type = TcpEndpoint
    endpoint_decoder = endpoint_decoder
    capabilities = Capabilities(
        transfer_model=TransferModel.PUSH,
        mem_kinds=frozenset({"DRAM"}),
        max_transfer_bytes=None,
        notifications=True,
        address_options=frozenset({"host", "advertise_host"}),
    )
    wire_version = TCP_WIRE_VERSION
    grant_type = TcpGrant
    request_type = TcpRequest
    reply_type = TcpReply
    max_header_bytes = MAX_HEADER_BYTES
    max_notif_bytes = MAX_NOTIF_BYTES
    option_defaults = {
        "host": "127.0.0.1",  # bind address of the listener
        "port": API.planes.tcp.port,  # 0 = any free port
        # address put in grants; None = host (required for a wildcard host: 0.0.0.0 / ::)
        "advertise_host": API.planes.tcp.advertise_host,
    }

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        super().__init__(node_id=node_id, region=region, identity=identity, **options)
        opts = self._opts
        try:
            port = int(opts["port"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid tcp plane option: {exc}") from exc
        host = str(opts["host"])
        advertise = opts["advertise_host"] or host
        if advertise in ("", "0.0.0.0", "::"):
            raise ConfigError(f"tcp plane binds the wildcard {host!r}: set advertise_host to the "
                              f"address consumers should connect to")
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
        self._listen(listener, tag=f"-{self.port}", nodelay=True)

    # -- discovery --------------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "stdlib sockets"

    def describe_transport(self) -> str:
        return f"tcp {self.host}:{self.port}"

    # -- session binding (API 2): endpoint() and bind_peer() are HostEndpointPlane's -------------
    def _declared_address(self) -> tuple[str, int]:
        return self.host, self.port

    def _register_binding(self, binding: HostBinding) -> None:
        with self._lock:
            if self._closed:
                raise DataPlaneError("tcp plane is closed")
            self._bound.add(binding.scope)

    def unbind_peer(self, binding: Any) -> None:
        """Consumer side: close the idle pooled connections of ``binding``'s session; receives in
        flight finish but do not pool their connection afterwards. Never raises."""
        if not isinstance(binding, HostBinding):
            return
        with self._lock:
            self._bound.discard(binding.scope)
            idle = self._pool.drop_where_locked(
                lambda key: isinstance(key, tuple) and key[0] == binding.scope)
        for chan in idle:
            chan.close()

    # -- producer hooks ---------------------------------------------------------------------------
    def _grant(self, token: bytes, nbytes: int, runs_bytes: int) -> TcpGrant:
        return TcpGrant(self.host, self.port, token, nbytes, runs_bytes, self.node_id)

    def _send_grant(self, conn: socket.socket, state: Any, req: RequestLike,
                    served: ServedGrant) -> bool:
        """The OK reply and the granted views with ``sendmsg`` straight from the region (no
        intermediate copy), each call one revocable step."""
        head = memoryview(frame(TcpReply(TCP_WIRE_VERSION, STATUS_OK, served.nbytes)))
        bufs = [head, *served.views]
        conn.settimeout(self._opt.io_timeout_s)
        i = 0
        while i < len(bufs):
            with served.step() as go:
                if not go:
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
        return True

    # -- consumer hooks ---------------------------------------------------------------------------
    def _route(self, prepared: Any, grant: TcpGrant) -> _Route:
        """The grant must name exactly the declared host, port and node, and the connection goes
        to the checked addresses only. ``prepared`` None (a producer that declared nothing): the
        grant's host is used as is (logged once).

        Raises:
            DataPlaneError: ``prepared`` is not a tcp binding, or the grant names another host,
                port or node (:func:`~ectransport.data.binding.check_grant`).
        """
        if prepared is None:
            self._warn_unbound(grant)
            return _Route((0, grant.host, grant.port), (grant.host,), grant.node)
        binding = check_grant(prepared, self.name, grant.host, grant.port, grant.node)
        return _Route((binding.scope, grant.host, grant.port), binding.addrs, binding.node)

    def _admit_locked(self, route: _Route, grant: TcpGrant) -> None:
        if route.node:
            self._pool.note_locked(route.node, route.key)

    def _pool_key(self, route: _Route) -> Hashable:
        return route.key

    def _may_pool_locked(self, route: _Route) -> bool:
        """Not once its binding was unbound (unbound grants: scope 0, always)."""
        return route.key[0] == 0 or route.key[0] in self._bound

    def _connect(self, route: _Route) -> Channel:
        """A connection to the first of ``route.addrs`` that answers on its port."""
        port = route.key[2]
        error: OSError | None = None
        for addr in route.addrs:
            try:
                sock = socket.create_connection((addr, port),
                                                timeout=self._opt.connect_timeout_s)
                break
            except OSError as exc:
                error = exc
        else:
            raise error or OSError(f"no address to connect to for {route.key[1]}:{port}")
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        sock.settimeout(self._opt.io_timeout_s)
        return Channel(sock)

    def _receive_payload(self, handle: Receive, chan: Channel, reply: Any,
                         local: list[memoryview]) -> None:
        """``recv_into`` the local views straight (no intermediate copy)."""
        sock = chan.sock
        sock.settimeout(self._opt.io_timeout_s)
        for view in local:
            got, n = 0, len(view)
            while got < n:
                with handle.io_lock:
                    if handle.cancelled:
                        return
                    k = sock.recv_into(view[got:])
                if k == 0:
                    raise PeerClosed(f"producer closed after {got} of {n} bytes of a run")
                got += k

    def _warn_unbound(self, grant: TcpGrant) -> None:
        if not self._warned_unbound:
            self._warned_unbound = True
            _log.warning(
                "tcp plane %s: grant for %s:%d started without a session binding (the producer "
                "declared no endpoint, e.g. an older node): its grants are not bound to it, so "
                "a compromised producer could point this consumer elsewhere; logged "
                "once", self.node_id, grant.host, grant.port)


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
