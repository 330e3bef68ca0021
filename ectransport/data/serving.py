"""What the request-serving (PUSH) planes share: grant tokens and the grant registry with its
revoke rule, notifications, the producer's threaded accept/serve skeleton, the consumer's receive
handle, its connections and its pool of idle connections.

The TCP plane (:mod:`ectransport.data.tcp`) and the shm plugin (``ectransport_shm``) use all of it
through :class:`ectransport.data.socketplane.SocketServingPlane`; the UCX plane uses the grant
tokens and the notification queue only. Nothing here defines a wire format (framing helpers:
:mod:`ectransport.data.framing`, re-exported here).

Locking: the helpers that touch plane state take the plane's own ``threading.Lock`` (passed in), so
a plane's invariants (e.g. "closed" and "no new connection") hold under one lock.
"""

from __future__ import annotations

import collections
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from ectransport.data.base import XferState
from ectransport.data.framing import (
    PREFIX_BYTES,
    PeerClosed,
    close_quietly,
    frame,
    shutdown_quietly,
    unread_state,
)
from ectransport.errors import DataPlaneError

__all__ = [
    "PREFIX_BYTES", "STATUS_BAD_REQUEST", "STATUS_OK", "STATUS_UNKNOWN_GRANT", "TOKEN_BYTES",
    "Acceptor", "Channel", "ConnectionPool", "GrantTable", "Notifications", "PeerClosed",
    "Receive", "Receives", "ServedGrant", "close_quietly", "frame", "grant_token", "new_token",
    "receive_state", "shutdown_quietly", "unread_state",
]

#: Bytes of a grant token: a 128-bit random capability naming the granted blocks at the producer.
TOKEN_BYTES = 16

#: Reply status codes of a socket-serving plane (the same numbers in every such wire format).
STATUS_OK = 0
STATUS_UNKNOWN_GRANT = 1  #: never granted, revoked, or the plane is closing
STATUS_BAD_REQUEST = 2  #: the request could not be parsed; the connection is closed after it

_log = logging.getLogger(__name__)

K = TypeVar("K")
C = TypeVar("C")


def new_token() -> bytes:
    """A fresh random grant token of :data:`TOKEN_BYTES` bytes."""
    return secrets.token_bytes(TOKEN_BYTES)


class _Tokened(Protocol):
    """A plane grant: every one names its producer-side state by a random ``token``."""

    @property
    def token(self) -> bytes: ...


G = TypeVar("G", bound=_Tokened)


def grant_token(decoder: msgspec.msgpack.Decoder[G], plane_grant: bytes) -> bytes | None:
    """The ``token`` of a msgpack plane grant; None if it does not decode."""
    try:
        return decoder.decode(plane_grant).token
    except (msgspec.DecodeError, TypeError):
        return None


class Notifications:
    """Producer side: completion ``notif`` s queued for ``poll_notifications`` (thread-safe)."""

    def __init__(self) -> None:
        self._q: collections.deque[bytes] = collections.deque()

    def push(self, notif: bytes) -> None:
        """Queue ``notif``; an empty one means the consumer asked for none (as NIXL treats it)."""
        if notif:
            self._q.append(notif)

    def drain(self) -> list[bytes]:
        """Every queued notification, oldest first; the queue is empty afterwards."""
        out = []
        while True:
            try:
                out.append(self._q.popleft())
            except IndexError:
                return out

    def clear(self) -> None:
        self._q.clear()


class ServedGrant:
    """Producer side: one registered grant.

    Attributes:
        views: the granted payload bytes, memoryviews of the region in payload order.
        nbytes: payload bytes.
        revoked: set by :meth:`GrantTable.revoke` / :meth:`GrantTable.close_locked`.
        senders: the connections sending it now (shut down by a revoke that cannot wait).
        lock: held during each step that reads the region for it (:meth:`step`).
    """

    __slots__ = ("lock", "nbytes", "revoked", "senders", "views")

    def __init__(self, views: list[memoryview], nbytes: int):
        self.views = views
        self.nbytes = nbytes
        self.revoked = False
        self.senders: set[socket.socket] = set()
        self.lock = threading.Lock()

    @contextmanager
    def step(self) -> Iterator[bool]:
        """One step of a send that reads the region (a ``sendmsg`` of its views, a chunk copy):
        yields False if the grant was revoked (send nothing more, close the connection), else True
        with the grant's lock held until the step ends, so :meth:`GrantTable.revoke` waits it
        out. Keep a step short and bounded by the socket's timeout."""
        with self.lock:
            yield not self.revoked


