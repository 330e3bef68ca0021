"""An in-memory control plane: a :class:`ControlServer` / :class:`ControlClient` pair that
implements the control contract (``ectransport.control.base``) without sockets.

For tests that are about node logic, not sockets (STYLE.md §7, like trio's
``memory_stream_pair`` or httpx's ``MockTransport``): frames are delivered in order, events come
out of ``poll`` exactly as from the ZeroMQ implementation, and a test can cut a connection
(``Down`` on both sides), refuse a client's key (``AuthFailed``) or stop delivering frames
(a "frozen" peer) — deterministically, with no sleeps and no signals.

    net = MemoryNetwork()
    server = MemoryControlServer(net, "mem", 5601, allow=lambda key: key == "consumer-key")
    client = MemoryControlClient(net, public_key="consumer-key")
    conn = client.connect("mem", 5601, server_key=None)      # Up follows from client.poll()

Thread safety: every method may be called from any thread; ``poll`` waits on a condition with a
deadline and ``wake`` interrupts it, as the contract says.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ectransport.control.base import (
    AuthFailed,
    ClientEvent,
    ControlClient,
    ControlServer,
    Down,
    PeerId,
    Received,
    ServerEvent,
    Up,
)
from ectransport.errors import ConfigError


class MemoryNetwork:
    """The medium: listening servers by ``(host, port)`` and the links between ends."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.servers: dict[tuple[str, int], MemoryControlServer] = {}
        self._routes = 0

    def route(self) -> bytes:
        """A fresh routing id (like a ZMQ ROUTER identity)."""
        with self.lock:
            self._routes += 1
            return self._routes.to_bytes(4, "big")


@dataclass
class _Link:
    """One client connection to one server."""

    conn: str
    peer: PeerId
    client: MemoryControlClient
    server: MemoryControlServer
    up: bool = True
    frozen: bool = False  # frames towards the client are held (a stopped consumer/producer)
    held: list[bytes] = field(default_factory=list)


class MemoryControlServer(ControlServer):
    """Producer side. ``allow``: ``public_key -> bool`` (None admits every client, as the ZMQ
    server without an allow-list on loopback does).

    Raises (constructor): ConfigError if ``(host, port)`` is taken on this network.
    """

    def __init__(self, net: MemoryNetwork, host: str = "mem", port: int = 0, *,
                 allow: Callable[[str], bool] | None = None):
        self.net = net
        self.host = host
        self._allow = allow
        self._events: deque[ServerEvent] = deque()
        self._links: dict[bytes, _Link] = {}  # route -> link
        self._closed = False
        self._woken = False
        with net.lock:
            if port == 0:
                port = 1 + max((p for h, p in net.servers if h == host), default=40000)
            if (host, port) in net.servers:
                raise ConfigError(f"{host}:{port} is already bound on this memory network")
            self.port = port
            net.servers[(host, port)] = self

    def poll(self, timeout_s: float) -> list[ServerEvent]:
        with self.net.lock:
            self.net.lock.wait_for(lambda: bool(self._events) or self._closed or self._woken,
                                   timeout=max(0.0, timeout_s))
            self._woken = False
            out = list(self._events)
            self._events.clear()
            return out

    def send(self, peer: PeerId, data: bytes) -> bool:
        with self.net.lock:
            link = self._links.get(peer.route)
            if link is None or not link.up or self._closed:
                return False
            if link.frozen:
                link.held.append(bytes(data))
            else:
                link.client._deliver(Received(link.conn, bytes(data)))
            return True

    def wake(self) -> None:
        with self.net.lock:
            self._woken = True
            self.net.lock.notify_all()

    def close(self) -> None:
        with self.net.lock:
            if self._closed:
                return
            self._closed = True
            self.net.servers.pop((self.host, self.port), None)
            for link in list(self._links.values()):
                self._cut_locked(link)
            self.net.lock.notify_all()

    # -- test controls ---------------------------------------------------------------------------
    @property
    def peers(self) -> list[PeerId]:
        """The peers connected now."""
        with self.net.lock:
            return [link.peer for link in self._links.values() if link.up]

    def cut(self, peer: PeerId) -> None:
        """Drop one connection: ``Down`` on both sides (a closed socket, a heartbeat timeout)."""
        with self.net.lock:
            link = self._links.get(peer.route)
            if link is not None:
                self._cut_locked(link)

    # -- internals (network lock held) ---------------------------------------------------------
    def _accept_locked(self, link: _Link) -> bool:
        key = link.peer.user
        if self._allow is not None and not self._allow(key):
            return False
        self._links[link.peer.route] = link
        return True

    def _deliver_locked(self, link: _Link, data: bytes) -> None:
        if link.up and not self._closed:
            self._events.append(Received(link.peer, data))
            self.net.lock.notify_all()

    def _cut_locked(self, link: _Link) -> None:
        if not link.up:
            return
        link.up = False
        self._links.pop(link.peer.route, None)
        self._events.append(Down(link.peer))
        link.client._deliver(Down(link.conn))
        link.client._links.pop(link.conn, None)


