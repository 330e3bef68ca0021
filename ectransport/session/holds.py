"""ECTP v2 §10 at the producer: announced entries held and offered, read with no request.

:class:`HoldTable` is owned by a :class:`~ectransport.session.producer.ProducerSession`: it takes,
renews and ends holds (their pins charged in the session's ledger to :data:`HOLD_IDENTITY`); the
session sends the offers of the holds it hands back.

When the producer *announces* an entry (:meth:`ProducerSession.announce`: vLLM's
``ec_transfer_params``, or ``ProducerNode.announce``), it takes a **hold**: the entry is pinned for
``hold_s`` and described once on the hold plane (the first plane offered whose transfers the
consumer reads one-sidedly: ``offerable``), and every consumer session that was granted
``"offers"`` and has an anchor is sent an ``Offer`` with that grant. The announcement returns a
:class:`~ectransport.protocol.Ticket` — the producer's node id, the hold id and the mm_hash — for the
orchestrator to carry; a consumer that holds the offer for that id READs at once and sends
``XferDone`` after. The descriptors and NIXL metadata never leave the authenticated session.

Rules:

* **Anchor and window** (the validity rule of grants, ECTP v1 §6.3, for a grant nobody asked
  for). A session's anchor is the ``t`` of its newest ``Sync`` and the moment this producer
  received it. An offer item states ``valid_s = offered_until − (anchor received)``: the consumer
  uses it only until ``anchor.t + valid_s − margin`` on its own clock, which is before the hold
  ends whatever the two clocks' offsets. Offers go only to sessions with an anchor; the first
  ``Sync`` of a session is answered with offers of every live hold.
* **A hold ends at its deadline, never earlier** (no early release on a served read, unlike the
  hold of vLLM's announcement path): any session offered it may READ until the offered window
  closes, so a served read (``XferDone`` naming the hold) is counted, nothing more. The pin then
  stays for ``grace_s`` (a READ plane cannot revoke a read in flight; as a grant's grace period).
  Re-announcing a held entry extends its hold to ``now + hold_s`` and offers it again with the
  longer window (the hold's renewal).
* **Cap.** Holds (and their grace pins) may pin at most ``hold_share`` of the region; beyond it,
  or for an entry the hold plane cannot move, no hold is taken and consumers fetch the entry the v1
  way (a request). Without a hold plane, or with ``hold_share`` 0, the ticket's ``hold_id`` is 0.
* **Pending holds.** The hold id is chosen at the announcement, but the hold is taken only when
  the entry is READY *and* some session takes offers (granted, with an anchor) — an entry announced
  before its save landed, or while no consumer could be offered it, is not pinned for nobody; it is
  held at its commit or at the first ``Sync`` of a session, until ``hold_s`` after its (latest)
  announcement. At most :data:`MAX_PENDING_HOLDS` wait; beyond, the ticket's ``hold_id`` is 0.
* **A new Welcome** (a reconnect or a quarantine probe on the same connection) clears the
  session's anchor: the consumer forgot its offers, so its next first ``Sync`` replays them.
* **Targets.** An announcement may name the consumer(s) to offer the entry to (node ids or
  CURVE keys: ``to``); the hold then keeps them (:attr:`Hold.to`; re-announcing with another
  name adds it; one announcement naming none makes it a broadcast) and is taken only when one of
  them takes offers. Who is sent which offer is :mod:`.offering`'s rule.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ectransport.protocol import Grant
from ectransport.protocol.messages import MAX_GRANT_BYTES
from ectransport.session.commands import Command, Revoke
from ectransport.session.grants import Emit, PlaneFacts
from ectransport.session.pins import PinLedger
from ectransport.settings_schema import ProducerSettings
from ectransport.store import BlockStore

log = logging.getLogger("ectransport.session.producer")

#: The pin-budget identity that announcement holds are charged to (not a CURVE key or session id:
#: those never contain NUL).
HOLD_IDENTITY = "\x00holds"
#: Most entries announced before they were ready whose hold waits for their commit.
MAX_PENDING_HOLDS = 4096
#: Most consumers one hold may name.
MAX_TARGETS = 64

#: The consumers a hold is offered to: node ids or CURVE keys, or None (every session).
Targets = frozenset[str] | None
#: ``takers(targets) -> bool``: whether some session named by ``targets`` takes offers now.
Takers = Callable[[Targets], bool]


def joined(a: Targets, b: Targets) -> Targets:
    """The targets of a hold announced for ``a`` and then for ``b`` (None: everyone)."""
    if a is None or b is None:
        return None
    return frozenset(sorted(a | b)[:MAX_TARGETS])


@dataclass(eq=False)
class Hold:
    """One announcement hold: the pinned entry, its grant on the hold plane, and
    ``offered_until`` (session time): the end of the window its offers state (re-announcing moves
    it later, never earlier); ``to``: the consumers it is offered to (None: every session)."""

    hold_id: int
    mm_hash: str
    entry_id: int
    pinned_bytes: int
    offered_until: float
    grant: Grant
    served: int = 0
    to: Targets = None


class HoldTable:
    """Live and pending holds of a producer session (module docstring).

    Args:
        settings: hold_s, hold_share, grace_s. store / ledger: the session's.
        planes: plane facts by name; ``order``: the planes offered, best first (the hold plane
            is the first offerable one). rng / stats / emit: the session's.
    """

    def __init__(self, settings: ProducerSettings, store: BlockStore, ledger: PinLedger,
                 planes: dict[str, PlaneFacts], order: tuple[str, ...], rng: random.Random,
                 stats: dict[str, int], emit: Emit):
        self.settings = settings
        self.store = store
        self.ledger = ledger
        self.planes = planes
        self.rng = rng
        self.stats = stats
        self.emit = emit
        self._holds: dict[int, Hold] = {}
        self._hold_of: dict[str, int] = {}  # mm_hash -> live hold id
        #: mm_hash -> (hold id, give-up time, targets): announced, not held yet — not READY,
        #: or no session it is for takes offers now (a hold would pin for nobody)
        self._pending: dict[str, tuple[int, float, Targets]] = {}
        self.cap_bytes = int(store.region_bytes * max(0.0, settings.hold_share))
        self.plane = next((p for p in order if p in planes and planes[p].offerable), None)
        for k in ("holds", "hold_refused", "hold_expired", "hold_reads"):
            stats[k] = 0

    # -- queries -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._holds)

    def get(self, hold_id: int) -> Hold | None:
        return self._holds.get(hold_id)

    def held_bytes(self) -> int:
        """Bytes pinned by holds, their grace pins included (what the cap counts)."""
        return self.ledger.charged(HOLD_IDENTITY)

    def waits_for(self, mm_hash: str) -> bool:
        return mm_hash in self._pending

    def pending(self) -> list[str]:
        return list(self._pending)

    def live(self, now: float) -> list[Hold]:
        return [h for h in self._holds.values() if h.offered_until > now]

    def pins(self) -> list[tuple[str, int, str, int]]:
        """``(mm_hash, entry_id, identity, bytes)`` of every live hold's pin (for invariants)."""
        return [(h.mm_hash, h.entry_id, HOLD_IDENTITY, h.pinned_bytes)
                for h in self._holds.values()]

    # -- announcing ----------------------------------------------------------------------------
    def announce(self, mm_hash: str, now: float, takers: Takers,
                 to: Targets = None) -> tuple[int | None, list[Hold], list[Command]]:
        """Announce ``mm_hash`` for the consumers ``to`` (None: every session): hold it (or
        renew its hold). ``takers``: whether some session named by given targets takes offers
        now. Returns the hold id for the ticket (0: no hold can be taken; None: the entry is not
        in the store at all), the holds to offer now, and commands (a ``Revoke`` of a
        description refused)."""
        if self.store.get(mm_hash) is None:
            return None, [], []
        if self.plane is None or self.cap_bytes <= 0:
            return 0, [], []
        hid = self._hold_of.get(mm_hash)
        if hid is not None:  # renew: a longer window, offered again (to its new targets too)
            h = self._holds[hid]
            h.offered_until = max(h.offered_until, now + self.settings.hold_s)
            h.to = joined(h.to, to)
            return hid, [h], []
        pending = self._pending.get(mm_hash)
        if pending is None:
            if len(self._pending) >= MAX_PENDING_HOLDS:
                return 0, [], []
            pending = (self._new_id(), now + self.settings.hold_s, to)
        else:  # announced again before it was held: a later give-up time, more targets
            pending = (pending[0], max(pending[1], now + self.settings.hold_s),
                       joined(pending[2], to))
        self._pending[mm_hash] = pending
        taken, cmds = self.take_pending([mm_hash], now, takers)
        if pending[0] not in self._holds and mm_hash not in self._pending:
            return 0, taken, cmds  # refused (the cap): nothing will be offered
        return pending[0], taken, cmds

    def take_pending(self, mm_hashes: Collection[str], now: float,
                     takers: Takers) -> tuple[list[Hold], list[Command]]:
        """Take the pending holds of ``mm_hashes`` whose entries are READY, if some session they
        are for takes offers (``takers``; else they stay pending: no pin for nobody, until such a
        session's first ``Sync`` or their give-up time); drop those whose entry is gone or whose
        time is over."""
        taken: list[Hold] = []
        cmds: list[Command] = []
        for mm in list(mm_hashes):
            pending = self._pending.get(mm)
            if pending is None:
                continue
            entry = self.store.get(mm)
            if entry is None or now >= pending[1]:
                del self._pending[mm]
                continue
            if not entry.ready or not takers(pending[2]):
                continue
            del self._pending[mm]
            h, refused = self._take(mm, pending[0], now, pending[1], pending[2])
            cmds += refused
            if h is not None:
                taken.append(h)
        return taken, cmds

    def _new_id(self) -> int:
        pending = {h for h, _, _ in self._pending.values()}
        while True:
            hid = self.rng.getrandbits(63)
            if hid and hid not in self._holds and hid not in pending:
                return hid

    def _take(self, mm_hash: str, hold_id: int, now: float, until: float,
              to: Targets) -> tuple[Hold | None, list[Command]]:
        """Pin the READY entry ``mm_hash`` under a new hold offered until ``until`` and describe
        it; None (counted in ``hold_refused``) when the cap is reached or the plane cannot
        describe it (then a ``Revoke`` of a description refused for its size)."""
        plane = self.plane
        entry = self.store.get(mm_hash)
        if plane is None or entry is None or not entry.ready:
            return None, []
        facts = self.planes[plane]
        pinned = entry.num_blocks * self.store.block_bytes
        if (self.held_bytes() + pinned > self.cap_bytes
                or (facts.max_bytes is not None and entry.nbytes > facts.max_bytes)):
            self.stats["hold_refused"] += 1
            return None, []
        entry = self.store.pin_if_ready(mm_hash)
        assert entry is not None
        try:
            plane_grant = facts.describe(entry.runs, entry.nbytes)
        except Exception:  # a plane bug must not leak a pin or kill the node: no hold
            self.store.unpin(entry.mm_hash, entry.entry_id)
            log.exception("plane %s failed to describe a hold", plane)
            self.stats["hold_refused"] += 1
            return None, []
        if len(plane_grant) > MAX_GRANT_BYTES:  # described (registered), but unusable: revoke
            self.store.unpin(entry.mm_hash, entry.entry_id)
            self.stats["hold_refused"] += 1
            return None, [Revoke(plane, plane_grant)]
        grant = Grant(grant_id=hold_id, entry_bytes=entry.nbytes, num_blocks=entry.num_blocks,
                      block_bytes=self.store.block_bytes, lease_s=float(self.settings.hold_s),
                      plane=plane, plane_grant=plane_grant)
        h = Hold(hold_id, mm_hash, entry.entry_id, pinned, max(until, now + 1.0), grant, to=to)
        self._holds[hold_id] = h
        self._hold_of[mm_hash] = hold_id
        self.ledger.charge(HOLD_IDENTITY, pinned)
        self.stats["holds"] += 1
        self.emit("hold_taken", {"peer": "", "session_id": "", "mm_hash": mm_hash[:12],
                                 "grant_id": hold_id, "nbytes": entry.nbytes, "plane": plane})
        return h, []

    # -- reads and ends --------------------------------------------------------------------------
    def served(self, grant_id: int, mm_hash: str, ok: bool) -> bool:
        """A completion naming a hold of the same mm_hash: a served read, counted (the hold
        ends at its deadline all the same). False if it names no hold (then it is a grant's)."""
        h = self._holds.get(grant_id)
        if h is None or h.mm_hash != mm_hash:
            return False
        if ok:
            h.served += 1
            self.stats["hold_reads"] += 1
        return True

    def expire(self, now: float) -> list[Command]:
        """End the holds whose window closed: revoke their grants; their pins stay ``grace_s``
        more, charged to the holds' cap. Pending holds past their time are forgotten."""
        cmds: list[Command] = []
        for h in [h for h in self._holds.values() if h.offered_until <= now]:
            cmds += self._end(h, now)
        for mm in [m for m, (_, until, _) in self._pending.items() if until <= now]:
            del self._pending[mm]
        return cmds

    def close(self) -> list[Command]:
        """Shutdown: every hold ends and its pin goes now (the planes close next)."""
        self._pending.clear()
        cmds: list[Command] = []
        for h in list(self._holds.values()):
            cmds += self._end(h, None)
        return cmds

    def _end(self, h: Hold, now: float | None) -> list[Command]:
        del self._holds[h.hold_id]
        if self._hold_of.get(h.mm_hash) == h.hold_id:
            del self._hold_of[h.mm_hash]
        if now is None:
            self.ledger.unpin(h.mm_hash, h.entry_id, HOLD_IDENTITY, h.pinned_bytes)
        else:
            self.ledger.hold_back(now + max(0.0, self.settings.grace_s), h.mm_hash, h.entry_id,
                                  HOLD_IDENTITY, h.pinned_bytes)
            self.stats["hold_expired"] += 1
        self.emit("hold_ended", {"peer": "", "session_id": "", "mm_hash": h.mm_hash[:12],
                                 "grant_id": h.hold_id, "served": h.served})
        return [Revoke(h.grant.plane, h.grant.plane_grant)]
