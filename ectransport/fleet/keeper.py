"""``ClaimKeeper``: a claim this instance won stays alive while it encodes, and not longer.

A claim is taken with a short TTL (``claim_ttl_s``), so that the claim of an instance that dies
lapses soon and a waiter takes it over. An encode may take longer than that TTL: the keeper
renews every claim it tracks every third of its TTL (``RENEW_IF``: only while the claim's value
is still ours), on its own thread (``ect-fleet-claims-<instance>``, started with the first
claim), until the claim is handed back — published with its entry, given up, or released (the
callers :meth:`forget` it first) — or for ``max_hold_s`` at most. That bound
(``claim_wait_s``): by then every instance that was waiting when the claim was won has given up
waiting, and a claim its caller never hands back must not make the others wait for ever.

A renewal that finds the claim gone or someone else's (it lapsed during an outage and another
instance took it over) stops renewing it and counts ``claims_renewal_lost``; a renewal Redis
did not answer is tried again a third of the TTL later (the claim may lapse meanwhile: then at
worst two instances encode the item, never wrong bytes).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ectransport.fleet import scripts
from ectransport.fleet.keys import Keyspace
from ectransport.fleet.outcomes import Claim
from ectransport.fleet.stats import FleetStats

log = logging.getLogger("ectransport.fleet")


@dataclass
class _Kept:
    claim: Claim
    won_at: float
    due: float


class ClaimKeeper:
    """Renews the claims this instance is encoding under (module docstring; thread-safe).

    Args:
        client: the directory's background client (``op_timeout_s``).
        keys: the keyspace.
        stats: the directory's counters (``claims_renewed``, ``claims_renewal_lost``,
            ``claims_hold_expired``).
        max_hold_s: a claim is renewed for this long after it was won at most, s.
        name: the thread's name suffix (the instance).
    """

    def __init__(
        self, client: Any, keys: Keyspace, stats: FleetStats, max_hold_s: float, name: str = ""
    ):
        self.client, self.keys, self.stats = client, keys, stats
        self.max_hold_s = max_hold_s
        self._name = name
        self._cond = threading.Condition()
        self._kept: dict[str, _Kept] = {}  # token -> claim
        self._closed = False
        self._thread: threading.Thread | None = None

    def track(self, claim: Claim) -> None:
        """Renew ``claim`` from now on (it was just won)."""
        now = time.monotonic()
        with self._cond:
            if self._closed:
                return
            self._kept[claim.token] = _Kept(claim, now, now + claim.ttl_s / 3)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name=f"ect-fleet-claims-{self._name}"
                )
                self._thread.start()
            self._cond.notify_all()

    def forget(self, claim: Claim) -> None:
        """Stop renewing ``claim`` (it is being released, published or given up)."""
        with self._cond:
            self._kept.pop(claim.token, None)

    def find(self, raw: object) -> Claim | None:
        """The tracked claim whose value is ``raw``, if any."""
        with self._cond:
            for k in self._kept.values():
                if k.claim.raw == raw:
                    return k.claim
        return None

    def tracked(self) -> list[Claim]:
        """The claims renewed now."""
        with self._cond:
            return [k.claim for k in self._kept.values()]

    def close(self, timeout_s: float) -> list[Claim]:
        """Stop renewing; returns the claims that were still tracked (to release)."""
        with self._cond:
            self._closed = True
            left = [k.claim for k in self._kept.values()]
            self._kept.clear()
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        return left

    def release(self, claims: list[Claim]) -> None:
        """Give ``claims`` back now (closing: best effort, one round trip, never raises)."""
        if not claims:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for c in claims:
                scripts.run(pipe, scripts.DELETE_IF, (self.keys.claim(c.mm_hash),), c.raw)
            pipe.execute(raise_on_error=False)
        except Exception as exc:
            log.warning("fleet directory: could not release %d claim(s): %s", len(claims), exc)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for token, k in list(self._kept.items()):
                    if now - k.won_at >= self.max_hold_s:
                        del self._kept[token]
                        self.stats.add("claims_hold_expired")
                        log.warning(
                            "fleet directory: the claim on %r was held %.1f s without "
                            "being published or released; no longer renewed",
                            k.claim.mm_hash[:64],
                            now - k.won_at,
                        )
                due = [k for k in self._kept.values() if k.due <= now]
                if not due:
                    nxt = min((k.due for k in self._kept.values()), default=None)
                    self._cond.wait(None if nxt is None else max(0.0, nxt - now))
                    continue
            self._renew(due)

    def _renew(self, due: list[_Kept]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in due:
                c = k.claim
                scripts.run(
                    pipe,
                    scripts.RENEW_IF,
                    (self.keys.claim(c.mm_hash),),
                    c.raw,
                    int(c.ttl_s * 1000),
                )
            out = pipe.execute(raise_on_error=False)
        except Exception as exc:  # Redis unreachable: each is tried again a third later
            out = [exc] * len(due)
        now = time.monotonic()
        with self._cond:
            for k, reply in zip(due, out):
                if self._kept.get(k.claim.token) is not k:
                    continue  # handed back meanwhile
                if isinstance(reply, Exception):
                    k.due = now + k.claim.ttl_s / 3
                elif reply == 1:
                    self.stats.add("claims_renewed")
                    k.due = now + k.claim.ttl_s / 3
                else:  # lapsed (an outage longer than the TTL) and maybe taken over
                    del self._kept[k.claim.token]
                    self.stats.add("claims_renewal_lost")
