"""The fleet directory in the vLLM adapter (``[fleet]`` keys ``fleet_*``; ``docs/fleet.md``):
items a request carries no ``ec_transfer_params`` for are looked up, fetched from the fleet, or
encoded once in the whole fleet.

For every item of a waiting request that is not covered, not in this instance's own region
and not announced by the orchestrator, :meth:`FleetSide.decide` says what to do — without ever
blocking the scheduler (every Redis round trip runs on the directory's threads; an answer is
used at a later scheduler step):

- ``PENDING``: asked, not answered yet — the request is deferred (vLLM re-checks it next step);
- ``FETCH`` (holders, best first: same host, least loaded, then any): fetch from the first; on a
  miss from the next (:class:`~ectransport.vllm.sched_consumer.ConsumerSide`), finally encode
  locally. An ``ec_producer`` (no consumer side) skips its encoder instead and announces the
  holder in the request's ``ec_transfer_params`` (:func:`holder_announcement`);
- ``ENCODE``: this instance won the item's claim — it encodes, saves, and the claim is released
  once the entry is published (or given up);
- ``LOCAL``: nobody holds it (or the directory is down, slow, or did not answer in time) — encode
  locally.

The lookups of one scheduler step go out as one pipeline (:class:`~ectransport.fleet.LookupBatcher`,
flushed by :meth:`FleetSide.step`). Instances that encode (``ec_producer``, ``ec_both``) claim an
item the lookup found nowhere (:meth:`Directory.submit_claim_or_wait
<ectransport.fleet.Directory.submit_claim_or_wait>`): the first claimant encodes, the others wait
(at most ``fleet_claim_wait_s``) for its entry and fetch it. A pure consumer (``ec_consumer``)
only looks up: it does not publish what it encodes, so a claim of its would only make others
wait. Holders come only from the directory's trust predicate (:func:`fleet_trust`): the
explicit ``producer_keys``, or a certificate when fleet trust admits by certificate — never the
announced-key rule, so a hostile directory can cause a miss, never a fetch from an untrusted
peer (CURVE still authenticates the key, the producer still checks the compatibility hash).

Targeted offers from the directory (:mod:`ectransport.fleet.wants`): an instance with a consumer
side that claims a cold item records its consumer's node id in the item's wants set; the
claimant, once its entry is READY (:meth:`FleetSide.ready`), takes that set and announces the
entry to exactly those consumers (``ProducerNode.announce(to=...)``), so that a waiter whose
session with the claimant is up reads it on the offer, with no request (a fetch with no ticket
reads an offer of its item: ``ectransport.session.consumer_offers``). Both run on a background
thread; a want that arrives late, or an offer that does, only means a fetch with a request.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ectransport.errors import ConfigError
from ectransport.fleet import Acquired, Acquisition, Directory, Holder, LookupBatcher, wants
from ectransport.fleet.filter import TrustPredicate, trust_any
from ectransport.node.common import Layout
from ectransport.vllm.announcement import TRANSPORT, Announcement
from ectransport.vllm.settings import Settings
from ectransport.vllm.trust import ProducerKeys

log = logging.getLogger("ectransport.vllm.fleet")

#: The reserved key of a request's ``ec_transfer_params`` at a producer: the consumer(s) the
#: announcements of the request are offered to (node id or CURVE key, or a list; ECTP v2 §10.4).
OFFER_TO = "ect_offer_to"


class Verdict(enum.Enum):
    PENDING = "pending"
    FETCH = "fetch"
    ENCODE = "encode"
    LOCAL = "local"


@dataclass(frozen=True)
class Decision:
    """What to do with one item: ``verdict``, the ``holders`` to fetch from (FETCH), why
    (``detail``: LOCAL)."""

    verdict: Verdict
    holders: tuple[Holder, ...] = ()
    detail: str = ""


PENDING = Decision(Verdict.PENDING)

#: The directory counters :meth:`FleetSide.interval_stats` reports (``Directory.stats()`` names):
#: items found held (``hits``) or not (``misses``), lookups it could not answer, claims by outcome.
INTERVAL_COUNTERS = ("hits", "misses", "unavailable", "claims_won", "claims_lost",
                     "claims_waited", "claims_expired", "claims_wait_timeout", "claims_released")


def fleet_trust(keys: ProducerKeys, *, fetches: bool) -> TrustPredicate:
    """The holders a directory lookup may return (module docstring): the explicit
    ``producer_keys``, or any key with a certificate when fleet trust admits by certificate (the
    Welcome's certificate is then verified). ``fetches``: this instance fetches from holders
    (else it only names them to the orchestrator, whose consumer checks its own keys).

    Raises:
        ConfigError: an instance that fetches, with no explicit key and no certificate trust.
    """
    if not fetches:
        return trust_any
    if keys.announced and not keys.certificates:
        raise ConfigError("the fleet directory's holders are trusted by producer_keys (keys, "
                          "key files or directories) or by fleet trust certificates, never by "
                          "\"announced\": set producer_keys to the fleet's producer keys")

    def trusted(public_key: str, cert: bytes | None) -> bool:
        if not keys.announced and keys.listed(public_key):
            return True
        return bool(keys.certificates and cert)

    return trusted


class FleetSide:
    """The fleet directory of one vLLM instance's scheduler (module docstring).

    Args:
        settings: the connector settings (``fleet_*`` keys: ``common.fleet``).
        layout: the instance's layout (compatibility hash, entry sizes).
        directory: the producer node's directory (roles that encode: it publishes and
            claims), or None: a lookup-only directory is built (``ec_consumer``).
        trusted: the holders' trust predicate (:func:`fleet_trust`).
        claims: claim cold items before encoding them (roles that encode and publish).
        encoding: hands a claim this instance won to its producer node (released when the
            entry is published or given up).
        consumer_id: this instance's consumer node id, recorded as a want of the cold items it
            claims (None: no consumer side, nothing recorded).
        offer: ``(mm_hash, consumers)`` announces an entry to those consumers (the producer
            node's ``announce(mm_hash, to=consumers)``; None: no producer side).
    """

    def __init__(self, settings: Settings, layout: Layout, *, directory: Directory | None,
                 trusted: TrustPredicate, claims: bool,
                 encoding: Callable[[Any], None] | None = None,
                 consumer_id: str | None = None,
                 offer: Callable[[str, list[str]], Any] | None = None):
        fleet = settings.common.fleet
        self.settings = fleet
        self.own = directory is None
        self.directory = directory if directory is not None else Directory(
            fleet, trusted=trusted, compat_hash=layout.compat_hash)
        self.batcher = LookupBatcher(self.directory, answer_ttl_s=max(0.5, fleet.liveness_ttl_s / 3))
        self.claims = claims
        self.encoding = encoding
        self._claims: dict[str, tuple[cf.Future[Acquisition], float]] = {}
        self._encoding: dict[str, float] = {}  # mm_hash -> until: claimed and encoding here
        self._asked: dict[str, float] = {}  # mm_hash -> first asked (pending lookups)
        #: what an ``ec_producer`` found held elsewhere (holder, when found): announced for the
        #: request instead. A new request trusts it only as long as a lookup answer is reused
        #: (``answer_ttl_s``: a third of ``liveness_ttl_s``), then the item is looked up again,
        #: so a holder that died is named at most until its liveness lapses from the directory
        #: (``liveness_ttl_s``) and that answer ages out
        self.remote: dict[str, tuple[Holder, float]] = {}
        self.outcomes: dict[str, int] = {}
        self._outcomes_lock = threading.Lock()  # abandoned claims are counted on other threads
        self.consumer_id = consumer_id
        self.offer = offer
        self._background: cf.ThreadPoolExecutor | None = None  # wants: never the scheduler's
        self._interval_at = float("-inf")  # interval_stats: when last computed, and what
        self._interval_last: dict[str, Any] = {"counts": {}, "buckets": [], "sum_s": 0.0}
        #: the longest an item waits for the directory before it is encoded locally, s
        self.max_pending_s = fleet.claim_wait_s + 2 * fleet.lookup_timeout_s + \
            fleet.connect_timeout_s + 1.0

    def _count(self, what: str) -> None:
        with self._outcomes_lock:
            self.outcomes[what] = self.outcomes.get(what, 0) + 1

    # -- the decision ----------------------------------------------------------------------
    def decide(self, mm_hash: str, nbytes: int, now: float) -> Decision:
        """What to do with ``mm_hash`` (``nbytes``: its size here) now; never blocks."""
        until = self._encoding.get(mm_hash)
        if until is not None:
            if now < until:
                return Decision(Verdict.LOCAL, detail="encoding here")  # vLLM dedups the encode
            del self._encoding[mm_hash]
        claim = self._claims.get(mm_hash)
        if claim is not None:
            return self._claimed(mm_hash, claim[0], now - claim[1])
        holders = self.batcher.result(mm_hash)
        if holders is None:
            asked = self._asked.setdefault(mm_hash, now)
            if now - asked > self.max_pending_s:  # no answer at all: never wait longer
                self._asked.pop(mm_hash, None)
                self._count("local:no_answer")
                return Decision(Verdict.LOCAL, detail="no answer from the fleet directory")
            self.batcher.want(mm_hash, nbytes)
            return PENDING
        self._asked.pop(mm_hash, None)
        if holders:
            self._count("found")
            return Decision(Verdict.FETCH, tuple(holders))
        if not self.claims or self.batcher.last_unavailable is not None:
            why = str(self.batcher.last_unavailable or "no holder in the fleet")
            self._count("local:miss" if self.batcher.last_unavailable is None else
                        "local:unavailable")
            return Decision(Verdict.LOCAL, detail=why)
        fut = self.directory.submit_claim_or_wait(mm_hash, nbytes=nbytes)
        self._claims[mm_hash] = (fut, now)
        if self.consumer_id is not None:  # if another instance encodes it: offer it to us
            me, ttl_s = self.consumer_id, self.max_pending_s
            self._in_background(lambda: wants.want(self.directory, mm_hash, me, ttl_s))
        return self._claimed(mm_hash, fut, 0.0)

    def _claimed(self, mm_hash: str, fut: cf.Future[Acquisition], age_s: float) -> Decision:
        if not fut.done():
            if age_s > self.max_pending_s:
                del self._claims[mm_hash]
                self._abandon(mm_hash, fut)
                self._count("local:no_answer")
                return Decision(Verdict.LOCAL, detail="no answer to the claim in time")
            return PENDING
        del self._claims[mm_hash]
        got = fut.result()
        if got.outcome is Acquired.FOUND:
            self._count("found_after_wait" if got.waited_s > 0 else "found")
            self.batcher.forget(mm_hash)
            return Decision(Verdict.FETCH, got.holders)
        if got.outcome is Acquired.ENCODE and got.claim is not None:
            self._count("claimed")
            if self.encoding is not None:
                self.encoding(got.claim)
            self._encoding[mm_hash] = self.batcher.clock() + got.claim.ttl_s
            return Decision(Verdict.ENCODE)
        self._count("local:claim_wait" if got.unavailable is None else "local:unavailable")
        return Decision(Verdict.LOCAL, detail=got.detail)

    def admit_encoder(self, request: Any, num_computed_tokens: int, now: float,
                      held_here: Callable[[str], bool], block_bytes: int) -> bool:
        """``ensure_cache_available`` of an ``ec_producer`` (no consumer side): an item some
        other instance holds is not encoded here — it is announced at ``request_finished`` with
        that holder's address (:attr:`remote`, :func:`holder_announcement`); a cold one is
        claimed first (this instance then encodes it, or waits for the claimant's entry). True
        once no item waits for the directory."""
        pending = False
        for feature in getattr(request, "mm_features", None) or ():
            pos = feature.mm_position
            mm_hash = feature.identifier
            if pos.offset + pos.length <= num_computed_tokens or held_here(mm_hash):
                continue
            found = self.remote.get(mm_hash)
            if found is not None and now - found[1] <= self.batcher.answer_ttl_s:
                continue
            d = self.decide(mm_hash, int(pos.get_num_embeds()) * block_bytes, now)
            if d.verdict is Verdict.PENDING:
                pending = True  # (a stale holder is not named meanwhile: the request waits)
            elif d.verdict is Verdict.FETCH:
                self.remote[mm_hash] = (d.holders[0], now)
            else:
                self.remote.pop(mm_hash, None)  # encoded here after all
        return not pending

    def remote_holder(self, mm_hash: str) -> Holder | None:
        """The holder an ``ec_producer`` found for ``mm_hash`` elsewhere (its encoder skipped)."""
        got = self.remote.get(mm_hash)
        return got[0] if got is not None else None

    def fetched(self, mm_hash: str, ok: bool) -> None:
        """The fetch from the fleet ended (``ok``: landed); after a miss of every holder the
        next lookup asks the directory again."""
        self._count("fetched" if ok else "fetch_missed")
        if not ok:
            self.batcher.forget(mm_hash)

    def ready(self, mm_hash: str) -> None:
        """The producer committed ``mm_hash`` (READY). If this instance claimed it, the
        consumers the directory says wait for it are offered it (module docstring); on a
        background thread, never blocking."""
        if mm_hash not in self._encoding or self.offer is None:
            return
        offer, me = self.offer, self.consumer_id

        def offer_to_waiters() -> None:
            names = wants.take_wants(self.directory, mm_hash)
            if not isinstance(names, list):
                return  # the directory did not answer: they fetch with a request
            names = [n for n in names if n != me]
            if names:
                offer(mm_hash, names)
                self._count("offered_waiters")

        self._in_background(offer_to_waiters)

    def _in_background(self, fn: Callable[[], Any]) -> None:
        if self._background is None:
            self._background = cf.ThreadPoolExecutor(1, thread_name_prefix="ect-fleet-wants")
        try:
            self._background.submit(_logged, fn)
        except RuntimeError:  # closed
            pass

    def step(self, now: float) -> None:
        """Once per scheduler step: this step's lookups as one pipeline; state nobody asks for
        any more pruned (a claim won for a request that went away is given back)."""
        self.batcher.flush()
        # a request admitted on a holder keeps it until request_finished (a few steps); one
        # admitted later looks the item up again (admit_encoder)
        keep_s = 2 * self.settings.liveness_ttl_s
        for m in [m for m, (_, t) in self.remote.items() if now - t > keep_s]:
            del self.remote[m]
        for m in [m for m, t in self._asked.items() if now - t > self.max_pending_s]:
            del self._asked[m]
        for m in [m for m, t in self._encoding.items() if now >= t]:
            del self._encoding[m]
        for m, (fut, t) in list(self._claims.items()):
            if fut.done() and now - t > self.max_pending_s:
                del self._claims[m]
                self._abandon(m, fut)

    def _abandon(self, mm_hash: str, fut: cf.Future[Acquisition]) -> None:
        """Nobody waits for this claim attempt any more: a claim it won (now, or later — the
        attempt may still be polling on the directory's thread) is given back, unless the
        item was published meanwhile (the publication released it). Never blocks: the release
        is queued on the directory's holder thread."""

        def give_back(done: cf.Future[Acquisition]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            claim = done.result().claim
            if claim is not None and not self.own and mm_hash not in self.directory.held():
                self._count("claims_abandoned")
                self.directory.unpublish(mm_hash, claim=claim)

        fut.add_done_callback(give_back)

    def interval_stats(self, now: float, min_interval_s: float = 1.0) -> dict[str, Any] | None:
        """What moved since the last call (vLLM's per-interval connector stats), at most once
        per ``min_interval_s`` (None before that, or when nothing moved):
        ``{"counts": {name: n}, "lookup_buckets": [n per bucket of
        ectransport.fleet.stats.LOOKUP_BUCKETS_S, then +Inf], "lookup_sum_s": s}``. Counts:
        the directory's :data:`INTERVAL_COUNTERS` and this side's decisions as
        ``decision:<outcome>``."""
        if now - self._interval_at < min_interval_s:
            return None
        self._interval_at = now
        snap = self.directory.stats()
        counts = {k: int(snap.get(k, 0)) for k in INTERVAL_COUNTERS}
        counts.update({f"decision:{k}": n for k, n in self.outcome_counts().items()})
        hist, sum_s = self.directory.stats_.histogram()
        cumulative = [n for _, n in hist]
        buckets = [b - a for a, b in zip([0, *cumulative], cumulative)]
        last = self._interval_last
        self._interval_last = {"counts": counts, "buckets": buckets, "sum_s": sum_s}
        delta = {k: n - last["counts"].get(k, 0) for k, n in counts.items()}
        delta = {k: n for k, n in delta.items() if n}
        dbuckets = [n - (last["buckets"][i] if i < len(last["buckets"]) else 0)
                    for i, n in enumerate(buckets)]
        if not delta and not any(dbuckets):
            return None
        return {"counts": delta, "lookup_buckets": dbuckets,
                "lookup_sum_s": sum_s - float(last["sum_s"])}

    def outcome_counts(self) -> dict[str, int]:
        """A copy of :attr:`outcomes` (any thread): what this side decided, by outcome."""
        with self._outcomes_lock:
            return dict(self.outcomes)

    def stats(self) -> dict[str, float]:
        """The directory's counters (``hits``, ``misses``, ``claims_*``, ``lookup_p50_s``...)
        and this side's outcomes (``found``, ``claimed``, ``local:*``, ``fetched``...)."""
        return {**self.directory.stats(),
                **{f"vllm_{k}": v for k, v in self.outcome_counts().items()}}

    def close(self) -> None:
        if self._background is not None:
            self._background.shutdown(wait=False, cancel_futures=True)
        if self.own:
            self.directory.close()


def _logged(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a hint lost: the waiters fetch with a request
        log.warning("EC fleet: recording or offering to waiting consumers failed",
                    exc_info=True)


def holder_announcement(h: Holder, layout: Layout, settings: Settings) -> dict[str, Any]:
    """``ec_transfer_params`` entry naming fleet holder ``h`` (an ``ec_producer`` that found the
    item held elsewhere and skipped its encoder): the consumer fetches from ``h`` with a request
    (no hold, no ticket) and checks ``h``'s key against its own ``producer_keys``."""
    return Announcement(peer_host=h.host, peer_port=h.port, size_bytes=h.nbytes,
                        shape=[h.nbytes // layout.block_bytes, layout.hidden],
                        dtype=layout.dtype, public_key=h.public_key,
                        planes=list(settings.planes), versions=list(settings.versions),
                        producer_id=h.instance, transport=TRANSPORT).to_params()


def offer_targets(request: Any) -> list[str] | None:
    """The consumers a producer's request names for its announcements (:data:`OFFER_TO`), or
    None (broadcast, or none: the producer's ``broadcast_offers``)."""
    params = getattr(request, "ec_transfer_params", None)
    if not isinstance(params, dict):
        return None
    to = params.get(OFFER_TO)
    if isinstance(to, str) and to:
        return [to]
    if isinstance(to, list) and all(isinstance(x, str) and x for x in to) and to:
        return list(to[:64])
    return None
