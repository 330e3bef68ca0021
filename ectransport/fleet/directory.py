"""``Directory``: the fleet-wide encoder-cache directory on Redis/Valkey (``docs/fleet.md``).

    d = Directory(settings.fleet, identity=Identity(...), trusted=keys.trusted,
                  compat_hash=layout.compat_hash).start()
    d.publish(mm_hash, nbytes)                     # entry ready (never blocks: queued)
    d.unpublish(mm_hash)                           # evicted / discarded
    found = d.lookup_many([h1, h2])                # {h1: [Holder, ...], h2: []}, one round trip
    fut = d.submit_lookup([h1, h2])                # the same on a worker thread (a Future)
    got = d.claim_or_wait(h1)                      # FOUND holders | ENCODE (claim) | ENCODE_LOCALLY

Every call that talks to Redis ends within its deadline (``lookup_timeout_s`` for lookups and
claim polls, ``op_timeout_s`` for the rest, connects within ``connect_timeout_s``) and answers a
typed outcome on failure (:class:`DirectoryUnavailable`; a :class:`Lookup` with
``unavailable`` set); after a failure, calls answer ``BACKOFF`` at once until the retry backoff
ends. Only :meth:`check` raises (for the CLI and start-up checks).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ectransport.errors import ConfigError
from ectransport.fleet import client as rc
from ectransport.fleet import scripts
from ectransport.fleet.claims import Claims
from ectransport.fleet.filter import InstanceView, Policy, TrustPredicate, select_holders
from ectransport.fleet.health import Health
from ectransport.fleet.holder import HolderLoop
from ectransport.fleet.identity import Identity
from ectransport.fleet.keeper import ClaimKeeper
from ectransport.fleet.keys import Keyspace, valid_instance, valid_mm_hash
from ectransport.fleet.outcomes import (
    Acquired,
    Acquisition,
    Claim,
    DirectoryAuthError,
    DirectoryError,
    DirectoryUnavailable,
    Lookup,
    UnavailableReason,
)
from ectransport.fleet.stats import FleetStats
from ectransport.fleet.workers import MAX_IN_FLIGHT, Workers  # noqa: F401 (re-exported)
from ectransport.settings_schema import API, FleetSettings

log = logging.getLogger("ectransport.fleet")


class Directory(Claims):
    """The fleet directory client of one instance (see module docstring; thread-safe).

    Args:
        settings: the ``[fleet]`` section (``url`` required).
        identity: this instance as a holder (publishing needs it); None for a lookup-only
            client.
        trusted: ``(public_key, cert) -> bool``; lookups return only holders it accepts (use
            :func:`~ectransport.fleet.filter.trust_any` in tools that never fetch). Required
            for lookups and :meth:`claim_or_wait`.
        compat_hash: drop holders with another compatibility hash (hex); default the
            identity's, or accept any.
        local_hosts: hosts that count as "same host" besides loopback and this machine's name
            (default: the identity's host).
        clock: monotonic seconds (tests may pass a fake for the backoff).

    Raises:
        ConfigError: bad settings (see :func:`ectransport.fleet.client.connection_kwargs`) or
            redis-py is missing. Nothing connects before the first call.
    """

    def __init__(
        self,
        settings: FleetSettings = API.fleet,
        *,
        identity: Identity | None = None,
        trusted: TrustPredicate | None = None,
        compat_hash: str | None = None,
        local_hosts: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self.identity = identity
        self.keys = Keyspace(settings.namespace)
        self.incarnation = secrets.token_hex(8)
        name = identity.instance if identity else settings.instance
        if name is not None and not valid_instance(name):
            raise ConfigError(
                f"fleet.instance {name!r}: expected 1..128 letters, digits or '_.:@-'"
            )
        self.instance = name or f"client-{secrets.token_hex(4)}"
        self._fast = rc.make_client(settings, settings.lookup_timeout_s)
        self._slow = rc.make_client(settings, settings.op_timeout_s)
        self.health = Health(settings.retry_backoff_s, settings.retry_backoff_max_s)
        self.stats_ = FleetStats()
        self.clock = clock
        hosts = {*local_hosts, socket.gethostname()}
        if identity is not None:
            hosts.add(identity.host)
        self._policy = Policy(
            trusted=trusted or _no_trust,
            self_instance=name,
            compat_hash=compat_hash or (identity.compat_hash if identity else None),
            local_hosts=frozenset(hosts),
            max_entry_bytes=settings.max_entry_bytes,
        )
        self._has_trust = trusted is not None
        self._view = InstanceView()
        self._view_lock = threading.Lock()
        self._closed = threading.Event()
        self._workers = Workers()
        self._keeper = ClaimKeeper(
            self._slow,
            self.keys,
            self.stats_,
            max(settings.claim_wait_s, settings.claim_ttl_s),
            name=self.instance,
        )
        self._loop = (
            HolderLoop(
                settings,
                identity,
                self.incarnation,
                self.keys,
                self._slow,
                self.health,
                self.stats_,
                clock,
                keeper=self._keeper,
            )
            if identity is not None
            else None
        )

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> Directory:
        """Start the holder thread (liveness, publishing, GC); a lookup-only client needs none.
        Returns at once: an unreachable Redis is retried in the background."""
        if self._loop is not None:
            self._loop.start()
        return self

    def wait_live(self, timeout_s: float) -> bool:
        """Wait until this instance's liveness record is written (its holders are visible)."""
        return self._loop is not None and self._loop.live_event.wait(timeout_s)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every publish/unpublish so far is written; False if not by ``timeout_s``
        (Redis unreachable: they stay queued)."""
        return self._loop is not None and self._loop.wait_flushed(timeout_s)

    def close(self, *, withdraw: bool = True) -> None:
        """Stop the threads; with ``withdraw``, remove this instance and its holder records and
        give back the claims it still holds (best effort, within ``op_timeout_s`` each).
        Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        claims = self._keeper.close(timeout_s=self.settings.op_timeout_s + 1)
        if self._loop is not None:
            self._loop.close(timeout_s=self.settings.op_timeout_s * 3 + 1)
            claims += self._loop.unreleased()
            if withdraw:
                try:
                    self._loop.withdraw()
                except Exception as exc:
                    log.warning(
                        "fleet directory: could not withdraw %s: %s",
                        self.instance,
                        rc.classify(exc),
                    )
        if withdraw:
            self._keeper.release(claims)
        self._workers.close()
        for c in (self._fast, self._slow):
            try:
                c.close()
            except Exception:
                pass

    def __enter__(self) -> Directory:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self) -> dict[str, Any]:
        """Talk to Redis once (``PING``, ``INFO server``); for the CLI and start-up checks.

        Returns:
            ``{"server": "redis"|"valkey", "version": str, "rtt_s": float, "cluster": bool}``.

        Raises:
            DirectoryAuthError: AUTH/ACL refused.
            DirectoryError: unreachable, timed out, not a Redis server, or a cluster node
                without ``fleet.cluster``.
        """
        t0 = time.perf_counter()
        try:
            self._slow.ping()
            rtt = time.perf_counter() - t0
            info = self._slow.info("server")
            cluster = (
                self.settings.cluster
                or str(self._slow.info("cluster").get("cluster_enabled", 0)) == "1"
            )
        except Exception as exc:
            outcome = rc.classify(exc)
            where = self.settings.url
            if outcome.reason is UnavailableReason.AUTH:
                raise DirectoryAuthError(
                    f"Redis at {where} refused our credentials "
                    f"({outcome.detail}); check fleet.username and "
                    "fleet.password_file"
                ) from exc
            raise DirectoryError(f"cannot use the fleet directory at {where}: {outcome}") from exc
        if cluster and not self.settings.cluster:
            raise DirectoryError(
                f"the fleet directory at {self.settings.url} is a Redis Cluster "
                "node: set fleet.cluster = true (--redis-cluster)"
            )
        server = "valkey" if "valkey_version" in info else "redis"
        return {
            "server": server,
            "rtt_s": rtt,
            "cluster": cluster,
            "version": str(info.get("valkey_version") or info.get("redis_version", "?")),
        }

    # -- holder side ---------------------------------------------------------------------------
    def publish(self, mm_hash: str, nbytes: int, *, claim: Claim | None = None) -> None:
        """``mm_hash`` is ready here (``nbytes`` bytes); queued, never blocks. With ``claim``
        (won for this item), the claim is released right after the holder record is written.

        Raises:
            ConfigError: no identity, an invalid mm_hash or size.
        """
        loop = self._holder_loop()
        if not valid_mm_hash(mm_hash) or not isinstance(nbytes, int) or nbytes < 1:
            raise ConfigError(
                f"publish({mm_hash!r}, {nbytes!r}): expected an mm_hash of "
                "1..1024 characters and a size >= 1 byte"
            )
        loop.publish(mm_hash, nbytes, claim)

    def unpublish(self, mm_hash: str, *, claim: Claim | None = None) -> None:
        """``mm_hash`` is no longer held here (evicted, discarded); queued, never blocks. With
        ``claim`` (an encode given up), the claim is released in the same write."""
        if valid_mm_hash(mm_hash):
            self._holder_loop().unpublish(mm_hash, claim)

    def set_load(self, load: float) -> None:
        """This instance's load figure (lower = preferred), written with the next renewal."""
        self._holder_loop().set_load(load)

    def held(self) -> dict[str, int]:
        """What this instance publishes as held: mm_hash -> bytes."""
        return self._loop.held() if self._loop is not None else {}

    def _holder_loop(self) -> HolderLoop:
        if self._loop is None:
            raise ConfigError(
                "this Directory has no identity: pass identity=Identity(...) to publish"
            )
        return self._loop

    # -- lookups -------------------------------------------------------------------------------
    def lookup_many(
        self, mm_hashes: Iterable[str], *, nbytes: Mapping[str, int] | None = None
    ) -> Lookup:
        """The usable holders of each mm_hash, best first, in ONE pipeline round trip (the
        items' holder hashes, the live instances and the server clock; on a cluster one per
        master that serves any of them).

        Args:
            mm_hashes: the items (duplicates asked once).
            nbytes: expected entry sizes, bytes, where known (others' sizes are dropped).

        Returns:
            A :class:`Lookup` (``[]`` = miss); ``unavailable`` set when Redis did not answer.

        Raises:
            ConfigError: this Directory was built without ``trusted=``.
        """
        self._need_trust()
        asked = list(dict.fromkeys(m for m in mm_hashes if valid_mm_hash(m)))
        result = self._lookup(asked, nbytes, claim=None)
        return result[0]

    def lookup(self, mm_hash: str, nbytes: int | None = None) -> Lookup:
        """:meth:`lookup_many` of one item."""
        return self.lookup_many([mm_hash], nbytes=None if nbytes is None else {mm_hash: nbytes})

    def _vouched(self) -> bool:
        return self._loop is not None and self._loop.live_event.is_set()

    def _lookup(
        self,
        asked: list[str],
        nbytes: Mapping[str, int] | None,
        claim: tuple[str, bytes, int, bytes | None] | None,
    ) -> tuple[Lookup, Any]:
        """Holders of ``asked``; with ``claim=(mm_hash, raw, ttl_ms, lapsed)`` also ``SET NX
        PX`` (or, with ``lapsed``, the compare-and-set that replaces that value) and ``GET`` of
        that claim in the same round trip. Returns (lookup, (won, current))."""
        if self._closed.is_set():
            return self._unavailable(asked, DirectoryUnavailable(UnavailableReason.CLOSED)), None
        if not asked:
            return Lookup({}), None
        blocked = self.health.blocked(self.clock())
        if blocked is not None:
            return self._unavailable(asked, blocked), None
        t0 = time.perf_counter()
        try:
            pipe = self._fast.pipeline(transaction=False)
            for mm_hash in asked:
                pipe.hrandfield(
                    self.keys.holders(mm_hash), self.settings.max_holders, withvalues=True
                )
            if claim is not None:
                key = self.keys.claim(claim[0])
                if claim[3] is None:
                    pipe.set(key, claim[1], nx=True, px=claim[2])
                else:
                    scripts.run(pipe, scripts.TAKE_OVER, (key,), claim[3], claim[1], claim[2])
                pipe.get(key)
            pipe.hgetall(self.keys.instances)
            pipe.zrange(self.keys.alive, 0, -1, withscores=True)
            scripts.queue_now(pipe, self.keys.alive, self.settings.cluster)
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            outcome = rc.classify(exc)
            self.health.failed(outcome, self.clock())
            return self._unavailable(asked, outcome), None
        elapsed = time.perf_counter() - t0
        n = len(asked)
        tail = replies[n:]
        claimed = (tail[0], tail[1]) if claim is not None else None
        inst_raw, alive_raw, now = tail[-3:]
        for r in (*tail[-3:], *(claimed or ())):
            if isinstance(r, Exception):  # NOPERM, WRONGTYPE, ...: not an answer we can use
                outcome = rc.classify(r)
                self.health.failed(outcome, self.clock())
                return self._unavailable(asked, outcome), None
        self.health.succeeded()
        now_ms = scripts.server_ms(now)
        with self._view_lock:
            self._view.update(inst_raw, alive_raw, now_ms)
            sel = select_holders(
                asked, dict(zip(asked, replies[:n])), self._view, self._policy, nbytes
            )
        hits = sum(1 for m in asked if sel.holders[m])
        st = self.stats_
        st.lookup_latency(elapsed)
        st.add_many(
            {
                "lookups": 1,
                "lookup_items": n,
                "hits": hits,
                "misses": n - hits,
                "skipped_self": sel.skipped_self,
            }
        )
        st.add_many(sel.dropped, prefix="dropped_")
        if sel.stale and self._loop is not None:
            self._loop.add_stale(sel.stale)
        return Lookup(sel.holders, elapsed_s=elapsed), claimed

    def _unavailable(self, asked: list[str], why: DirectoryUnavailable) -> Lookup:
        self.stats_.add_many(
            {"lookups": 1, "lookup_items": len(asked), "misses": len(asked), "unavailable": 1}
        )
        return Lookup({m: [] for m in asked}, unavailable=why)

    def _need_trust(self) -> None:
        if not self._has_trust:
            raise ConfigError(
                "lookups need a trust predicate: Directory(..., trusted=...) "
                "(ectransport.fleet.trust_any in tools that never fetch)"
            )

    # -- asynchronous forms --------------------------------------------------------------------
    def submit_lookup(
        self,
        mm_hashes: Iterable[str],
        *,
        nbytes: Mapping[str, int] | None = None,
        callback: Callable[[Lookup], None] | None = None,
    ) -> cf.Future[Lookup]:
        """:meth:`lookup_many` on the directory's lookup thread; returns at once.

        Poll ``future.done()`` / ``future.result()``, or pass ``callback`` (called on the
        lookup thread with the :class:`Lookup`; keep it cheap; exceptions are logged). With
        more than :data:`~ectransport.fleet.workers.MAX_IN_FLIGHT` calls queued, the future is already done with an
        ``unavailable`` (``BUSY``) lookup.
        """
        self._need_trust()
        asked = list(dict.fromkeys(m for m in mm_hashes if valid_mm_hash(m)))
        return self._workers.submit(
            "lookups",
            lambda: self.lookup_many(asked, nbytes=nbytes),
            lambda why: self._unavailable(asked, why),
            callback,
        )

    def submit_claim_or_wait(
        self,
        mm_hash: str,
        *,
        nbytes: int | None = None,
        callback: Callable[[Acquisition], None] | None = None,
        **kw: Any,
    ) -> cf.Future[Acquisition]:
        """:meth:`claim_or_wait` on a waiting thread (4 at most); returns at once."""
        self._need_trust()
        return self._workers.submit(
            "waits",
            lambda: self.claim_or_wait(mm_hash, nbytes=nbytes, **kw),
            lambda why: Acquisition(Acquired.ENCODE_LOCALLY, detail=str(why), unavailable=why),
            callback,
        )

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters (``hits``, ``misses``, ``claims_won``/``_waited``/``_expired``, ``dropped_*``
        by reason, ``published``, ``resyncs``, ...), ``lookup_p50_s``/``lookup_p99_s``, and
        gauges ``publish_queue`` (operations not yet written) and ``directory_down``."""
        out = self.stats_.snapshot()
        out["publish_queue"] = self._loop.queued() if self._loop is not None else 0
        out["held"] = len(self._loop.held()) if self._loop is not None else 0
        out["directory_down"] = int(self.health.down)
        return out

    @property
    def redis(self) -> Any:
        """The ``redis.Redis`` client of background operations (``op_timeout_s``), for tools."""
        return self._slow


def _no_trust(public_key: str, cert: bytes | None) -> bool:
    return False
