"""Consumer side of the ZeroMQ control plane: :class:`ZmqControlClient`, one DEALER (+ socket
monitor) per producer (see :mod:`ectransport.control.zmqctl` for the design).
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass, field
from typing import cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from ectransport.control.base import (
    AuthFailed,
    ClientEvent,
    ControlClient,
    Down,
    Received,
    Up,
)
from ectransport.control.keys import load_public
from ectransport.control.zmq_common import (
    HANDSHAKE_FAILED,
    LARGE_FRAME,
    LOG_NAME,
    MONITOR_DRAIN_MAX,
    CommonOpts,
    Waker,
    check_positive,
    close_monitored,
    keypair,
    ms,
    set_common,
    tcp_endpoint,
)
from ectransport.errors import ConfigError
from ectransport.settings_schema import API

_D = API.control.client  # the defaults: ectransport.settings_schema.ControlClientSettings
_MAX_LINGER_S = 3600.0  # ZeroMQ takes the linger as a C int of ms: far below its limit

__all__ = ["ZmqControlClient"]

log = logging.getLogger(LOG_NAME)

_CLIENT_EVENTS = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED
)
_NO_DETAIL_LIMIT = 4  # unexplained handshake hang-ups before a client reports AuthFailed


@dataclass
class _Conn:
    key: str
    sock: zmq.Socket[bytes]
    mon: zmq.Socket[bytes]
    deadline: float | None
    state: str = "connecting"  # connecting | up | down
    tcp_seen: bool = False
    no_detail: int = 0
    hints: list[str] = field(default_factory=list)


class ZmqControlClient(ControlClient):
    """Consumer-side control connections: one DEALER (+ socket monitor) per producer, one Context.

    Args:
        secret_key, public_key: this consumer's CURVE keys (Z85); required unless ``insecure``.
        insecure: plain ZMTP; only talks to producers that are insecure too.
        handshake_timeout_s: after TCP connects, the CURVE handshake must succeed within this.
        heartbeat_ivl_s, heartbeat_timeout_s: ZMTP heartbeats; a silent producer → ``Down``.
        max_frame_bytes: ZMQ_MAXMSGSIZE for frames from producers.
        max_msgs_per_poll: frames read per ``poll`` at most, round-robin across connections.
        sndhwm, rcvhwm: per-connection queue bounds (frames).
        reconnect_ivl_s, reconnect_ivl_max_s: ZMQ reconnect backoff while a producer is away.
        close_linger_s: at :meth:`close`, frames already sent get this long (s) to leave; the
            completions a consumer sends as it closes give its grants back, which would
            otherwise stay pinned at the producer until their lease ends.

    Events from ``poll`` (connection key ``"host:port"``):
        ``Up(conn)``: CURVE handshake succeeded (again after a ``Down``).
        ``AuthFailed(conn, reason)``: the producer rejected our key, the producer key is wrong, or
            plain/CURVE mismatch; the connection is closed (no more reconnects) and forgotten.
        ``Down(conn)``: an established connection dropped (ZMQ keeps reconnecting; ``Up`` may
            follow), or the producer was unreachable (no TCP connection) for handshake_timeout_s
            after ``connect``.
        ``Received(conn, data)``.
    """

    def __init__(
        self,
        *,
        secret_key: str | None = None,
        public_key: str | None = None,
        insecure: bool = False,
        handshake_timeout_s: float = _D.handshake_timeout_s,
        heartbeat_ivl_s: float = _D.heartbeat_ivl_s,
        heartbeat_timeout_s: float = _D.heartbeat_timeout_s,
        max_frame_bytes: int = _D.max_frame_bytes,
        max_msgs_per_poll: int = _D.max_msgs_per_poll,
        sndhwm: int = _D.sndhwm,
        rcvhwm: int = _D.rcvhwm,
        reconnect_ivl_s: float = _D.reconnect_ivl_s,
        reconnect_ivl_max_s: float = _D.reconnect_ivl_max_s,
        close_linger_s: float = _D.close_linger_s,
    ) -> None:
        check_positive(
            handshake_timeout_s=handshake_timeout_s,
            heartbeat_ivl_s=heartbeat_ivl_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            max_frame_bytes=max_frame_bytes,
            max_msgs_per_poll=max_msgs_per_poll,
            reconnect_ivl_s=reconnect_ivl_s,
        )
        self.insecure = insecure
        if insecure:
            log.warning("INSECURE control client: no encryption, no producer authentication")
            self.public_key: str | None = None
            self._secret: str | None = None
        else:
            self.public_key, self._secret = keypair(secret_key, public_key, "consumer")
        self.handshake_timeout_s = handshake_timeout_s
        if not 0.0 <= close_linger_s <= _MAX_LINGER_S:
            raise ConfigError(f"close_linger_s must be within 0..{_MAX_LINGER_S:g} s, "
                              f"got {close_linger_s!r}")
        self._linger_ms = ms(close_linger_s)
        self.max_msgs_per_poll = int(max_msgs_per_poll)
        self._opts: CommonOpts = {
            "heartbeat_ivl_s": heartbeat_ivl_s,
            "heartbeat_timeout_s": heartbeat_timeout_s,
            "max_frame_bytes": max_frame_bytes,
            "sndhwm": sndhwm,
            "rcvhwm": rcvhwm,
        }
        self._reconnect_ms = (ms(reconnect_ivl_s), ms(max(reconnect_ivl_s, reconnect_ivl_max_s)))
        self._ctx = zmq.Context()
        self._conns: dict[str, _Conn] = {}
        self._by_sock: dict[zmq.Socket[bytes], _Conn] = {}
        self._waker = Waker()
        self._poller = zmq.Poller()
        self._poller.register(self._waker.fd, zmq.POLLIN)
        self._closed = False

    # -- ControlClient -----------------------------------------------------------------------
    def connect(self, host: str, port: int, server_key: str | None) -> str:
        if self._closed:
            raise ConfigError("connect() on a closed ZmqControlClient")
        key = f"{host}:{port}"
        if key in self._conns:
            return key
        server_pub = None
        if not self.insecure:
            if server_key is None:
                raise ConfigError(
                    f"connecting to {key} with CURVE needs the producer's public key "
                    "(server_key); the producer prints it at start-up"
                )
            server_pub = load_public(server_key)
        sock = self._ctx.socket(zmq.DEALER)
        mon = None
        try:
            set_common(sock, **self._opts)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on established connections
            sock.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ms[0])
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, self._reconnect_ms[1])
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            if server_pub is not None:
                assert self._secret is not None and self.public_key is not None
                sock.setsockopt(zmq.CURVE_SERVERKEY, server_pub.encode("ascii"))
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key.encode("ascii"))
                sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret.encode("ascii"))
            mon = sock.get_monitor_socket(events=_CLIENT_EVENTS)
            sock.connect(tcp_endpoint(host, port))
        except zmq.ZMQError as e:
            close_monitored(sock, mon)
            raise ConfigError(f"cannot connect to {key}: {e.strerror}") from None
        conn = _Conn(key, sock, mon, deadline=time.monotonic() + self.handshake_timeout_s)
        self._conns[key] = conn
        self._by_sock[sock] = conn
        self._by_sock[mon] = conn
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)
        return key

    def send(self, conn: str, data: bytes) -> bool:
        c = self._conns.get(conn)
        if c is None or c.state != "up":
            return False
        try:
            c.sock.send(data, flags=zmq.NOBLOCK, copy=len(data) < LARGE_FRAME)
        except zmq.ZMQError:  # Again: queue full / not connected
            return False
        return True

    def poll(self, timeout_s: float) -> list[ClientEvent]:
        if self._closed:
            return []
        now = time.monotonic()
        deadlines = [c.deadline for c in self._conns.values() if c.deadline is not None]
        wait_s = min([timeout_s, *(d - now for d in deadlines)])
        try:
            ready = dict(self._poller.poll(ms(max(0.0, wait_s))))
        except zmq.ZMQError as e:
            if e.errno != errno.EINTR:
                raise
            ready = {}
        if self._waker.fd in ready:
            self._waker.drain()
        events: list[ClientEvent] = []
        # only sockets the poller reported readable (level-triggered, so nothing is missed)
        for c in [c for c in self._conns.values() if c.mon in ready]:
            self._drain_monitor(c, events)
        self._drain_data(events, [c for c in self._conns.values() if c.sock in ready])
        now = time.monotonic()
        for c in list(self._conns.values()):
            if c.deadline is not None and now >= c.deadline:
                self._handshake_timeout(c, events)
        return events

    def disconnect(self, conn: str) -> None:
        c = self._conns.get(conn)
        if c is not None:
            self._forget(c)

    def wake(self) -> None:
        self._waker.wake()

    def close(self) -> None:
        """Close every connection; frames already sent get up to ``close_linger_s`` to leave
        (this call returns once they did, or then). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for c in list(self._conns.values()):
            self._forget(c, self._linger_ms)
        self._waker.close()
        # any socket still open closes at once; those closed above keep their linger, and this
        # returns once their frames left or it passed
        self._ctx.destroy(linger=0)

    def __enter__(self) -> ZmqControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _forget(self, c: _Conn, linger_ms: int = 0) -> None:
        self._conns.pop(c.key, None)
        for s in (c.sock, c.mon):
            self._by_sock.pop(s, None)
            self._poller.unregister(s)
        close_monitored(c.sock, c.mon, linger_ms)

    def _fail(self, c: _Conn, reason: str, events: list[ClientEvent]) -> None:
        log.warning("control connection %s: authentication failed: %s", c.key, reason)
        self._forget(c)
        events.append(AuthFailed(c.key, reason))

    def _up(self, c: _Conn, events: list[ClientEvent]) -> None:
        c.state = "up"
        c.deadline = None
        c.no_detail = 0
        log.info("control connection %s up (%s)", c.key, "PLAIN" if self.insecure else "CURVE")
        events.append(Up(c.key))

    def _mismatch_reason(self) -> str:
        if self.insecure:
            return (
                "plain/CURVE mismatch: the producer requires CURVE but this consumer is in "
                "insecure plain mode; configure a consumer keypair"
            )
        return (
            "plain/CURVE mismatch: the producer is in insecure plain mode, this consumer uses CURVE"
        )

    def _drain_monitor(self, c: _Conn, events: list[ClientEvent]) -> None:
        for _ in range(MONITOR_DRAIN_MAX):
            if c.key not in self._conns:
                return
            try:
                ev = recv_monitor_message(c.mon, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, value = ev["event"], ev["value"]
            if kind == zmq.EVENT_CONNECTED:
                c.tcp_seen = True
                if c.state != "up" and c.deadline is None:
                    c.deadline = time.monotonic() + self.handshake_timeout_s
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if c.state != "up":
                    self._up(c, events)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._fail(
                    c,
                    f"producer rejected this consumer's key {(self.public_key or '')[:8]}... "
                    f"(ZAP status {value}): unknown client key; add it to the producer's "
                    "allow-list",
                    events,
                )
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    self._fail(c, self._mismatch_reason(), events)
                elif value in (
                    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC,
                    zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE,
                ):
                    self._fail(
                        c,
                        f"producer key mismatch: CURVE handshake with {c.key} failed "
                        "cryptographically; check the producer public key you were given",
                        events,
                    )
                else:
                    self._fail(c, f"CURVE handshake protocol error {value:#x}", events)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # The producer hung up mid-handshake without an ERROR: for a CURVE client this is
                # what a wrong server key looks like (the producer cannot decrypt our HELLO), but a
                # plain/CURVE mismatch also shows it when the producer notices first. Wait for a
                # specific event on a retry; give up after a few or at the deadline.
                c.no_detail += 1
                if c.no_detail >= _NO_DETAIL_LIMIT:
                    self._fail(c, self._no_detail_reason(c), events)
            elif kind == zmq.EVENT_DISCONNECTED and c.state == "up":
                c.state = "down"
                log.info("control connection %s down", c.key)
                events.append(Down(c.key))

    def _no_detail_reason(self, c: _Conn) -> str:
        if self.insecure:
            return self._mismatch_reason()
        return (
            f"producer key mismatch: {c.key} closed the CURVE handshake without an answer; the "
            "server key given is most likely not this producer's public key (else a plain/CURVE "
            "mismatch — the producer runs without CURVE — or the producer dropped an unknown "
            "client key without replying)"
        )

    def _handshake_timeout(self, c: _Conn, events: list[ClientEvent]) -> None:
        x = f"{self.handshake_timeout_s:g}s"
        if c.tcp_seen:
            if c.no_detail and not self.insecure:
                reason = self._no_detail_reason(c)
            else:
                # TCP connected but the peer said nothing at all: a wrong key, an unknown client
                # key or a plain/CURVE mismatch each end the handshake with an event (above);
                # silence means the peer never completed its ZeroMQ greeting
                reason = (
                    f"no handshake from the producer at {c.key} within {x}: it accepted the TCP "
                    "connection but never answered the ZeroMQ greeting (a stopped or overloaded "
                    "process, or not an ectransport producer)"
                )
            self._fail(c, reason, events)
        else:
            c.deadline = None
            if c.state == "connecting":
                c.state = "down"
                log.info("control connection %s: producer unreachable for %s", c.key, x)
                events.append(Down(c.key))

    def _drain_data(self, events: list[ClientEvent], active: list[_Conn]) -> None:
        budget = self.max_msgs_per_poll
        while budget > 0 and active:
            still = []
            for c in active:
                if budget <= 0:
                    break
                try:
                    data = c.sock.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
                if c.state != "up":
                    self._up(c, events)  # a frame proves the handshake succeeded
                events.append(Received(c.key, data))
                budget -= 1
                # EVENTS is an int option (pyzmq types every option int | bytes); cheaper than
                # a failing recv
                if cast(int, c.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    still.append(c)
            active = still
