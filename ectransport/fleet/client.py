"""Redis connections of the directory, built from :class:`FleetSettings`; what failures mean.

``redis`` (redis-py, the ``fleet`` extra) is imported here, on first use, never by
``import ectransport``. Every client is built without redis-py's automatic retries (a retry
would multiply a call's deadline) and with socket timeouts, so a call on a stopped or
unreachable Redis ends within its deadline. TLS: a ``rediss://`` URL or ``fleet.tls``; AUTH/ACL:
``fleet.username`` (or the URL's user) and ``fleet.password_file``. A URL that carries a
password is refused: URLs are printed by ``ectransport config show`` and visible in ``ps``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ectransport.errors import ConfigError
from ectransport.fleet.outcomes import DirectoryUnavailable, UnavailableReason
from ectransport.settings_schema import FleetSettings

_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}

# -- scripts: one key slot each (cluster-safe), compare-and-act on our own values -----------

#: KEYS instances, alive; ARGV instance, record, ttl_ms -> {previous record, previous
#: deadline, server now ms}
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local old = redis.call('HGET', KEYS[1], ARGV[1])
local old_deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return {old, old_deadline, now}
"""
#: KEYS key; ARGV value -> 1 if the key held value and was deleted, else 0
DELETE_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
#: KEYS key; ARGV value, ttl_ms -> 1 if the key held value and its expiry was reset, else 0
RENEW_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
#: KEYS hash; ARGV field, value -> 1 if the field held value and was deleted, else 0
HDEL_IF = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""
#: KEYS instances, alive; ARGV instance, cutoff_ms -> the removed instance record, or nil when
#: it renewed after the cutoff
GC_INSTANCE = """
local s = redis.call('ZSCORE', KEYS[2], ARGV[1])
if s and tonumber(s) > tonumber(ARGV[2]) then return false end
local rec = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return rec
"""


def parse_url(url: str) -> dict[str, Any]:
    """``host``, ``port``, ``db``, ``username`` and ``tls`` of a ``redis://`` URL.

    Raises:
        ConfigError: another scheme, no host, a bad port or db, or a password in the URL.
    """
    try:
        parts = urlsplit(url)
        port = parts.port or 6379
    except ValueError as e:
        raise ConfigError(f"fleet.url {url!r}: {e}") from e
    if parts.scheme not in _SCHEMES:
        raise ConfigError(f"fleet.url {url!r}: expected redis:// or rediss:// (valkey:// and "
                          f"valkeys:// too), got {parts.scheme or 'no'} scheme")
    if parts.password is not None:
        raise ConfigError("fleet.url carries a password: put it in a file named by "
                          "fleet.password_file (--redis-password-file) instead; URLs are shown "
                          "by `ectransport config show` and in process lists")
    if not parts.hostname:
        raise ConfigError(f"fleet.url {url!r} names no host")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"fleet.url {url!r}: the path must be a database number, got {path!r}")
    return {"host": parts.hostname, "port": port, "db": int(path or 0),
            "username": unquote(parts.username) if parts.username else None,
            "tls": _SCHEMES[parts.scheme]}


def read_password(path: str | None) -> str | None:
    """The password in ``path`` (trailing newline stripped), or None.

    Raises:
        ConfigError: the file cannot be read.
    """
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as e:
        raise ConfigError(f"fleet.password_file {path}: {e.strerror or e}") from e


def connection_kwargs(settings: FleetSettings) -> dict[str, Any]:
    """Keyword arguments of ``redis.Redis`` for ``settings`` (timeouts added by
    :func:`make_client`).

    Raises:
        ConfigError: no ``fleet.url``, or an invalid one (see :func:`parse_url`), an unreadable
            password file, a TLS key without its certificate.
    """
    if settings.url is None:
        raise ConfigError("no fleet directory configured: set fleet.url (--redis-url, "
                          "ECTRANSPORT_FLEET__URL or [fleet] url = \"redis://host:6379\")")
    u = parse_url(settings.url)
    kw: dict[str, Any] = {"host": u["host"], "port": u["port"], "db": u["db"],
                          "username": settings.username or u["username"],
                          "password": read_password(settings.password_file)}
    if kw["username"] is not None and kw["password"] is None:
        kw["password"] = ""  # an ACL user without a password ('nopass')
    if u["tls"] or settings.tls:
        if settings.tls_key_file and not settings.tls_cert_file:
            raise ConfigError("fleet.tls_key_file without fleet.tls_cert_file")
        kw.update(ssl=True, ssl_ca_certs=settings.tls_ca_file,
                  ssl_certfile=settings.tls_cert_file, ssl_keyfile=settings.tls_key_file,
                  ssl_check_hostname=settings.tls_check_hostname)
    return kw


def redis_module() -> Any:
    """The ``redis`` module.

    Raises:
        ConfigError: redis-py is not installed.
    """
    try:
        import redis
    except ImportError as e:
        raise ConfigError("the fleet directory needs redis-py: pip install "
                          "'ectransport[fleet]'") from e
    return redis


def make_client(settings: FleetSettings, timeout_s: float, max_connections: int = 16) -> Any:
    """A ``redis.Redis`` whose every socket operation ends within ``timeout_s`` and whose
    connect ends within ``min(connect_timeout_s, timeout_s)`` (no retries).

    Raises:
        ConfigError: see :func:`connection_kwargs`; redis-py missing.
    """
    redis = redis_module()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = connection_kwargs(settings)
    kw.update(socket_timeout=timeout_s,
              socket_connect_timeout=min(settings.connect_timeout_s, timeout_s),
              retry=Retry(NoBackoff(), 0), max_connections=max_connections,
              health_check_interval=0)
    params = inspect.signature(redis.Redis.__init__).parameters
    if "driver_info" in params:
        kw["driver_info"] = None  # no CLIENT SETINFO round trips on each new connection
    return redis.Redis(**kw)


def classify(exc: BaseException) -> DirectoryUnavailable:
    """The typed outcome of a failed call (``exc`` raised by redis-py or the socket layer)."""
    redis = redis_module()
    e = redis.exceptions
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (e.AuthenticationError, e.AuthorizationError, e.NoPermissionError,
                        e.AuthenticationWrongNumberOfArgsError)) or \
            (isinstance(exc, e.ResponseError) and
             str(exc).startswith(("WRONGPASS", "NOAUTH", "NOPERM"))):
        return DirectoryUnavailable(UnavailableReason.AUTH, detail)
    if isinstance(exc, (e.TimeoutError, TimeoutError)):
        return DirectoryUnavailable(UnavailableReason.TIMEOUT, detail)
    if isinstance(exc, (e.ConnectionError, ConnectionError, OSError)):
        return DirectoryUnavailable(UnavailableReason.DOWN, detail)
    return DirectoryUnavailable(UnavailableReason.ERROR, detail)