class GrantTable:
    """Producer side: the grants a plane serves, by token, and the revoke rule every
    socket-serving plane follows.

    **Revoke** (:meth:`revoke`): the grant is refused from then on (a later request finds no
    token: ``STATUS_UNKNOWN_GRANT``), and once ``revoke`` returns no send reads a byte of the
    region for it: a send between two steps stops at its next :meth:`ServedGrant.step`; a step in
    progress is waited out for ``grace_s`` seconds, then the connections sending the grant are shut
    down (which wakes a step blocked on a full socket buffer) and it is waited out for at most
    ``wait_s`` more (the socket timeout bounds it). A grant whose send finished is simply dropped:
    its connection stays usable.

    Args:
        lock: the plane's lock (guards the table and each grant's ``senders``).
        what: the plane as messages name it (``"tcp plane"``).
        grace_s: how long :meth:`revoke` waits for a step before shutting connections down, s.
        wait_s: how long it then waits for the step to end (the plane's io timeout), s.
    """

    def __init__(self, lock: threading.Lock, what: str, *, grace_s: float, wait_s: float):
        self._lock = lock
        self._what = what
        self._grace_s = grace_s
        self._wait_s = wait_s
        self._grants: dict[bytes, ServedGrant] = {}
        self._closed = False

    def add(self, views: list[memoryview], nbytes: int) -> bytes:
        """Register ``views`` (``nbytes`` payload bytes) under a fresh token; the token.

        Raises:
            DataPlaneError: the table was closed.
        """
        token = new_token()
        with self._lock:
            if self._closed:
                raise DataPlaneError(f"{self._what} is closed")
            self._grants[token] = ServedGrant(views, nbytes)
        return token

    def lookup(self, token: bytes) -> ServedGrant | None:
        """The live grant of ``token``, or None."""
        with self._lock:
            return self._grants.get(token)

    def begin(self, token: bytes, conn: socket.socket) -> ServedGrant | None:
        """A send of ``token``'s grant on ``conn`` begins: the grant (``conn`` counted among its
        senders until :meth:`end`), or None if it is unknown or revoked."""
        with self._lock:
            served = self._grants.get(token)
            if served is not None:
                served.senders.add(conn)
            return served

    def end(self, served: ServedGrant, conn: socket.socket) -> None:
        """The send of ``served`` on ``conn`` ended (done or aborted)."""
        with self._lock:
            served.senders.discard(conn)

    def revoke(self, token: bytes | None) -> None:
        """Revoke ``token``'s grant (the rule in the class docstring); unknown tokens and None
        are a no-op. Returns within ``grace_s + wait_s`` seconds."""
        if token is None:
            return
        with self._lock:
            served = self._grants.pop(token, None)
            if served is None:
                return
            served.revoked = True  # a sender checks it under served.lock before each step
        if not served.lock.acquire(timeout=self._grace_s):
            with self._lock:
                senders = list(served.senders)
            for sock in senders:
                shutdown_quietly(sock)
            if not served.lock.acquire(timeout=self._wait_s):  # pragma: no cover
                _log.error("%s: a send of a revoked grant did not stop", self._what)
                return
        served.lock.release()

    def close_locked(self) -> None:
        """Under the plane lock: register nothing more and revoke every grant (without waiting:
        the plane then shuts its connections down and joins their threads)."""
        self._closed = True
        for served in self._grants.values():
            served.revoked = True
        self._grants.clear()


