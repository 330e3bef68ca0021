"""ProducerSession: the sans-I/O connection object that serves encoder-cache entries to every
consumer of a producer node.

Feed it frames, data-plane notifications, peer-down events, entry changes and the time; it
returns commands (:mod:`.commands`). It owns the consumer connections that said Hello
(:class:`~ectransport.session.grants.PeerState`) and four components with narrow interfaces:
:class:`~ectransport.session.grants.GrantTable` (how one entry is answered, how a grant ends),
:class:`~ectransport.session.pins.PinLedger` (pin budgets and grace periods),
:class:`~ectransport.session.waits.WaitQueue` (ECTP v2 readiness waits) and
:class:`~ectransport.session.holds.HoldTable` (ECTP v2 §10 announcement holds). Planes are a
static table of facts (:class:`~ectransport.session.grants.PlaneFacts`), the region one reader.

Checks on a request, in order (each failure is a NACK and takes no pin): Hello done for this
peer (BAD_REQUEST), frame version = negotiated (VERSION, by the codec), session id non-empty and
this connection's (BAD_REQUEST), compatibility hash (INCOMPAT); then the entry's own checks
(:meth:`~ectransport.session.grants.GrantTable.answer`).

**ECTP v2** (``protocols/ectp-v2.md``). A ``ReqBatch`` names up to 64 entries, each answered
exactly once in an ``AckBatch`` of its ``batch_id``: answerable items at once (grants, inline
bytes, NACKs); an item whose entry is reserved but not ready waits (no pin) for at most
``min(wait_s, max_wait_s)`` and is named at once in one ``Parked`` frame, then answered when the
entry becomes ready (:meth:`ProducerSession.on_entries_changed`), NACK_MISSING when it is gone,
NACK_NOT_READY when the wait is over. Refused as a whole (same NACK for every item, nothing
pinned): before Hello or for another session (BAD_REQUEST), a foreign compatibility hash
(INCOMPAT), an mm_hash named twice (BAD_REQUEST); a ``batch_id`` whose items still wait is
refused with a ``Nack``. An announced entry (:meth:`ProducerSession.announce`) is held and
offered to the sessions that asked for offers (ECTP v2 §10; :mod:`.holds`). Fleet trust
(:mod:`.admission`) admits a Hello first, by its certificate: see :meth:`ProducerSession.on_trust_lost`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ectransport.protocol import (
    FEATURE_OFFERS,
    FEATURE_RENEW_ACK,
    AckItem,
    DoneBatch,
    DoneItem,
    FrameError,
    Hello,
    Nack,
    Parked,
    Renew,
    ReqBatch,
    Status,
    Sync,
    Ticket,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)
from ectransport.session.admission import Admission, refusal_detail
from ectransport.session.commands import Command, Send
from ectransport.session.frames import ack_frames, rejection
from ectransport.session.grants import (
    Answer,
    GrantTable,
    GrantView,
    PeerState,
    PlaneFacts,
    ProducerConfig,
    ReadBytes,
    notif_for,
    parse_notif,
)
from ectransport.session.holds import HoldTable
from ectransport.session.invariants import check_producer
from ectransport.session.negotiate import negotiate, untrusted, welcome
from ectransport.session.offering import OfferRouter
from ectransport.session.pins import PinLedger
from ectransport.session.waits import WaitingItem, WaitQueue
from ectransport.store import BlockStore
from ectransport.trust.verify import Refused

log = logging.getLogger("ectransport.session.producer")

__all__ = ["GrantView", "PlaneFacts", "ProducerConfig", "ProducerSession", "notif_for",
           "parse_notif"]

_STATS = ("grants", "completed", "abandoned", "expired", "released_peer_down", "bad_frames",
          "late_signals", "inline", "batches", "waited", "parked_frames", "offers", "syncs")


class ProducerSession:
    """Grants access to entries of ``store`` (module docstring).

    Args:
        config: :class:`~ectransport.session.grants.ProducerConfig`.
        store: the producer's block store (shared with the node, which serialises access).
        planes: plane name → :class:`~ectransport.session.grants.PlaneFacts`.
        rng: source of grant and hold ids (default: the OS CSPRNG; tests pass a seeded one).
        observer: ``(event, fields) -> None`` (synchronous, cheap, never calls back):
            ``grant_issued``, ``grant_ended`` (``why``, ``held_s``), ``nack_sent``
            (``status``), ``lease_expired``, ``hold_taken``, ``hold_ended``; fields carry
            ``peer``, ``session_id``, ``mm_hash``, ``grant_id``, ``nbytes``, ``plane`` where known.
        read: ``(runs, nbytes) -> bytes``, an entry's bytes for inline answers (called with the
            node's lock held); None: never inline.
        admission: fleet trust (:class:`~.admission.Admission`); None: every Hello is admitted.
    """

    def __init__(self, config: ProducerConfig, store: BlockStore,
                 planes: Mapping[str, PlaneFacts], *, rng: random.Random | None = None,
                 observer: Callable[[str, dict[str, Any]], None] | None = None,
                 read: ReadBytes | None = None, admission: Admission | None = None):
        self.config = config
        self.admission = admission
        self.settings = s = config.settings
        self.store = store
        self.planes = dict(planes)
        self.observer = observer
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self.nacks: dict[Status, int] = {}
        rng = rng or random.SystemRandom()
        self.ledger = PinLedger(store)
        self.grants_table = GrantTable(s, store, self.ledger, self.planes, rng, read,
                                       self.stats, self._emit)
        self.waits = WaitQueue()
        self.holds = HoldTable(s, store, self.ledger, self.planes, config.planes, rng,
                               self.stats, self._emit)
        self._peers: dict[Any, PeerState] = {}
        self._sessions: dict[str, Any] = {}  # session_id -> peer
        self.offering = OfferRouter(self.holds, self._peers, self.stats, s.broadcast_offers)

    # -- queries -------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.grants_table.budget_bytes

    @property
    def active_grants(self) -> int:
        return len(self.grants_table)

    @property
    def waiting_items(self) -> int:
        """ECTP v2 batch items waiting for their entry to become ready (none holds a pin)."""
        return len(self.waits)

    @property
    def grace_pins(self) -> int:
        return self.ledger.held_back

    @property
    def active_holds(self) -> int:
        return len(self.holds)

    @property
    def hold_cap_bytes(self) -> int:
        return self.holds.cap_bytes

    def held_bytes(self) -> int:
        return self.holds.held_bytes()

    def pinned_bytes(self, identity: str | None = None) -> int:
        return self.ledger.total() if identity is None else self.ledger.charged(identity)

    def pinned_by_identity(self) -> dict[str, int]:
        return self.ledger.by_identity()

    def grant_keys(self) -> list[tuple[str, str, int]]:
        return [g.key for g in self.grants_table]

    def grants(self) -> list[GrantView]:
        """Every live grant (not those held back for their grace period), as copies."""
        return self.grants_table.views()

    def waits_for(self, mm_hash: str) -> bool:
        """Whether something waits for ``mm_hash`` to change (then the node reports it with
        :meth:`on_entries_changed` at once): a parked batch item or a pending hold."""
        return self.waits.waits_for(mm_hash) or self.holds.waits_for(mm_hash)

    def next_deadline(self) -> float | None:
        """The earliest moment a waiting item must be answered (session time), or None."""
        return self.waits.next_deadline()

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests: :func:`.invariants.check_producer`).

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        check_producer(self)

    # -- events --------------------------------------------------------------------------------
    def on_frame(self, peer: Any, data: bytes, now: float, user: str = "") -> list[Command]:
        """A frame from ``peer`` (``user``: its authenticated identity, "" if none)."""
        state = self._peers.get(peer)
        try:
            msg = decode(data, versions=(state.version,) if state else self.config.versions)
        except FrameError as e:
            self.stats["bad_frames"] += 1
            return [self._reject(peer, e, data)]
        if isinstance(msg, Hello):
            return self._on_hello(peer, msg, user, now)
        if isinstance(msg, XferReq):
            return self._on_req(peer, state, msg, now)
        if isinstance(msg, ReqBatch):
            return self._on_batch(peer, state, msg, now)
        if not isinstance(msg, (Sync, DoneBatch, XferDone, Renew)):
            return [self._nack(peer, Status.NACK_BAD_REQUEST, f"unexpected {type(msg).__name__}")]
        if state is None or msg.session_id != state.session_id:
            return [self._nack(peer, Status.NACK_BAD_REQUEST,
                               f"{type(msg).__name__} for a foreign session")]
        match msg:
            case Sync():
                return self._on_sync(peer, state, msg, now)
            case Renew():  # answered by RenewAck where granted (ECTP v2 §11)
                return self.grants_table.on_renew(state, msg, now)
            case XferDone():
                return self._on_done(state, msg, now)
            case DoneBatch():
                return [c for it in msg.items for c in self._on_done(state, it, now)]
        return []

    def on_notification(self, notif: bytes, now: float) -> list[Command]:
        """A data-plane completion notification (bytes as built by :func:`notif_for`)."""
        key = parse_notif(notif)
        return self.grants_table.end(key, "completed", now) if key is not None else []

    def on_peer_down(self, peer: Any, now: float) -> list[Command]:
        """The consumer went away: its grants end at once (not at their leases) and its
        waiting items are dropped unanswered (nobody is left to read the answer)."""
        if self.admission is not None:
            self.admission.forget(peer)
        state = self._peers.pop(peer, None)
        if state is None:
            return []
        self.waits.drop_peer(peer)
        self._sessions.pop(state.session_id, None)
        return [c for key in self.grants_table.keys_of(state.session_id)
                for c in self.grants_table.end(key, "released_peer_down", now)]

    def on_trust_lost(self, peer: Any, refused: Refused, now: float) -> list[Command]:
        """Fleet trust no longer admits ``peer``'s live session (:meth:`.Admission.recheck`):
        it ends as at peer down; the peer is told by a ``Nack`` naming the reason and its next
        frames are refused as before Hello. (A refused Hello gets the refusal alone, and ends
        any session on its connection.)"""
        if peer not in self._peers:
            return []
        nack = self._nack(peer, Status.NACK_BAD_REQUEST, refusal_detail(refused))
        return [nack, *self.on_peer_down(peer, now)]

    def on_entries_changed(self, mm_hashes: Collection[str], now: float) -> list[Command]:
        """Entries changed in the store (ready, discarded or evicted): answer the batch items
        waiting for them, take the holds pending on them. Unknown mm_hashes are no-ops."""
        answers: dict[tuple[Any, int], tuple[WaitingItem, list[AckItem]]] = {}
        cmds: list[Command] = []
        for mm in dict.fromkeys(mm_hashes):
            if not self.waits.waits_for(mm):
                continue
            entry = self.store.get(mm)
            if entry is not None and not entry.ready:
                continue  # still being saved: keep waiting
            for w in self.waits.take(mm):
                st = self._peers.get(w.peer)
                assert st is not None and st.session_id == w.session_id  # dropped with its peer
                a = (Answer(Status.NACK_MISSING,
                            "entry discarded while waiting (save aborted, or evicted)")
                     if entry is None else
                     self.grants_table.answer(w.peer, st, mm, now, inline_max=w.inline_max))
                cmds += a.cmds
                self._collect(w, a, answers)
        return cmds + self._answer_frames(answers) + self.offering.entries_changed(mm_hashes,
                                                                                   now)

    def announce(self, mm_hash: str, now: float, to: str | Collection[str] | None = None,
                 ) -> tuple[Ticket | None, list[Command]]:
        """Hold ``mm_hash`` (or renew its hold) and offer it to the consumers ``to`` names
        (node ids or CURVE keys), or to all when it names none (:mod:`.offering`): the ticket
        (``hold_id`` 0: no hold; None: not in the store) and the commands."""
        hid, cmds = self.offering.announce(mm_hash, now, to)
        if hid is None:
            return None, []
        return Ticket(producer=self.config.node_id, hold_id=hid, mm_hash=mm_hash), cmds

    def poll(self, now: float) -> list[Command]:
        """Sweep the waits (changes unreported, waits over: NACK_NOT_READY), the holds, the
        grace periods and every lease (an expired grant ends exactly once)."""
        cmds: list[Command] = []
        if len(self.waits):
            cmds += self.on_entries_changed(self.waits.mm_hashes(), now)
            answers: dict[tuple[Any, int], tuple[WaitingItem, list[AckItem]]] = {}
            for w in self.waits.due(now):
                self._collect(w, Answer(Status.NACK_NOT_READY, f"entry allocated, save not "
                                        f"landed after waiting {now - w.received:.3g} s"),
                              answers)
            cmds += self._answer_frames(answers)
        cmds += self.holds.expire(now)
        self.ledger.release_due(now)
        for g in self.grants_table.expired(now):
            fields = GrantTable._fields(g)
            log.warning("lease expired: session=%s mm_hash=%s grant=%d", g.key[0][:8],
                        g.key[1][:12], g.key[2], extra=fields)
            self._emit("lease_expired", {**fields, "nbytes": g.nbytes, "plane": g.plane})
            cmds += self.grants_table.end(g.key, "expired", now)
        return cmds

    def close(self) -> list[Command]:
        """Shutdown: every grant and hold ends and every pin goes (the planes close next);
        waiting items are dropped."""
        self.waits.clear()
        cmds = self.holds.close()
        for g in self.grants_table:
            cmds += self.grants_table.end(g.key, "released_peer_down", None)
        self.ledger.release_all()
        return cmds

    # -- handlers ------------------------------------------------------------------------------
    def _on_hello(self, peer: Any, msg: Hello, user: str, now: float) -> list[Command]:
        adm = self.admission
        admitted = None if adm is None else adm.check(user, msg.cert, msg.session_id)
        if isinstance(admitted, Refused):
            self.nacks[Status.NACK_BAD_REQUEST] = self.nacks.get(Status.NACK_BAD_REQUEST, 0) + 1
            return [*self.on_peer_down(peer, now), Send(peer, untrusted(msg, admitted))]
        owner = self._sessions.get(msg.session_id)
        other = owner is not None and owner != peer and \
            self._peers[owner].identity != (user or msg.session_id)
        n = negotiate(msg, self.config, self.planes, taken_by_other=other)
        if n.status is not Status.OK:
            self.nacks[n.status] = self.nacks.get(n.status, 0) + 1
            self._emit("nack_sent", {"peer": user or msg.session_id, "session_id": msg.session_id,
                                     "mm_hash": "", "grant_id": -1, "status": n.status.name,
                                     "detail": n.detail})
            return [Send(peer, welcome(msg, self.config, n.status, detail=n.detail))]
        cmds: list[Command] = []
        if owner is not None and owner != peer:
            cmds += self.on_peer_down(owner, now)  # reconnect: the old route's grants end
        old = self._peers.get(peer)
        if old is not None and old.session_id != msg.session_id:
            cmds += self.on_peer_down(peer, now)  # a new session on this connection supersedes
        state = self._peers.get(peer)
        if state is None:
            state = PeerState(peer, msg.session_id, n.version, n.plane, user or msg.session_id)
            self._peers[peer] = state
            self._sessions[msg.session_id] = peer
        facts = self.planes.get(state.plane)
        state.offers = (FEATURE_OFFERS in msg.features and state.version >= 2
                        and self.holds.plane is not None and state.plane == self.holds.plane)
        state.anchor = None  # a new Welcome: the consumer forgot its offers and Sync stamps
        state.node_id = msg.node_id
        state.renew_ack = FEATURE_RENEW_ACK in msg.features and state.version >= 2
        if adm is not None and admitted is not None:
            adm.keep(peer, admitted, msg.session_id)
        return [*cmds, Send(peer, welcome(msg, self.config, Status.OK, state.version,
                                          state.plane, endpoint=facts.endpoint if facts else b"",
                                          features=state.features(),
                                          cert=adm.own_cert if adm is not None else b""))]

    def _frame_problem(self, state: PeerState | None, session_id: str,
                       compat_hash: str) -> tuple[Status, str] | None:
        """The request-wide checks: Hello first, this connection's session, the hash."""
        if state is None:
            return Status.NACK_BAD_REQUEST, "send Hello first"
        if not session_id:
            return Status.NACK_BAD_REQUEST, "empty session id"
        if session_id != state.session_id:
            return Status.NACK_BAD_REQUEST, "session id is not this connection's session"
        if compat_hash != self.config.compat_hash:
            return Status.NACK_INCOMPAT, "compatibility hash mismatch"
        return None

    def _on_req(self, peer: Any, state: PeerState | None, msg: XferReq,
                now: float) -> list[Command]:
        def ack(status: Status, detail: str) -> list[Command]:
            self._count_nack(status, detail, state.identity if state else str(peer),
                             msg.session_id, msg.mm_hash)
            return [Send(peer, encode(XferAck(v=msg.v, session_id=msg.session_id,
                                              mm_hash=msg.mm_hash, status=status, grant=None,
                                              detail=detail)))]

        bad = self._frame_problem(state, msg.session_id, msg.compat_hash)
        if bad is not None:
            return ack(*bad)
        assert state is not None
        a = self.grants_table.answer(peer, state, msg.mm_hash, now)
        if a.status is not Status.OK:
            return [*a.cmds, *ack(a.status, a.detail)]
        rec = a.record
        assert rec is not None  # OK without inline (v1): a grant
        if not rec.ack:  # a new grant, or one issued in an AckBatch: its XferAck, once
            rec.ack = encode(XferAck(v=msg.v, session_id=msg.session_id, mm_hash=msg.mm_hash,
                                     status=Status.OK, grant=rec.grant, detail=""))
        return [Send(peer, rec.ack)]

    def _on_batch(self, peer: Any, state: PeerState | None, msg: ReqBatch,
                  now: float) -> list[Command]:
        self.stats["batches"] += 1

        def refuse(status: Status, detail: str) -> list[Command]:
            for it in msg.items:
                self._count_nack(status, detail, state.identity if state else str(peer),
                                 msg.session_id, it.mm_hash)
            return self._acks(peer, msg.v, msg.session_id, msg.batch_id,
                              [AckItem(mm_hash=it.mm_hash, status=status, grant=None, data=b"",
                                       detail=detail) for it in msg.items])

        bad = self._frame_problem(state, msg.session_id, msg.compat_hash)
        if bad is not None:
            return refuse(*bad)
        assert state is not None
        if left := self.waits.waiting_in(peer, msg.batch_id):
            return [self._nack(peer, Status.NACK_BAD_REQUEST, f"batch {msg.batch_id} still has "
                               f"{left} item(s) waiting: batch ids must not be reused before "
                               f"every item of the batch was answered")]
        names = [it.mm_hash for it in msg.items]
        if len(set(names)) != len(names):
            dup = next(mm for i, mm in enumerate(names) if mm in names[:i])
            return refuse(Status.NACK_BAD_REQUEST, f"mm_hash {dup[:64]!r} appears more than once "
                          f"in the batch: name each entry once")
        wait_s = max(0.0, min(float(msg.wait_s), self.settings.max_wait_s))
        items: list[AckItem] = []
        parked: list[str] = []
        cmds: list[Command] = []
        for mm in names:
            a = self.grants_table.answer(peer, state, mm, now, inline_max=msg.inline_max)
            cmds += a.cmds
            if a.status is Status.NACK_NOT_READY and wait_s > 0 and self.waits.has_room(peer):
                self.waits.park(WaitingItem(peer, state.session_id, msg.batch_id, mm, msg.v,
                                            msg.inline_max, now, now + wait_s))
                self.stats["waited"] += 1
                parked.append(mm)
                continue
            if a.status is not Status.OK:
                self._count_nack(a.status, a.detail, state.identity, msg.session_id, mm)
            items.append(a.item(mm))
        cmds += self._acks(peer, msg.v, msg.session_id, msg.batch_id, items)
        if parked:  # every item is answered or named parked in this step (ECTP v2 §4.3)
            self.stats["parked_frames"] += 1
            cmds.append(Send(peer, encode(Parked(v=msg.v, session_id=msg.session_id,
                                                 batch_id=msg.batch_id, items=parked,
                                                 wait_s=wait_s))))
        return cmds

    def _on_done(self, state: PeerState, msg: XferDone | DoneItem, now: float) -> list[Command]:
        if self.holds.served(msg.grant_id, msg.mm_hash, msg.ok):
            return []
        return self.grants_table.end((state.session_id, msg.mm_hash, msg.grant_id),
                                     "completed" if msg.ok else "abandoned", now)

    def _on_sync(self, peer: Any, state: PeerState, msg: Sync, now: float) -> list[Command]:
        if not state.offers:
            return [self._nack(peer, Status.NACK_BAD_REQUEST,
                               "Sync on a session not granted offers")]
        return self.offering.on_sync(state, msg.t, now)

    # -- frames --------------------------------------------------------------------------------
    def _collect(self, w: WaitingItem, a: Answer,
                 answers: dict[tuple[Any, int], tuple[WaitingItem, list[AckItem]]]) -> None:
        """Add a parked item's answer to its batch's next ``AckBatch``."""
        st = self._peers.get(w.peer)
        if st is not None and a.status is not Status.OK:
            self._count_nack(a.status, a.detail, st.identity, w.session_id, w.mm_hash)
        answers.setdefault((w.peer, w.batch_id), (w, []))[1].append(a.item(w.mm_hash))

    def _answer_frames(self, answers: dict[tuple[Any, int], tuple[WaitingItem, list[AckItem]]],
                       ) -> list[Command]:
        return [c for (peer, bid), (w, items) in answers.items()
                for c in self._acks(peer, w.v, w.session_id, bid, items)]

    def _acks(self, peer: Any, v: int, session_id: str, batch_id: int,
              items: list[AckItem]) -> list[Command]:
        return list(ack_frames(peer, v, session_id, batch_id, items))

    def _count_nack(self, status: Status, detail: str, peer: str, session_id: str,
                    mm_hash: str) -> None:
        self.nacks[status] = self.nacks.get(status, 0) + 1
        self._emit("nack_sent", {"peer": peer, "session_id": session_id,
                                 "mm_hash": mm_hash[:12], "grant_id": -1,
                                 "status": status.name, "detail": detail})

    def _nack(self, peer: Any, status: Status, detail: str) -> Send:
        """A ``Nack`` frame, at the peer's session version (before a session, the lowest
        version spoken: ``Nack`` exists in every version)."""
        self.nacks[status] = self.nacks.get(status, 0) + 1
        state = self._peers.get(peer)
        v = state.version if state else min(self.config.versions)
        return Send(peer, encode(Nack(v=v, status=status, detail=detail)))

    def _reject(self, peer: Any, err: FrameError, data: bytes) -> Send:
        """Answer a frame that did not decode (:func:`~.frames.rejection`)."""
        state = self._peers.get(peer)
        v = state.version if state else min(self.config.versions)
        send, n = rejection(peer, err, data, v, v2=state is not None and state.version >= 2,
                            waiting=lambda bid: self.waits.waiting_in(peer, bid) > 0)
        self.nacks[err.status] = self.nacks.get(err.status, 0) + n
        return send

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        if self.observer is not None:
            self.observer(event, fields)