class MemoryControlClient(ControlClient):
    """Consumer side. ``public_key`` is the identity the server sees (``""``: insecure); a
    connection to an address with no server stays pending (like an unreachable producer)."""

    def __init__(self, net: MemoryNetwork, *, public_key: str = ""):
        self.net = net
        self.public_key = public_key
        self._events: deque[ClientEvent] = deque()
        self._links: dict[str, _Link] = {}
        self._closed = False
        self._woken = False

    def connect(self, host: str, port: int, server_key: str | None) -> str:
        conn = f"{host}:{port}"
        with self.net.lock:
            if conn in self._links:
                return conn
            server = self.net.servers.get((host, port))
            if server is None or server._closed:
                return conn  # nothing listens: no event, as with an unreachable host
            link = _Link(conn, PeerId(self.net.route(), self.public_key), self, server)
            if server._accept_locked(link):
                self._links[conn] = link
                self._deliver(Up(conn))
            else:
                self._deliver(AuthFailed(conn, "producer rejected this consumer's key"))
            return conn

    def send(self, conn: str, data: bytes) -> bool:
        with self.net.lock:
            link = self._links.get(conn)
            if link is None or not link.up or self._closed:
                return False
            link.server._deliver_locked(link, bytes(data))
            return True

    def poll(self, timeout_s: float) -> list[ClientEvent]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self.net.lock:
            self.net.lock.wait_for(lambda: bool(self._events) or self._closed or self._woken,
                                   timeout=max(0.0, deadline - time.monotonic()))
            self._woken = False
            out = list(self._events)
            self._events.clear()
            return out

    def disconnect(self, conn: str) -> None:
        with self.net.lock:
            link = self._links.pop(conn, None)
            if link is not None and link.up:
                link.up = False
                link.server._links.pop(link.peer.route, None)
                link.server._events.append(Down(link.peer))
                self.net.lock.notify_all()

    def wake(self) -> None:
        with self.net.lock:
            self._woken = True
            self.net.lock.notify_all()

    def close(self) -> None:
        for conn in list(self._links):
            self.disconnect(conn)
        with self.net.lock:
            self._closed = True
            self.net.lock.notify_all()

    # -- test controls ---------------------------------------------------------------------------
    def freeze(self, conn: str, frozen: bool = True) -> None:
        """Hold (``True``) or release (``False``) frames from the producer on ``conn``: a stopped
        consumer loop whose connection stays up. Held frames are delivered, in order, on
        release."""
        with self.net.lock:
            link = self._links.get(conn)
            if link is None:
                return
            link.frozen = frozen
            if not frozen:
                for data in link.held:
                    self._deliver(Received(conn, data))
                link.held.clear()

    # -- internals (network lock held) ---------------------------------------------------------
    def _deliver(self, ev: ClientEvent) -> None:
        self._events.append(ev)
        self.net.lock.notify_all()
