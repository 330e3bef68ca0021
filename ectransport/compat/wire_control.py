"""Control connections that speak vLLM's plain framing: every message is ``[b"", payload]``.

:class:`VllmRouter` (a :class:`ControlServer`: our producer) and :class:`VllmDealerClient` (a
:class:`ControlClient`: our consumer, one DEALER per producer) implement the same control contract
as the ECTP ZeroMQ/CURVE pair, so the same node drivers run them. No authentication and no
encryption: vLLM's wire has none (the profile is opt-in only, see :mod:`.vllm_wire`). Neither side
reports ``Down``: vLLM's sessions are not bound to a connection (leases and deadlines clean up).
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

from ectransport.control.base import (
    ClientEvent,
    ControlClient,
    ControlServer,
    PeerId,
    Received,
    ServerEvent,
    Up,
)
from ectransport.errors import ConfigError

log = logging.getLogger("ectransport.compat.vllm_wire")

#: Frames drained per socket and poll (bounded work per step).
_DRAIN = 256
_ids = itertools.count()


class _Waker:
    """An inproc PAIR whose read end sits in a poller: :meth:`wake` (any thread) makes the poll
    return; :meth:`drain` empties it."""

    def __init__(self, zmq: Any, ctx: Any):
        self._zmq = zmq
        self.r = ctx.socket(zmq.PAIR)
        self.w = ctx.socket(zmq.PAIR)
        addr = f"inproc://vllm-wire-wake-{next(_ids)}-{id(self)}"
        self.r.bind(addr)
        self.w.connect(addr)
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock:
            try:
                self.w.send(b"", self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass

    def drain(self) -> None:
        while True:
            try:
                self.r.recv(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return

    def close(self) -> None:
        self.r.close(0)
        self.w.close(0)


class VllmRouter(ControlServer):
    """Plain-ZMQ ROUTER speaking vLLM's envelope ``[identity, b"", payload]``; peers are
    ``PeerId(identity, "")`` (no authenticated identity).

    Raises (constructor): ConfigError if the address cannot be bound.
    """

    def __init__(self, host: str, port: int, max_frame_bytes: int = 1 << 20):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._closed = False
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._router.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as e:
            self._router.close(0)
            self._ctx.term()
            raise ConfigError(f"cannot bind the vLLM wire ROUTER on {host}:{port}: {e}") from None
        self.host = host
        self.port = int(self._router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._waker = _Waker(zmq, self._ctx)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._waker.r, zmq.POLLIN)
        self.malformed_dropped = 0
        log.warning("vLLM wire profile: PLAIN ZMQ (no authentication, no encryption) on %s:%d",
                    host, self.port)

    def poll(self, timeout_s: float) -> list[ServerEvent]:
        zmq = self._zmq
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if self._waker.r in events:
            self._waker.drain()
        out: list[ServerEvent] = []
        for _ in range(_DRAIN):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or frames[1] != b"":
                self.malformed_dropped += 1
                continue
            out.append(Received(PeerId(frames[0], ""), frames[2]))
        return out

    def send(self, peer: PeerId, data: bytes) -> bool:
        try:
            self._router.send_multipart([peer.route, b"", data], self._zmq.NOBLOCK)
            return True
        except self._zmq.ZMQError:
            return False

    def wake(self) -> None:
        self._waker.wake()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._router.close(0)
        self._waker.close()
        self._ctx.term()


class VllmDealerClient(ControlClient):
    """One plain DEALER per producer, vLLM's consumer framing ``[b"", payload]``.

    ``connect`` reports ``Up`` at once (a plain socket has no handshake; frames queue until the
    TCP connection is made); ZMQ heartbeats keep it alive (2 s, 4 s timeout, as vLLM's).
    """

    def __init__(self, max_frame_bytes: int = 1 << 20):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._socks: dict[str, Any] = {}
        self._conn_of: dict[Any, str] = {}
        self._pending: list[ClientEvent] = []
        self._max_frame_bytes = max_frame_bytes
        self._waker = _Waker(zmq, self._ctx)
        self._poller = zmq.Poller()
        self._poller.register(self._waker.r, zmq.POLLIN)
        self._closed = False
        self.malformed_dropped = 0

    def connect(self, host: str, port: int, server_key: str | None) -> str:
        conn = f"{host}:{port}"
        if conn in self._socks:
            return conn
        zmq = self._zmq
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
        s.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4000)
        s.connect(f"tcp://{host}:{port}")
        self._socks[conn] = s
        self._conn_of[s] = conn
        self._poller.register(s, zmq.POLLIN)
        self._pending.append(Up(conn))
        return conn

    def send(self, conn: str, data: bytes) -> bool:
        s = self._socks.get(conn)
        if s is None:
            return False
        try:
            s.send_multipart([b"", data], self._zmq.NOBLOCK)
            return True
        except self._zmq.ZMQError:
            return False

    def poll(self, timeout_s: float) -> list[ClientEvent]:
        zmq = self._zmq
        out, self._pending = self._pending, []
        events = dict(self._poller.poll(0 if out else max(0, int(timeout_s * 1000))))
        if self._waker.r in events:
            self._waker.drain()
        for s, conn in list(self._conn_of.items()):
            if s not in events:
                continue
            for _ in range(_DRAIN):
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2 or frames[0] != b"":
                    self.malformed_dropped += 1
                    continue
                out.append(Received(conn, frames[1]))
        return out

    def disconnect(self, conn: str) -> None:
        s = self._socks.pop(conn, None)
        if s is not None:
            self._conn_of.pop(s, None)
            self._poller.unregister(s)
            s.close(0)

    def wake(self) -> None:
        self._waker.wake()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._socks):
            self.disconnect(conn)
        self._waker.close()
        self._ctx.term()
