"""ECTP v2 §10 at the producer: announced entries held and offered, read with no request.

When the producer *announces* an entry (:meth:`ProducerHolds.announce`: vLLM's
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
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ectransport.protocol import (
    FEATURE_OFFERS,
    DoneItem,
    Grant,
    Offer,
    OfferItem,
    Status,
    Sync,
    Ticket,
    XferDone,
    encode,
)
from ectransport.protocol.messages import MAX_BATCH_ITEMS, MAX_GRANT_BYTES
from ectransport.session.commands import Command, Revoke, Send
from ectransport.session.grants import PeerState
from ectransport.session.producer_batches import FRAME_BUDGET_BYTES, ProducerBatches

log = logging.getLogger("ectransport.session.producer")

#: The pin-budget identity that announcement holds are charged to (not a CURVE key or session id:
#: those never contain NUL).
HOLD_IDENTITY = "\x00holds"
#: Most entries announced before they were ready whose hold waits for their commit.
MAX_PENDING_HOLDS = 4096


@dataclass(eq=False)
class Hold:
    """One announcement hold: the pinned entry, its grant on the hold plane, and
    ``offered_until`` (session time): the end of the window its offers state (re-announcing moves
    it later, never earlier)."""

    hold_id: int
    mm_hash: str
    entry_id: int
    pinned_bytes: int
    offered_until: float
    grant: Grant
    served: int = 0


class ProducerHolds(ProducerBatches):
    """Holds and offers of a producer session (module docstring); the frames reach it from
    :class:`~ectransport.session.producer.ProducerSession`, which derives from it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._holds: dict[int, Hold] = {}
        self._hold_of: dict[str, int] = {}  # mm_hash -> live hold id
        #: mm_hash -> (hold id, give-up time): announced, not held yet — not READY, or no
        #: session takes offers now (a hold would pin for nobody)
        self._pending_holds: dict[str, tuple[int, float]] = {}
        self.hold_cap_bytes = int(self.store.region_bytes * max(0.0, self.config.hold_share))
        self.hold_plane = next((p for p in self.config.planes if self._offerable(p)), None)
        for k in ("holds", "hold_refused", "hold_expired", "hold_reads", "offers", "syncs"):
            self.stats[k] = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def active_holds(self) -> int:
        return len(self._holds)

    def held_bytes(self) -> int:
        """Bytes pinned by holds, their grace pins included (what the cap counts)."""
        return self._pinned_by.get(HOLD_IDENTITY, 0)

    def waits_for(self, mm_hash: str) -> bool:
        return mm_hash in self._pending_holds or super().waits_for(mm_hash)

    def _held_pins(self) -> list[tuple[str, int, str, int]]:
        return [(h.mm_hash, h.entry_id, HOLD_IDENTITY, h.pinned_bytes)
                for h in self._holds.values()]

    # -- announcing ----------------------------------------------------------------------------
    def announce(self, mm_hash: str, now: float) -> tuple[Ticket | None, list[Command]]:
        """Announce ``mm_hash``: hold it (or renew its hold) and offer it to the sessions that
        take offers. Returns the ticket — ``hold_id`` 0 when no hold can be taken (see the
        module docstring) — and the commands (``Offer`` sends; a ``Revoke`` of a description
        refused); None (and nothing) if the entry is not in the store at all."""
        self._now = now
        entry = self.store.get(mm_hash)
        if entry is None:
            return None, []
        if self.hold_plane is None or self.hold_cap_bytes <= 0:
            return self._ticket(mm_hash, 0), []
        hid = self._hold_of.get(mm_hash)
        if hid is not None:  # renew: a longer window, offered again
            h = self._holds[hid]
            h.offered_until = max(h.offered_until, now + self.config.hold_s)
            return self._ticket(mm_hash, hid), self._offer_all([h])
        pending = self._pending_holds.get(mm_hash)
        if pending is None:
            if len(self._pending_holds) >= MAX_PENDING_HOLDS:
                return self._ticket(mm_hash, 0), []
            pending = (self._new_hold_id(), now + self.config.hold_s)
        else:  # announced again before it was held: a later give-up time
            pending = (pending[0], max(pending[1], now + self.config.hold_s))
        self._pending_holds[mm_hash] = pending
        cmds = self._take_pending([mm_hash], now)
        if pending[0] not in self._holds and mm_hash not in self._pending_holds:
            return self._ticket(mm_hash, 0), cmds  # refused (the cap): nothing will be offered
        return self._ticket(mm_hash, pending[0]), cmds

    def on_entries_changed(self, mm_hashes: Collection[str], now: float) -> list[Command]:
        return super().on_entries_changed(mm_hashes, now) + self._take_pending(mm_hashes, now)

    def _takers(self) -> bool:
        """Whether some session would be offered a hold now (granted offers, has an anchor)."""
        return any(st.offers and st.anchor is not None for st in self._peers.values())

    def _take_pending(self, mm_hashes: Collection[str], now: float) -> list[Command]:
        """Take the pending holds of ``mm_hashes`` whose entries are READY, if a session takes
        offers (else they stay pending: no pin for nobody, until a session's first ``Sync`` or
        their give-up time); drop those whose entry is gone or whose time is over. Returns the
        ``Offer`` sends (and ``Revoke`` of descriptions refused)."""
        taken: list[Hold] = []
        cmds: list[Command] = []
        takers = self._takers()
        for mm in list(mm_hashes):
            pending = self._pending_holds.get(mm)
            if pending is None:
                continue
            entry = self.store.get(mm)
            if entry is None or now >= pending[1]:
                del self._pending_holds[mm]
                continue
            if not entry.ready or not takers:
                continue
            del self._pending_holds[mm]
            h, refused = self._take(mm, pending[0], now, pending[1])
            cmds += refused
            if h is not None:
                taken.append(h)
        return cmds + self._offer_all(taken)

    def _ticket(self, mm_hash: str, hold_id: int) -> Ticket:
        return Ticket(producer=self.config.node_id, hold_id=hold_id, mm_hash=mm_hash)

    def _new_hold_id(self) -> int:
        pending = {h for h, _ in self._pending_holds.values()}
        while True:
            hid = self._rng.getrandbits(63)
            if hid and hid not in self._holds and hid not in pending:
                return hid

    def _take(self, mm_hash: str, hold_id: int, now: float,
              until: float) -> tuple[Hold | None, list[Command]]:
        """Pin the READY entry ``mm_hash`` under a new hold offered until ``until`` and describe
        it; None (counted in ``hold_refused``) when the cap is reached or the plane cannot
        describe it (then a ``Revoke`` of a description refused for its size)."""
        plane = self.hold_plane
        entry = self.store.get(mm_hash)
        if plane is None or entry is None or not entry.ready:
            return None, []
        pinned = entry.num_blocks * self.store.block_bytes
        limit = self._max_bytes(plane)
        describe = self.describers.get(plane)
        if (self.held_bytes() + pinned > self.hold_cap_bytes or describe is None
                or (limit is not None and entry.nbytes > limit)):
            self.stats["hold_refused"] += 1
            return None, []
        entry = self.store.pin_if_ready(mm_hash)
        assert entry is not None
        try:
            plane_grant = describe(entry.runs, entry.nbytes)
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
                      block_bytes=self.store.block_bytes, lease_s=float(self.config.hold_s),
                      plane=plane, plane_grant=plane_grant)
        h = Hold(hold_id, mm_hash, entry.entry_id, pinned, max(until, now + 1.0), grant)
        self._holds[hold_id] = h
        self._hold_of[mm_hash] = hold_id
        self._pinned_by[HOLD_IDENTITY] = self.held_bytes() + pinned
        self.stats["holds"] += 1
        self._emit("hold_taken", {"peer": "", "session_id": "", "mm_hash": mm_hash[:12],
                                  "grant_id": hold_id}, nbytes=entry.nbytes, plane=plane)
        return h, []

    # -- offers --------------------------------------------------------------------------------
    def _offer_all(self, holds: list[Hold]) -> list[Command]:
        """``Offer`` frames of ``holds`` to every session that takes them (has an anchor)."""
        if not holds:
            return []
        cmds: list[Command] = []
        for st in self._peers.values():
            if st.offers and st.anchor is not None:
                cmds += self._offer_frames(st, holds)
        return cmds

    def _offer_frames(self, st: PeerState, holds: list[Hold]) -> list[Command]:
        assert st.anchor is not None
        t, received = st.anchor
        items = [OfferItem(h.mm_hash, h.grant, max(0.0, h.offered_until - received))
                 for h in holds if h.grant.plane == st.plane]
        cmds: list[Command] = []
        chunk: list[OfferItem] = []
        size = 0
        for it in items:
            n = 256 + len(it.grant.plane_grant) + 4 * len(it.mm_hash)
            if chunk and (len(chunk) == MAX_BATCH_ITEMS or size + n > FRAME_BUDGET_BYTES):
                cmds.append(self._offer_send(st, t, chunk))
                chunk, size = [], 0
            chunk.append(it)
            size += n
        if chunk:
            cmds.append(self._offer_send(st, t, chunk))
        return cmds

    def _offer_send(self, st: PeerState, anchor: float, items: list[OfferItem]) -> Send:
        self.stats["offers"] += len(items)
        return Send(st.peer, encode(Offer(v=st.version, session_id=st.session_id, anchor=anchor,
                                          items=items)))

    def _grants_offers(self, state: PeerState, features: list[str]) -> bool:
        """Whether a session just welcomed gets offers: it asked, speaks v2, and negotiated the
        hold plane."""
        return (FEATURE_OFFERS in features and state.version >= 2
                and self.hold_plane is not None and state.plane == self.hold_plane)

    # -- frames ---------------------------------------------------------------------------------
    def _on_sync(self, peer: Any, state: PeerState | None, msg: Sync, now: float) -> list[Command]:
        if state is None or msg.session_id != state.session_id:
            return [self._nack(peer, Status.NACK_BAD_REQUEST, "Sync for a foreign session")]
        if not state.offers:
            return [self._nack(peer, Status.NACK_BAD_REQUEST,
                               "Sync on a session not granted offers")]
        self.stats["syncs"] += 1
        first = state.anchor is None
        state.anchor = (float(msg.t), now)
        if not first:
            return []
        live = [h for h in self._holds.values() if h.offered_until > now]
        # entries announced while no session took offers are held now (and offered to all)
        return self._offer_frames(state, live) + self._take_pending(list(self._pending_holds),
                                                                     now)

    def _hold_done(self, msg: XferDone | DoneItem) -> bool:
        """``XferDone`` naming a hold of the same mm_hash: a served read, counted (the hold ends
        at its deadline all the same). False if it names no hold (then it is a grant's)."""
        h = self._holds.get(msg.grant_id)
        if h is None or h.mm_hash != msg.mm_hash:
            return False
        if msg.ok:
            h.served += 1
            self.stats["hold_reads"] += 1
        return True

    # -- ending --------------------------------------------------------------------------------
    def _expire_holds(self, now: float) -> list[Command]:
        """End the holds whose window closed: revoke their grants; their pins stay ``grace_s``
        more, charged to the holds' cap."""
        cmds: list[Command] = []
        for h in [h for h in self._holds.values() if h.offered_until <= now]:
            cmds += self._end_hold(h, now)
        for mm in [m for m, (_, until) in self._pending_holds.items() if until <= now]:
            del self._pending_holds[mm]  # never held: nobody took offers before its time
        return cmds

    def _end_hold(self, h: Hold, now: float | None) -> list[Command]:
        del self._holds[h.hold_id]
        if self._hold_of.get(h.mm_hash) == h.hold_id:
            del self._hold_of[h.mm_hash]
        if now is None:  # shutdown: the planes close next
            self.store.unpin(h.mm_hash, h.entry_id)
            self._uncharge(HOLD_IDENTITY, h.pinned_bytes)
        else:
            heapq.heappush(self._grace, (now + max(0.0, self.config.grace_s), h.mm_hash,
                                         h.entry_id, HOLD_IDENTITY, h.pinned_bytes))
            self.stats["hold_expired"] += 1
        self._emit("hold_ended", {"peer": "", "session_id": "", "mm_hash": h.mm_hash[:12],
                                  "grant_id": h.hold_id}, served=h.served)
        return [Revoke(h.grant.plane, h.grant.plane_grant)]

    def _close_holds(self) -> list[Command]:
        self._pending_holds.clear()
        cmds: list[Command] = []
        for h in list(self._holds.values()):
            cmds += self._end_hold(h, None)
        return cmds
