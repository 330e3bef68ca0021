"""Redis connections of the directory, built from :class:`FleetSettings`; what failures mean.

``redis`` (redis-py, the ``fleet`` extra) is imported here, on first use, never by
``import ectransport``. Every client is built without redis-py's automatic retries (a retry
would multiply a call's deadline) and with socket timeouts, so a call on a stopped or
unreachable Redis ends within its deadline. A Redis Cluster (``fleet.cluster``; the URL may list
several startup nodes, ``redis://h1:p1,h2:p2``) is reached through
:mod:`ectransport.fleet.cluster`. TLS: a ``rediss://`` URL or ``fleet.tls``; AUTH/ACL:
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


def parse_url(url: str) -> dict[str, Any]:
    """``host``, ``port``, ``db``, ``username``, ``tls`` and ``nodes`` of a
    ``redis://[user@]host:port[,host:port...][/db]`` URL (``nodes``: every ``(host, port)``;
    several are a cluster's startup nodes).

    Raises:
        ConfigError: another scheme, no host, a bad port or db, or a password in the URL.
    """
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise ConfigError(f"fleet.url {url!r}: {e}") from e
    if parts.scheme not in _SCHEMES:
        raise ConfigError(
            f"fleet.url {url!r}: expected redis:// or rediss:// (valkey:// and "
            f"valkeys:// too), got {parts.scheme or 'no'} scheme"
        )
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    if ":" in userinfo:
        raise ConfigError(
            "fleet.url carries a password: put it in a file named by "
            "fleet.password_file (--redis-password-file) instead; URLs are shown "
            "by `ectransport config show` and in process lists"
        )
    nodes = []
    for hostport in hostlist.split(","):
        try:
            one = urlsplit(f"//{hostport}")
            port = one.port or 6379
        except ValueError as e:
            raise ConfigError(f"fleet.url {url!r}: {e}") from e
        if not one.hostname:
            raise ConfigError(f"fleet.url {url!r} names no host")
        nodes.append((one.hostname, port))
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"fleet.url {url!r}: the path must be a database number, got {path!r}")
    return {
        "host": nodes[0][0],
        "port": nodes[0][1],
        "db": int(path or 0),
        "nodes": nodes,
        "username": unquote(userinfo) if userinfo else None,
        "tls": _SCHEMES[parts.scheme],
    }


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
    :func:`make_client`; with ``fleet.cluster``, ``startup_nodes`` replaces ``host``/``port``
    and there is no ``db``).

    Raises:
        ConfigError: no ``fleet.url``, or an invalid one (see :func:`parse_url`), several hosts
            without ``fleet.cluster``, a database other than 0 on a cluster, an unreadable
            password file, a TLS key without its certificate.
    """
    if settings.url is None:
        raise ConfigError(
            "no fleet directory configured: set fleet.url (--redis-url, "
            'ECTRANSPORT_FLEET__URL or [fleet] url = "redis://host:6379")'
        )
    u = parse_url(settings.url)
    kw: dict[str, Any] = {
        "username": settings.username or u["username"],
        "password": read_password(settings.password_file),
    }
    if settings.cluster:
        if u["db"]:
            raise ConfigError(
                f"fleet.url {settings.url!r}: a Redis Cluster has only database "
                "0 (drop the /db path)"
            )
        kw["startup_nodes"] = u["nodes"]
    elif len(u["nodes"]) > 1:
        raise ConfigError(
            f"fleet.url {settings.url!r} names several hosts: that is a Redis "
            "Cluster's startup nodes; set fleet.cluster = true (--redis-cluster)"
        )
    else:
        kw.update(host=u["host"], port=u["port"], db=u["db"])
    if kw["username"] is not None and kw["password"] is None:
        kw["password"] = ""  # an ACL user without a password ('nopass')
    if u["tls"] or settings.tls:
        if settings.tls_key_file and not settings.tls_cert_file:
            raise ConfigError("fleet.tls_key_file without fleet.tls_cert_file")
        kw.update(
            ssl=True,
            ssl_ca_certs=settings.tls_ca_file,
            ssl_certfile=settings.tls_cert_file,
            ssl_keyfile=settings.tls_key_file,
            ssl_check_hostname=settings.tls_check_hostname,
        )
    return kw


