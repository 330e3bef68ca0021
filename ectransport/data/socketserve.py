"""The serving half of a socket-serving plane (:class:`SocketServer`, producer side): grants
registered under tokens, the accept thread and one thread per connection reading request frames,
the revoke rule, notifications. Joined with the fetching half in
:class:`ectransport.data.socketplane.SocketServingPlane`, which documents the rules.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import msgspec

from ectransport.data.base import ServingPlane
from ectransport.data.framing import FrameError, frame, recv_frame
from ectransport.data.runs import payload_spans, views
from ectransport.data.serving import (
    STATUS_BAD_REQUEST,
    STATUS_UNKNOWN_GRANT,
    Acceptor,
    GrantTable,
    Notifications,
    ServedGrant,
    grant_token,
)
from ectransport.data.socketbase import RequestLike, SocketPlaneBase
from ectransport.store import Run

__all__ = ["SocketServer"]


class SocketServer(SocketPlaneBase, ServingPlane):
    """Producer side of a socket-serving plane: ``describe``, ``revoke``, ``poll_notifications``
    and the serving threads; the subclass writes :meth:`_grant` and :meth:`_send_grant` (and
    optionally :meth:`_open_connection` / :meth:`_close_connection`)."""

    def _setup_serving(self) -> None:
        """The producer's state (called by the constructor)."""
        what = f"{self.name} plane"
        self._grants = GrantTable(self._lock, what, grace_s=self.revoke_grace_s,
                                  wait_s=self._opt.io_timeout_s)
        self._notifs = Notifications()
        self._acceptor: Acceptor | None = None

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
