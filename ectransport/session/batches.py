"""The consumer's record of what it asked for (ECTP v2 ``ReqBatch`` frames, and the v1 requests
it gave up on), so that every answer can be matched to a question — or ignored.

:class:`BatchTable` is owned by a :class:`~ectransport.session.consumer.ConsumerSession`; it
changes no fetch state itself. It keeps:

* the open batches (one :class:`~ectransport.session.fetch.Batch` per request still waiting for
  answers; pruned as the fetches that wait for them end);
* the ids of batches answered in full lately (:data:`MAX_ANSWERED`): a later answer for one of
  them is counted as a second answer, not as a batch never sent;
* the requests given up on (:data:`MAX_ABANDONED`; batch id ``None`` for a v1 ``XferReq``): the
  late grant of one of them is given back once, so that the producer unpins at once — and only
  for a request really sent, so unsolicited acks are never reflected one for one.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from ectransport.session.fetch import Batch

#: Batch ids remembered as answered in full.
MAX_ANSWERED = 256
#: Requests given up on, remembered so that their late grant is given back.
MAX_ABANDONED = 1024


class BatchTable:
    """Open batches, recently answered batch ids and abandoned requests (module docstring)."""

    def __init__(self) -> None:
        self._open: dict[int, Batch] = {}
        self._seq = 0
        self._answered: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._abandoned: collections.OrderedDict[tuple[int | None, str], None] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    @property
    def abandoned(self) -> int:
        return len(self._abandoned)

    def open(self, names: Iterable[str], inline_max: int, sent: float, wait_s: float) -> int:
        """Record a new batch naming ``names``; returns its id (unique in this session)."""
        self._seq += 1
        items = frozenset(names)
        self._open[self._seq] = Batch(items, set(items), inline_max, sent, wait_s)
        return self._seq

    def get(self, batch_id: int) -> Batch | None:
        return self._open.get(batch_id)

    def close_if_answered(self, batch_id: int) -> None:
        """Forget batch ``batch_id`` once none of its items waits any more."""
        b = self._open.get(batch_id)
        if b is not None and not b.waiting:
            del self._open[batch_id]
            self._answered[batch_id] = None
            while len(self._answered) > MAX_ANSWERED:
                self._answered.popitem(last=False)

    def was_answered(self, batch_id: int) -> bool:
        return batch_id in self._answered

    def stray_reason(self, batch: Batch | None, batch_id: int, mm_hash: str) -> str:
        """Why an answer that no fetch waits for is ignored: ``second_answer``,
        ``unknown_batch`` or ``not_in_batch``."""
        if batch is None:
            return "second_answer" if batch_id in self._answered else "unknown_batch"
        if mm_hash in batch.items and mm_hash not in batch.waiting:
            return "second_answer"
        return "not_in_batch"

    def abandon(self, batch_id: int | None, mm_hash: str) -> None:
        """The request for ``mm_hash`` (in batch ``batch_id``; None: an XferReq) was given up."""
        key = (batch_id, mm_hash)
        self._abandoned[key] = None
        self._abandoned.move_to_end(key)
        while len(self._abandoned) > MAX_ABANDONED:
            self._abandoned.popitem(last=False)

    def take_abandoned(self, batch_id: int | None, mm_hash: str) -> bool:
        """Whether that request was given up on (forgotten now: its late answer counts once)."""
        key = (batch_id, mm_hash)
        if key not in self._abandoned:
            return False
        del self._abandoned[key]
        return True

    def parked(self, batch: Batch, mm_hashes: Iterable[str],
               asked: Callable[[str], bool]) -> tuple[list[str], collections.Counter[str]]:
        """The items of a ``Parked`` frame for ``batch`` that really wait (``asked(mm_hash)``:
        a fetch waits for this batch's answer for it), marked parked; and the others counted by
        why: ``parked_not_in_batch``, ``parked_answered`` (or given up on), ``parked_twice``."""
        ok: list[str] = []
        strays: collections.Counter[str] = collections.Counter()
        for mm in mm_hashes:
            if mm not in batch.items:
                strays["parked_not_in_batch"] += 1
            elif mm not in batch.waiting or not asked(mm):
                strays["parked_answered"] += 1
            elif mm in batch.parked:
                strays["parked_twice"] += 1
            else:
                batch.parked.add(mm)
                ok.append(mm)
        return ok, strays

    def prune(self, still_waits: Callable[[str, int], bool]) -> None:
        """Forget the items whose fetch no longer waits for that batch's answer (``still_waits(
        mm_hash, batch_id)`` False: ended, or asked again in another batch), and batches left with
        none: the table stays bounded by the fetches in flight."""
        for bid, b in list(self._open.items()):
            b.waiting = {m for m in b.waiting if still_waits(m, bid)}
            if not b.waiting:
                del self._open[bid]

    def clear(self) -> None:
        """The connection went away or failed: no open batch can be answered any more."""
        self._open.clear()
