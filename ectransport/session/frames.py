"""Frame builders of the producer session: answers cut into frames that fit — the ``AckBatch``
frames of one batch and the ``Offer`` frames of some holds (ECTP v2), each kept below
:data:`FRAME_BUDGET_BYTES` (inline data and grants of 64 items could exceed the 8 MiB frame
limit), ``Offer`` frames to :data:`~ectransport.protocol.MAX_BATCH_ITEMS` items — and the answer
to a frame that did not decode (:func:`rejection`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ectransport.protocol import (
    AckBatch,
    AckItem,
    FrameError,
    Nack,
    Offer,
    OfferItem,
    XferAck,
    encode,
)
from ectransport.protocol.codec import MAX_FRAME_BYTES, peek_batch, peek_ids
from ectransport.protocol.messages import MAX_BATCH_ITEMS
from ectransport.session.commands import Send
from ectransport.session.grants import PeerState
from ectransport.session.holds import Hold

#: A frame is cut before its items' bytes reach this.
FRAME_BUDGET_BYTES = MAX_FRAME_BYTES - (256 << 10)


def _item_bytes(item: AckItem) -> int:
    """A generous size of an ``AckItem`` on the wire, bytes."""
    grant = len(item.grant.plane_grant) + len(item.grant.plane) if item.grant is not None else 0
    return 256 + len(item.data) + grant + 4 * (len(item.mm_hash) + len(item.detail))


def ack_frames(peer: Any, v: int, session_id: str, batch_id: int,
               items: list[AckItem]) -> list[Send]:
    """``items`` as ``AckBatch`` frames of ``batch_id``: one, unless they would not fit."""
    out: list[Send] = []
    chunk: list[AckItem] = []
    size = 0
    for item in items:
        n = _item_bytes(item)
        if chunk and size + n > FRAME_BUDGET_BYTES:
            out.append(Send(peer, encode(AckBatch(v=v, session_id=session_id, batch_id=batch_id,
                                                  items=chunk))))
            chunk, size = [], 0
        chunk.append(item)
        size += n
    if chunk:
        out.append(Send(peer, encode(AckBatch(v=v, session_id=session_id, batch_id=batch_id,
                                              items=chunk))))
    return out


def offer_frames(st: PeerState, holds: list[Hold]) -> list[Send]:
    """The offers of ``holds`` (those on ``st``'s plane) to the session ``st``, which has an
    anchor: each item is valid ``offered_until − (anchor received)`` after the anchor's ``t``
    (the window rule of :mod:`.holds`)."""
    assert st.anchor is not None
    t, received = st.anchor
    out: list[Send] = []
    chunk: list[OfferItem] = []
    size = 0

    def send() -> None:
        out.append(Send(st.peer, encode(Offer(v=st.version, session_id=st.session_id, anchor=t,
                                              items=chunk))))

    for h in holds:
        if h.grant.plane != st.plane:
            continue
        it = OfferItem(h.mm_hash, h.grant, max(0.0, h.offered_until - received))
        n = 256 + len(it.grant.plane_grant) + 4 * len(it.mm_hash)
        if chunk and (len(chunk) == MAX_BATCH_ITEMS or size + n > FRAME_BUDGET_BYTES):
            send()
            chunk, size = [], 0
        chunk.append(it)
        size += n
    if chunk:
        send()
    return out


def rejection(peer: Any, err: FrameError, data: bytes, v: int, *, v2: bool,
              waiting: Callable[[int], bool]) -> tuple[Send, int]:
    """The answer to a frame that did not decode, so that the consumer can attribute it: the
    ``AckBatch`` of a batch that can be named on a v2 session (``v2``) and whose id has no item
    waiting (``waiting(batch_id)`` False), the ``XferAck`` of a request that can be named, else a
    ``Nack``; at version ``v``. Returns it and how many NACKs it counts."""
    if err.kind == "reqs" and v2:
        batch = peek_batch(data)
        if batch is not None and not waiting(batch[1]):
            sid, batch_id, mm_hashes = batch
            items = [AckItem(mm_hash=mm, status=err.status, grant=None, data=b"",
                             detail=err.detail[:1000]) for mm in mm_hashes]
            return Send(peer, encode(AckBatch(v=v, session_id=sid, batch_id=batch_id,
                                              items=items))), len(mm_hashes)
    if err.kind == "req":
        sid, mm = peek_ids(data)
        return Send(peer, encode(XferAck(v=v, session_id=sid, mm_hash=mm, status=err.status,
                                         grant=None, detail=err.detail[:1000]))), 1
    return Send(peer, encode(Nack(v=v, status=err.status, detail=err.detail[:1000]))), 1
