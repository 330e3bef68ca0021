"""Scheduler side of the consumer role: fetch what ``ec_transfer_params`` name, then load it.

Per feature of a waiting request (``ensure_cache_available``), in order:

1. already covered by computed tokens → nothing to do;
2. this request already fell back for it → compute locally (once, never re-fetched for it);
3. landed → admissible (``has_cache_item`` is true, the scheduler will load it);
4. fetch in flight → defer the request, unless the fetch ended: landed → 3, miss → 2;
5. no announcement (no params entry, or one without ``peer_host``: vLLM's metadata-only
   entries) → with a fleet directory (``fleet_url``), what it says
   (:mod:`ectransport.vllm.fleet`: wait for its answer, fetch from its holders in order, or
   compute locally) — unless vLLM's own encoder cache holds the item (it was allocated here and
   vLLM has not reported it freed: ``free_encoder_mm_hashes``), then nothing is asked; without a
   directory, compute locally;
6. a malformed announcement (:func:`~ectransport.vllm.announcement.read_announcement`: a field
   of the wrong type, out of bounds or missing), announced size or shape ≠ local layout, an
   untrusted producer key → compute locally without fetching (logged, counted in ``outcomes``);
7. otherwise start a fetch (:meth:`ConsumerNode.submit_held`, with the announcement's ticket:
   ``ect_hold``) and defer — unless it lands within ``admit_wait_s`` (a read on the producer's
   offer, or a small entry answered inline: then the request is admitted in this step; the
   scheduler waits at most ``admit_wait_s`` per step in all, whatever the number of requests).

Every fetch ends by its deadline (``fetch_timeout_s``) in landed or miss, so no request waits
forever; a miss of any kind (missing, dead, incompatible, busy, timeout...) makes the feature
compute locally — except a transient one (no ack, connection dropped: :data:`TRANSIENT`), after
which the same producer is asked again within the deadline once its quarantine is over (a
stalled or briefly overloaded host costs a wait, not an encode). A feature that must compute
locally but carries no media (an orchestrator replaced it by a reference to the remote
encoding) cannot: its request is reported by ``take_unavailable_requests`` and vLLM fails it,
instead of the encoder failing the engine.

A landed entry stays pinned in the shared region until every request that wanted it was
scheduled or finished and every load of it was reported by all ranks (the scheduler's
:class:`~ectransport.vllm.loads.LoadLedger`, shared with the local tier, counts the reports).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ectransport.node import Miss, MissReason
from ectransport.node.common import Layout, Security
from ectransport.node.consumer import ConsumerNode, Held, ProducerAddress
from ectransport.settings_schema import PlanesSettings
from ectransport.vllm.announcement import (
    AnnouncementError,
    is_announced,
    read_announcement,
)
from ectransport.vllm.fleet import OFFER_TO, FleetSide, Verdict
from ectransport.vllm.loads import LoadLedger
from ectransport.vllm.metadata import LoadOrder
from ectransport.vllm.region import RegionPart
from ectransport.vllm.settings import Settings
from ectransport.vllm.trust import ProducerKeys

log = logging.getLogger("ectransport.vllm.consumer")

_GRACE_S = 5.0  # the node resolves every fetch by its deadline; this only guards against a bug
#: Misses that say the producer was there but did not answer in time or dropped the connection
#: (an overloaded or briefly stalled host): the fetch asks the same producer again while its
#: ``fetch_timeout_s`` lasts — at most :data:`MAX_RETRIES` times, each once the producer's
#: quarantine is over — instead of encoding at once
TRANSIENT = frozenset({MissReason.TIMEOUT, MissReason.PEER_DOWN})
MAX_RETRIES = 3
#: pause before asking again, and between asks while the producer is still quarantined, s
RETRY_PAUSE_S = 0.25
#: a retry needs this much of the deadline left at least, s
RETRY_MIN_LEFT_S = 0.5
#: items of vLLM's encoder cache tracked at most (oldest forgotten first: looked up again)
MAX_TRACKED = 1 << 16


def consumer_planes(settings: Settings) -> PlanesSettings:
    """The consumer node's plane options: the instance's, with NIXL's progress thread off.

    The consumer's own I/O thread progresses its READs (it polls each one until it completes),
    so the thread only ever ran while the consumer waited. Measured with three vLLM engines on 2
    cores (tests/vllm_engine/test_fleet_engines.py): right after a consumer bound a producer's
    NIXL endpoint on a new connection, that thread spun a whole core for seconds while the
    producer — with vLLM's worker of the waiting instance busy-polling the other core — got no
    CPU to answer (6-9 s stalls in 7 of 20 runs; none in 7 runs without the thread).
    """
    planes = settings.common.planes
    return msgspec.structs.replace(planes, nixl=msgspec.structs.replace(planes.nixl,
                                                                         prog_thread=False))


@dataclass
class _Fetch:
    future: Any
    nbytes: int
    give_up: float
    waiters: set[str] = field(default_factory=set)
    started: float = 0.0  # scheduler clock when the fetch was submitted (s)
    steps: int = 0  # scheduler steps it stayed in flight
    fast: bool = False  # expected to land at once (an offer, or inline): admit waits for it
    holders: tuple[Any, ...] = ()  # fleet holders still to try after this one misses
    fleet: bool = False  # fetched from a fleet holder (no ec_transfer_params)
    addr: ProducerAddress | None = None  # the producer asked (again on a transient miss)
    retries: int = 0  # asked again after a transient miss (TRANSIENT), at most MAX_RETRIES
    retry_at: float | None = None  # future is None until then: a retry waits for its turn


@dataclass
class _Landed:
    held: Held
    wanted: set[str] = field(default_factory=set)  # requests admitted but not yet scheduled
    pins: int = 0  # loads dispatched and not yet reported by every rank


#: The ledger's name for this side's loads (logs, ``LoadLedger.pending``).
OWNER = "consumer"


class ConsumerSide:
    """Owns the :class:`ConsumerNode` landing into ``part`` of the shared region.

    Args:
        loads: the scheduler's load ledger (shared with the local tier): queues this side's load
            orders and counts their reports.
        local: tells whether this instance's local tier holds an item (then it is not fetched).
    """

    def __init__(self, settings: Settings, layout: Layout, part: RegionPart, security: Security,
                 node_id: str, loads: LoadLedger,
                 local: Callable[[str], bool] | None = None):
        self.settings = settings
        self.local = local
        self.layout = layout
        self.part = part
        self.keys = ProducerKeys(settings)
        self.loads = loads
        self.node = ConsumerNode(layout=layout, security=dataclasses.replace(
                                     security, allow=self.keys.listed), region=part,
                                 settings=settings.common.consumer,
                                 node=settings.node_section(node_id), trust=settings.common.trust,
                                 plane_settings=consumer_planes(settings))
        self._fetches: dict[str, _Fetch] = {}
        self._landed: dict[str, _Landed] = {}
        self._local: set[tuple[str, str]] = set()  # (request_id, mm_hash) computed locally
        self._unavailable: set[str] = set()  # requests to fail: local compute without media
        self._checked: set[str] = set()  # requests whose params were matched against their items
        self.outcomes: Counter[str] = Counter()  # "landed", "local:<why>", "miss:<reason>"
        #: what admit() waited this scheduler step (at most admit_wait_s in all, whatever the
        #: number of requests; reset by step)
        self._admit_spent_s = 0.0
        #: the fleet directory (``ectransport.vllm.fleet``), set by the scheduler delegate
        self.fleet: FleetSide | None = None
        #: items vLLM's encoder cache holds: allocated (computed or loaded) and not reported
        #: freed since; a fleet lookup for one of them would fetch what vLLM does not need
        self._in_vllm: OrderedDict[str, None] = OrderedDict()

    # -- queries -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Load orders not yet handed to the workers (the ledger's). Fetches in flight do not
        count: a request waiting for one keeps the engine stepping anyway, and one nobody waits
        for any more is settled at the next step. Loads awaiting reports do not count either:
        vLLM does not run the workers' EC hooks on an idle consumer step, so stepping would not
        deliver them."""
        return self.loads.busy

    def has(self, mm_hash: str) -> bool:
        return mm_hash in self._landed

    def computes_locally(self, request_id: str, mm_hash: str) -> bool:
        return (request_id, mm_hash) in self._local

    # -- admission -----------------------------------------------------------------------------
    def admit(self, request: Any, num_computed_tokens: int, now: float,
              _waited: bool = False) -> bool:
        """``ensure_cache_available``: True when no feature of ``request`` waits for a fetch.

        Fetches it starts that should land at once — read on the producer's offer (a ticket,
        ECTP v2 §10) or small enough to come inline — are waited for up to ``admit_wait_s``, so
        that the request is admitted in this scheduler step rather than the next."""
        params = getattr(request, "ec_transfer_params", None)
        params = params if isinstance(params, dict) else {}
        if not params and self.fleet is None:
            return True
        rid = request.request_id
        if params:
            self._check_match(request, params)
        pending = False
        fast: list[str] = []  # fetches started here that should land at once
        for feature in request.mm_features or ():
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue
            mm_hash = feature.identifier
            if (rid, mm_hash) in self._local:
                continue
            if self.local is not None and self.local(mm_hash):
                continue  # this instance's own region has it
            f = self._fetches.get(mm_hash)
            if f is not None:
                f.waiters.add(rid)
                if not self._settle(mm_hash, f, now):
                    pending = True
                    continue
            if mm_hash in self._landed:
                self._landed[mm_hash].wanted.add(rid)
                continue
            if (rid, mm_hash) in self._local:
                continue
            if mm_hash not in params or not is_announced(params[mm_hash]):
                if self.fleet is not None and mm_hash not in self._in_vllm and \
                        self._from_fleet(rid, mm_hash, feature, now):
                    pending = True
                continue  # not announced: vLLM's cache, the fleet's holder, or the encoder
            if self._start(rid, mm_hash, feature, params[mm_hash], now):
                pending = True
                if self._fetches[mm_hash].fast:
                    fast.append(mm_hash)
        budget_s = self.settings.admit_wait_s - self._admit_spent_s
        if fast and not _waited and budget_s > 0:
            t0 = time.monotonic()
            concurrent.futures.wait([self._fetches[m].future for m in fast], timeout=budget_s)
            self._admit_spent_s += time.monotonic() - t0
            return self.admit(request, num_computed_tokens, now, _waited=True)
        if not pending and any(
                (rid, f.identifier) in self._local and getattr(f, "data", None) is None
                and f.mm_position.offset + f.mm_position.length > num_computed_tokens
                for f in request.mm_features):
            log.error("EC consumer: request %s needs a remote encoding it could not get and "
                      "carries no media to compute it; vLLM fails the request", rid)
            self._unavailable.add(rid)
            return False
        return not pending

    def _check_match(self, request: Any, params: dict) -> None:
        """Log once per request when its ec_transfer_params name none of its items: the
        producer's mm_hashes differ from this instance's (mm_hash covers the model name)."""
        rid = request.request_id
        if rid in self._checked:
            return
        self._checked.add(rid)
        mine = {f.identifier for f in request.mm_features or ()}
        if mine and not mine.intersection(params) and set(params) != {OFFER_TO}:
            self.outcomes["local:no_match"] += len(mine)
            log.warning("EC consumer: request %s carries ec_transfer_params for %d item(s), but "
                        "none is one of its %d multimodal item(s); encoding them locally. vLLM's "
                        "mm_hash covers the model name: start producer and consumer with the "
                        "identical --model string (and the same media)", rid, len(params),
                        len(mine))

    def take_unavailable(self) -> set[str]:
        """Requests to fail (see module docstring); each is returned once."""
        out, self._unavailable = self._unavailable, set()
        return out

    def _fall_back(self, rids: set[str] | list[str], mm_hash: str, why: str) -> None:
        self.outcomes[why] += 1
        for rid in rids:
            self._local.add((rid, mm_hash))

    def _start(self, rid: str, mm_hash: str, feature: Any, entry: object, now: float) -> bool:
        """Start the fetch ``entry`` (the item's ``ec_transfer_params`` value) announces (True),
        or make the item compute locally (False: malformed, wrong size, untrusted key)."""
        rows = int(feature.mm_position.get_num_embeds())
        nbytes = rows * self.layout.block_bytes
        try:
            ann = read_announcement(mm_hash, entry)
        except AnnouncementError as e:
            return self._refuse(rid, mm_hash, str(e))
        why = ann.mismatch(nbytes, rows, self.layout)
        if why is not None:
            return self._refuse(rid, mm_hash, why)
        key, distrust = self.keys.resolve(ann.public_key)
        if distrust:
            return self._refuse(rid, mm_hash, f"untrusted key: {distrust}")
        addr = ProducerAddress(ann.peer_host, ann.peer_port, key)
        ticket = ann.ticket(mm_hash)
        future = self.node.submit_held(addr, mm_hash, timeout_s=self.settings.fetch_timeout_s,
                                       ticket=ticket)
        fast = ticket is not None or nbytes <= self.node.settings.inline_max_bytes
        self._fetches[mm_hash] = _Fetch(future, nbytes,
                                        now + self.settings.fetch_timeout_s + _GRACE_S, {rid},
                                        started=now, fast=fast, addr=addr)
        log.debug("EC consumer: fetching %s (%d bytes) from %s", mm_hash, nbytes, addr.key)
        return True

    def _refuse(self, rid: str, mm_hash: str, why: str) -> bool:
        """The item computes locally, not fetched; ``why`` starts with the outcome's name
        (``"announcement: ..."``, ``"size mismatch: ..."``, ``"untrusted key: ..."``)."""
        log.warning("EC consumer: computing %s locally without fetching: %s", mm_hash, why)
        self._fall_back({rid}, mm_hash, "local:" + why.split(":")[0])
        return False

    def _settle(self, mm_hash: str, f: _Fetch, now: float) -> bool:
        """Resolve a finished fetch (True) or leave it in flight (False)."""
        if f.future is None and not self._ask_again(mm_hash, f, now):
            return False  # a retry waiting for its turn
        if f.future is None or not f.future.done():
            if now < f.give_up:
                return False
            del self._fetches[mm_hash]
            if f.future is not None:
                f.future.add_done_callback(self._release_late)
            self._fall_back(f.waiters, mm_hash, "miss:no_outcome")
            log.error("EC consumer: fetch of %s has no outcome past its deadline", mm_hash)
            return True
        del self._fetches[mm_hash]
        out = f.future.result()
        if isinstance(out, Held):
            if out.nbytes != f.nbytes:
                self.node.release_held(out)
                self._fall_back(f.waiters, mm_hash, "miss:size")
                log.warning("EC consumer: producer sent %d bytes for %s, expected %d; computing "
                            "locally", out.nbytes, mm_hash, f.nbytes)
            else:
                self.outcomes["landed"] += 1
                self._landed[mm_hash] = _Landed(out, set(f.waiters))
                log.debug("EC consumer: %s landed (%d bytes, %s); seen %.3f ms after the fetch "
                          "started, %d scheduler step(s) later", mm_hash, out.nbytes, out.plane,
                          (now - f.started) * 1e3, f.steps)
        else:
            if f.holders and now < f.give_up - _GRACE_S:  # a fleet holder missed: the next
                log.info("EC consumer: fleet holder of %s missed (%s); trying the next",
                         mm_hash, out.reason.value)
                self._fleet_fetch(f.waiters, mm_hash, f.nbytes, f.holders, now,
                                  give_up=f.give_up)
                return False
            if self._retry(mm_hash, f, out, now):
                return False
            self._fall_back(f.waiters, mm_hash, f"miss:{out.reason.value}")
            log.info("EC consumer: fetch of %s missed (%s: %s); computing locally", mm_hash,
                     out.reason.value, out.detail)
        if f.fleet and self.fleet is not None:
            self.fleet.fetched(mm_hash, isinstance(out, Held))
        return True

    def _retry(self, mm_hash: str, f: _Fetch, miss: Miss, now: float) -> bool:
        """After a miss of the fetch ``f``: ask the same producer again later (True) if the miss
        was transient (:data:`TRANSIENT`; or QUARANTINED while a retry waits for the quarantine
        that miss started), retries are left and so is enough of the deadline."""
        transient = miss.reason in TRANSIENT and f.retries < MAX_RETRIES
        waiting = miss.reason is MissReason.QUARANTINED and f.retries > 0
        if f.addr is None or not (transient or waiting) or \
                f.give_up - _GRACE_S - now < RETRY_PAUSE_S + RETRY_MIN_LEFT_S:
            return False
        if transient:
            f.retries += 1
            log.info("EC consumer: fetch of %s missed (%s: %s); asking the producer again "
                     "(%.1f s of its deadline left)", mm_hash, miss.reason.value, miss.detail,
                     f.give_up - _GRACE_S - now)
        f.future, f.retry_at = None, now + RETRY_PAUSE_S
        self._fetches[mm_hash] = f
        return True

    def _ask_again(self, mm_hash: str, f: _Fetch, now: float) -> bool:
        """A retry whose turn came is submitted (True); one still waiting is left (False)."""
        assert f.addr is not None and f.retry_at is not None
        if now < f.retry_at:
            return False
        left = f.give_up - _GRACE_S - now
        f.future = self.node.submit_held(f.addr, mm_hash, timeout_s=max(left, 0.0))
        f.retry_at = None
        return True

    def _from_fleet(self, rid: str, mm_hash: str, feature: Any, now: float) -> bool:
        """An item without ``ec_transfer_params``: ask the fleet directory
        (:meth:`FleetSide.decide <ectransport.vllm.fleet.FleetSide.decide>`, never blocking).
        True while the request must wait (asked, or fetching from a holder); False when it
        computes here (nobody holds it, this instance won its claim, or no answer in time)."""
        assert self.fleet is not None
        nbytes = int(feature.mm_position.get_num_embeds()) * self.layout.block_bytes
        d = self.fleet.decide(mm_hash, nbytes, now)
        if d.verdict is Verdict.PENDING:
            return True
        if d.verdict is Verdict.FETCH:
            self._fleet_fetch({rid}, mm_hash, nbytes, d.holders, now)
            return True
        log.debug("EC consumer: %s computes here (fleet: %s%s)", mm_hash, d.verdict.value,
                  f": {d.detail}" if d.detail else "")
        self._fall_back({rid}, mm_hash, f"fleet:{d.verdict.value}")
        return False

    def _fleet_fetch(self, waiters: set[str], mm_hash: str, nbytes: int,
                     holders: tuple[Any, ...], now: float, give_up: float | None = None) -> None:
        """Fetch ``mm_hash`` from the first of ``holders``; the rest are tried on a miss, all
        within one ``fetch_timeout_s`` counted from the first holder's fetch (``give_up``: that
        fetch's, for the next holders), so a dead fleet costs a request one deadline at most."""
        h, rest = holders[0], holders[1:]
        if give_up is None:
            give_up = now + self.settings.fetch_timeout_s + _GRACE_S
        left = give_up - _GRACE_S - now  # > 0: _settle tries the next holder only before it
        addr = ProducerAddress(h.host, h.port, h.public_key)
        future = self.node.submit_held(addr, mm_hash,
                                       timeout_s=min(self.settings.fetch_timeout_s, left))
        self._fetches[mm_hash] = _Fetch(future, nbytes, give_up, set(waiters), started=now,
                                        holders=rest, fleet=True, addr=addr)

    def _release_late(self, future: Any) -> None:
        out = future.result()
        if isinstance(out, Held):
            self.node.release_held(out)

    # -- loads ---------------------------------------------------------------------------------
    def on_alloc(self, request: Any, index: int, now: float) -> None:
        """The scheduler loads ``request.mm_features[index]`` externally: pin it, queue a load."""
        mm_hash = request.mm_features[index].identifier
        landed = self._landed.get(mm_hash)
        if landed is None or self.loads.queued(mm_hash):
            return
        landed.wanted.discard(request.request_id)
        landed.pins += 1
        h = landed.held
        order = LoadOrder(mm_hash, self.loads.new_id(), tuple(self.part.spans(h.runs, h.nbytes)),
                          h.nbytes, (h.nbytes // self.layout.block_bytes, self.layout.hidden))
        self.loads.add(order, owner=OWNER, on_done=lambda: self._load_done(mm_hash), now=now)

    def in_vllm_cache(self, mm_hash: str) -> None:
        """vLLM allocated ``mm_hash`` in its encoder cache (``update_state_after_alloc``)."""
        self._in_vllm.pop(mm_hash, None)
        self._in_vllm[mm_hash] = None
        while len(self._in_vllm) > MAX_TRACKED:  # bounded whatever vLLM reports
            self._in_vllm.popitem(last=False)

    def vllm_freed(self, mm_hashes: Any) -> None:
        """vLLM evicted these from its encoder cache (``free_encoder_mm_hashes`` of a step)."""
        for m in mm_hashes or ():
            self._in_vllm.pop(m, None)

    def step(self, now: float) -> None:
        """Once per scheduler step, before the ledger hands out this step's orders: settles
        finished fetches and gives back landed entries nobody wants any more."""
        self._admit_spent_s = 0.0
        for mm_hash, f in list(self._fetches.items()):
            f.steps += not self._settle(mm_hash, f, now)
        for mm_hash in [m for m, x in self._landed.items() if not x.wanted and not x.pins]:
            self._release(mm_hash)

    def _load_done(self, mm_hash: str) -> None:
        """The ledger settled one load of ``mm_hash`` (every rank reported, or it timed out)."""
        landed = self._landed.get(mm_hash)
        if landed is None:
            return
        landed.pins -= 1
        if landed.pins == 0 and not landed.wanted:
            self._release(mm_hash)

    def _release(self, mm_hash: str) -> None:
        landed = self._landed.pop(mm_hash)
        self.node.release_held(landed.held)

    # -- request end ---------------------------------------------------------------------------
    def on_finished(self, request: Any) -> None:
        rid = request.request_id
        self._unavailable.discard(rid)
        self._checked.discard(rid)
        for feature in request.mm_features or ():
            mm_hash = feature.identifier
            self._local.discard((rid, mm_hash))
            f = self._fetches.get(mm_hash)
            if f is not None:
                f.waiters.discard(rid)
            landed = self._landed.get(mm_hash)
            if landed is not None:
                landed.wanted.discard(rid)
                if not landed.wanted and not landed.pins:
                    self._release(mm_hash)

    def close(self) -> None:
        self.node.close()  # in-flight fetches end as misses; the region goes with its owner
        self._fetches.clear()
        self._landed.clear()
        self._local.clear()
        self._unavailable.clear()
        self._checked.clear()
        self._in_vllm.clear()

