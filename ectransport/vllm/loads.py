"""The load ledger: every load order of one engine's scheduler, from queued to reported.

A load order (:class:`~ectransport.vllm.metadata.LoadOrder`) copies an entry of the shared
region into vLLM's ``encoder_cache`` on every rank. Two sources queue them — the consumer side
(an entry fetched from a producer) and the local tier (an entry this instance saved itself) — and
both need the same bookkeeping: a transfer id fresh per dispatch, the orders handed to the
workers once (:meth:`LoadLedger.take`), the ranks' reports counted until every rank has reported
(success or failure alike: the blocks are read either way), and a deadline after which an
unreported load is settled anyway (a rank that died must not pin the blocks forever). Settling
calls the owner's ``on_done``, which gives back what pinned the blocks (a fetched entry's hold,
a local entry's pin); only then may eviction reuse them.

Sans-I/O: time is a parameter (``now``, seconds on the scheduler's monotonic clock).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ectransport.vllm.metadata import LoadOrder

log = logging.getLogger("ectransport.vllm.loads")


@dataclass
class _Load:
    order: LoadOrder
    owner: str
    on_done: Callable[[], None]
    give_up: float
    ranks: set[int] = field(default_factory=set)


class LoadLedger:
    """The load orders of one scheduler (module docstring).

    Args:
        expected_reports: how many ranks report each load (every loading rank; at least 1).
        timeout_s: a load not reported by every rank this long after it was queued is settled
            anyway (``load_timeout_s``).
    """

    def __init__(self, expected_reports: int, timeout_s: float):
        self.expected_reports = max(1, expected_reports)
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._issued: set[int] = set()
        self._queued: list[LoadOrder] = []
        self._loads: dict[int, _Load] = {}

    @property
    def busy(self) -> bool:
        """Orders queued and not yet handed to the workers."""
        return bool(self._queued)

    def pending(self, owner: str | None = None) -> int:
        """Loads not yet settled (queued or awaiting reports), of ``owner`` or of all."""
        return sum(owner is None or x.owner == owner for x in self._loads.values())

    def queued(self, mm_hash: str) -> bool:
        """An order for ``mm_hash`` waits to be handed out (a second one would load it twice)."""
        return any(o.mm_hash == mm_hash for o in self._queued)

    def new_id(self) -> int:
        """A transfer id for the next :meth:`add` (ids are never reused)."""
        tid = next(self._ids)
        self._issued.add(tid)
        return tid

    def add(self, order: LoadOrder, *, owner: str, on_done: Callable[[], None],
            now: float) -> None:
        """Queue ``order`` (its ``transfer_id`` from :meth:`new_id`); ``on_done`` runs once,
        when every rank has reported it, when it times out, or at :meth:`close`.

        Raises:
            ValueError: the transfer id was not issued by :meth:`new_id` or is in use.
        """
        if order.transfer_id not in self._issued:
            raise ValueError(f"transfer id {order.transfer_id} was not issued by this ledger or "
                             "is in use already")
        self._issued.discard(order.transfer_id)
        self._queued.append(order)
        self._loads[order.transfer_id] = _Load(order, owner, on_done, now + self.timeout_s)

    def take(self, now: float) -> list[LoadOrder]:
        """This step's orders for the workers (each handed out once); first settles the loads
        whose deadline has passed."""
        for tid, load in list(self._loads.items()):
            if now >= load.give_up:
                log.warning("EC %s: load %d of %s not reported by every rank within %.0f s; "
                            "releasing it", load.owner, tid, load.order.mm_hash, self.timeout_s)
                self._settle(tid)
        orders, self._queued = self._queued, []
        return orders

    def on_reports(self, loaded: list[tuple[int, int]], failed: list[tuple[int, int, str]]) -> None:
        """Apply the workers' ``(transfer_id, rank)`` reports (``failed`` with the reason);
        unknown ids (stale, replayed, another connector's) are ignored."""
        for tid, rank, why in failed:
            load = self._loads.get(tid)
            if load is not None:
                log.error("EC %s: rank %d could not load %s (transfer %d): %s", load.owner,
                          rank, load.order.mm_hash, tid, why)
        for tid, rank in [*loaded, *((t, r) for t, r, _ in failed)]:
            load = self._loads.get(tid)
            if load is None:
                continue
            load.ranks.add(rank)
            if len(load.ranks) >= self.expected_reports:
                self._settle(tid)

    def _settle(self, tid: int) -> None:
        load = self._loads.pop(tid)
        if load.order in self._queued:  # timed out before any step handed it out
            self._queued.remove(load.order)
        load.on_done()

    def close(self) -> None:
        """Settle every load (``on_done`` of each; one that raises is logged, the rest go on)."""
        self._queued.clear()
        for tid in list(self._loads):
            try:
                self._settle(tid)
            except Exception:  # noqa: BLE001 - shutdown goes on whatever one owner does
                log.exception("EC loads: settling transfer %d failed", tid)
