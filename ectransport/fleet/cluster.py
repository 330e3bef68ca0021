"""The directory on a Redis Cluster (``fleet.cluster``): a client built on first use, and
pipelines split by master.

Every command and script of the directory touches the keys of one slot (``keys.py``: the keys
used together share a hash tag), so nothing needs ``MULTI`` or a cross-slot operation. What a
cluster changes is the pipelines: the commands of one pipeline (a lookup: the holders of each
item, the claim, and the ``{fleet}`` keys) live on several masters.

:class:`ClusterBatch` queues a pipeline's commands, groups them by the master that serves each
key's slot, and sends one plain pipeline per master, one master after the other: a lookup of one
item costs at most two round trips (its slot's master and ``{fleet}``'s), a lookup of many at
most one per master. A master that does not answer costs one deadline, and its commands' replies
are that error (the directory turns them into misses); the other masters' replies are used.
redis-py's own cluster pipeline is not used because it re-sends each command that failed on a
node one at a time, each with its own deadline, so a lookup of k items with a stopped master
took k deadlines.

After a connection error, a timeout, or a ``MOVED``/``ASK``/``CLUSTERDOWN``/``TRYAGAIN`` reply
the slot table is refreshed (at most once per :data:`REFRESH_EVERY_S`) before the next pipeline;
single commands (liveness renewals, GC, ``SCAN``) go through redis-py's ``RedisCluster``, which
follows redirections itself (no retries: :func:`~ectransport.fleet.client.make_client`).

:class:`ClusterClient` builds its ``RedisCluster`` on first use, because the constructor connects
to discover the slots: an instance must start while its directory is unreachable, and a failed
start is retried by the next call (the directory's backoff paces them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: Shortest interval between two refreshes of the slot table after errors, s.
REFRESH_EVERY_S = 1.0

#: Error replies that mean the slot table is out of date or the cluster is failing over.
_STALE_PREFIXES = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


class ClusterClient:
    """A ``redis.cluster.RedisCluster`` built on first use (module docstring); thread-safe.

    Attribute access is forwarded to the cluster client (building it if needed), except
    :meth:`pipeline` (a :class:`ClusterBatch`) and :meth:`close` (never builds).

    Args:
        factory: builds the ``RedisCluster`` (connects; raises redis-py's errors).
        clock: monotonic seconds.
    """

    def __init__(self, factory: Callable[[], Any], clock: Callable[[], float] = time.monotonic):
        self._factory = factory
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Any = None
        self._stale = False
        self._refreshed_at = float("-inf")

    def get(self) -> Any:
        """The cluster client, built now if needed, its slot table refreshed first if an error
        marked it stale (at most once per :data:`REFRESH_EVERY_S`).

        Raises:
            redis-py's errors: no startup node answered (``RedisClusterException``).
        """
        with self._lock:
            if self._client is None:
                self._client = self._factory()
                self._refreshed_at = self._clock()
                self._stale = False
            client = self._client
            now = self._clock()
            refresh = self._stale and now - self._refreshed_at >= REFRESH_EVERY_S
            if refresh:
                self._stale, self._refreshed_at = False, now
        if refresh:
            try:
                client.nodes_manager.initialize()
            except Exception:  # the commands that follow fail and say why
                self.mark_stale()
        return client

    def mark_stale(self) -> None:
        """Refresh the slot table before the next pipeline (a node failed or redirected us)."""
        with self._lock:
            self._stale = True

    def pipeline(self, transaction: bool = False) -> ClusterBatch:
        """A pipeline split by master (module docstring); ``transaction`` must be False."""
        if transaction:
            raise ValueError("the fleet directory never uses MULTI on a cluster")
        return ClusterBatch(self)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.get(), name)


def _key_of(name: str, args: tuple[Any, ...]) -> Any:
    """The key that routes a queued command: ``EVAL script numkeys key ...`` → the first key;
    every other command the directory pipelines names its key first."""
    if name == "execute_command" and args and str(args[0]).upper() == "EVAL":
        return args[3]
    return args[0]


def _stale_reply(reply: object) -> bool:
    return isinstance(reply, Exception) and str(reply).startswith(_STALE_PREFIXES)


class ClusterBatch:
    """One pipeline on a cluster: queue commands as on a ``redis`` pipeline (any command method,
    or ``execute_command``), then :meth:`execute` (module docstring).

    Replies come back in the order queued, parsed as redis-py parses them; a command whose
    master failed gets that exception as its reply.
    """

    def __init__(self, owner: ClusterClient):
        self._owner = owner
        self._calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., ClusterBatch]:
        if name.startswith("_"):
            raise AttributeError(name)

        def queue(*args: Any, **kwargs: Any) -> ClusterBatch:
            self._calls.append((name, args, kwargs))
            return self

        return queue

    def __len__(self) -> int:
        return len(self._calls)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Send the queued commands, one pipeline per master; the replies in order.

        Raises:
            the first error reply or failure when ``raise_on_error`` (after every master was
            tried); redis-py's errors when the cluster client cannot be built.
        """
        calls, self._calls = self._calls, []
        if not calls:
            return []
        client = self._owner.get()
        replies: list[Any] = [None] * len(calls)
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, (name, args, _kw) in enumerate(calls):
            try:
                node = client.get_node_from_key(_key_of(name, args))
            except Exception as exc:
                node, replies[i] = None, exc
            if node is None:
                if replies[i] is None:
                    replies[i] = _uncovered(_key_of(name, args))
                self._owner.mark_stale()
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        for node, idx in groups.values():
            try:
                pipe = client.get_redis_connection(node).pipeline(transaction=False)
                for i in idx:
                    name, args, kw = calls[i]
                    getattr(pipe, name)(*args, **kw)
                out = pipe.execute(raise_on_error=False)
            except Exception as exc:  # the node is down, stopped or unreachable
                out = [exc] * len(idx)
                self._owner.mark_stale()
            for i, reply in zip(idx, out):
                replies[i] = reply
            if any(_stale_reply(r) for r in out):
                self._owner.mark_stale()
        if raise_on_error:
            for r in replies:
                if isinstance(r, Exception):
                    raise r
        return replies


def _uncovered(key: Any) -> Exception:
    from redis.exceptions import ClusterDownError

    return ClusterDownError(f"CLUSTERDOWN no master serves the slot of {key!r}")
