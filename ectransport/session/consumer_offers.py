"""ECTP v2 §10 at the consumer: offers of announced entries, read with no request.

A session that asked for ``"offers"`` in its Hello and was granted them in the Welcome sends a
``Sync`` (its clock) once bound and every :data:`SYNC_INTERVAL_S`; the producer sends an
``Offer`` for every entry it announces and holds (and, at the first ``Sync``, for every live
hold). The consumer keeps each usable offer item — keyed by hold id, at most :data:`MAX_OFFERS`,
dropped once its window is over — and a fetch given a :class:`~ectransport.protocol.Ticket` of
this producer whose hold id it holds, for the same mm_hash, posts its READ at once: no request,
no answer to wait for. The read then runs as a granted one (validity window, ``XferDone`` after
the READ, quarantine on timeout). Anything else — no offer yet, another mm_hash, a producer other
than the ticket's, a window too short to read in (:data:`MIN_OFFER_LEFT_S`) — is fetched with a
request, as without a ticket.

**Window.** An item is usable until ``anchor + valid_s − margin`` on this consumer's clock, where
``anchor`` is the ``t`` of one of this session's own ``Sync`` frames (an offer naming any other
anchor is ignored) and ``margin = min(validity_margin_s, lease_s / 4)`` plus
:data:`DRIFT_ALLOWANCE` of the time since the anchor (clock rates of two hosts differ by parts per
million). The producer received that ``Sync`` after ``anchor``, and its hold lasts ``valid_s``
after it received it, so the window closes before the hold ends whatever the clocks' offsets
(ECTP v1 §6.3's rule, anchored on a moment this consumer chose). Offers are refused like grants:
wrong plane, layout or lease (:func:`~ectransport.session.fetch.grant_problem`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ectransport.protocol import FEATURE_OFFERS, Grant, Offer, Sync, Ticket, encode
from ectransport.session.commands import Command, Send
from ectransport.session.consumer_batches import ConsumerBatches
from ectransport.session.fetch import Fetch, FetchState, grant_problem

log = logging.getLogger("ectransport.session.consumer")

#: How often a session granted offers sends ``Sync``, seconds (bounds the clock drift a window
#: must allow for).
SYNC_INTERVAL_S = 30.0
#: ``Sync`` stamps remembered per session (an offer must name one of them as its anchor).
MAX_SYNCS = 8
#: Offer items kept per session (the oldest goes first).
MAX_OFFERS = 4096
#: Shortest window left for a READ to start on an offer, seconds; with less, a request is
#: faster than a READ that might finish after the window (then discarded and the producer
#: quarantined).
MIN_OFFER_LEFT_S = 1.0
#: Relative clock-rate difference allowed for, on the time since the anchor (100 ppm).
DRIFT_ALLOWANCE = 1e-4
#: Plane-grant bytes of the offers kept per session (the oldest go first): a hostile producer
#: cannot make a consumer hold more, whatever the grants' sizes and windows.
MAX_OFFER_BYTES = 64 << 20
#: How often expired offers are pruned, seconds (a scan of the table).
PRUNE_S = 0.5


@dataclass(frozen=True)
class OfferRecord:
    """A usable offer item: its mm_hash, its grant, and the end of its window (this consumer's
    clock, seconds)."""

    mm_hash: str
    grant: Grant
    usable_until: float


class ConsumerOffers(ConsumerBatches):
    """Offers of a consumer session (module docstring); derived by
    :class:`~ectransport.session.consumer.ConsumerSession`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._offers: collections.OrderedDict[int, OfferRecord] = collections.OrderedDict()
        self._syncs: collections.deque[float] = collections.deque(maxlen=MAX_SYNCS)
        self._offer_bytes = 0
        self._next_prune = 0.0
        #: fetches started on an offer, and tickets that fell back to a request (by why)
        self.offer_reads = 0
        self.offer_fallbacks: collections.Counter[str] = collections.Counter()

    @property
    def offers_held(self) -> int:
        """Offer items this session holds now (usable or not yet pruned)."""
        return len(self._offers)

    def _start_offers(self, features: list[str], now: float) -> list[Command]:
        """The session is bound: if offers were granted, send the first ``Sync``."""
        self._offers.clear()
        self._offer_bytes = 0
        self._syncs.clear()
        self.offers_on = (FEATURE_OFFERS in features and FEATURE_OFFERS in self._wants_offers()
                          and (self.version or 0) >= 2)
        if not self.offers_on:
            self._next_sync = float("inf")
            return []
        return self._sync(now)

    def _sync(self, now: float) -> list[Command]:
        self._syncs.append(now)
        self._next_sync = now + SYNC_INTERVAL_S
        return [Send(self.conn, encode(Sync(v=self.version or 2, session_id=self.session_id,
                                            t=max(0.0, now))))]

    def _stop_offers(self) -> None:
        self.offers_on = False
        self._offers.clear()
        self._offer_bytes = 0
        self._next_sync = float("inf")

    def _poll_offers(self, now: float) -> list[Command]:
        """Drop offers whose window is over (a scan every :data:`PRUNE_S`); send the periodic
        ``Sync``."""
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_S
            for hid in [h for h, r in self._offers.items() if r.usable_until <= now]:
                self._drop_offer(hid)
        if self.offers_on and now >= self._next_sync and self.welcomed:
            return self._sync(now)
        return []

    def _on_offer(self, msg: Offer, now: float) -> list[Command]:
        if msg.session_id != self.session_id:
            return self._ignore("offer_foreign_session", f"an Offer for session "
                                f"{msg.session_id[:32]!r}, not ours", len(msg.items))
        if not self.offers_on or msg.anchor not in self._syncs:
            return self._ignore("offer_bad_anchor", "an Offer anchored on no Sync of this "
                                "session (or offers not granted)", len(msg.items))
        for it in msg.items:
            g = it.grant
            bad = grant_problem(g, self.plane, self.store)
            if bad:
                self._ignore("bad_offer", f"an offer for {it.mm_hash[:12]!r}: {bad}")
                continue
            if it.valid_s > g.lease_s + max(0.0, now - msg.anchor) + 1.0:
                # a hold lasts at most its length after the announcement, which came after
                # the anchor's Sync was received: a longer claim is not believed
                self._ignore("bad_offer", f"an offer for {it.mm_hash[:12]!r} valid {it.valid_s} s "
                             f"after its anchor, beyond its {g.lease_s} s hold")
                continue
            margin = (min(self.config.validity_margin_s, g.lease_s / 4)
                      + DRIFT_ALLOWANCE * it.valid_s)
            until = msg.anchor + it.valid_s - margin
            old = self._offers.get(g.grant_id)
            if until <= now or (old is not None and old.usable_until >= until
                                and old.mm_hash == it.mm_hash):
                continue  # nothing new (a hold never shortens)
            self._drop_offer(g.grant_id)
            self._offers[g.grant_id] = OfferRecord(it.mm_hash, g, until)
            self._offer_bytes += len(g.plane_grant)
            while self._offers and (len(self._offers) > MAX_OFFERS
                                    or self._offer_bytes > MAX_OFFER_BYTES):
                self._drop_offer(next(iter(self._offers)))
        return []

    def _drop_offer(self, hold_id: int) -> None:
        rec = self._offers.pop(hold_id, None)
        if rec is not None:
            self._offer_bytes -= len(rec.grant.plane_grant)

    def _offer_for(self, mm_hash: str, ticket: Ticket | None, now: float) -> OfferRecord | None:
        """The usable offer a ticket names for ``mm_hash``, or None (counted by why)."""
        if ticket is None or ticket.hold_id == 0:
            return None
        why = ""
        rec = self._offers.get(ticket.hold_id)
        if ticket.mm_hash != mm_hash or (self.producer_id and ticket.producer != self.producer_id):
            why = "foreign_ticket"
        elif not self.offers_on:
            why = "no_offers"
        elif rec is None:
            why = "not_offered"
        elif rec.mm_hash != mm_hash:
            why = "other_entry"
        elif rec.usable_until - now < MIN_OFFER_LEFT_S:
            why = "window_over"
        if why:
            self.offer_fallbacks[why] += 1
            return None
        return rec

    def _read_offer(self, f: Fetch, rec: OfferRecord, now: float) -> list[Command]:
        """Start ``f`` (new, READY link) on an offer: as an OK answer arriving now, with the
        offer's window."""
        self.offer_reads += 1
        f.offer = True
        f.state = FetchState.WAITING_ACK
        f.req_sent = now
        f.timings["offer"] = now
        return self._use_grant(f, rec.grant, rec.usable_until, now)

    def _take_offers(self, fs: list[Fetch], tickets: Mapping[str, Ticket],
                     now: float) -> tuple[list[Fetch], list[Command]]:
        """Start the fetches of ``fs`` that a usable offer covers; return the others."""
        rest: list[Fetch] = []
        cmds: list[Command] = []
        for f in fs:
            rec = self._offer_for(f.mm_hash, tickets.get(f.mm_hash), now)
            if rec is None:
                rest.append(f)
            else:
                cmds += self._read_offer(f, rec, now)
        return rest, cmds
