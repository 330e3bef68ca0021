"""The fetching half of a socket-serving plane (:class:`SocketFetcher`, consumer side):
``start`` checks a grant against the session's binding before any I/O, a receive thread per
transfer requests the grant and reads the reply and payload, connections are pooled under the
"nothing unread" rule. Joined with the serving half in
:class:`ectransport.data.socketplane.SocketServingPlane`, which documents the rules.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Generic

import msgspec

from ectransport.data.base import FetchingPlane, XferState
from ectransport.data.framing import PeerClosed, close_fds, frame, recv_frame, unread_state
from ectransport.data.runs import payload_spans, views
from ectransport.data.serving import (
    STATUS_OK,
    STATUS_UNKNOWN_GRANT,
    ConnectionPool,
    Receive,
    Receives,
    receive_state,
)
from ectransport.data.socketbase import C, G, R, ReplyLike, SocketPlaneBase
from ectransport.errors import DataPlaneError
from ectransport.store import Run

__all__ = ["SocketFetcher"]


class SocketFetcher(SocketPlaneBase, FetchingPlane, Generic[G, R, C]):
    """Consumer side of a socket-serving plane: ``start``, ``check``, ``release``,
    ``forget_peer`` and the receive threads; the subclass writes :meth:`_route`,
    :meth:`_pool_key`, :meth:`_connect`, :meth:`_receive_payload` (optionally
    :meth:`_admit_locked`, :meth:`_may_pool_locked`, :meth:`_accept_reply`) and the session
    binding."""

    def _setup_fetching(self) -> None:
        """The consumer's state (called by the constructor)."""
        self._receives = Receives(self._lock, self._opt.max_inflight, f"{self.name} plane")
        self._pool: ConnectionPool[Hashable, C] = ConnectionPool(self._lock,
                                                                 self._opt.max_idle_per_peer)

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
