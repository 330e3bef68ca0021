"""The local CPU tier: an instance reuses the encoder outputs it saved earlier in its own region.

vLLM keeps encoder outputs in its (device) encoder cache only while requests use them and space
allows. An instance that saves its outputs into the host region (``ec_producer``, ``ec_both``)
holds them there until FIFO eviction of ready, unpinned entries (the producer store's rule), so a
repeated item can skip the encoder, with or without peers — what vLLM's ECCPUConnector offers as
CPU offload:

- ``has_cache_item`` is true for a READY entry of this instance's producer store;
- ``ec_both`` (runs the model): the entry is pinned and a :class:`LoadOrder` copies it into
  ``encoder_cache`` on every rank; the pin goes once every rank reported the load (or after
  ``load_timeout_s``), so eviction never reuses blocks a load still reads;
- ``ec_producer`` (encoder only): nothing to load; the encoder is skipped and the entry is
  announced again.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from ectransport.vllm.metadata import LoadOrder
from ectransport.vllm.sched_producer import ProducerSide

log = logging.getLogger("ectransport.vllm.local")

#: Transfer ids of local loads start here, far from the consumer side's (which start at 1).
FIRST_ID = 1 << 48


@dataclass
class _Load:
    mm_hash: str
    entry_id: int
    give_up: float
    ranks: set[int] = field(default_factory=set)


class LocalTier:
    """Local reuse of ``producer``'s ready entries (see module docstring).

    Args:
        producer: the instance's producer side (its node's store holds the entries).
        loads: True when the instance runs the model (``ec_both``): hits are loaded.
        expected_load_reports: ranks that report each load.
        load_timeout_s: a load pin not reported by every rank by then is released anyway.
    """

    def __init__(self, producer: ProducerSide, *, loads: bool, expected_load_reports: int,
                 load_timeout_s: float):
        self.producer = producer
        self.node = producer.node
        self.loads = loads
        self.expected_load_reports = max(1, expected_load_reports)
        self.load_timeout_s = load_timeout_s
        self._ids = itertools.count(FIRST_ID)
        self._queued: list[LoadOrder] = []
        self._inflight: dict[int, _Load] = {}
        self.hits = 0

    def has(self, mm_hash: str) -> bool:
        e = self.node.lookup(mm_hash)
        return e is not None and e.ready

    @property
    def pinned(self) -> int:
        """Local loads whose pin is held."""
        return len(self._inflight)

    def on_alloc(self, request: Any, index: int, now: float) -> bool:
        """The scheduler takes ``request.mm_features[index]`` from this tier. True if handled
        (a load was queued, or none is needed); False if the entry went meanwhile."""
        mm_hash = request.mm_features[index].identifier
        if not self.loads:
            self.hits += 1
            return self.has(mm_hash)
        if any(o.mm_hash == mm_hash for o in self._queued):
            return True
        e = self.node.pin_local(mm_hash)
        if e is None or not e.ready:
            return False
        self.hits += 1
        tid = next(self._ids)
        rows = e.nbytes // self.producer.layout.block_bytes
        self._queued.append(LoadOrder(mm_hash, tid, tuple(self.producer.part.spans(e.runs,
                                                                                   e.nbytes)),
                                      e.nbytes, (rows, self.producer.layout.hidden)))
        self._inflight[tid] = _Load(mm_hash, e.entry_id, now + self.load_timeout_s)
        log.debug("EC local tier: loading %s from the host region", mm_hash)
        return True

    def take_orders(self, now: float) -> list[LoadOrder]:
        for tid, load in list(self._inflight.items()):
            if now >= load.give_up:
                log.warning("EC local tier: load of %s not reported by every rank within "
                            "%.0f s; releasing it", load.mm_hash, self.load_timeout_s)
                self._unpin(tid)
        orders, self._queued = self._queued, []
        return orders

    def on_reports(self, loaded: list[tuple[int, int]], failed: list[tuple[int, int, str]]) -> None:
        for tid, rank, why in failed:
            if tid in self._inflight:
                log.error("EC local tier: rank %d could not load %s: %s", rank,
                          self._inflight[tid].mm_hash, why)
        for tid, rank in [*loaded, *((t, r) for t, r, _ in failed)]:
            load = self._inflight.get(tid)
            if load is None:
                continue
            load.ranks.add(rank)
            if len(load.ranks) >= self.expected_load_reports:
                self._unpin(tid)

    def _unpin(self, tid: int) -> None:
        load = self._inflight.pop(tid)
        if not self.node.unpin_local(load.mm_hash, load.entry_id):
            log.debug("EC local tier: unpin of %s skipped (entry gone)", load.mm_hash)

    def close(self) -> None:
        for tid in list(self._inflight):
            self._unpin(tid)
        self._queued.clear()