class Acceptor:
    """Producer side: an accept thread on ``listener`` and one daemon serving thread per accepted
    connection, at most ``max_connections`` (the next are closed and counted ``refused``).

    ``serve(conn)`` handles one connection until it returns; the acceptor then forgets and closes
    the connection (an exception is logged on ``log``, never raised).

    Args:
        lock: the plane's lock; admission and :meth:`close_locked` hold it.
        stats: the plane's counter (``accepted``, ``refused``).
        nodelay: set ``TCP_NODELAY`` on accepted connections.
    """

    def __init__(self, listener: socket.socket, serve: Callable[[socket.socket], None], *,
                 lock: threading.Lock, stats: collections.Counter[str], max_connections: int,
                 log: logging.Logger, what: str, accept_name: str, serve_name: str,
                 nodelay: bool = False):
        self.listener = listener
        self.closed = False
        self.conns: set[socket.socket] = set()
        self._serve = serve
        self._lock = lock
        self._stats = stats
        self._max_connections = max_connections
        self._log = log
        self._what = what
        self._serve_name = serve_name
        self._nodelay = nodelay
        self._threads: set[threading.Thread] = set()
        self._closing: list[socket.socket] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=accept_name)
        self._thread.start()

    def close_locked(self) -> None:
        """Under the plane lock: admit nothing more (the first step of closing)."""
        self.closed = True
        self._closing = list(self.conns)

    def stop(self) -> None:
        """Make the accept thread return and shut down every connection being served."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        for sock in self._closing:
            shutdown_quietly(sock)

    def join_and_close(self, others: list[threading.Thread], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` in all for the accept and serving threads and ``others``
        (never the calling thread), then close the listener and the wake-up pair."""
        deadline = time.monotonic() + timeout_s
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            threads = list(self._threads) + others
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        for s in (self.listener, self._wake_r, self._wake_w):
            close_quietly(s)
        self._selector.close()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                events = self._selector.select(1.0)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.fileobj is self._wake_r:
                    return
                try:
                    conn, _addr = self.listener.accept()
                except OSError:
                    continue
                self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        with self._lock:
            if self.closed or len(self.conns) >= self._max_connections:
                self._stats["refused"] += 1
                close_quietly(conn)
                return
            self._stats["accepted"] += 1
            self.conns.add(conn)
            t = threading.Thread(target=self._run, args=(conn,), daemon=True,
                                 name=self._serve_name)
            self._threads.add(t)
        if self._nodelay:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        t.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        except Exception:  # a bug in there must not leak the thread's connection silently
            self._log.exception("%s: connection handler failed", self._what)
        finally:
            with self._lock:
                self.conns.discard(conn)
                self._threads.discard(threading.current_thread())
            close_quietly(conn)