def redis_module() -> Any:
    """The ``redis`` module.

    Raises:
        ConfigError: redis-py is not installed.
    """
    try:
        import redis
    except ImportError as e:
        raise ConfigError(
            "the fleet directory needs redis-py: pip install 'ectransport[fleet]'"
        ) from e
    return redis


def make_client(settings: FleetSettings, timeout_s: float, max_connections: int = 16) -> Any:
    """A client whose every socket operation ends within ``timeout_s`` and whose connect ends
    within ``min(connect_timeout_s, timeout_s)``, with no retries: a ``redis.Redis``, or with
    ``fleet.cluster`` a :class:`~ectransport.fleet.cluster.ClusterClient` (a
    ``RedisCluster`` built on first use; a call may then take one deadline per master it
    touches).

    Raises:
        ConfigError: see :func:`connection_kwargs`; redis-py missing.
    """
    redis = redis_module()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = connection_kwargs(settings)
    kw.update(
        socket_timeout=timeout_s,
        socket_connect_timeout=min(settings.connect_timeout_s, timeout_s),
        max_connections=max_connections,
        health_check_interval=0,
    )
    params = inspect.signature(redis.Redis.__init__).parameters
    if "driver_info" in params:
        kw["driver_info"] = None  # no CLIENT SETINFO round trips on each new connection
    if not settings.cluster:
        return redis.Redis(retry=Retry(NoBackoff(), 0), **kw)
    from redis.cluster import ClusterNode, RedisCluster

    from ectransport.fleet.cluster import ClusterClient

    nodes = [ClusterNode(host, port) for host, port in kw.pop("startup_nodes")]
    # retry: the cluster level (the nodes' connections never retry in cluster mode);
    # require_full_coverage=False: the client starts while some slots are down (those
    # commands fail, the others work)
    return ClusterClient(
        lambda: RedisCluster(
            startup_nodes=nodes, retry=Retry(NoBackoff(), 0), require_full_coverage=False, **kw
        )
    )


def classify(exc: BaseException) -> DirectoryUnavailable:
    """The typed outcome of a failed call (``exc`` raised by redis-py or the socket layer)."""
    redis = redis_module()
    e = redis.exceptions
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(
        exc,
        (
            e.AuthenticationError,
            e.AuthorizationError,
            e.NoPermissionError,
            e.AuthenticationWrongNumberOfArgsError,
        ),
    ) or (
        isinstance(exc, e.ResponseError) and str(exc).startswith(("WRONGPASS", "NOAUTH", "NOPERM"))
    ):
        return DirectoryUnavailable(UnavailableReason.AUTH, detail)
    if isinstance(exc, (e.TimeoutError, TimeoutError)):
        return DirectoryUnavailable(UnavailableReason.TIMEOUT, detail)
    if isinstance(exc, (e.ConnectionError, ConnectionError, OSError)):
        return DirectoryUnavailable(UnavailableReason.DOWN, detail)
    # a cluster whose slots are not all served (a master failed), or unreachable as a whole
    cluster_down = tuple(
        getattr(e, n)
        for n in ("ClusterDownError", "SlotNotCoveredError", "RedisClusterUnreachableError")
        if hasattr(e, n)
    )
    if isinstance(exc, cluster_down) or (
        isinstance(exc, e.ResponseError) and str(exc).startswith(("CLUSTERDOWN", "TRYAGAIN"))
    ):
        return DirectoryUnavailable(UnavailableReason.DOWN, detail)
    return DirectoryUnavailable(UnavailableReason.ERROR, detail)
