"""The shared base of the planes that serve granted bytes over a stream socket (PUSH model):
:class:`SocketServingPlane`. The TCP plane and the shm plugin are subclasses; a new plane of this
kind writes only what is its own (how it listens and connects, what its grant names, how the
payload crosses the connection).

What the base does, identically for every subclass:

* **options**: the plane's own (:attr:`SocketServingPlane.option_defaults`) plus the serving bounds
  (:data:`~ectransport.data.options.SERVING_DEFAULTS`: ``connect_timeout_s``, ``io_timeout_s``,
  ``idle_timeout_s``, ``max_connections``, ``max_inflight``, ``max_idle_per_peer``); unknown or
  invalid ones raise :class:`~ectransport.errors.ConfigError`; DRAM regions only.
* **producer**: :meth:`~SocketServingPlane.describe` registers a random 128-bit token for exactly
  the granted blocks (:class:`~ectransport.data.serving.GrantTable`; no region address leaves the
  producer); an accept thread and one thread per connection (at most ``max_connections``) read
  request frames (``idle_timeout_s`` between requests, ``io_timeout_s`` within one) and answer
  ``STATUS_BAD_REQUEST`` and close for an oversized, undecodable or wrong-version frame,
  ``STATUS_UNKNOWN_GRANT`` (connection kept) for an unknown or revoked token, else call the
  subclass's :meth:`~SocketServingPlane._send_grant`; a completed send queues the request's
  ``notif`` for :meth:`~SocketServingPlane.poll_notifications`.
* **revoke**, the same for every subclass: a revoked grant is refused from then on, and a send in
  progress stops before :meth:`~SocketServingPlane.revoke` returns — sends read the region only
  inside :meth:`ServedGrant.step`, which revoke waits out (50 ms, then it shuts the sending
  connections down and waits at most ``io_timeout_s`` more). A revoke after the send finished
  keeps the connection.
* **consumer**: :meth:`~SocketServingPlane.start` decodes and checks the grant against the
  session's binding (the subclass's :meth:`~SocketServingPlane._route`), the local runs and the
  notif size, before any I/O; a receive thread takes a pooled connection (or a new one), sends the
  request, reads the reply frame (at most :attr:`~SocketServingPlane.max_header_bytes`) and lets
  the subclass read exactly the announced payload (which must be the grant's size). A stale
  pooled connection (the producer closed it) is retried once on a new one.
* **the "nothing unread" rule** (issue 17): a connection goes back to the pool, and a pooled one
  is reused, only if nothing is waiting on it (:func:`~ectransport.data.framing.unread_state`);
  bytes waiting after a payload fail the transfer (:attr:`~SocketServingPlane.stray_bytes_fail`).
* **teardown**: :meth:`~SocketServingPlane.close` revokes everything, cancels every receive, closes
  every socket and joins every thread (2 s each at most).

Sizes are bytes, timeouts seconds. Every method may be called from any thread; plane state is
guarded by one lock (``self._lock``), never held across I/O.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import socket
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import msgspec

from ectransport.data.base import DataTransport, RegionLike, XferState
from ectransport.data.framing import (
    FrameError,
    PeerClosed,
    close_fds,
    frame,
    recv_frame,
    unread_state,
)
from ectransport.data.options import SERVING_DEFAULTS, ServingOptions, reject_unknown
from ectransport.data.runs import check_runs, payload_spans, views
from ectransport.data.serving import (
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_GRANT,
    Acceptor,
    Channel,
    ConnectionPool,
    GrantTable,
    Notifications,
    Receive,
    Receives,
    ServedGrant,
    grant_token,
    receive_state,
)
from ectransport.errors import ConfigError, DataPlaneError
from ectransport.store import Run

__all__ = ["GrantLike", "ReplyLike", "RequestLike", "SocketServingPlane"]

_JOIN_S = 2.0  # close(): how long to wait for the background threads, in all per group


class GrantLike(Protocol):
    """What the base reads of a plane's grant (a msgspec Struct)."""

    @property
    def token(self) -> bytes: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def runs_bytes(self) -> int: ...


class RequestLike(Protocol):
    """What the base reads of a request frame: ``{v, token, notif}``."""

    @property
    def v(self) -> int: ...
    @property
    def token(self) -> bytes: ...
    @property
    def notif(self) -> bytes: ...


