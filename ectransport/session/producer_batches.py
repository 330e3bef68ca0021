"""ECTP v2 at the producer: batches, readiness without polling, small entries inline
(``protocols/ectp-v2.md``).

A ``ReqBatch`` names up to 64 entries. Each item is answered exactly once, in an ``AckBatch`` of
the same ``batch_id``:

- items answerable now — a grant, inline bytes, or a NACK (MISSING, BUSY, ...; the checks of one
  ``XferReq``, :meth:`ProducerState._answer`) — all in the frame(s) answering the batch at once;
- an item whose entry is reserved but not ready *waits* (no pin, nothing charged) for at most
  ``min(wait_s, config.max_wait_s)`` from when the frame was received, and is named at once in
  one ``Parked`` frame of the batch (sent with the batch's immediate ``AckBatch``, or alone), so
  that the consumer hears from every item within its ack timeout; it is answered as soon as
  the entry becomes ready (the node reports it: :meth:`ProducerBatches.on_entries_changed`), with
  NACK_MISSING as soon as it is gone (save aborted; a ready entry evicted before its waiters were
  answered), and with NACK_NOT_READY once the wait is over (:meth:`ProducerBatches._sweep_waiting`,
  called by ``poll``). Waiting items of a consumer that goes away are dropped unanswered.

An OK entry of at most ``min(batch.inline_max, config.inline_max_bytes)`` bytes is answered with
its bytes (``data``, ``grant`` None): read while the node's lock keeps the READY entry's blocks
stable, no pin kept, no lease, no ``XferDone`` expected. Every other OK item carries a grant that
``XferDone``, ``Renew`` and the data-plane notification treat as any ``XferAck`` grant.

Refused as a whole, every item answered with the same NACK and nothing pinned: a batch before
Hello or for another session (BAD_REQUEST), with a foreign compatibility hash (INCOMPAT), naming an
mm_hash twice (BAD_REQUEST). A ``batch_id`` whose items still wait is refused with a ``Nack``
(BAD_REQUEST) — an ``AckBatch`` would be taken for answers to the waiting batch. The codec refuses
a batch on a v1 session (``SINCE``: NACK_VERSION, answered with a ``Nack``).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Collection
from typing import Any

from ectransport.protocol import AckBatch, AckItem, Parked, ReqBatch, Status, encode
from ectransport.protocol.codec import MAX_FRAME_BYTES
from ectransport.session.commands import Command, Send
from ectransport.session.grants import MAX_WAITING_PER_PEER, PeerState, WaitingItem
from ectransport.session.producer_state import Answer, ProducerState

log = logging.getLogger("ectransport.session.producer")

#: An ``AckBatch`` frame is cut before its items' bytes reach this (inline data and grants of up
#: to 64 items could exceed the 8 MiB frame limit; the batch is then answered in several frames).
FRAME_BUDGET_BYTES = MAX_FRAME_BYTES - (256 << 10)
#: Generous per-item overhead of an ``AckItem`` beyond its data, grant blob and strings, bytes.
_ITEM_OVERHEAD = 256


def _item_bytes(item: AckItem) -> int:
    grant = len(item.grant.plane_grant) + len(item.grant.plane) if item.grant is not None else 0
    return _ITEM_OVERHEAD + len(item.data) + grant + 4 * (len(item.mm_hash) + len(item.detail))


class ProducerBatches(ProducerState):
    """The v2 frames and events of a producer session (see the module docstring); the v1 ones
    are in :class:`~ectransport.session.producer.ProducerSession`, which derives from this."""

    def on_entries_changed(self, mm_hashes: Collection[str], now: float) -> list[Command]:
        """Entries changed in the store (became ready, were discarded or evicted): answer the
        batch items waiting for them. Unknown or unchanged mm_hashes are no-ops."""
        self._now = now
        answers: dict[tuple[Any, int], tuple[WaitingItem, list[AckItem]]] = {}
        cmds: list[Command] = []
        for mm in dict.fromkeys(mm_hashes):
            waiting = self._waiting.get(mm)
            if not waiting:
                continue
            entry = self.store.get(mm)
            if entry is not None and not entry.ready:
                continue  # still being saved: keep waiting
            del self._waiting[mm]
            for w in waiting:
                if entry is None:
                    a = Answer(Status.NACK_MISSING,
                               "entry discarded while waiting (save aborted, or evicted)")
                else:
                    a = self._answer_waiting(w, now)
                cmds += a.cmds
                self._unpark(w, a, answers)
        return cmds + self._send_answers(answers)

    # -- handlers ------------------------------------------------------------------------------
    def _on_batch(self, peer: Any, state: PeerState | None, msg: ReqBatch,
                  now: float) -> list[Command]:
        cfg = self.config
        self.stats["batches"] += 1
        who = state.identity if state else str(peer)

        def refuse(status: Status, detail: str) -> list[Command]:
            for it in msg.items:
                self._count_nack(status, detail, who, msg.session_id, it.mm_hash)
            return self._frames(peer, msg.v, msg.session_id, msg.batch_id,
                                [AckItem(mm_hash=it.mm_hash, status=status, grant=None, data=b"",
                                         detail=detail) for it in msg.items])

        if state is None:
            return refuse(Status.NACK_BAD_REQUEST, "send Hello first")
        if state.version < 2:  # the codec refuses it first (SINCE); kept for other callers
            return [self._nack(peer, Status.NACK_VERSION,
                               f"ReqBatch needs ECTP v2; this session speaks v{state.version}")]
        if not msg.session_id:
            return refuse(Status.NACK_BAD_REQUEST, "empty session id")
        if msg.session_id != state.session_id:
            return refuse(Status.NACK_BAD_REQUEST, "session id is not this connection's session")
        if msg.compat_hash != cfg.compat_hash:
            return refuse(Status.NACK_INCOMPAT, "compatibility hash mismatch")
        if msg.batch_id in state.waiting:
            return [self._nack(peer, Status.NACK_BAD_REQUEST,
                               f"batch {msg.batch_id} still has {state.waiting[msg.batch_id]} "
                               f"item(s) waiting: batch ids must not be reused before every item "
                               f"of the batch was answered")]
        names = [it.mm_hash for it in msg.items]
        if len(set(names)) != len(names):
            dup = next(mm for i, mm in enumerate(names) if mm in names[:i])
            return refuse(Status.NACK_BAD_REQUEST,
                          f"mm_hash {dup[:64]!r} appears more than once in the batch: name "
                          f"each entry once")
        wait_s = max(0.0, min(float(msg.wait_s), cfg.max_wait_s))
        items: list[AckItem] = []
        parked: list[str] = []
        cmds: list[Command] = []
        for it in msg.items:
            a = self._answer(peer, state, it.mm_hash, now, inline_max=msg.inline_max)
            cmds += a.cmds
            if a.status is Status.NACK_NOT_READY and wait_s > 0 and \
                    state.waiting_items < MAX_WAITING_PER_PEER:
                self._park(WaitingItem(peer, state.session_id, msg.batch_id, it.mm_hash, msg.v,
                                       msg.inline_max, now, now + wait_s), state)
                parked.append(it.mm_hash)
                continue
            if a.status is not Status.OK:
                self._count_nack(a.status, a.detail, state.identity, msg.session_id, it.mm_hash)
            items.append(a.item(it.mm_hash))
        cmds += self._frames(peer, msg.v, msg.session_id, msg.batch_id, items)
        if parked:  # every item is answered or named parked in this step (ECTP v2 §4.3)
            self.stats["parked_frames"] += 1
            cmds.append(Send(peer, encode(Parked(v=msg.v, session_id=msg.session_id,
                                                 batch_id=msg.batch_id, items=parked,
                                                 wait_s=wait_s))))
        return cmds

    # -- waiting items -------------------------------------------------------------------------
    def _park(self, w: WaitingItem, state: PeerState) -> None:
        self._waiting.setdefault(w.mm_hash, []).append(w)
        self._wait_seq += 1
        heapq.heappush(self._wait_heap, (w.until, self._wait_seq, w))
        state.waiting[w.batch_id] = state.waiting.get(w.batch_id, 0) + 1
        self.stats["waited"] += 1

    def _answer_waiting(self, w: WaitingItem, now: float) -> Answer:
        state = self._peers.get(w.peer)
        assert state is not None and state.session_id == w.session_id  # dropped with its peer
        return self._answer(w.peer, state, w.mm_hash, now, inline_max=w.inline_max)

    def _unpark(self, w: WaitingItem, a: Answer,
                answers: dict[tuple[Any, int], tuple[WaitingItem, list[AckItem]]]) -> None:
        """Mark ``w`` answered with ``a`` (already removed from ``_waiting``) and collect its
        item for the batch's next ``AckBatch``."""
        w.answered = True
        state = self._peers.get(w.peer)
        if state is not None:
            left = state.waiting.get(w.batch_id, 0) - 1
            if left > 0:
                state.waiting[w.batch_id] = left
            else:
                state.waiting.pop(w.batch_id, None)
            if a.status is not Status.OK:
                self._count_nack(a.status, a.detail, state.identity, w.session_id, w.mm_hash)
        answers.setdefault((w.peer, w.batch_id), (w, []))[1].append(a.item(w.mm_hash))

    def _sweep_waiting(self, now: float) -> list[Command]:
        """Answer what changed unreported (a store changed without ``on_entries_changed``), then
        every item whose wait is over: NACK_NOT_READY."""
        cmds = self.on_entries_changed(list(self._waiting), now) if self._waiting else []
        answers: dict[tuple[Any, int], tuple[WaitingItem, list[AckItem]]] = {}
        heap = self._wait_heap
        while heap and (heap[0][2].answered or heap[0][0] <= now):
            _, _, w = heapq.heappop(heap)
            if w.answered:
                continue
            items = self._waiting.get(w.mm_hash, [])
            items.remove(w)
            if not items:
                self._waiting.pop(w.mm_hash, None)
            waited = now - w.received
            self._unpark(w, Answer(Status.NACK_NOT_READY,
                                   f"entry allocated, save not landed after waiting "
                                   f"{waited:.3g} s"), answers)
        return cmds + self._send_answers(answers)

    def _drop_waiting(self, peer: Any) -> None:
        """The consumer went away (or its session was replaced): its waiting items are dropped
        unanswered (their deadlines leave the heap lazily)."""
        for mm in list(self._waiting):
            items = self._waiting[mm]
            keep = [w for w in items if w.peer != peer]
            for w in items:
                if w.peer == peer:
                    w.answered = True
            if keep:
                self._waiting[mm] = keep
            else:
                del self._waiting[mm]
        state = self._peers.get(peer)
        if state is not None:
            state.waiting.clear()

    def _clear_waiting(self) -> None:
        for items in self._waiting.values():
            for w in items:
                w.answered = True
        self._waiting.clear()
        self._wait_heap.clear()
        for st in self._peers.values():
            st.waiting.clear()

    # -- frames --------------------------------------------------------------------------------
    def _send_answers(self, answers: dict[tuple[Any, int], tuple[WaitingItem, list[AckItem]]],
                      ) -> list[Command]:
        out: list[Command] = []
        for (peer, batch_id), (w, items) in answers.items():
            out += self._frames(peer, w.v, w.session_id, batch_id, items)
        return out

    def _frames(self, peer: Any, v: int, session_id: str, batch_id: int,
                items: list[AckItem]) -> list[Command]:
        """``items`` as ``AckBatch`` frames of ``batch_id``: one, unless their inline bytes and
        grants would not fit one frame (:data:`FRAME_BUDGET_BYTES`)."""
        out: list[Command] = []
        chunk: list[AckItem] = []
        size = 0
        for item in items:
            n = _item_bytes(item)
            if chunk and size + n > FRAME_BUDGET_BYTES:
                out.append(Send(peer, encode(AckBatch(v=v, session_id=session_id,
                                                      batch_id=batch_id, items=chunk))))
                chunk, size = [], 0
            chunk.append(item)
            size += n
        if chunk:
            out.append(Send(peer, encode(AckBatch(v=v, session_id=session_id, batch_id=batch_id,
                                                  items=chunk))))
        return out
