"""Binding a host:port plane's grants to the producer that declared it (plugin API 2).

The TCP and UCX planes reach a producer at a ``host:port`` named in each grant. A grant is only as
trustworthy as the producer that sent it: a *compromised* producer (a CURVE key the consumer trusts
that turned hostile) must not be able to point a consumer at another producer or at an unrelated
endpoint. So the producer's plane declares once per session, over the authenticated control plane,
where it listens (:class:`HostEndpoint`, the plane's ``endpoint()``); the consumer's plane checks
the declaration (:func:`bind_host_endpoint`) and every grant of the session must name exactly the
declared ``host:port`` (:func:`check_grant`), else it is refused before any I/O.

**The host rule.** The declared host must be the host the consumer dialed for the control plane:
both are resolved (``socket.getaddrinfo``) to IP addresses, and the consumer only ever connects to
the declared host's addresses that are also addresses of the dialed host (``HostBinding.addrs``;
never a fresh DNS answer later). Loopback addresses (127.0.0.0/8, ::1) all count as "this host",
but only when the dialed host is loopback too. Unspecified addresses (0.0.0.0, ::) never match.
Operators: the data plane must be reachable at the address consumers dial for the control plane,
or both must advertise the same host name (``advertise_host``).

What this does not cover: a producer may still declare *another port of its own host* (nothing on
a plain TCP/UCX port proves who listens there). That port is on a machine the hostile producer
already controls, its grant tokens are worthless elsewhere, and a consumer keeps each binding's
connections apart (:attr:`HostBinding.scope`), so another producer's transfers are not disturbed.
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from ectransport.data.base import MAX_ENDPOINT_BYTES
from ectransport.errors import DataPlaneError

#: Version of the endpoint declaration (``HostEndpoint.v``), checked by :func:`bind_host_endpoint`.
ENDPOINT_VERSION = 1
#: Longest identity a declaration may carry (``identity_of`` gives 16 hex digits).
MAX_IDENTITY_CHARS = 64

_scopes = itertools.count(1)  # unique per binding; 0 = unbound (prepared=None)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class HostEndpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a host:port plane declares in ``Welcome`` (subclassed with a tag per plane).

    Attributes:
        v: :data:`ENDPOINT_VERSION` (required: never a defaulted field msgspec may omit).
        host: the address grants name (the plane's advertised host).
        port: the plane's listener port.
        node: the producer's node id (grants name it too).
        identity: the producer's identity (``identity_of`` its CURVE public key; ``""`` insecure).
    """

    v: int
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    node: Annotated[str, msgspec.Meta(max_length=256)]
    identity: Annotated[str, msgspec.Meta(max_length=MAX_IDENTITY_CHARS)]


@dataclass(frozen=True)
class HostBinding:
    """Consumer side: a producer's checked declaration; ``start(prepared=...)`` takes it.

    Attributes:
        plane: name of the plane that made it (another plane's binding is refused).
        scope: unique per :func:`bind_host_endpoint` call; keys the consumer's pooled
            connections/endpoints, so one producer session's failures never touch another's.
        peer: the control connection (``"host:port"``) of the session.
        node / identity / host / port: as declared (and checked).
        addrs: the IP addresses to connect to (declared ∩ dialed, see the module docstring).
    """

    plane: str
    scope: int
    peer: str
    node: str
    identity: str
    host: str
    port: int
    addrs: tuple[str, ...]


def resolve(host: str) -> list[IPAddress]:
    """The IP addresses of ``host`` (a name or a literal; ``[v6]`` brackets allowed), in resolver
    order, without duplicates and without unspecified addresses; IPv4-mapped IPv6 as IPv4.

    Raises:
        DataPlaneError: the host does not resolve.
    """
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise DataPlaneError(f"cannot resolve host {host!r}: {exc}") from exc
    out: list[IPAddress] = []
    for *_, sockaddr in infos:
        try:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        except ValueError:
            continue
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not ip.is_unspecified and ip not in out:
            out.append(ip)
    return out


def allowed_addresses(declared: str, dialed: str) -> tuple[str, ...]:
    """The addresses of ``declared`` the consumer may connect to: those that are addresses of
    ``dialed`` too, or loopback ones when ``dialed`` is loopback (module docstring).

    Raises:
        DataPlaneError: none (the declared host is another machine than the one dialed).
    """
    dialed_ips = resolve(dialed)
    declared_ips = resolve(declared)
    dialed_loopback = any(ip.is_loopback for ip in dialed_ips)
    ok = tuple(str(ip) for ip in declared_ips
               if ip in dialed_ips or (ip.is_loopback and dialed_loopback))
    if not ok:
        raise DataPlaneError(
            f"the producer declares its data plane at {declared!r} "
            f"({', '.join(map(str, declared_ips)) or 'no address'}), but the control plane was "
            f"dialed at {dialed!r} ({', '.join(map(str, dialed_ips)) or 'no address'}): a plane "
            f"must be reachable at the host consumers dial for control (set the same "
            f"advertise host for both); refused so that a producer cannot redirect consumers")
    return ok


def endpoint_bytes(endpoint: HostEndpoint) -> bytes:
    """The msgpack declaration ``endpoint()`` returns."""
    return msgspec.msgpack.encode(endpoint)


E = TypeVar("E", bound=HostEndpoint)