class ReplyLike(Protocol):
    """What the base reads of a reply frame: ``{v, status, nbytes, detail}``."""

    @property
    def v(self) -> int: ...
    @property
    def status(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def detail(self) -> str: ...


G = TypeVar("G", bound=GrantLike)  # the plane's grant
R = TypeVar("R")  # a consumer's route to one producer (its binding, or what an unbound grant names)
C = TypeVar("C", bound=Channel)  # the consumer's connection to a producer


class SocketServingPlane(DataTransport, Generic[G, R, C]):
    """Base class of a PUSH plane whose producer serves granted bytes over a stream socket.

    A subclass declares (class attributes): ``name``, ``capabilities``, ``wire_version``,
    ``grant_type``, ``request_type`` (fields ``v, token, notif``), ``reply_type`` (fields ``v,
    status, nbytes, detail``, all with these names), ``max_header_bytes``, ``max_notif_bytes``,
    ``option_defaults``, and implements the hooks below. Its constructor calls
    ``super().__init__(node_id=..., region=..., identity=..., **options)`` first (which checks the
    options and maps the region; no thread starts), reads its own options from ``self._opts``,
    then binds a listening socket and hands it to :meth:`_listen`.

    Hooks (see each one): producer :meth:`_grant`, :meth:`_send_grant`, optionally
    :meth:`_open_connection` / :meth:`_close_connection`; consumer :meth:`_route`,
    :meth:`_pool_key`, :meth:`_connect`, :meth:`_receive_payload`, optionally
    :meth:`_admit_locked`, :meth:`_may_pool_locked`, :meth:`_accept_reply`; teardown
    :meth:`_close_locked`, :meth:`_after_close`.

    ``stats`` counts ``accepted``/``refused`` connections, ``served``/``aborted``/``unknown``
    grants and ``bad`` requests (producer), and ``stale`` pooled connections and ``stray`` ones
    found with unread bytes (consumer); subclasses add their own.

    Raises (constructor): ConfigError for an unknown or invalid option or a non-DRAM region.
    """

    # -- declared by the subclass ----------------------------------------------------------------
    #: version carried by every request and reply frame, checked on both sides
    wire_version: ClassVar[int]
    #: the msgpack Struct of the plane's grant (has ``token``, ``nbytes``, ``runs_bytes``)
    grant_type: ClassVar[type[Any]]
    #: the request frame (consumer → producer) and the reply frame (producer → consumer)
    request_type: ClassVar[type[Any]]
    reply_type: ClassVar[type[Any]]
    #: largest frame body accepted, bytes
    max_header_bytes: ClassVar[int] = 4096
    #: largest ``notif`` a request may carry, bytes
    max_notif_bytes: ClassVar[int] = 2048
    #: the plane's own constructor options and their defaults (SERVING_DEFAULTS are added)
    option_defaults: ClassVar[Mapping[str, Any]] = {}
    #: whether reply frames may carry descriptors (``SCM_RIGHTS``; Unix sockets only)
    fds_with_replies: ClassVar[bool] = False
    #: whether bytes found waiting after a payload fail the transfer (the stream is out of sync:
    #: were they the reply's?); False only where the payload cannot be taken from the stream
    #: (shm: it comes through the segment) — the connection is never pooled either way
    stray_bytes_fail: ClassVar[bool] = True
    #: revoke(): how long to wait for a step in progress before shutting its connection down, s
    revoke_grace_s: ClassVar[float] = 0.05

    _grant_decoder: ClassVar[msgspec.msgpack.Decoder[Any]]
    _request_decoder: ClassVar[msgspec.msgpack.Decoder[Any]]
    _reply_decoder: ClassVar[msgspec.msgpack.Decoder[Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, dec in (("grant_type", "_grant_decoder"), ("request_type", "_request_decoder"),
                          ("reply_type", "_reply_decoder")):
            if attr in cls.__dict__:
                setattr(cls, dec, msgspec.msgpack.Decoder(cls.__dict__[attr]))

    def __init__(self, *, node_id: str, region: RegionLike, identity: str = "", **options: Any):
        what = f"{self.name} plane"
        reject_unknown(what, options, {**self.option_defaults, **SERVING_DEFAULTS})
        #: every option, defaults filled in (the subclass reads its own from here)
        self._opts: dict[str, Any] = {**SERVING_DEFAULTS, **self.option_defaults, **options}
        mem_kind = getattr(region, "mem_kind", "DRAM")
        if mem_kind != "DRAM":
            raise ConfigError(f"{what} moves DRAM only, region is {mem_kind!r}")
        try:
            self._opt = ServingOptions.parse(self._opts)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid {what} option: {exc}") from exc
        self._opt.check(what)

        self.node_id = node_id
        self.identity = str(identity)
        self._log = logging.getLogger(type(self).__module__)
        self._block_bytes = int(region.block_bytes)
        self._num_blocks = int(region.nbytes) // self._block_bytes
        buf = getattr(region, "buf", None)
        if buf is not None:
            mem = memoryview(buf).cast("B")
        else:
            mem = memoryview((ctypes.c_ubyte * int(region.nbytes)).from_address(
                int(region.addr))).cast("B")
        if mem.nbytes < self._num_blocks * self._block_bytes:
            raise ConfigError(f"region buffer has {mem.nbytes} bytes, expected "
                              f"{self._num_blocks * self._block_bytes}")
        #: the region's bytes (None once closed; views held by transfers keep the buffer alive)
        self._mem: memoryview | None = mem

        self._lock = threading.Lock()
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()
        # producer state
        self._grants = GrantTable(self._lock, what, grace_s=self.revoke_grace_s,
                                  wait_s=self._opt.io_timeout_s)
        self._notifs = Notifications()
        self._acceptor: Acceptor | None = None
        # consumer state
        self._receives = Receives(self._lock, self._opt.max_inflight, what)
        self._pool: ConnectionPool[Hashable, C] = ConnectionPool(self._lock,
                                                                 self._opt.max_idle_per_peer)

    def _listen(self, listener: socket.socket, *, tag: str = "", nodelay: bool = False) -> None:
        """Start serving ``listener`` (bound and listening): the accept thread and one thread
        per connection, named ``ectransport-<name>-accept<tag>`` / ``-serve<tag>``; ``nodelay``
        sets ``TCP_NODELAY`` on accepted connections. Call once, last in the constructor."""
        self._acceptor = Acceptor(
            listener, self._serve, lock=self._lock, stats=self.stats,
            max_connections=self._opt.max_connections, log=self._log, what=f"{self.name} plane",
            accept_name=f"ectransport-{self.name}-accept{tag}",
            serve_name=f"ectransport-{self.name}-serve{tag}", nodelay=nodelay)

    # -- producer side ----------------------------------------------------------------------------
    def describe(self, runs: Sequence[Run], nbytes: int) -> bytes:
        """Register a fresh token for exactly ``runs`` and return the msgpack grant
        (:meth:`_grant`).

        Raises:
            DataPlaneError: the plane is closed, ``runs`` is empty or leaves the region, or
                ``nbytes`` exceeds the runs.
        """
        blocks = self._check_runs(runs, nbytes)
        spans = payload_spans(runs, self._block_bytes, nbytes)
        token = self._grants.add(views(self._region(), spans), nbytes)
        return msgspec.msgpack.encode(self._grant(token, nbytes, blocks * self._block_bytes))

    def revoke(self, plane_grant: bytes) -> None:
        """Stop serving ``plane_grant``: later requests get ``STATUS_UNKNOWN_GRANT``, and a send in
        progress stops before this returns (its connection is shut down if it does not reach its
        next step within 50 ms); returns within ``io_timeout_s`` + 50 ms. Unknown or malformed
        grants: no-op."""
        token = grant_token(self._grant_decoder, plane_grant)
        if token is None:
            self._log.debug("%s plane: revoke of a malformed grant ignored", self.name)
        self._grants.revoke(token)

    def poll_notifications(self) -> list[bytes]:
        """The ``notif`` of every grant fully sent since the last call."""
        return self._notifs.drain()

    # -- consumer side ----------------------------------------------------------------------------
    def start(self, prepared: Any, plane_grant: bytes, runs: Sequence[Run], nbytes: int,
              notif: bytes) -> Receive:
        """Request the granted blocks and receive them into local ``runs`` (background thread).

        ``prepared`` is the session's :meth:`bind_peer` result; the grant must name what it
        declared (:meth:`_route`).

        Raises:
            DataPlaneError: malformed grant, a grant not covered by ``prepared`` (nothing was
                connected), runs/nbytes that do not match it, an oversized ``notif``, too many
                receives in flight, or the plane is closed.
        """
        try:
            grant: G = self._grant_decoder.decode(plane_grant)
        except (msgspec.DecodeError, TypeError) as exc:
            raise DataPlaneError(f"malformed {self.name} grant ({len(plane_grant)} bytes): "
                                 f"{exc}") from exc
        route = self._route(prepared, grant)
        blocks = self._check_runs(runs, nbytes)
        local_bytes = blocks * self._block_bytes
        if grant.runs_bytes != local_bytes or grant.nbytes != nbytes:
            raise DataPlaneError(
                f"{self.name} grant covers {grant.nbytes} bytes in {grant.runs_bytes} bytes of "
                f"blocks, the local transfer is {nbytes} bytes in {local_bytes}; both sides must "
                f"use the same block_bytes and block count")
        if len(notif) > self.max_notif_bytes:
            raise DataPlaneError(f"notif is {len(notif)} bytes, at most {self.max_notif_bytes}")
        local = views(self._region(), payload_spans(runs, self._block_bytes, nbytes))
        handle = Receive(nbytes)
        request = frame(self.request_type(v=self.wire_version, token=grant.token,
                                          notif=bytes(notif)))
        with self._lock:
            if self._closed:
                raise DataPlaneError(f"{self.name} plane is closed")
            self._admit_locked(route, grant)
            self._receives.admit_locked(handle)
            handle.start(self._receive, (handle, route, request, local),
                         f"ectransport-{self.name}-recv")
        return handle

    def check(self, handle: Any) -> XferState:
        """PROC, DONE or ERR; a released handle keeps its last state (ERR if it was in flight)."""
        return receive_state(handle)

    def release(self, handle: Any) -> None:
        """Cancel (shut its connection down if mid-transfer) and forget a receive; idempotent.
        When this returns no more bytes land in the handle's local blocks."""
        self._receives.release(handle)

    def forget_peer(self, peer: str) -> None:
        """Close the pooled connections to producer node ``peer``; unknown names: no-op."""
        for chan in self._pool.forget(peer):
            chan.close()

    def close(self) -> None:
        """Stop serving, cancel every receive, close every socket, join threads; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._grants.close_locked()
            if self._acceptor is not None:
                self._acceptor.close_locked()
            handles = self._receives.snapshot_locked()
            pooled = self._pool.close_locked()
            self._close_locked()
        if self._acceptor is not None:
            self._acceptor.stop()
        for h in handles:
            self.release(h)
        for chan in pooled:
            chan.close()
        threads = [h.thread for h in handles if h.thread]
        if self._acceptor is not None:
            self._acceptor.join_and_close(threads, _JOIN_S)
        self._notifs.clear()
        self._mem = None
        self._after_close()

    # -- hooks: producer --------------------------------------------------------------------------
    def _grant(self, token: bytes, nbytes: int, runs_bytes: int) -> msgspec.Struct:
        """The grant ``describe`` returns for ``token`` (``nbytes`` payload bytes in
        ``runs_bytes`` bytes of blocks), naming how this plane is reached."""
        raise NotImplementedError

    def _open_connection(self, conn: socket.socket) -> Any:
        """A new connection was accepted (on its serving thread): whatever the plane keeps per
        connection (passed to :meth:`_send_grant`), or None to close it at once. Default True."""
        return True

    def _close_connection(self, state: Any) -> None:
        """The connection of ``state`` is being closed (its serving thread ends)."""

    def _send_grant(self, conn: socket.socket, state: Any, req: RequestLike,
                    served: ServedGrant) -> bool:
        """Answer ``req`` on ``conn`` with ``STATUS_OK`` and the granted bytes (``served.views``).

        Read the region only inside ``with served.step() as go:`` (and send nothing more when
        ``go`` is False); set a timeout on every socket operation. Return True once every byte
        was handed off (the base then counts ``served`` and queues the notif), False if the
        connection must be closed (count ``aborted`` or ``bad`` first). OSError may propagate
        (counted ``aborted``)."""
        raise NotImplementedError

    # -- hooks: consumer --------------------------------------------------------------------------
    def _route(self, prepared: Any, grant: G) -> R:
        """``start``'s check of ``grant`` against the session's binding ``prepared``, before any
        I/O; what the receive needs to reach the producer.

        Raises:
            DataPlaneError: ``prepared`` is not this plane's binding, or the grant names anything
                it does not.
        """
        raise NotImplementedError

    def _admit_locked(self, route: R, grant: G) -> None:
        """Under the plane lock, as ``start`` admits a receive on ``route`` (e.g. note which node
        serves it for :meth:`forget_peer`); raise DataPlaneError to refuse (e.g. an ended
        binding)."""

    def _pool_key(self, route: R) -> Hashable:
        """The pool key of ``route``'s connections (one producer endpoint of one binding)."""
        raise NotImplementedError

    def _may_pool_locked(self, route: R) -> bool:
        """Under the plane lock: whether a connection of ``route`` may be pooled (False once its
        binding was unbound). Default True."""
        return True

    def _connect(self, route: R) -> C:
        """A new connection to ``route``'s producer, ready for a request (any handshake done),
        within ``connect_timeout_s``/``io_timeout_s``.

        Raises:
            OSError / DataPlaneError: cannot connect, or the listener is not the declared plane.
        """
        raise NotImplementedError

    def _accept_reply(self, chan: C, reply: Any, fds: list[int]) -> None:
        """An OK reply arrived on ``chan`` with ``fds`` (closed by the caller afterwards): take
        what it carries. Default: descriptors are refused.

        Raises:
            DataPlaneError: the reply or its descriptors are not what the plane expects.
        """
        if fds:
            raise DataPlaneError("producer sent an unannounced descriptor")

    def _receive_payload(self, handle: Receive, chan: C, reply: Any,
                         local: list[memoryview]) -> None:
        """Read exactly ``handle.nbytes`` payload bytes (> 0) of ``reply`` into ``local`` (views
        of the local runs, in payload order), each write under ``handle.io_lock`` and only while
        ``handle.cancelled`` is False (else return); never read past the payload.

        Raises:
            OSError / ValueError / DataPlaneError: the transfer failed (ERR with the message).
        """
        raise NotImplementedError

    # -- hooks: teardown --------------------------------------------------------------------------
    def _close_locked(self) -> None:
        """Under the plane lock, as :meth:`close` begins: drop the plane's own state."""

    def _after_close(self) -> None:
        """Last step of :meth:`close`, every thread joined (e.g. remove leftover files)."""

    # -- shared -----------------------------------------------------------------------------------
    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def _region(self) -> memoryview:
        """The region's bytes.

        Raises:
            DataPlaneError: the plane is closed.
        """
        mem = self._mem
        if mem is None or self._closed:
            raise DataPlaneError(f"{self.name} plane is closed")
        return mem

    def _check_runs(self, runs: Sequence[Run], nbytes: int) -> int:
        """Validate ``runs``/``nbytes`` against the region; the number of blocks.

        Raises:
            DataPlaneError: the plane is closed, or :func:`~ectransport.data.runs.check_runs`.
        """
        if self._closed:
            raise DataPlaneError(f"{self.name} plane is closed")
        return check_runs(runs, nbytes, self._num_blocks, self._block_bytes)

    # -- producer internals -----------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        """One connection (on its :class:`Acceptor` thread, which closes it): read requests until
        EOF, error, abort or idle timeout."""
        state = self._open_connection(conn)
        if state is None:
            return
        try:
            while not self._closed:
                try:
                    body, _ = recv_frame(conn, self._opt.idle_timeout_s, self._opt.io_timeout_s,
                                         self.max_header_bytes)
                except FrameError as exc:
                    self._reply_error(conn, STATUS_BAD_REQUEST, str(exc))
                    return
                except OSError:
                    return  # EOF, reset, idle or stalled: just close
                try:
                    req: RequestLike = self._request_decoder.decode(body)
                except (msgspec.DecodeError, TypeError, ValueError) as exc:
                    self._reply_error(conn, STATUS_BAD_REQUEST, f"bad request: {exc}")
                    return
                if req.v != self.wire_version:
                    self._reply_error(conn, STATUS_BAD_REQUEST, f"{self.name} wire version "
                                      f"{req.v}, expected {self.wire_version}")
                    return
                served = self._grants.begin(req.token, conn)
                if served is None:
                    self._count("unknown")
                    if not self._reply_error(conn, STATUS_UNKNOWN_GRANT,
                                             "unknown or revoked grant"):
                        return
                    continue
                try:
                    ok = self._send_grant(conn, state, req, served)
                except OSError as exc:
                    self._count("aborted")
                    self._log.debug("%s plane: send aborted: %s", self.name, exc)
                    return
                finally:
                    self._grants.end(served, conn)
                if not ok:
                    return
                self._count("served")
                self._notifs.push(req.notif)
        finally:
            self._close_connection(state)

    def _reply_error(self, conn: socket.socket, status: int, detail: str) -> bool:
        """Send a reply frame of ``status`` without payload (``bad`` is counted unless it is
        ``STATUS_UNKNOWN_GRANT``); False if it could not be sent."""
        if status != STATUS_UNKNOWN_GRANT:
            self._count("bad")
            self._log.debug("%s plane: %s", self.name, detail)
        try:
            conn.settimeout(self._opt.io_timeout_s)
            conn.sendall(frame(self.reply_type(v=self.wire_version, status=status, nbytes=0,
                                               detail=detail[:200])))
            return True
        except OSError:
            return False

    # -- consumer internals -----------------------------------------------------------------------
    def _receive(self, handle: Receive, route: R, request: bytes, local: list[memoryview]
                 ) -> None:
        """Receive thread: request, reply frame, payload into ``local``; sets DONE or ERR.

        Reads are bounded: the reply by :attr:`max_header_bytes`, the payload by the grant's
        ``nbytes`` (a reply announcing another size fails). The connection is pooled again only
        if nothing is left unread on it (:func:`unread_state`).
        """
        chan: C | None = None
        io_s = self._opt.io_timeout_s
        try:
            for attempt in (0, 1):
                chan, reused = self._channel(route, fresh=attempt > 0)
                with handle.sock_lock:
                    if handle.cancelled:
                        return
                    handle.sock = chan.sock
                try:
                    chan.sock.settimeout(io_s)
                    chan.sock.sendall(request)
                    body, fds = recv_frame(chan.sock, io_s, io_s, self.max_header_bytes,
                                           self.fds_with_replies)
                    break
                except (PeerClosed, ConnectionResetError, BrokenPipeError):
                    if not reused or handle.cancelled:
                        raise
                    chan.close()  # a stale pooled connection: retry once on a fresh one
                    chan = None
            # the second attempt is on a fresh connection, whose failure re-raises: the loop
            # only ends by a break, with a connection
            assert chan is not None
            try:
                reply: ReplyLike = self._reply_decoder.decode(body)
                if reply.v != self.wire_version:
                    raise DataPlaneError(f"{self.name} wire version {reply.v}, expected "
                                         f"{self.wire_version}")
                if reply.status != STATUS_OK:
                    handle.detail = f"producer refused: status {reply.status} ({reply.detail})"
                    if reply.status == STATUS_UNKNOWN_GRANT and not fds:  # the stream is in sync
                        with handle.sock_lock:
                            reusable, handle.sock = not handle.cancelled, None
                        if reusable:
                            self._pool_or_close(route, chan)
                            chan = None
                    return
                self._accept_reply(chan, reply, fds)
            finally:
                close_fds(fds)
            if reply.nbytes != handle.nbytes:
                raise DataPlaneError(f"producer sends {reply.nbytes} bytes, expected "
                                     f"{handle.nbytes}")
            if handle.nbytes:
                self._receive_payload(handle, chan, reply, local)
            if self.stray_bytes_fail and unread_state(chan.sock) == "pending":
                # which bytes were the reply's? fail rather than guess
                raise DataPlaneError(f"producer sent more than the {handle.nbytes} bytes granted "
                                     f"(unread bytes follow the payload); connection closed")
            with handle.io_lock, handle.sock_lock:
                if handle.cancelled:
                    return
                handle.sock = None  # ours alone now: a later release cannot shut it down
                handle.state = XferState.DONE
            self._pool_or_close(route, chan)
            chan = None
        except (OSError, ValueError, DataPlaneError) as exc:  # msgspec.DecodeError: a ValueError
            handle.detail = f"{type(exc).__name__}: {exc}"
            self._log.debug("%s plane: receive failed: %s", self.name, exc)
        except Exception:
            handle.detail = "internal error"
            self._log.exception("%s plane: receive thread failed", self.name)
        finally:
            if chan is not None:
                chan.close()
            handle.settle()

    def _channel(self, route: R, fresh: bool) -> tuple[C, bool]:
        """A pooled connection of ``route`` with nothing waiting on it (others are closed and
        counted ``stale``), or a new one (:meth:`_connect`); ``(chan, reused)``."""
        key = self._pool_key(route)
        while not fresh and (idle := self._pool.take(key)) is not None:
            if unread_state(idle.sock) == "clean":
                return idle, True
            self._count("stale")
            self._log.debug("%s plane: pooled connection had unread bytes or was closed",
                            self.name)
            idle.close()
        return self._connect(route), False

    def _pool_or_close(self, route: R, chan: C) -> None:
        """Pool ``chan`` if nothing waits on it (unread bytes: counted ``stray``; EOF), its
        binding is live and the pool has room; else close it."""
        pooled = False
        left = unread_state(chan.sock)
        if left == "clean":
            with self._lock:
                pooled = self._may_pool_locked(route) and self._pool.put_locked(
                    self._pool_key(route), chan)
        elif left == "pending":
            self._count("stray")
        if not pooled:
            chan.close()
