"""What both ends of the ZeroMQ control plane share: socket options, endpoint and key helpers, the
thread-safe :class:`Waker` and the per-peer :class:`RateLimiter`.

See :mod:`ectransport.control.zmqctl` for the design (CURVE, ZAP, monitors); the server lives in
:mod:`ectransport.control.zmq_server`, the client in :mod:`ectransport.control.zmq_client`.
"""

from __future__ import annotations

import ipaddress
import math
import os
import threading
from typing import TypedDict

import zmq

from ectransport.control.keys import is_z85_key
from ectransport.errors import ConfigError

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
MONITOR_DRAIN_MAX = 10_000  # monitor events are bounded by connection churn; drain them all
LARGE_FRAME = 64 << 10  # zero-copy sends above this size
#: Logger names of the control plane (kept from the single-module layout).
LOG_NAME = "ectransport.control.zmqctl"
ZAP_LOG_NAME = LOG_NAME + ".zap"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # hostnames, interface names, "*": treat as reachable from outside


def tcp_endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def ms(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1000))


def check_positive(**kw: float) -> None:
    for name, v in kw.items():
        if not v > 0:
            raise ConfigError(f"{name} must be > 0, got {v!r}")


def keypair(secret_key: str | None, public_key: str | None, who: str) -> tuple[str, str]:
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


class CommonOpts(TypedDict):
    """The keyword arguments of :func:`set_common`, kept by a client for every socket it opens."""

    heartbeat_ivl_s: float
    heartbeat_timeout_s: float
    max_frame_bytes: int
    sndhwm: int
    rcvhwm: int


def set_common(
    sock: zmq.Socket[bytes],
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
    sock.setsockopt(zmq.HEARTBEAT_IVL, ms(heartbeat_ivl_s))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms(heartbeat_timeout_s))
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(ms(heartbeat_timeout_s), 6_553_500))


def close_monitored(sock: zmq.Socket[bytes], mon: zmq.Socket[bytes] | None,
                    linger_ms: int = 0) -> None:
    """Disable the monitor first (pyzmq#626-style hangs otherwise), then close both: the monitor
    at once, ``sock`` after its queued frames left or ``linger_ms`` (ms) passed."""
    if mon is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon.close(linger=0)
    sock.close(linger=linger_ms)


class Waker:
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
            while len(os.read(self._r, 4096)) == 4096:
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


class RateLimiter:
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