def bind_host_endpoint(plane: str, decoder: msgspec.msgpack.Decoder[E], endpoint: bytes, *,
                       peer: str, host: str, identity: str) -> HostBinding | None:
    """Check a producer's declaration (``bind_peer`` of a host:port plane).

    Args:
        plane: the plane's name (for messages and :attr:`HostBinding.plane`).
        decoder: msgpack decoder of the plane's :class:`HostEndpoint` subclass.
        endpoint: the declaration; ``b""`` (a producer that declares nothing): returns None, and
            that session's grants are not bound (the plane logs it).
        peer / host / identity: see ``DataTransport.bind_peer``.

    Raises:
        DataPlaneError: the declaration is longer than ``MAX_ENDPOINT_BYTES``, does not decode,
            has another version, carries another identity than ``identity`` (when non-empty), or
            names another host than ``host`` (:func:`allowed_addresses`).
    """
    if not endpoint:
        return None
    if len(endpoint) > MAX_ENDPOINT_BYTES:
        raise DataPlaneError(f"{plane} endpoint declaration of {len(endpoint)} bytes, at most "
                             f"{MAX_ENDPOINT_BYTES}")
    try:
        decl = decoder.decode(endpoint)
    except (msgspec.DecodeError, TypeError) as exc:
        raise DataPlaneError(f"malformed {plane} endpoint declaration ({len(endpoint)} bytes) "
                             f"from {peer}: {exc}") from exc
    if decl.v != ENDPOINT_VERSION:
        raise DataPlaneError(f"{plane} endpoint declaration version {decl.v} from {peer}, "
                             f"expected {ENDPOINT_VERSION}")
    if identity and decl.identity != identity:
        raise DataPlaneError(
            f"{plane} endpoint declared by {peer} carries identity {decl.identity!r}, the "
            f"producer authenticated as {identity!r}: refused (a declaration must come from the "
            f"producer that sends it)")
    addrs = allowed_addresses(decl.host, host)
    return HostBinding(plane, next(_scopes), peer, decl.node, decl.identity, decl.host, decl.port,
                       addrs)


def check_grant(binding: Any, plane: str, host: str, port: int, node: str | None = None
                ) -> HostBinding:
    """``start``'s check: the grant names exactly what ``binding`` declared.

    ``node`` is checked when the grant names one (the TCP grant does; the UCX grant has none).

    Raises:
        DataPlaneError: ``binding`` is not a :class:`HostBinding` of ``plane``, or the grant names
            another host, port or node than the producer declared for this session.
    """
    if not isinstance(binding, HostBinding) or binding.plane != plane:
        raise DataPlaneError(f"{plane} plane: prepared={type(binding).__name__} is not a binding "
                             f"of this plane (pass bind_peer's result)")
    if (host, port) != (binding.host, binding.port) or (node is not None
                                                        and node != binding.node):
        raise DataPlaneError(
            f"{plane} grant names {host}:{port} (node {node!r}), but producer {binding.peer} "
            f"declared {binding.host}:{binding.port} (node {binding.node!r}) for this session: "
            f"refused before any I/O (a producer may only grant what it declared)")
    return binding


class HostEndpointPlane:
    """``endpoint()`` and ``bind_peer()`` of a plane reached at ``host:port`` (TCP, UCX): the
    declaration :class:`HostEndpoint` and its check :func:`bind_host_endpoint`. Put it before the
    plane's base class; the plane names its declaration type and decoder, says which address it
    declares (:meth:`_declared_address`) and may hook the binding (:meth:`_check_open`,
    :meth:`_register_binding`)."""

    name: ClassVar[str]
    #: the plane's tagged :class:`HostEndpoint` subclass and its msgpack decoder
    endpoint_type: ClassVar[type[HostEndpoint]]
    endpoint_decoder: ClassVar[msgspec.msgpack.Decoder[Any]]
    node_id: str
    identity: str

    def _declared_address(self) -> tuple[str, int]:
        """The ``(host, port)`` grants name: what :meth:`endpoint` declares."""
        raise NotImplementedError

    def _check_open(self) -> None:
        """Before a declaration is checked: raise DataPlaneError if the plane is closed."""

    def _register_binding(self, binding: HostBinding) -> None:
        """After a declaration was accepted (e.g. note its scope as pooled); may raise
        DataPlaneError (closed meanwhile)."""

    def endpoint(self) -> bytes:
        """Producer side: the msgpack declaration ``{v, host, port, node, identity}`` (about 80
        bytes) that every grant of a session must match."""
        host, port = self._declared_address()
        return endpoint_bytes(self.endpoint_type(ENDPOINT_VERSION, host, port, self.node_id,
                                                 self.identity))

    def bind_peer(self, endpoint: bytes, *, peer: str, host: str, identity: str
                  ) -> HostBinding | None:
        """Consumer side: check a producer's :meth:`endpoint` and return the session's binding.

        ``b""`` (a producer that declares nothing) gives None: that session's grants are not bound
        (``start`` warns once). Rules: :mod:`ectransport.data.binding`.

        Raises:
            DataPlaneError: oversized, malformed or wrong-version declaration; an identity other
                than ``identity`` (when non-empty); a host other than the dialed ``host``; the
                plane is closed.
        """
        self._check_open()
        binding = bind_host_endpoint(self.name, self.endpoint_decoder, endpoint, peer=peer,
                                     host=host, identity=identity)
        if binding is not None:
            self._register_binding(binding)
        return binding
