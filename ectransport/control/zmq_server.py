"""Producer side of the ZeroMQ control plane: :class:`ZmqControlServer`, one ROUTER socket with
CurveZMQ and a ZAP allow-list (see :mod:`ectransport.control.zmqctl` for the design).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from typing import cast

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from ectransport.control.base import ControlServer, Down, PeerId, Received, ServerEvent
from ectransport.control.keys import AllowList, is_z85_key
from ectransport.control.zmq_common import (
    HANDSHAKE_FAILED,
    LARGE_FRAME,
    LOG_NAME,
    MONITOR_DRAIN_MAX,
    ZAP_LOG_NAME,
    RateLimiter,
    Waker,
    check_positive,
    close_monitored,
    is_loopback,
    keypair,
    ms,
    set_common,
    tcp_endpoint,
)
from ectransport.errors import ConfigError
from ectransport.settings_schema import API

_D = API.control.server  # the defaults: ectransport.settings_schema.ControlServerSettings

__all__ = ["ZmqControlServer"]

log = logging.getLogger(LOG_NAME)
zap_log = logging.getLogger(ZAP_LOG_NAME)

_SERVER_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED
_GONE_ROUTE_S = 2.0  # frames of a closed connection received after its Down: dropped this long
_DRAIN_ALL_MAX = 4096  # frames received at most in a poll that reports Downs (their last ones)


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


class ZmqControlServer(ControlServer):
    """Producer-side control endpoint: one ROUTER socket on its own Context.

    Args:
        host, port: bind address; ``port=0`` picks an ephemeral port (see ``.port``/``.endpoint``).
            ``"localhost"`` binds 127.0.0.1.
        secret_key, public_key: the producer's CURVE keys (Z85). ``public_key`` is derived when
            omitted and checked when given.
        allow: admitted client keys. ``None`` is only accepted on a loopback bind, where any client
            holding the producer's public key is admitted (logged as a warning).
        admit_any_key: the ZAP handler admits every CURVE client key, on any bind: admission
            is decided after the handshake, by the certificate in the client's ``Hello``
            (``ectransport.trust``, admission ``certificate`` / ``either``). The client is still
            authenticated: ``PeerId.user`` is its key. Not with ``allow`` or ``insecure``.
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
        admit_any_key: bool = False,
        insecure: bool = False,
        heartbeat_ivl_s: float = _D.heartbeat_ivl_s,
        heartbeat_timeout_s: float = _D.heartbeat_timeout_s,
        max_frame_bytes: int = _D.max_frame_bytes,
        max_msgs_per_poll: int = _D.max_msgs_per_poll,
        peer_rate_per_s: float = _D.peer_rate_per_s,
        peer_burst: int = _D.peer_burst,
        sndhwm: int = _D.sndhwm,
        rcvhwm: int = _D.rcvhwm,
        handshake_timeout_s: float = _D.handshake_timeout_s,
    ) -> None:
        check_positive(
            heartbeat_ivl_s=heartbeat_ivl_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            max_frame_bytes=max_frame_bytes,
            max_msgs_per_poll=max_msgs_per_poll,
            handshake_timeout_s=handshake_timeout_s,
        )
        if not 0 <= int(port) <= 65535:
            raise ConfigError(f"port must be 0..65535, got {port!r}")
        bind_host = "127.0.0.1" if host == "localhost" else host
        loopback = is_loopback(bind_host)
        self.insecure = insecure
        self.public_key: str | None = None
        self.handshake_failures = 0
        self.rate_dropped = 0
        self.malformed_dropped = 0
        self.max_msgs_per_poll = int(max_msgs_per_poll)
        self._closed = True  # until fully constructed
        self._policy: _ZapPolicy | None = None

        if admit_any_key and (allow is not None or insecure):
            raise ConfigError(
                "admit_any_key=True (admission by certificate) cannot be combined with "
                f"{'an allow-list' if allow is not None else 'insecure=True'}: the ZAP handler "
                "either admits every CURVE key or checks an allow-list"
            )
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
            self.public_key, secret = keypair(secret_key, public_key, "producer")
            if allow is None and not admit_any_key and not loopback:
                raise ConfigError(
                    f"binding non-loopback address {host!r} needs a client allow-list "
                    "(allow=AllowList(dir); `serve --allow-dir`) or admission by certificate "
                    "(admit_any_key=True; [trust] admission = \"certificate\" with trust_ca, "
                    "docs/fleet-trust.md); without either anyone holding the producer's public "
                    "key could connect"
                )

        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._mon: zmq.Socket[bytes] | None = None
        self._waker: Waker | None = None
        try:
            if not insecure:
                # ZAP must be running on this Context before the socket accepts peers.
                self._auth = ThreadAuthenticator(self._ctx, log=zap_log)
                self._auth.start()
                if allow is not None:
                    self._policy = _ZapPolicy(allow)
                    self._auth.configure_curve_callback("*", self._policy)
                elif admit_any_key:
                    log.info(
                        "control server on %s admits every CURVE key at the handshake; "
                        "peers are admitted by the certificate in their Hello", host
                    )
                    self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
                else:
                    log.warning(
                        "no client allow-list on loopback %s: any local client holding the "
                        "producer's public key is admitted",
                        host,
                    )
                    self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            r = self._router = self._ctx.socket(zmq.ROUTER)
            set_common(
                r,
                heartbeat_ivl_s=heartbeat_ivl_s,
                heartbeat_timeout_s=heartbeat_timeout_s,
                max_frame_bytes=max_frame_bytes,
                sndhwm=sndhwm,
                rcvhwm=rcvhwm,
            )
            # Mandatory: an unroutable/full send raises (→ False) instead of vanishing silently.
            r.setsockopt(zmq.ROUTER_MANDATORY, 1)
            r.setsockopt(zmq.HANDSHAKE_IVL, ms(handshake_timeout_s))
            if ":" in bind_host:
                r.setsockopt(zmq.IPV6, 1)
            if secret is not None:
                r.setsockopt(zmq.CURVE_SERVER, 1)
                r.setsockopt(zmq.CURVE_SECRETKEY, secret.encode("ascii"))
            self._mon = r.get_monitor_socket(events=_SERVER_EVENTS)
            try:
                r.bind(tcp_endpoint(bind_host, port if port else "*"))
            except zmq.ZMQError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"port {port} on {host} is in use (another producer running?); "
                        "choose another port or port=0 for an ephemeral one"
                    ) from None
                if e.errno == errno.EADDRNOTAVAIL or e.errno == errno.ENODEV:
                    raise ConfigError(
                        f"cannot bind {host}:{port}: not an address of this host"
                    ) from None
                raise ConfigError(f"cannot bind {host}:{port}: {e.strerror}") from None
            last = r.getsockopt_string(zmq.LAST_ENDPOINT)
            self.host = host
            self.port = int(last.rsplit(":", 1)[1])
            self.endpoint = tcp_endpoint(bind_host, self.port)
            self._waker = Waker()
            self._poller = zmq.Poller()
            self._poller.register(r, zmq.POLLIN)
            self._poller.register(self._mon, zmq.POLLIN)
            self._poller.register(self._waker.fd, zmq.POLLIN)
        except BaseException:
            self._teardown()
            raise
        self._limiter = RateLimiter(peer_rate_per_s, peer_burst)
        self._limited: set[object] = set()
        self._route_peer: dict[bytes, PeerId] = {}
        self._fd_peer: dict[int, PeerId] = {}
        self._skip_disconnect: dict[int, int] = {}
        self._gone: dict[bytes, float] = {}
        self._closing: list[PeerId] = []  # closed connections: Down once their frames are read
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

    def poll(self, timeout_s: float) -> list[ServerEvent]:
        if self._closed:
            return []
        try:
            ready = dict(self._poller.poll(ms(timeout_s)))
        except zmq.ZMQError as e:
            if e.errno == errno.EINTR:
                return []
            raise
        assert self._waker is not None
        if self._waker.fd in ready:
            self._waker.drain()
        events: list[ServerEvent] = []
        now = time.monotonic()
        self._expire_gone(now)
        # Only the sockets the poller reported (level-triggered: what is left is reported again);
        # a failed non-blocking recv costs as much as a successful one on a small VM.
        # The monitor first: a close read now predates every frame read after it (the fd of a
        # DISCONNECTED is matched to a peer by that order). A closed connection's Down waits
        # until the router was drained: ZeroMQ queued its last frames before it reported the
        # close, and a consumer's last completions give its grants back (after the Down they
        # would be dropped as a gone route's, the grants held back until their leases end).
        if self._mon in ready:
            self._drain_monitor(events)
        if self._router in ready:
            self._drain_router(events, now)
        if self._closing:  # (also a peer whose fd a newer connection took, seen in that drain)
            self._drain_router(events, now, until_empty=True)
        closing, self._closing = self._closing, []
        for peer in closing:
            self._peer_down(peer, events)
        return events

    def send(self, peer: PeerId, data: bytes) -> bool:
        if self._closed:
            return False
        assert self._router is not None
        try:
            self._router.send_multipart(
                [peer.route, data], flags=zmq.NOBLOCK, copy=len(data) < LARGE_FRAME
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

    def __enter__(self) -> ZmqControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _teardown(self) -> None:
        if self._waker is not None:
            self._waker.close()
        if self._router is not None:
            close_monitored(self._router, self._mon)
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

    def _peer_down(self, peer: PeerId, events: list[ServerEvent]) -> None:
        self._route_peer.pop(peer.route, None)
        expiry = time.monotonic() + _GONE_ROUTE_S
        self._gone[peer.route] = expiry
        self._gone_q.append((expiry, peer.route))
        self._limited.discard(peer.route)
        log.info("consumer %s disconnected", peer.short())
        events.append(Down(peer))

    def _drain_monitor(self, events: list[ServerEvent]) -> None:
        assert self._mon is not None
        for _ in range(MONITOR_DRAIN_MAX):
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
                    self._closing.append(peer)  # its Down at the end of this poll
            elif kind & HANDSHAKE_FAILED:
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

    def _drain_router(self, events: list[ServerEvent], now: float, *,
                      until_empty: bool = False) -> None:
        """Receive up to ``max_msgs_per_poll`` frames (``until_empty``: all that are queued, at
        most :data:`_DRAIN_ALL_MAX`: the receive queues are bounded, but a flood is not)."""
        r = self._router
        assert r is not None
        secure = not self.insecure
        for _ in range(_DRAIN_ALL_MAX if until_empty else self.max_msgs_per_poll):
            try:
                frames = r.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._accept(frames, events, now, secure)
            # EVENTS is an int option (pyzmq types every option int | bytes); cheaper than a
            # recv that fails
            if not cast(int, r.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return

    def _accept(self, frames: list[zmq.Frame], events: list[ServerEvent], now: float,
                secure: bool) -> None:
        """Authenticate, rate-limit and queue one received [route, data] envelope."""
        if len(frames) != 2:
            self.malformed_dropped += 1
            log.debug("dropping envelope of %d frames (expected [route, data])", len(frames))
            return
        route = frames[0].bytes
        msg = frames[1]
        if route in self._gone:
            return  # after its connection's Down (its last frames came before): nobody to answer
        user = ""
        peer = self._route_peer.get(route)
        if secure:
            try:
                user = cast(str, msg.get("User-Id"))  # a str property; pyzmq types it int | str
            except zmq.ZMQError:
                user = ""
            # validated once per connection (the route's first frame), not on every frame
            if (peer is None or peer.user != user) and not is_z85_key(user):
                self.malformed_dropped += 1
                log.warning("dropping frame without an authenticated CURVE User-Id")
                return
        if peer is None:
            peer = self._route_peer[route] = PeerId(route, user)
            self._track_fd(msg, peer)
        elif peer.user != user:
            self.malformed_dropped += 1
            log.warning("dropping frame: route %s changed user", peer.short())
            return
        bucket = user or route
        if not self._limiter.allow(bucket, now):
            self.rate_dropped += 1
            if bucket not in self._limited:
                self._limited.add(bucket)
                log.warning("consumer %s exceeds its frame rate; dropping", peer.short())
            return
        self._limited.discard(bucket)
        events.append(Received(peer, msg.bytes))

    def _track_fd(self, msg: zmq.Frame, peer: PeerId) -> None:
        try:
            fd = int(msg.get(zmq.SRCFD))
        except (zmq.ZMQError, TypeError, ValueError):
            return
        old = self._fd_peer.get(fd)
        if old is not None and old.route != peer.route:
            # fd reused: the old connection closed; its DISCONNECTED event is still queued.
            self._skip_disconnect[fd] = self._skip_disconnect.get(fd, 0) + 1
            self._fd_peer.pop(fd)
            self._closing.append(old)  # its Down at the end of this poll, after its frames
        self._fd_peer[fd] = peer


# -- client ----------------------------------------------------------------------------------
