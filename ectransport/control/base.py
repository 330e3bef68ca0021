"""The control-plane contract: small authenticated frames between producer and consumers.

The control plane moves opaque ``bytes`` frames (ECTP messages, encoded by the caller) and reports
connection events; it knows nothing about sessions. Every call is non-blocking or has a deadline.
``wake()`` is the only method safe to call from another thread: it makes a blocked ``poll`` return.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S")  # an event's source: PeerId (server) or connection key (client)


@dataclass(frozen=True)
class PeerId:
    """An authenticated peer as the producer sees it.

    Attributes:
        route: transport routing id (ZMQ ROUTER identity), opaque.
        user: the authenticated identity: the CURVE public key (Z85, 40 chars), or ``""`` in
            insecure plain mode. Budgets, quarantine and logs use it.
    """

    route: bytes
    user: str

    def short(self) -> str:
        return (self.user[:8] or "plain") + ":" + self.route.hex()[:8]


# -- events ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Received(Generic[S]):
    """A frame arrived. ``source`` is a :class:`PeerId` (server) or a connection key (client)."""

    source: S
    data: bytes


@dataclass(frozen=True)
class Up:
    """Client: the connection is established and authenticated (handshake succeeded)."""

    conn: str


@dataclass(frozen=True)
class AuthFailed:
    """Client: authentication failed (unknown key, server key mismatch, plain vs CURVE)."""

    conn: str
    reason: str


@dataclass(frozen=True)
class Down(Generic[S]):
    """The peer went away (disconnect or heartbeat timeout). ``source`` as in :class:`Received`."""

    source: S


ServerEvent = Received[PeerId] | Down[PeerId]  # what a ControlServer reports
ClientEvent = Received[str] | Up | AuthFailed | Down[str]  # what a ControlClient reports
Event = ServerEvent | ClientEvent


class ControlServer(ABC):
    """Producer side: one listening endpoint, many authenticated consumers."""

    host: str
    port: int

    @abstractmethod
    def poll(self, timeout_s: float) -> list[ServerEvent]:
        """Wait up to ``timeout_s`` for frames/events, then drain what is buffered (bounded)."""

    @abstractmethod
    def send(self, peer: PeerId, data: bytes) -> bool:
        """Queue a frame to ``peer``; False if it could not be queued (peer gone, queue full)."""

    @abstractmethod
    def wake(self) -> None:
        """Thread-safe: make a concurrent ``poll`` return early."""

    @abstractmethod
    def close(self) -> None:
        """Close everything; idempotent."""


class ControlClient(ABC):
    """Consumer side: connections to any number of producers, keyed by ``"host:port"``."""

    @abstractmethod
    def connect(self, host: str, port: int, server_key: str | None) -> str:
        """Start connecting (non-blocking); returns the connection key. ``Up`` or
        ``AuthFailed`` follows from ``poll``. ``server_key`` is the producer's CURVE public key
        (Z85), required unless the client is in insecure plain mode."""

    @abstractmethod
    def send(self, conn: str, data: bytes) -> bool:
        """Queue a frame on a connection; False if it is not connected."""

    @abstractmethod
    def poll(self, timeout_s: float) -> list[ClientEvent]:
        """Wait up to ``timeout_s`` for frames/events on all connections, then drain them."""

    @abstractmethod
    def disconnect(self, conn: str) -> None:
        """Close one connection; idempotent."""

    @abstractmethod
    def wake(self) -> None:
        """Thread-safe: make a concurrent ``poll`` return early."""

    @abstractmethod
    def close(self) -> None:
        """Close everything; idempotent."""
