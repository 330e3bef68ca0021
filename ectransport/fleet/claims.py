"""Claims: no two instances of a fleet encode the same cold item at once.

The first instance that needs an item nobody holds claims it (``SET <claim key> <record> NX PX
claim_ttl_s``); the others wait for it to become ready, up to ``claim_wait_s``, then encode
themselves. The claimant renews its claim every third of its TTL while it encodes
(:class:`~ectransport.fleet.keeper.ClaimKeeper`), so a slow encode keeps it; when the claimant
dies, its claim is released for the waiters **either** way, whichever comes first:

- the claim expires (``claim_ttl_s`` after its last renewal): the next waiter's ``SET NX`` wins;
- the claimant's liveness record lapses (``liveness_ttl_s`` after its last renewal) or names
  another incarnation (it restarted): a waiter sees it in the same round trip as the claim and
  takes the claim over with a compare-and-set on the dead claimant's value (``TAKE_OVER``).

Either way exactly one waiter wins (``SET NX`` and the compare-and-set are atomic; the others
then see a live claimant's claim and keep waiting for its encode), and every wait still ends at
``claim_wait_s``. Waiters learn of readiness by **polling** the item (holders and claim in one
round trip, 5 ms doubling to ``claim_poll_max_s``) rather than by pub/sub: no extra connection
per instance, no window between subscribing and checking in which a notification is lost, the
same behaviour on Redis, Valkey and a cluster, and nothing to re-subscribe after an outage; the
cost is at most one round trip per ``claim_poll_max_s`` per waiting item, and up to that much
latency to notice.

A claim's value is a :class:`ClaimRecord` with a random token; releasing, renewing and taking
over compare it (a script), so an instance never removes or extends a claim that expired and
was re-taken by another.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from ectransport.fleet import client as rc
from ectransport.fleet import scripts
from ectransport.fleet.filter import InstanceView, Policy
from ectransport.fleet.health import Health
from ectransport.fleet.keeper import ClaimKeeper
from ectransport.fleet.keys import Keyspace, valid_mm_hash
from ectransport.fleet.outcomes import (
    Acquired,
    Acquisition,
    Claim,
    ClaimLost,
    ClaimOutcome,
    DirectoryUnavailable,
    Lookup,
    UnavailableReason,
)
from ectransport.fleet.records import ClaimRecord, Rejected, decode, encode
from ectransport.fleet.stats import FleetStats
from ectransport.settings_schema import FleetSettings

_FIRST_POLL_S = 0.005


class Claims:
    """The claim calls of :class:`~ectransport.fleet.Directory` (a mixin: it provides the
    clients, the counters and the one-round-trip ``_lookup``)."""

    settings: FleetSettings
    keys: Keyspace
    instance: str
    incarnation: str
    health: Health
    stats_: FleetStats
    clock: Callable[[], float]
    _fast: Any
    _slow: Any
    _policy: Policy
    _closed: Any
    _keeper: ClaimKeeper
    _view: InstanceView
    _view_lock: Any

    def _lookup(
        self,
        asked: list[str],
        nbytes: Mapping[str, int] | None,
        claim: tuple[str, bytes, int, bytes | None] | None,
    ) -> tuple[Lookup, Any]:
        raise NotImplementedError

    def _vouched(self) -> bool:
        """Whether this instance's liveness record is written (its claims say so)."""
        raise NotImplementedError

    def _need_trust(self) -> None:
        raise NotImplementedError

    # -- claims --------------------------------------------------------------------------------
    def _claim_value(self) -> tuple[str, bytes]:
        token = secrets.token_hex(16)
        return token, encode(
            ClaimRecord(
                v=1,
                instance=self.instance,
                incarnation=self.incarnation,
                token=token,
                taken_ms=int(time.time() * 1000),
                liveness=self._vouched(),
            )
        )

    def claim(self, mm_hash: str, ttl_s: float | None = None) -> ClaimOutcome:
        """Try to become the one instance that encodes ``mm_hash`` (``SET NX PX``).

        Returns:
            :class:`Claim` (won: encode, then ``publish(..., claim=c)`` or
            :meth:`release_claim`; renewed meanwhile), :class:`ClaimLost` (another instance
            holds it) or :class:`DirectoryUnavailable` — the last two are falsy.
        """
        ttl = ttl_s or self.settings.claim_ttl_s
        if not valid_mm_hash(mm_hash):
            return DirectoryUnavailable(UnavailableReason.ERROR, "invalid mm_hash")
        token, raw = self._claim_value()
        outcome = self._call(
            self._fast,
            lambda p: (
                p.set(self.keys.claim(mm_hash), raw, nx=True, px=int(ttl * 1000)),
                p.get(self.keys.claim(mm_hash)),
            ),
        )
        if isinstance(outcome, DirectoryUnavailable):
            return outcome
        won, current = outcome
        if won:
            self.stats_.add("claims_won")
            c = Claim(mm_hash, token, ttl, raw)
            self._keeper.track(c)
            return c
        self.stats_.add("claims_lost")
        return ClaimLost(mm_hash, _claimant(current))

    def release_claim(self, claim: Claim) -> bool:
        """Give up a claim won by :meth:`claim` (only if it is still ours; no longer renewed);
        True if released."""
        self._keeper.forget(claim)
        out = self._call(
            self._slow,
            lambda p: (
                scripts.run(p, scripts.DELETE_IF, (self.keys.claim(claim.mm_hash),), claim.raw),
            ),
        )
        ok = not isinstance(out, DirectoryUnavailable) and out[0] == 1
        if ok:
            self.stats_.add("claims_released")
        return ok

    def renew_claim(self, claim: Claim, ttl_s: float | None = None) -> bool:
        """Extend a claim still ours to ``ttl_s`` (default its own) from now; True if renewed.
        (Claims won here are renewed in the background already; this is for callers that
        hold a claim longer than that.)"""
        ttl = ttl_s or claim.ttl_s
        out = self._call(
            self._slow,
            lambda p: (
                scripts.run(
                    p,
                    scripts.RENEW_IF,
                    (self.keys.claim(claim.mm_hash),),
                    claim.raw,
                    int(ttl * 1000),
                ),
            ),
        )
        ok = not isinstance(out, DirectoryUnavailable) and out[0] == 1
        if ok:
            self.stats_.add("claims_renewed")
        return ok

    def _call(self, client: Any, build: Callable[[Any], tuple[Any, ...]]) -> Any:
        """One pipeline round trip; its replies, or the typed outcome of its failure."""
        if self._closed.is_set():
            return DirectoryUnavailable(UnavailableReason.CLOSED)
        blocked = self.health.blocked(self.clock())
        if blocked is not None:
            return blocked
        try:
            pipe = client.pipeline(transaction=False)
            build(pipe)
            replies = pipe.execute()
        except Exception as exc:
            outcome = rc.classify(exc)
            if outcome.reason is not UnavailableReason.ERROR:
                self.health.failed(outcome, self.clock())
            return outcome
        self.health.succeeded()
        return replies

    def claim_or_wait(
        self,
        mm_hash: str,
        *,
        nbytes: int | None = None,
        ttl_s: float | None = None,
        max_wait_s: float | None = None,
    ) -> Acquisition:
        """Find holders of ``mm_hash``, or win its claim, or wait for the claimant's entry.

        Each attempt is one round trip (the item's holders, ``SET NX PX`` of its claim — or the
        compare-and-set that takes over a dead claimant's —, the claim's value, the live
        instances): holders found → ``FOUND`` (a claim won in the same round trip is released);
        claim won → ``ENCODE`` (the claim is renewed until it is published or released); the
        claim is this instance's own (won by an earlier call, still encoding) → ``ENCODE`` with
        that claim; else the claim is someone else's and the item is polled again (5 ms,
        doubling to ``claim_poll_max_s``) until a holder appears (``FOUND``), the claim is
        released (its claimant's claim expired, or its liveness record lapsed: the next attempt
        may win it, at once), or ``max_wait_s`` (default ``claim_wait_s``) passes →
        ``ENCODE_LOCALLY``. A directory that cannot answer → ``ENCODE_LOCALLY`` at once.
        """
        self._need_trust()
        ttl = ttl_s or self.settings.claim_ttl_s
        wait = self.settings.claim_wait_s if max_wait_s is None else max_wait_s
        t0 = self.clock()
        deadline = t0 + wait
        pause = _FIRST_POLL_S
        seen_claim, waited = False, False
        lapsed: bytes | None = None  # the value of a claim whose claimant's liveness lapsed
        expected = None if nbytes is None else {mm_hash: nbytes}
        while True:
            token, raw = self._claim_value()
            found, claimed = self._lookup(
                [mm_hash], expected, (mm_hash, raw, int(ttl * 1000), lapsed)
            )
            now = self.clock()
            if found.unavailable is not None:
                return Acquisition(
                    Acquired.ENCODE_LOCALLY,
                    waited_s=now - t0,
                    detail=str(found.unavailable),
                    unavailable=found.unavailable,
                )
            won = bool(claimed and claimed[0])
            holders = found.get(mm_hash, [])
            if holders:
                if won:
                    self.release_claim(Claim(mm_hash, token, ttl, raw))
                if waited:
                    self.stats_.add("claims_waited")
                return Acquisition(Acquired.FOUND, holders=tuple(holders), waited_s=now - t0)
            if won:
                self.stats_.add("claims_won")
                if seen_claim:
                    self.stats_.add("claims_expired")
                if lapsed is not None:
                    self.stats_.add("claims_taken_over")
                c = Claim(mm_hash, token, ttl, raw)
                self._keeper.track(c)
                return Acquisition(Acquired.ENCODE, claim=c, waited_s=now - t0)
            current = claimed[1] if claimed else None
            state = self._claim_state(current)
            if state == "ours":
                mine = self._keeper.find(current)
                if mine is not None:  # this instance is encoding it under an earlier claim
                    return Acquisition(Acquired.ENCODE, claim=mine, waited_s=now - t0)
            lapsed = current if state == "lapsed" else None
            if not seen_claim:
                self.stats_.add("claims_lost")
                seen_claim = True
            if now >= deadline:
                self.stats_.add("claims_wait_timeout")
                return Acquisition(
                    Acquired.ENCODE_LOCALLY,
                    waited_s=now - t0,
                    detail=f"no holder within {wait:.3g} s (claimed by {_claimant(current)!r})",
                )
            waited = True
            nap = 0.0 if lapsed is not None else min(pause, max(0.0, deadline - now))
            if self._closed.wait(nap):
                why = DirectoryUnavailable(UnavailableReason.CLOSED)
                return Acquisition(Acquired.ENCODE_LOCALLY, detail=str(why), unavailable=why)
            if lapsed is None:
                pause = min(pause * 2, self.settings.claim_poll_max_s)

    def _claim_state(self, raw: object) -> str:
        """``ours`` (this incarnation's), ``live`` (its claimant's liveness record is live and
        of the claim's incarnation), ``lapsed`` (the record vouched for the claim and has
        lapsed, or names another incarnation: the claimant died or restarted) or ``unknown``
        (no claim, an unreadable one, or one no liveness record vouches for: only its expiry
        releases it). Judged on the live instances of the last round trip."""
        rec = decode(raw, ClaimRecord) if raw is not None else None
        if rec is None or isinstance(rec, Rejected):
            return "unknown"
        if rec.instance == self.instance and rec.incarnation == self.incarnation:
            return "ours"
        if not rec.liveness:
            return "unknown"
        with self._view_lock:
            live = self._view.live.get(rec.instance)
            known = rec.instance in self._view.known
        if live is not None and live.incarnation == rec.incarnation:
            return "live"
        return "lapsed" if known else "unknown"


def _claimant(raw: object) -> str:
    rec = decode(raw, ClaimRecord) if raw is not None else None
    return "" if rec is None or isinstance(rec, Rejected) else rec.instance