class Receive:
    """Consumer side: one receive on a background thread (the handle a PUSH plane's ``start``
    returns). ``sock`` is the connection it uses, shut down by :meth:`cancel`."""

    __slots__ = ("cancelled", "detail", "io_lock", "nbytes", "sock", "sock_lock", "state",
                 "thread")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.state = XferState.PROC
        self.detail = ""
        self.cancelled = False
        self.sock: socket.socket | None = None
        self.io_lock = threading.Lock()  # held during each write into the local blocks
        self.sock_lock = threading.Lock()  # guards sock/cancelled; never held across I/O
        self.thread: threading.Thread | None = None

    def start(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        self.thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        self.thread.start()

    def cancel(self) -> None:
        """Stop the receive; when this returns no more bytes land in the local blocks."""
        with self.sock_lock:
            self.cancelled = True
            shutdown_quietly(self.sock)  # wakes a receive blocked in the thread
        with self.io_lock:  # waits out a write in progress
            if self.state is XferState.PROC:
                self.state = XferState.ERR
                self.detail = self.detail or "released while in flight"

    def settle(self) -> None:
        """At the end of the receive thread: drop the socket; still in flight means ERR."""
        with self.sock_lock:
            self.sock = None
        with self.io_lock:
            if self.state is XferState.PROC:
                self.state = XferState.ERR
                self.detail = self.detail or "cancelled"


class Channel:
    """Consumer side: one connection to a producer's plane (what the pool keeps). Planes that
    keep more per connection (the shm plugin: the mapped segment) subclass it."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def close(self) -> None:
        """Close the connection (and whatever the subclass holds); never raises."""
        close_quietly(self.sock)


def receive_state(handle: Any) -> XferState:
    """``check`` of a PUSH plane: PROC, DONE or ERR; a released handle keeps its last state (ERR
    if it was in flight); anything but a :class:`Receive` is ERR."""
    if not isinstance(handle, Receive):
        return XferState.ERR
    return handle.state


class Receives:
    """Consumer side: the receives in flight, at most ``max_inflight``."""

    def __init__(self, lock: threading.Lock, max_inflight: int, what: str):
        self._lock = lock
        self._max_inflight = max_inflight
        self._what = what
        self._handles: set[Receive] = set()

    def admit_locked(self, handle: Receive) -> None:
        """Under the plane lock: count ``handle`` in flight.

        Raises:
            DataPlaneError: ``max_inflight`` receives are in flight already.
        """
        if len(self._handles) >= self._max_inflight:
            raise DataPlaneError(f"{self._what} has {len(self._handles)} receives in flight "
                                 f"(max_inflight={self._max_inflight})")
        self._handles.add(handle)

    def release(self, handle: Any) -> None:
        """Cancel and forget ``handle`` (:meth:`Receive.cancel`); anything else: no-op."""
        if not isinstance(handle, Receive):
            return
        handle.cancel()
        with self._lock:
            self._handles.discard(handle)

    def snapshot_locked(self) -> list[Receive]:
        """Under the plane lock: the receives in flight."""
        return list(self._handles)


class ConnectionPool(Generic[K, C]):
    """Consumer side: idle connections ``C`` per producer endpoint ``K`` (at most
    ``max_idle_per_peer`` each), and the endpoints seen for each producer node id.

    Closing the connections it hands out or refuses is the caller's job (``C`` is opaque here).
    """

    def __init__(self, lock: threading.Lock, max_idle_per_peer: int):
        self._lock = lock
        self._max_idle = max_idle_per_peer
        self._idle: dict[K, list[C]] = {}
        self._endpoints: dict[str, set[K]] = {}
        self._closed = False

    def take(self, key: K) -> C | None:
        """An idle connection to ``key``, or None."""
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        return None

    def put(self, key: K, conn: C, keep: bool = True) -> bool:
        """Pool ``conn`` if ``keep`` and there is room; False: the caller must close it."""
        with self._lock:
            return keep and self.put_locked(key, conn)

    def put_locked(self, key: K, conn: C) -> bool:
        """Under the plane lock: :meth:`put` (so the caller can check its own state first)."""
        idle = self._idle.setdefault(key, [])
        if not self._closed and len(idle) < self._max_idle:
            idle.append(conn)
            return True
        return False

    def drop_where_locked(self, pred: Callable[[K], bool]) -> list[C]:
        """Under the plane lock: remove and return the idle connections of every key matching
        ``pred`` (e.g. the keys of one producer session)."""
        out: list[C] = []
        for key in [k for k in self._idle if pred(k)]:
            out += self._idle.pop(key)
        return out

    def note_locked(self, node: str, key: K) -> None:
        """Under the plane lock: producer ``node`` serves at ``key``."""
        self._endpoints.setdefault(node, set()).add(key)

    def forget(self, node: str) -> list[C]:
        """Remove and return the idle connections to producer ``node``."""
        with self._lock:
            return [c for key in self._endpoints.pop(node, ()) for c in self._idle.pop(key, [])]

    def close_locked(self) -> list[C]:
        """Under the plane lock: pool nothing more; remove and return every idle connection."""
        self._closed = True
        out = [c for conns in self._idle.values() for c in conns]
        self._idle.clear()
        self._endpoints.clear()
        return out
