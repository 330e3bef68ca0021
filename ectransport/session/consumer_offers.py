"""ECTP v2 §10 at the consumer: the offers of announced entries a session holds, read with no
request.

A session that asked for ``"offers"`` in its Hello and was granted them in the Welcome sends a
``Sync`` (its clock) once bound and every :data:`SYNC_INTERVAL_S`; the producer sends an
``Offer`` for every entry it announces and holds (and, at the first ``Sync``, for every live
hold). :class:`OfferTable` keeps each usable offer item — keyed by hold id, at most
:data:`MAX_OFFERS` and :data:`MAX_OFFER_BYTES`, dropped once its window is over — and answers
whether a fetch given a :class:`~ectransport.protocol.Ticket` may read at once
(:meth:`OfferTable.lookup`). The read then runs as a granted one (validity window, ``XferDone``
after the READ, quarantine on timeout). Anything else — no offer yet, another mm_hash, a producer
other than the ticket's, a window too short to read in (:data:`MIN_OFFER_LEFT_S`) — is fetched
with a request. A fetch with no ticket reads the newest usable offer of its mm_hash this session
holds, if any: the producer offered it to this session (a consumer it names in a targeted
announcement, e.g. one the fleet directory says waits for the entry, may be told nothing else);
it is the same hold and the same window a ticket would name.

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
from dataclasses import dataclass

from ectransport.protocol import Grant, Offer, Ticket
from ectransport.session.fetch import grant_problem
from ectransport.store import BlockStore

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


class OfferTable:
    """The offers one consumer session holds (module docstring). ``on``: the Welcome granted
    offers on the current connection; ``next_sync``: when the next ``Sync`` is due (None: never)."""

    def __init__(self, validity_margin_s: float):
        self.validity_margin_s = validity_margin_s
        self.on = False
        self.next_sync: float | None = None
        self._offers: collections.OrderedDict[int, OfferRecord] = collections.OrderedDict()
        self._newest: dict[str, int] = {}  # mm_hash -> hold id of its newest offer
        self._syncs: collections.deque[float] = collections.deque(maxlen=MAX_SYNCS)
        self._bytes = 0
        self._next_prune = 0.0
        #: fetches started on an offer, and tickets that fell back to a request (by why)
        self.reads = 0
        self.fallbacks: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._offers)

    def start(self, granted: bool) -> None:
        """A new binding: forget every offer and anchor; ``granted``: offers are on."""
        self.stop()
        self._syncs.clear()
        self.on = granted

    def stop(self) -> None:
        self.on = False
        self.next_sync = None
        self._offers.clear()
        self._newest.clear()
        self._bytes = 0

    def synced(self, now: float) -> None:
        """A ``Sync`` stamped ``now`` is being sent: an anchor offers may name."""
        self._syncs.append(now)
        self.next_sync = now + SYNC_INTERVAL_S

    def prune(self, now: float) -> None:
        """Drop offers whose window is over (a scan at most every :data:`PRUNE_S`)."""
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_S
        for hid in [h for h, r in self._offers.items() if r.usable_until <= now]:
            self._drop(hid)

    def accept(self, msg: Offer, now: float, plane: str | None,
               store: BlockStore) -> list[tuple[str, str, int]]:
        """Keep the usable items of ``msg`` (its session id already checked); returns what was
        ignored, as ``(why, detail, items)``: ``offer_bad_anchor``, ``bad_offer``."""
        if not self.on or msg.anchor not in self._syncs:
            return [("offer_bad_anchor", "an Offer anchored on no Sync of this session (or "
                     "offers not granted)", len(msg.items))]
        ignored: list[tuple[str, str, int]] = []
        for it in msg.items:
            g = it.grant
            bad = grant_problem(g, plane, store)
            if not bad and it.valid_s > g.lease_s + max(0.0, now - msg.anchor) + 1.0:
                # a hold lasts at most its length after the announcement, which came after
                # the anchor's Sync was received: a longer claim is not believed
                bad = f"valid {it.valid_s} s after its anchor, beyond its {g.lease_s} s hold"
            if bad:
                ignored.append(("bad_offer", f"an offer for {it.mm_hash[:12]!r}: {bad}", 1))
                continue
            margin = min(self.validity_margin_s, g.lease_s / 4) + DRIFT_ALLOWANCE * it.valid_s
            until = msg.anchor + it.valid_s - margin
            old = self._offers.get(g.grant_id)
            if until <= now or (old is not None and old.usable_until >= until
                                and old.mm_hash == it.mm_hash):
                continue  # nothing new (a hold never shortens)
            self._drop(g.grant_id)
            self._offers[g.grant_id] = OfferRecord(it.mm_hash, g, until)
            self._newest[it.mm_hash] = g.grant_id
            self._bytes += len(g.plane_grant)
            while self._offers and (len(self._offers) > MAX_OFFERS
                                    or self._bytes > MAX_OFFER_BYTES):
                self._drop(next(iter(self._offers)))
        return ignored

    def lookup(self, mm_hash: str, ticket: Ticket | None, producer_id: str,
               now: float) -> OfferRecord | None:
        """The usable offer ``ticket`` names for ``mm_hash`` from producer ``producer_id``, or
        None (a fallback to a request, counted in :attr:`fallbacks` by why). With no ticket,
        the newest usable offer of ``mm_hash`` (module docstring), or None (not counted)."""
        if ticket is None:
            return self._untargeted(mm_hash, now)
        if ticket.hold_id == 0:
            return None
        rec = self._offers.get(ticket.hold_id)
        why = ""
        if ticket.mm_hash != mm_hash or (producer_id and ticket.producer != producer_id):
            why = "foreign_ticket"
        elif not self.on:
            why = "no_offers"
        elif rec is None:
            why = "not_offered"
        elif rec.mm_hash != mm_hash:
            why = "other_entry"
        elif rec.usable_until - now < MIN_OFFER_LEFT_S:
            why = "window_over"
        if why:
            self.fallbacks[why] += 1
            return None
        self.reads += 1
        return rec

    def _untargeted(self, mm_hash: str, now: float) -> OfferRecord | None:
        hid = self._newest.get(mm_hash)
        rec = self._offers.get(hid) if hid is not None and self.on else None
        if rec is None or rec.usable_until - now < MIN_OFFER_LEFT_S:
            return None
        self.reads += 1
        return rec

    def _drop(self, hold_id: int) -> None:
        rec = self._offers.pop(hold_id, None)
        if rec is not None:
            self._bytes -= len(rec.grant.plane_grant)
            if self._newest.get(rec.mm_hash) == hold_id:
                del self._newest[rec.mm_hash]
