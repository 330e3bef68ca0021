"""The local CPU tier: an instance reuses the encoder outputs it saved earlier in its own region.

vLLM keeps encoder outputs in its (device) encoder cache only while requests use them and space
allows. An instance that saves its outputs into the host region (``ec_producer``, ``ec_both``)
holds them there until FIFO eviction of ready, unpinned entries (the producer store's rule), so a
repeated item can skip the encoder, with or without peers — what vLLM's ECCPUConnector offers as
CPU offload:

- ``has_cache_item`` is true for a READY entry of this instance's producer store;
- ``ec_both`` (runs the model): the entry is pinned and a :class:`LoadOrder` copies it into
  ``encoder_cache`` on every rank; the pin goes once every rank reported the load (or after
  ``load_timeout_s``: the scheduler's :class:`~ectransport.vllm.loads.LoadLedger`, shared with
  the consumer side), so eviction never reuses blocks a load still reads;
- ``ec_producer`` (encoder only): nothing to load; the encoder is skipped and the entry is
  announced again.
"""

from __future__ import annotations

import logging
from typing import Any

from ectransport.vllm.loads import LoadLedger
from ectransport.vllm.metadata import LoadOrder
from ectransport.vllm.sched_producer import ProducerSide

log = logging.getLogger("ectransport.vllm.local")

#: The ledger's name for this tier's loads (logs, ``LoadLedger.pending``).
OWNER = "local tier"


class LocalTier:
    """Local reuse of ``producer``'s ready entries (see module docstring).

    Args:
        producer: the instance's producer side (its node's store holds the entries).
        ledger: the scheduler's load ledger (shared with the consumer side): queues this tier's
            load orders and counts their reports; the pin of a load goes when it settles.
        loads: True when the instance runs the model (``ec_both``): hits are loaded.
    """

    def __init__(self, producer: ProducerSide, ledger: LoadLedger, *, loads: bool):
        self.producer = producer
        self.node = producer.node
        self.ledger = ledger
        self.loads = loads
        self.hits = 0

    def has(self, mm_hash: str) -> bool:
        e = self.node.lookup(mm_hash)
        return e is not None and e.ready

    @property
    def pinned(self) -> int:
        """Local loads whose pin is held."""
        return self.ledger.pending(OWNER)

    def on_alloc(self, request: Any, index: int, now: float) -> bool:
        """The scheduler takes ``request.mm_features[index]`` from this tier. True if handled
        (a load was queued, or none is needed); False if the entry went meanwhile."""
        mm_hash = request.mm_features[index].identifier
        if not self.loads:
            self.hits += 1
            return self.has(mm_hash)
        if self.ledger.queued(mm_hash):
            return True
        e = self.node.pin_local(mm_hash)
        if e is None or not e.ready:
            return False
        self.hits += 1
        rows = e.nbytes // self.producer.layout.block_bytes
        order = LoadOrder(mm_hash, self.ledger.new_id(),
                          tuple(self.producer.part.spans(e.runs, e.nbytes)), e.nbytes,
                          (rows, self.producer.layout.hidden))
        entry_id = e.entry_id
        self.ledger.add(order, owner=OWNER, on_done=lambda: self._unpin(mm_hash, entry_id),
                        now=now)
        log.debug("EC local tier: loading %s from the host region", mm_hash)
        return True

    def _unpin(self, mm_hash: str, entry_id: int) -> None:
        """The ledger settled the load: drop its pin (the entry may be evicted again)."""
        if not self.node.unpin_local(mm_hash, entry_id):
            log.debug("EC local tier: unpin of %s skipped (entry gone)", mm_hash)
