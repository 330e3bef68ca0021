"""Bookkeeping checks of a :class:`~ectransport.session.ProducerSession`, for tests (the
session's :meth:`~ectransport.session.ProducerSession.check_invariants` runs them)."""

from __future__ import annotations

from typing import Any


def check_producer(p: Any) -> None:
    """Assert ``p``'s bookkeeping is consistent: grants indexed once each and held by a live
    peer, session ids naming their peer, every pinned byte charged to an identity, every pin of
    a live entry of the same id, every waiting item of a live v2 session.

    Raises:
        AssertionError: naming the first inconsistency found.
    """
    pins = p.grants_table.check(p._sessions)
    charged: dict[str, int] = {}
    for g in p.grants_table:
        charged[g.identity] = charged.get(g.identity, 0) + g.pinned_bytes
    for mm, eid, identity, n in (*p.holds.pins(), *p.ledger.held_back_pins()):
        pins[(mm, eid)] = pins.get((mm, eid), 0) + 1
        charged[identity] = charged.get(identity, 0) + n
    assert charged == p.ledger.by_identity(), f"budget {p.ledger.by_identity()} != {charged}"
    for sid, peer in p._sessions.items():
        st = p._peers.get(peer)
        assert st is not None and st.session_id == sid, f"session {sid} has no peer"
    assert len(p._sessions) == len(p._peers), "a peer without its session id"
    p.waits.check({peer: (st.session_id, st.version) for peer, st in p._peers.items()})
    for (mm, eid), n in pins.items():
        e = p.store.get(mm)
        assert e is not None and e.entry_id == eid and e.pins >= n, (
            f"entry {mm[:12]} ({eid}) lacks {n} pins")
