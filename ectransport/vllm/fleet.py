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
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ectransport.errors import ConfigError
from ectransport.fleet import Acquired, Acquisition, Directory, Holder, LookupBatcher
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
    """

    def __init__(self, settings: Settings, layout: Layout, *, directory: Directory | None,
                 trusted: TrustPredicate, claims: bool,
                 encoding: Callable[[Any], None] | None = None):
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
        #: what an ``ec_producer`` found held elsewhere: announced for the request instead
        self.remote: dict[str, tuple[Holder, float]] = {}
        self.outcomes: dict[str, int] = {}
        #: the longest an item waits for the directory before it is encoded locally, s
        self.max_pending_s = fleet.claim_wait_s + 2 * fleet.lookup_timeout_s + \
            fleet.connect_timeout_s + 1.0

    def _count(self, what: str) -> None:
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
        return self._claimed(mm_hash, fut, 0.0)

    def _claimed(self, mm_hash: str, fut: cf.Future[Acquisition], age_s: float) -> Decision:
        if not fut.done():
            if age_s > self.max_pending_s:
                del self._claims[mm_hash]
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
            if pos.offset + pos.length <= num_computed_tokens or mm_hash in self.remote \
                    or held_here(mm_hash):
                continue
            d = self.decide(mm_hash, int(pos.get_num_embeds()) * block_bytes, now)
            if d.verdict is Verdict.PENDING:
                pending = True
            elif d.verdict is Verdict.FETCH:
                self.remote[mm_hash] = (d.holders[0], now)
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

    def step(self, now: float) -> None:
        """Once per scheduler step: this step's lookups as one pipeline; state nobody asks for
        any more pruned (a claim won for a request that went away is given back)."""
        self.batcher.flush()
        for m in [m for m, (_, t) in self.remote.items() if now - t > 60.0]:
            del self.remote[m]
        for m in [m for m, t in self._asked.items() if now - t > self.max_pending_s]:
            del self._asked[m]
        for m in [m for m, t in self._encoding.items() if now >= t]:
            del self._encoding[m]
        for m, (fut, t) in list(self._claims.items()):
            if fut.done() and now - t > self.max_pending_s:
                del self._claims[m]
                got = fut.result()
                if got.claim is not None and not self.own and m not in self.directory.held():
                    # won for nobody: given back by the directory's thread (never blocks here)
                    self.directory.unpublish(m, claim=got.claim)

    def stats(self) -> dict[str, float]:
        """The directory's counters (``hits``, ``misses``, ``claims_*``, ``lookup_p50_s``...)
        and this side's outcomes (``found``, ``claimed``, ``local:*``, ``fetched``...)."""
        return {**self.directory.stats(), **{f"vllm_{k}": v for k, v in self.outcomes.items()}}

    def close(self) -> None:
        if self.own:
            self.directory.close()


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
