"""ZeroMQ control plane: ROUTER (producer) / DEALER (consumer), CurveZMQ + ZAP allow-list.

Wire shape: a consumer's DEALER sends single-frame messages; the producer's ROUTER sees
``[route, data]`` and answers ``[route, data]``. Frames are opaque bytes (ECTP, encoded above us).

Security (DESIGN.md "Defaults are secure"): CURVE is on unless ``insecure=True``; a ZAP handler
(pyzmq ``ThreadAuthenticator``) on the server's own Context admits client keys through an
:class:`~ectransport.control.keys.AllowList`; a non-loopback bind without an allow-list is refused.
Frames without an authenticated ``User-Id`` are dropped (fail closed even if ZAP were missing).

Pitfalls handled here (reference/anchors.md §E):
  * CURVE failures are silent to a client (it just retries): each DEALER has a socket monitor;
    handshake-failure events and a handshake deadline turn them into ``AuthFailed``, after which
    the socket is closed so it stops reconnecting.
  * ZAP is per Context and must run before peers connect and stop before ``term()``.
  * Peer disconnects: ``ZMQ_ROUTER_NOTIFY`` is a DRAFT option, absent from the stock libzmq 4.3.5
    wheel (setsockopt → EINVAL). Instead the server monitors its ROUTER: ``EVENT_DISCONNECTED``
    carries the connection's fd, and each received frame carries its source fd (``ZMQ_SRCFD``
    message property), which maps fd → route.

Threading: one thread owns a server/client; only ``wake()`` may be called from other threads.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from ectransport.control.base import (
    AuthFailed,
    ControlClient,
    ControlServer,
    Down,
    Event,
    PeerId,
    Received,
    Up,
)
from ectransport.control.keys import AllowList, is_z85_key, load_public
from ectransport.errors import ConfigError

__all__ = ["AllowList", "ZmqControlClient", "ZmqControlServer"]

log = logging.getLogger(__name__)
zap_log = logging.getLogger(__name__ + ".zap")

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_SERVER_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
_CLIENT_EVENTS = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
)
_MONITOR_DRAIN_MAX = 10_000  # monitor events are bounded by connection churn; drain them all
_GONE_ROUTE_S = 2.0  # frames still queued from a closed connection are dropped for this long
_LARGE_FRAME = 64 << 10  # zero-copy sends above this size
_NO_DETAIL_LIMIT = 4  # unexplained handshake hang-ups before a client reports AuthFailed


# -- helpers ---------------------------------------------------------------------------------
def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # hostnames, interface names, "*": treat as reachable from outside


def _tcp_endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _ms(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1000))


def _check_positive(**kw: float) -> None:
    for name, v in kw.items():
        if not v > 0:
            raise ConfigError(f"{name} must be > 0, got {v!r}")


def _keypair(secret_key: str | None, public_key: str | None, who: str) -> tuple[str, str]:
    if secret_key is None:
        raise ConfigError(
            f"CURVE is on but no {who} secret key was given: create one with "
            "ectransport.control.keys.generate_keypair (load it with load_keypair), "
            "or pass insecure=True for plain-text testing on a trusted host"
        )
    if not is_z85_key(secret_key):
        raise ConfigError(f"{who} secret key is not a 40-character Z85 CURVE key")
    derived = zmq.curve_public(secret_key.encode("ascii")).decode("ascii")
    if public_key is not None and public_key != derived:
        raise ConfigError(f"{who} public key does not belong to the given secret key")
    return derived, secret_key


def _set_common(
    sock: zmq.Socket,
    *,
    heartbeat_ivl_s: float,
    heartbeat_timeout_s: float,
    max_frame_bytes: int,
    sndhwm: int,
    rcvhwm: int,
) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(heartbeat_ivl_s))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(heartbeat_timeout_s))
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(_ms(heartbeat_timeout_s), 6_553_500))


def _close_monitored(sock: zmq.Socket, mon: zmq.Socket | None) -> None:
    """Disable the monitor first (pyzmq#626-style hangs otherwise), then close both, linger 0."""
    if mon is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon.close(linger=0)
    sock.close(linger=0)


class _Waker:
    """A self-pipe registered in the poller: ``wake()`` is safe from any thread, and never blocks
    (a full pipe means a wake is already pending). Avoids sharing a zmq socket between threads."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def fd(self) -> int:
        return self._r

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:
                pass

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._r)
            os.close(self._w)


class _RateLimiter:
    """Per-key token buckets: ``rate_per_s`` tokens/s, at most ``burst`` banked."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(max(1, burst))
        self._buckets: dict[object, list[float]] = {}

    def allow(self, key: object, now: float) -> bool:
        if self.rate_per_s <= 0:
            return True
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= 4096:
                self._prune(now)
            b = self._buckets[key] = [self.burst, now]
        tokens = min(self.burst, b[0] + (now - b[1]) * self.rate_per_s)
        b[1] = now
        if tokens >= 1.0:
            b[0] = tokens - 1.0
            return True
        b[0] = tokens
        return False

    def _prune(self, now: float) -> None:
        full = [
            k
            for k, (t, last) in self._buckets.items()
            if t + (now - last) * self.rate_per_s >= self.burst
        ]
        for k in full:
            del self._buckets[k]


class _ZapPolicy:
    """ZAP ``credentials_provider`` backed by an AllowList (runs in the authenticator thread)."""

    def __init__(self, allow: AllowList) -> None:
        self.allow = allow
        self.reject_count = 0
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        pub = key.decode("ascii", "replace") if isinstance(key, bytes) else str(key)
        try:
            ok = self.allow.admits(pub)
        except Exception:  # noqa: BLE001 - a raising policy must deny, not kill the ZAP thread
            zap_log.exception("allow-list lookup failed; denying %s...", pub[:8])
            ok = False
        if not ok:
            with self._lock:
                self.reject_count += 1
                first = pub not in self._logged and len(self._logged) < 1024
                if first:
                    self._logged.add(pub)
            zap_log.log(
                logging.INFO if first else logging.DEBUG,
                "rejected CURVE client key %s... (not in the allow-list); admit it with "
                "`allow_key(ALLOW_DIR, KEY)` if it is a legitimate consumer",
                pub[:8],
            )
        return ok


# -- server ----------------------------------------------------------------------------------
class ZmqControlServer(ControlServer):
    """Producer-side control endpoint: one ROUTER socket on its own Context.

    Args:
        host, port: bind address; ``port=0`` picks an ephemeral port (see ``.port``/``.endpoint``).
            ``"localhost"`` binds 127.0.0.1.
        secret_key, public_key: the producer's CURVE keys (Z85). ``public_key`` is derived when
            omitted and checked when given.
        allow: admitted client keys. ``None`` is only accepted on a loopback bind, where any client
            holding the producer's public key is admitted (logged as a warning).
        insecure: plain ZMTP (NULL mechanism), no encryption or authentication; loud warning.
        heartbeat_ivl_s, heartbeat_timeout_s: ZMTP heartbeats; a silent consumer is dropped after
            ``heartbeat_timeout_s`` and reported as ``Down``.
        max_frame_bytes: ZMQ_MAXMSGSIZE; a larger frame drops that connection.
        max_msgs_per_poll: frames read per ``poll`` at most (bounded work per call).
        peer_rate_per_s, peer_burst: per-peer token bucket; frames beyond it are dropped and
            counted in ``rate_dropped``. A peer is its CURVE key (all its connections share one
            bucket), or its route in plain mode. ``peer_rate_per_s <= 0`` disables the limit.
        sndhwm, rcvhwm: per-connection queue bounds (frames).
        handshake_timeout_s: ZMQ_HANDSHAKE_IVL: half-open handshakes are dropped after this.

    Raises:
        ConfigError: missing keys, non-loopback bind without allow-list, port in use, bad address.

    Events from ``poll``: ``Received(PeerId(route, user), data)`` (``user`` = the client's CURVE
    public key, ``""`` in plain mode) and ``Down(PeerId)`` when a peer that sent at least one frame
    disconnects or misses heartbeats. Counters: ``reject_count`` (ZAP denials),
    ``handshake_failures``, ``rate_dropped``, ``malformed_dropped``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret_key: str | None = None,
        public_key: str | None = None,
        allow: AllowList | None = None,
        insecure: bool = False,
        heartbeat_ivl_s: float = 2.0,
        heartbeat_timeout_s: float = 4.0,
        max_frame_bytes: int = 8 << 20,
        max_msgs_per_poll: int = 256,
        peer_rate_per_s: float = 2000.0,
        peer_burst: int = 500,
        sndhwm: int = 1000,
        rcvhwm: int = 1000,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        _check_positive(
            heartbeat_ivl_s=heartbeat_ivl_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            max_frame_bytes=max_frame_bytes,
            max_msgs_per_poll=max_msgs_per_poll,
            handshake_timeout_s=handshake_timeout_s,
        )
        if not 0 <= int(port) <= 65535:
            raise ConfigError(f"port must be 0..65535, got {port!r}")
        bind_host = "127.0.0.1" if host == "localhost" else host
        loopback = _is_loopback(bind_host)
        self.insecure = insecure
        self.public_key: str | None = None
        self.handshake_failures = 0
        self.rate_dropped = 0
        self.malformed_dropped = 0
        self.max_msgs_per_poll = int(max_msgs_per_poll)
        self._closed = True  # until fully constructed
        self._policy: _ZapPolicy | None = None

        if insecure:
            if allow is not None:
                raise ConfigError(
                    "insecure=True cannot enforce an allow-list (plain mode has no client keys); "
                    "drop insecure=True to use CURVE"
                )
            log.warning(
                "INSECURE control plane on %s:%s: no encryption, no authentication; any host "
                "that can reach it can talk to this producer%s",
                host,
                port,
                "" if loopback else " (NON-LOOPBACK ADDRESS)",
            )
            secret = None
        else:
            self.public_key, secret = _keypair(secret_key, public_key, "producer")
            if allow is None and not loopback:
                raise ConfigError(
                    f"binding non-loopback address {host!r} needs a client allow-list "
                    "(allow=AllowList(dir)); without one anyone holding the producer's public key "
                    "could connect"
                )

        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._router: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._waker: _Waker | None = None
        try:
            if not insecure:
                # ZAP must be running on this Context before the socket accepts peers.
                self._auth = ThreadAuthenticator(self._ctx, log=zap_log)
                self._auth.start()
                if allow is not None:
                    self._policy = _ZapPolicy(allow)
                    self._auth.configure_curve_callback("*", self._policy)
                else:
                    log.warning(
                        "no client allow-list on loopback %s: any local client holding the "
                        "producer's public key is admitted",
                        host,
                    )
                    self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            r = self._router = self._ctx.socket(zmq.ROUTER)
            _set_common(
                r,
                heartbeat_ivl_s=heartbeat_ivl_s,
                heartbeat_timeout_s=heartbeat_timeout_s,
                max_frame_bytes=max_frame_bytes,
                sndhwm=sndhwm,
                rcvhwm=rcvhwm,
            )
            # Mandatory: an unroutable/full send raises (→ False) instead of vanishing silently.
            r.setsockopt(zmq.ROUTER_MANDATORY, 1)
            r.setsockopt(zmq.HANDSHAKE_IVL, _ms(handshake_timeout_s))
            if ":" in bind_host:
                r.setsockopt(zmq.IPV6, 1)
            if secret is not None:
                r.setsockopt(zmq.CURVE_SERVER, 1)
                r.setsockopt(zmq.CURVE_SECRETKEY, secret.encode("ascii"))
            self._mon = r.get_monitor_socket(events=_SERVER_EVENTS)
            try:
                r.bind(_tcp_endpoint(bind_host, port if port else "*"))
            except zmq.ZMQError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"port {port} on {host} is in use (another producer running?); "
                        "choose another port or port=0 for an ephemeral one"
                    ) from None
                if e.errno == errno.EADDRNOTAVAIL or e.errno == zmq.ENODEV:
                    raise ConfigError(
                        f"cannot bind {host}:{port}: not an address of this host"
                    ) from None
                raise ConfigError(f"cannot bind {host}:{port}: {e.strerror}") from None
            last = r.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.host = host
            self.port = int(last.rsplit(":", 1)[1])
            self.endpoint = _tcp_endpoint(bind_host, self.port)
            self._waker = _Waker()
            self._poller = zmq.Poller()
            self._poller.register(r, zmq.POLLIN)
            self._poller.register(self._mon, zmq.POLLIN)
            self._poller.register(self._waker.fd, zmq.POLLIN)
        except BaseException:
            self._teardown()
            raise
        self._limiter = _RateLimiter(peer_rate_per_s, peer_burst)
        self._limited: set[object] = set()
        self._route_peer: dict[bytes, PeerId] = {}
        self._fd_peer: dict[int, PeerId] = {}
        self._skip_disconnect: dict[int, int] = {}
        self._gone: dict[bytes, float] = {}
        self._gone_q: deque[tuple[float, bytes]] = deque()
        self._last_hs_log = float("-inf")
        self._closed = False
        log.info(
            "control server listening on %s (%s)",
            self.endpoint,
            "PLAIN" if insecure else "CURVE",
        )

    # -- ControlServer -----------------------------------------------------------------------
    @property
    def reject_count(self) -> int:
        """CURVE client keys refused by the allow-list (ZAP denials) so far."""
        return self._policy.reject_count if self._policy else 0

    @property
    def peers(self) -> list[PeerId]:
        """Peers that sent at least one frame and have not gone ``Down``."""
        return list(self._route_peer.values())

    def poll(self, timeout_s: float) -> list[Event]:
        if self._closed:
            return []
        try:
            ready = dict(self._poller.poll(_ms(timeout_s)))
        except zmq.ZMQError as e:
            if e.errno == errno.EINTR:
                return []
            raise
        assert self._waker is not None
        if self._waker.fd in ready:
            self._waker.drain()
        events: list[Event] = []
        now = time.monotonic()
        self._expire_gone(now)
        self._drain_monitor(events)
        self._drain_router(events, now)
        return events

    def send(self, peer: PeerId, data: bytes) -> bool:
        if self._closed:
            return False
        assert self._router is not None
        try:
            self._router.send_multipart(
                [peer.route, data], flags=zmq.NOBLOCK, copy=len(data) < _LARGE_FRAME
            )
        except zmq.Again:
            log.debug("send to %s: queue full", peer.short())
            return False
        except zmq.ZMQError as e:
            log.debug("send to %s failed: %s", peer.short(), e)
            return False
        return True

    def wake(self) -> None:
        w = self._waker
        if w is not None:
            w.wake()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _teardown(self) -> None:
        if self._waker is not None:
            self._waker.close()
        if self._router is not None:
            _close_monitored(self._router, self._mon)
            self._router = self._mon = None
        if self._auth is not None:
            self._auth.stop()  # before term(): pyzmq#626
            self._auth = None
        self._ctx.destroy(linger=0)

    def _expire_gone(self, now: float) -> None:
        q = self._gone_q
        while q and q[0][0] <= now:
            _, route = q.popleft()
            if self._gone.get(route, now + 1) <= now:
                del self._gone[route]

    def _peer_down(self, peer: PeerId, events: list[Event]) -> None:
        self._route_peer.pop(peer.route, None)
        expiry = time.monotonic() + _GONE_ROUTE_S
        self._gone[peer.route] = expiry
        self._gone_q.append((expiry, peer.route))
        self._limited.discard(peer.route)
        log.info("consumer %s disconnected", peer.short())
        events.append(Down(peer))

    def _drain_monitor(self, events: list[Event]) -> None:
        assert self._mon is not None
        for _ in range(_MONITOR_DRAIN_MAX):
            try:
                ev = recv_monitor_message(self._mon, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, value = ev["event"], ev["value"]
            if kind == zmq.EVENT_DISCONNECTED:
                skip = self._skip_disconnect.get(value, 0)
                if skip:
                    # This fd was already reused by a newer connection, which proved this
                    # (older) one closed; its Down was emitted then.
                    if skip == 1:
                        del self._skip_disconnect[value]
                    else:
                        self._skip_disconnect[value] = skip - 1
                    continue
                peer = self._fd_peer.pop(value, None)
                if peer is not None:
                    self._peer_down(peer, events)
            elif kind & _HANDSHAKE_FAILED:
                self.handshake_failures += 1
                self._log_handshake_failure(kind, value)

    def _log_handshake_failure(self, kind: int, value: int) -> None:
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # the ZAP policy already logged the key
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                why = "client used a different producer public key (producer key mismatch)"
            elif value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                why = "plain/CURVE mismatch between client and producer"
            else:
                why = f"ZMTP protocol error {value:#x}"
        else:
            why = "connection closed during the handshake"
        now = time.monotonic()
        level = logging.INFO if now - self._last_hs_log >= 1.0 else logging.DEBUG
        if level == logging.INFO:
            self._last_hs_log = now
        log.log(level, "control handshake failed on %s: %s", self.endpoint, why)

    def _drain_router(self, events: list[Event], now: float) -> None:
        r = self._router
        assert r is not None
        secure = not self.insecure
        for _ in range(self.max_msgs_per_poll):
            try:
                frames = r.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.malformed_dropped += 1
                log.debug("dropping envelope of %d frames (expected [route, data])", len(frames))
                continue
            route = frames[0].bytes
            msg = frames[1]
            if route in self._gone:
                continue  # queued before its connection closed; nobody can be answered
            user = ""
            if secure:
                try:
                    user = msg.get("User-Id")
                except zmq.ZMQError:
                    user = ""
                if not is_z85_key(user):
                    self.malformed_dropped += 1
                    log.warning("dropping frame without an authenticated CURVE User-Id")
                    continue
            peer = self._route_peer.get(route)
            if peer is None:
                peer = self._route_peer[route] = PeerId(route, user)
                self._track_fd(msg, peer, events)
            elif peer.user != user:
                self.malformed_dropped += 1
                log.warning("dropping frame: route %s changed user", peer.short())
                continue
            bucket = user or route
            if not self._limiter.allow(bucket, now):
                self.rate_dropped += 1
                if bucket not in self._limited:
                    self._limited.add(bucket)
                    log.warning("consumer %s exceeds its frame rate; dropping", peer.short())
                continue
            self._limited.discard(bucket)
            events.append(Received(peer, msg.bytes))

    def _track_fd(self, msg: zmq.Frame, peer: PeerId, events: list[Event]) -> None:
        try:
            fd = int(msg.get(zmq.SRCFD))
        except (zmq.ZMQError, TypeError, ValueError):
            return
        old = self._fd_peer.get(fd)
        if old is not None and old.route != peer.route:
            # fd reused: the old connection closed; its DISCONNECTED event is still queued.
            self._skip_disconnect[fd] = self._skip_disconnect.get(fd, 0) + 1
            self._fd_peer.pop(fd)
            self._peer_down(old, events)
        self._fd_peer[fd] = peer


# -- client ----------------------------------------------------------------------------------
@dataclass
class _Conn:
    key: str
    sock: zmq.Socket
    mon: zmq.Socket
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
        handshake_timeout_s: float = 1.5,
        heartbeat_ivl_s: float = 2.0,
        heartbeat_timeout_s: float = 4.0,
        max_frame_bytes: int = 8 << 20,
        max_msgs_per_poll: int = 256,
        sndhwm: int = 1000,
        rcvhwm: int = 1000,
        reconnect_ivl_s: float = 0.1,
        reconnect_ivl_max_s: float = 2.0,
    ) -> None:
        _check_positive(
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
            self.public_key, self._secret = _keypair(secret_key, public_key, "consumer")
        self.handshake_timeout_s = handshake_timeout_s
        self.max_msgs_per_poll = int(max_msgs_per_poll)
        self._opts = {
            "heartbeat_ivl_s": heartbeat_ivl_s,
            "heartbeat_timeout_s": heartbeat_timeout_s,
            "max_frame_bytes": max_frame_bytes,
            "sndhwm": sndhwm,
            "rcvhwm": rcvhwm,
        }
        self._reconnect_ms = (_ms(reconnect_ivl_s), _ms(max(reconnect_ivl_s, reconnect_ivl_max_s)))
        self._ctx = zmq.Context()
        self._conns: dict[str, _Conn] = {}
        self._by_sock: dict[zmq.Socket, _Conn] = {}
        self._waker = _Waker()
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
            _set_common(sock, **self._opts)
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
            sock.connect(_tcp_endpoint(host, port))
        except zmq.ZMQError as e:
            _close_monitored(sock, mon)
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
            c.sock.send(data, flags=zmq.NOBLOCK, copy=len(data) < _LARGE_FRAME)
        except zmq.ZMQError:  # Again: queue full / not connected
            return False
        return True

    def poll(self, timeout_s: float) -> list[Event]:
        if self._closed:
            return []
        now = time.monotonic()
        deadlines = [c.deadline for c in self._conns.values() if c.deadline is not None]
        wait_s = min([timeout_s, *(d - now for d in deadlines)])
        try:
            ready = dict(self._poller.poll(_ms(max(0.0, wait_s))))
        except zmq.ZMQError as e:
            if e.errno != errno.EINTR:
                raise
            ready = {}
        if self._waker.fd in ready:
            self._waker.drain()
        events: list[Event] = []
        for c in list(self._conns.values()):
            self._drain_monitor(c, events)
        self._drain_data(events)
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
        if self._closed:
            return
        self._closed = True
        for c in list(self._conns.values()):
            self._forget(c)
        self._waker.close()
        self._ctx.destroy(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _forget(self, c: _Conn) -> None:
        self._conns.pop(c.key, None)
        for s in (c.sock, c.mon):
            self._by_sock.pop(s, None)
            self._poller.unregister(s)
        _close_monitored(c.sock, c.mon)

    def _fail(self, c: _Conn, reason: str, events: list[Event]) -> None:
        log.warning("control connection %s: authentication failed: %s", c.key, reason)
        self._forget(c)
        events.append(AuthFailed(c.key, reason))

    def _up(self, c: _Conn, events: list[Event]) -> None:
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

    def _drain_monitor(self, c: _Conn, events: list[Event]) -> None:
        for _ in range(_MONITOR_DRAIN_MAX):
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
                    f"(ZAP status {value}): unknown client key; add it to the producer's allow-list",
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
            "server key given is most likely not this producer's public key (or the producer "
            "dropped an unknown client key without replying)"
        )

    def _handshake_timeout(self, c: _Conn, events: list[Event]) -> None:
        x = f"{self.handshake_timeout_s:g}s"
        if c.tcp_seen:
            if c.no_detail and not self.insecure:
                reason = self._no_detail_reason(c)
            elif self.insecure:
                reason = f"no handshake within {x}: {self._mismatch_reason()}"
            else:
                reason = (
                    f'no CURVE handshake within {x}: wrong producer key ("producer key mismatch"),'
                    " unknown client key, or plain/CURVE mismatch"
                )
            self._fail(c, reason, events)
        else:
            c.deadline = None
            if c.state == "connecting":
                c.state = "down"
                log.info("control connection %s: producer unreachable for %s", c.key, x)
                events.append(Down(c.key))

    def _drain_data(self, events: list[Event]) -> None:
        budget = self.max_msgs_per_poll
        active = list(self._conns.values())
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
                still.append(c)
            active = still
