"""The holder side of the directory: liveness renewal, the publish queue, re-publishing, GC.

One daemon thread per started :class:`Directory` (``ect-fleet-<instance>``) does everything
here, so that ``publish``/``unpublish`` never block their caller:

- **liveness**: every ``liveness_ttl_s / 3`` one script writes the instance record and moves its
  deadline in ``alive`` to the server's clock + ``liveness_ttl_s``. The script returns the record
  it replaced: if that was not this incarnation's (Redis restarted or was flushed, the record
  was collected after a long pause, or another instance uses the same name), or if the previous
  renewal failed, everything the instance holds is re-published (a *resync*).
- **publish queue**: publish/unpublish are queued (latest per mm_hash wins) and written in
  pipelines, at most 512 operations a round trip, once the instance's record is written. While
  Redis is unreachable the queue keeps up to ``publish_queue_max`` items; beyond that it is
  dropped and a resync replaces it. The claim a publish or an unpublish hands back (the entry
  encoded under it is ready, or its encode was given up) is queued apart, by its token, and is
  never replaced by a later operation on the item: it is released in the pipeline that writes
  the item's latest operation, after it (waiters never see the claim gone before the holder),
  or after the resync that replaces a dropped queue.
- **resync**: the incarnation's ``entries`` set minus what it holds is unpublished, and all it
  holds is published again.
- **GC**: instances whose liveness lapsed more than ``gc_after_s`` ago are removed with their
  holder records (compare-and-delete: a record rewritten meanwhile is kept); stale records that
  lookups found are deleted the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ectransport.fleet import client as rc
from ectransport.fleet import scripts
from ectransport.fleet.health import Health
from ectransport.fleet.identity import Identity
from ectransport.fleet.keeper import ClaimKeeper
from ectransport.fleet.keys import Keyspace
from ectransport.fleet.outcomes import Claim
from ectransport.fleet.records import HolderRecord, InstanceRecord, Rejected, decode, encode
from ectransport.fleet.stats import FleetStats
from ectransport.settings_schema import FleetSettings

log = logging.getLogger("ectransport.fleet")

_CHUNK = 512
_GC_EVERY = 10  # liveness renewals between two GC rounds
_GC_INSTANCES = 16  # instances collected per round at most
_MAX_STALE = 4096

Op = tuple[str, int]  # ("pub" | "unpub", nbytes)


class HolderLoop:
    """Liveness, publishing and GC for one instance (see module docstring). Internal to
    :class:`Directory`, which owns the clients and the counters."""

    def __init__(
        self,
        settings: FleetSettings,
        identity: Identity,
        incarnation: str,
        keys: Keyspace,
        client: Any,
        health: Health,
        stats: FleetStats,
        clock: Callable[[], float],
        keeper: ClaimKeeper | None = None,
    ):
        self.s, self.identity, self.incarnation = settings, identity, incarnation
        self.keys, self.client, self.health, self.stats, self.clock = (
            keys,
            client,
            health,
            stats,
            clock,
        )
        self.keeper = keeper
        self.entries_key = keys.entries(identity.instance, incarnation)
        self._cond = threading.Condition()
        self._held: dict[str, int] = {}
        self._pending: OrderedDict[str, Op] = OrderedDict()
        self._releases: dict[str, Claim] = {}  # token -> a claim to release (module docstring)
        self._stale: dict[tuple[str, bytes], bytes] = {}
        self._resync = True
        self._writing = 0  # operations taken from the queue whose write has not returned
        self._live = False  # the instance record is written (since the last failure)
        self._closed = False
        self._load = 0.0
        self._beats = 0
        self._thread: threading.Thread | None = None
        self.live_event = threading.Event()

    # -- caller side (any thread, never blocks on Redis) -------------------------------------
    def publish(self, mm_hash: str, nbytes: int, claim: Claim | None) -> None:
        with self._cond:
            self._held[mm_hash] = nbytes
            self._queue(mm_hash, ("pub", nbytes), claim)

    def unpublish(self, mm_hash: str, claim: Claim | None) -> None:
        with self._cond:
            self._held.pop(mm_hash, None)
            self._queue(mm_hash, ("unpub", 0), claim)

    def _queue(self, mm_hash: str, op: Op, claim: Claim | None) -> None:
        self._pending.pop(mm_hash, None)
        self._pending[mm_hash] = op
        if claim is not None:
            self._releases[claim.token] = claim
        if len(self._pending) > self.s.publish_queue_max:
            self.stats.add("publish_dropped", len(self._pending))
            self._pending.clear()  # the resync re-publishes what is held; releases stay queued
            self._resync = True
        self._cond.notify_all()

    def set_load(self, load: float) -> None:
        with self._cond:
            self._load = max(0.0, float(load))

    def add_stale(self, stale: list[tuple[str, bytes, bytes]]) -> None:
        with self._cond:
            for mm_hash, field, raw in stale:
                if len(self._stale) < _MAX_STALE:
                    self._stale[(mm_hash, field)] = raw
            self._cond.notify_all()

    def held(self) -> dict[str, int]:
        with self._cond:
            return dict(self._held)

    def queued(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._releases) + (1 if self._resync else 0)

    def unreleased(self) -> list[Claim]:
        """The claims queued for release and not written yet (closing: released directly)."""
        with self._cond:
            left = list(self._releases.values())
            self._releases.clear()
            return left

    def wait_flushed(self, timeout_s: float) -> bool:
        """Wait until every queued operation and claim release is written (and no resync is
        due)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (
                self._pending or self._releases or self._writing or self._resync or not self._live
            ):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)
            return True

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, daemon=True, name=f"ect-fleet-{self.identity.instance}"
            )
            self._thread.start()

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        renew_s = self.s.liveness_ttl_s / 3
        next_beat = 0.0
        while True:
            with self._cond:
                if self._closed:
                    return
            now = self.clock()
            try:
                if now >= next_beat:
                    next_beat = now + renew_s
                    self._heartbeat()
                if self._live:
                    self._write()
            except Exception as exc:  # the thread never dies; the next renewal retries
                outcome = rc.classify(exc)
                if self._live:
                    log.warning("fleet directory: %s", outcome)
                self.stats.add("heartbeat_failures")
                self.health.failed(outcome, self.clock())
                with self._cond:
                    self._live = False
                    self._resync = True
                self.live_event.clear()
            with self._cond:
                if self._closed:
                    return
                busy = self._live and (
                    self._pending or self._resync or self._stale or self._releases
                )
                if not busy:
                    self._cond.wait(max(0.0, next_beat - self.clock()))

    def instance_record(self) -> bytes:
        i = self.identity
        with self._cond:
            load = self._load
        return encode(
            InstanceRecord(
                v=1,
                instance=i.instance,
                incarnation=self.incarnation,
                host=i.host,
                port=i.port,
                public_key=i.public_key,
                cert=i.cert,
                compat_hash=i.compat_hash,
                load=load,
                roles=i.roles,
                started_ms=i.started_ms,
            )
        )

    def _heartbeat(self) -> None:
        reply = scripts.run(
            self.client,
            scripts.HEARTBEAT,
            (self.keys.instances, self.keys.alive),
            self.identity.instance,
            self.instance_record(),
            int(self.s.liveness_ttl_s * 1000),
        )
        old, old_deadline, now_ms = reply[0], reply[1], int(reply[2])
        self.stats.add("heartbeats")
        recovered = self.health.succeeded()
        ours = False
        if old is not None:
            rec = decode(old, InstanceRecord)
            ours = not isinstance(rec, Rejected) and rec.incarnation == self.incarnation
            if (
                not ours
                and not isinstance(rec, Rejected)
                and old_deadline is not None
                and float(old_deadline) > now_ms
            ):
                self.stats.add("name_conflicts")
                log.error(
                    "fleet directory: another live instance uses the name %r "
                    "(incarnation %s); give each instance its own fleet.instance",
                    self.identity.instance,
                    rec.incarnation,
                )
        with self._cond:
            if recovered:
                self.stats.add("reconnects")
            if not ours or recovered:
                self._resync = True
            self._live = True
            self._cond.notify_all()
        self.live_event.set()
        self._beats += 1
        if self._beats % _GC_EVERY == 0:
            try:
                self._gc(now_ms)
            except Exception as exc:  # a failed GC round does not make this instance dead
                log.warning("fleet directory: GC round failed: %s", rc.classify(exc))

    def _holder_record(self, mm_hash: str, nbytes: int) -> bytes:
        i = self.identity
        return encode(
            HolderRecord(
                v=1,
                mm_hash=mm_hash,
                instance=i.instance,
                incarnation=self.incarnation,
                host=i.host,
                port=i.port,
                public_key=i.public_key,
                cert=i.cert,
                nbytes=nbytes,
                compat_hash=i.compat_hash,
                load=self._load,
                published_ms=int(time.time() * 1000),
            )
        )

    def _write(self) -> None:
        with self._cond:
            resync = self._resync
        if resync:
            self._do_resync()
        self._flush()
        self._clean()

    def _do_resync(self) -> None:
        with self._cond:
            held = dict(self._held)
            self._resync = False
            self._writing = 1
        try:
            published = {
                m.decode("utf-8", "surrogateescape") for m in self.client.smembers(self.entries_key)
            }
            gone = sorted(published - set(held))
            inst = self.identity.instance
            items = list(held.items())
            for k in range(0, max(len(gone), len(items)), _CHUNK):
                pipe = self.client.pipeline(transaction=False)
                for mm_hash in gone[k : k + _CHUNK]:
                    pipe.hdel(self.keys.holders(mm_hash), inst)
                    pipe.srem(self.entries_key, mm_hash)
                for mm_hash, nbytes in items[k : k + _CHUNK]:
                    pipe.hset(
                        self.keys.holders(mm_hash), inst, self._holder_record(mm_hash, nbytes)
                    )
                    pipe.sadd(self.entries_key, mm_hash)
                pipe.execute()
        except BaseException:
            with self._cond:
                self._resync = True
            raise
        finally:
            with self._cond:
                self._writing = 0
                self._cond.notify_all()
        self.stats.add("resyncs")
        self.stats.add("republished", len(held))

    def _flush(self) -> None:
        while True:
            with self._cond:
                batch = [
                    self._pending.popitem(last=False)
                    for _ in range(min(_CHUNK, len(self._pending)))
                ]
                # a claim is released once its item's latest operation is written: in this
                # batch or before (not while it is queued, or a resync is due to write it)
                releases = (
                    []
                    if self._resync
                    else [c for c in self._releases.values() if c.mm_hash not in self._pending]
                )
                releases = releases[:_CHUNK]
                if not batch and not releases:
                    self._cond.notify_all()
                    return
                for c in releases:
                    del self._releases[c.token]
                self._writing = len(batch) + len(releases)
            if self.keeper is not None:
                for c in releases:  # no renewal races the release
                    self.keeper.forget(c)
            inst = self.identity.instance
            pipe = self.client.pipeline(transaction=False)
            for mm_hash, (op, nbytes) in batch:
                if op == "pub":
                    pipe.hset(
                        self.keys.holders(mm_hash), inst, self._holder_record(mm_hash, nbytes)
                    )
                    pipe.sadd(self.entries_key, mm_hash)
                else:
                    pipe.hdel(self.keys.holders(mm_hash), inst)
                    pipe.srem(self.entries_key, mm_hash)
            for c in releases:  # after the holder records: waiters never miss both
                scripts.run(pipe, scripts.DELETE_IF, (self.keys.claim(c.mm_hash),), c.raw)
            try:
                replies = pipe.execute()
            except BaseException:
                with self._cond:  # put back what no newer operation replaced, in order
                    self._writing = 0
                    for mm_hash, op_ in reversed(batch):
                        if mm_hash not in self._pending:
                            self._pending[mm_hash] = op_
                            self._pending.move_to_end(mm_hash, last=False)
                    for c in releases:
                        self._releases.setdefault(c.token, c)
                raise
            with self._cond:
                self._writing = 0
            pubs = sum(1 for _, (op, _n) in batch if op == "pub")
            self.stats.add("published", pubs)
            self.stats.add("unpublished", len(batch) - pubs)
            self.stats.add(
                "claims_released", sum(1 for r in replies[len(replies) - len(releases) :] if r == 1)
            )

    def _clean(self) -> None:
        with self._cond:
            if not self._stale:
                return
            batch = list(self._stale.items())[:_CHUNK]
            for k, _ in batch:
                del self._stale[k]
        pipe = self.client.pipeline(transaction=False)
        for (mm_hash, field), raw in batch:
            scripts.run(pipe, scripts.HDEL_IF, (self.keys.holders(mm_hash),), field, raw)
        done = pipe.execute(raise_on_error=False)
        self.stats.add("cleaned", sum(1 for r in done if r == 1))

    def _gc(self, now_ms: int) -> None:
        """Remove instances whose liveness lapsed ``gc_after_s`` ago, with their records."""
        cutoff = now_ms - int(self.s.gc_after_s * 1000)
        lapsed = self.client.zrangebyscore(
            self.keys.alive, "-inf", cutoff, start=0, num=_GC_INSTANCES
        )
        for name in lapsed:
            raw = scripts.run(
                self.client,
                scripts.GC_INSTANCE,
                (self.keys.instances, self.keys.alive),
                name,
                cutoff,
            )
            if raw is None:
                continue  # it renewed meanwhile
            self.stats.add("gc_instances")
            rec = decode(raw, InstanceRecord)
            if isinstance(rec, Rejected):
                continue
            self._gc_entries(rec)

    def _gc_entries(self, rec: InstanceRecord) -> None:
        key = self.keys.entries(rec.instance, rec.incarnation)
        members = [m.decode("utf-8", "surrogateescape") for m in self.client.smembers(key)]
        for k in range(0, len(members), _CHUNK):
            chunk = members[k : k + _CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for mm_hash in chunk:
                pipe.hget(self.keys.holders(mm_hash), rec.instance)
            values = pipe.execute(raise_on_error=False)
            pipe = self.client.pipeline(transaction=False)
            for mm_hash, raw in zip(chunk, values):
                h = decode(raw, HolderRecord) if isinstance(raw, bytes) else None
                if isinstance(h, HolderRecord) and h.incarnation == rec.incarnation:
                    scripts.run(
                        pipe, scripts.HDEL_IF, (self.keys.holders(mm_hash),), rec.instance, raw
                    )
            done = pipe.execute(raise_on_error=False)
            self.stats.add("cleaned", sum(1 for r in done if r == 1))
        self.client.delete(key)

    # -- shutdown ------------------------------------------------------------------------------
    def withdraw(self) -> None:
        """Remove this instance and everything it published (clean shutdown; may raise)."""
        inst = self.identity.instance
        held = list(self.held())
        pipe = self.client.pipeline(transaction=False)
        pipe.hdel(self.keys.instances, inst)
        pipe.zrem(self.keys.alive, inst)
        for mm_hash in held:
            pipe.hdel(self.keys.holders(mm_hash), inst)
        pipe.delete(self.entries_key)
        pipe.execute()
