"""Which consumer sessions a producer offers which announced entry (ECTP v2 §10.4).

An announcement (:meth:`ProducerSession.announce <ectransport.session.ProducerSession.announce>`)
may name the consumer it is for — the one the orchestrator routes the request to, or the one the
fleet directory names — by its node id (``Hello.node_id``) or its CURVE public key (the
authenticated identity its pins are charged to). Then only that consumer's sessions are sent
the ``Offer``: N consumers no longer cost N ``Offer`` frames per entry, and no consumer learns
the mm_hashes announced for the others. An announcement that names nobody is offered to every
session that takes offers when the producer broadcasts (``broadcast_offers``, the default; as
before), else to none (the ticket's ``hold_id`` is then 0: consumers fetch it with a request).

A session is *offered* a hold when it was granted ``"offers"``, has an anchor (a ``Sync``), and
the hold is for everyone or names the session's node id or identity. Naming is a routing choice,
not a capability: a ticket carried to a consumer the hold does not name is fetched with a
request, as any ticket without an offer (§10.3); an identity can only be named, never claimed
(the node id comes from the consumer's own Hello, the key from CURVE).

:class:`OfferRouter` is owned by the session; the holds' bookkeeping stays in
:class:`~ectransport.session.holds.HoldTable`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ectransport.session.commands import Command
from ectransport.session.frames import offer_frames
from ectransport.session.grants import PeerState
from ectransport.session.holds import MAX_TARGETS, Hold, HoldTable, Targets


def targets(to: str | Collection[str] | None) -> Targets:
    """An announcement's ``to`` as hold targets: None (everyone) or a set of at most
    :data:`~ectransport.session.holds.MAX_TARGETS` non-empty names."""
    if to is None:
        return None
    names = [to] if isinstance(to, str) else list(to)
    return frozenset(n for n in names[:MAX_TARGETS] if isinstance(n, str) and n)


class OfferRouter:
    """Who is sent which offer (module docstring).

    Args:
        holds: the session's hold table. peers: its sessions by peer (read, never changed).
        stats: the session's counters (``offers``: items sent; ``offers_targeted``: holds
            announced for named consumers). broadcast: offer announcements naming nobody to
            every session (else to none).
    """

    def __init__(self, holds: HoldTable, peers: Mapping[Any, PeerState], stats: dict[str, int],
                 broadcast: bool):
        self.holds = holds
        self.peers = peers
        self.stats = stats
        self.broadcast = broadcast
        stats.setdefault("offers_targeted", 0)

    @staticmethod
    def offered(st: PeerState, to: Targets) -> bool:
        """Whether the session ``st`` is offered a hold for ``to`` now."""
        return st.offers and st.anchor is not None and (
            to is None or st.node_id in to or st.identity in to)

    def takers(self, to: Targets) -> bool:
        """Whether some session would be offered a hold for ``to`` now."""
        return any(self.offered(st, to) for st in self.peers.values())

    def announce(self, mm_hash: str, now: float,
                 to: str | Collection[str] | None) -> tuple[int | None, list[Command]]:
        """Hold ``mm_hash`` for ``to`` and offer it: the hold id for the ticket (0: no hold;
        None: not in the store) and the commands."""
        named = targets(to)
        if named is None and not self.broadcast:
            return (None if self.holds.store.get(mm_hash) is None else 0), []
        if named is not None:
            self.stats["offers_targeted"] += 1
        hid, taken, cmds = self.holds.announce(mm_hash, now, self.takers, named)
        return hid, cmds + self.offer(taken)

    def entries_changed(self, mm_hashes: Collection[str], now: float) -> list[Command]:
        """Entries became ready: take the holds pending on them and offer them."""
        taken, cmds = self.holds.take_pending(mm_hashes, now, self.takers)
        return cmds + self.offer(taken)

    def on_sync(self, st: PeerState, t: float, now: float) -> list[Command]:
        """A ``Sync`` of ``st`` (granted offers) stamped ``t``: its newest anchor. The first one
        of a session is answered with the offers of the live holds it is offered, and the
        pending holds some session now takes are held and offered."""
        self.stats["syncs"] += 1
        first = st.anchor is None
        st.anchor = (float(t), now)
        if not first:
            return []
        cmds = self.frames(st, self.holds.live(now))
        taken, more = self.holds.take_pending(self.holds.pending(), now, self.takers)
        return cmds + more + self.offer(taken)

    def offer(self, holds: list[Hold]) -> list[Command]:
        """``Offer`` frames of ``holds`` to every session offered each."""
        if not holds:
            return []
        return [c for st in self.peers.values() for c in self.frames(st, holds)]

    def frames(self, st: PeerState, holds: list[Hold]) -> list[Command]:
        """The ``Offer`` frames of those of ``holds`` that ``st`` is offered."""
        mine = [h for h in holds if self.offered(st, h.to)]
        if not mine:
            return []
        self.stats["offers"] += sum(h.grant.plane == st.plane for h in mine)
        return list(offer_frames(st, mine))
