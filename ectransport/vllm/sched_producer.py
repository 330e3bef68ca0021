"""Scheduler side of the producer role: reserve, dispatch saves, commit, announce.

Life of one encoder output (mm_hash)::

    update_state_after_alloc ─► ProducerNode.reserve (NOT_READY: consumers get NACK_NOT_READY)
    build_connector_meta     ─► SaveOrder to the workers (the saving rank copies into the blocks)
    update_connector_output  ─► saved: ProducerNode.commit (READY, servable)
                                save_failed / no report within save_timeout_s: ProducerNode.abort
    request_finished         ─► ec_transfer_params for every feature with an entry, ready or not

Serving runs on the ProducerNode's own thread: grants, leases and completions do not wait for
engine steps.
"""

from __future__ import annotations

import logging
from typing import Any

from ectransport.node.common import Layout, Security
from ectransport.node.producer import ProducerNode
from ectransport.store import AllocFailed
from ectransport.vllm.metadata import SaveOrder
from ectransport.vllm.region import RegionPart
from ectransport.vllm.settings import Settings

log = logging.getLogger("ectransport.vllm.producer")

#: Marks the params entries this connector writes (other keys may be added by vLLM versions).
TRANSPORT = "ectransport"


class ProducerSide:
    """Owns the :class:`ProducerNode` serving ``part`` of the shared region.

    Raises:
        ConfigError / PlaneUnavailable: from the node (port in use, keys, plane missing).
    """

    def __init__(self, settings: Settings, layout: Layout, part: RegionPart, security: Security,
                 node_id: str):
        self.settings = settings
        self.layout = layout
        self.part = part
        self.node = ProducerNode(
            layout=layout, host=settings.host, port=settings.port, security=security,
            planes=settings.planes, lease_s=settings.lease_s, budget_bytes=settings.budget_bytes,
            node_id=node_id, versions=settings.versions, region=part).start()
        self._reserved: dict[str, SaveOrder] = {}  # reserved, not yet dispatched
        self._saving: dict[str, tuple[int, float]] = {}  # dispatched: entry_id, give-up time
        self._drops: list[tuple[str, int]] = []
        log.info("EC producer %s serving on %s:%d (planes %s, %d blocks of %d bytes)",
                 node_id, settings.announced_host, self.node.port, ",".join(settings.planes),
                 part.num_blocks, part.block_bytes)

    @property
    def busy(self) -> bool:
        """Saves reserved or dispatched but not yet reported by the workers."""
        return bool(self._reserved or self._saving)

    def on_alloc(self, request: Any, index: int) -> None:
        """Reserve blocks for the encoder output of ``request.mm_features[index]``; a full region
        skips the save (the engine never waits for it)."""
        feature = request.mm_features[index]
        mm_hash = feature.identifier
        if mm_hash in self._reserved or self.node.lookup(mm_hash) is not None:
            return
        rows = int(feature.mm_position.get_num_embeds())
        nbytes = rows * self.layout.block_bytes
        entry = self.node.reserve(mm_hash, nbytes)
        if isinstance(entry, AllocFailed):
            if entry.reason != "exists":
                log.warning("EC producer: not saving %s (%d bytes): region %s (%d free, %d "
                            "evictable blocks)", mm_hash, nbytes, entry.reason, entry.free_blocks,
                            entry.evictable_blocks)
            return
        self._reserved[mm_hash] = SaveOrder(mm_hash, entry.entry_id,
                                            tuple(self.part.spans(entry.runs, nbytes)), nbytes,
                                            (rows, self.layout.hidden))

    def take_orders(self, now: float) -> tuple[list[SaveOrder], list[tuple[str, int]]]:
        """This step's save orders and dropped saves (saves unreported past their deadline)."""
        for mm_hash, (entry_id, give_up) in list(self._saving.items()):
            if now >= give_up:
                del self._saving[mm_hash]
                self.node.abort(mm_hash, entry_id)
                self._drops.append((mm_hash, entry_id))
                log.warning("EC producer: save of %s not reported within %.0f s; dropped",
                            mm_hash, self.settings.save_timeout_s)
        orders = list(self._reserved.values())
        self._reserved.clear()
        for o in orders:
            self._saving[o.mm_hash] = (o.entry_id, now + self.settings.save_timeout_s)
        drops, self._drops = self._drops, []
        return orders, drops

    def on_reports(self, saved: list[tuple[str, int]], failed: list[tuple[str, int, str]]) -> None:
        """Apply the workers' save reports: completed copies become READY, failed ones go."""
        for mm_hash, entry_id in saved:
            if self._saving.get(mm_hash, (None,))[0] == entry_id:
                del self._saving[mm_hash]
                if self.node.commit(mm_hash, entry_id):
                    log.debug("EC producer: %s ready", mm_hash)
        for mm_hash, entry_id, why in failed:
            if self._saving.get(mm_hash, (None,))[0] == entry_id:
                del self._saving[mm_hash]
                self.node.abort(mm_hash, entry_id)
                log.warning("EC producer: save of %s failed on the worker: %s", mm_hash, why)

    def announce(self, request: Any) -> dict[str, dict[str, Any]]:
        """``ec_transfer_params`` for the request's features that have an entry (ready, or with
        the save still in flight: consumers retry on NACK_NOT_READY)."""
        items: dict[str, dict[str, Any]] = {}
        for feature in request.mm_features or ():
            mm_hash = feature.identifier
            entry = self.node.lookup(mm_hash)
            if entry is None:
                continue  # never saved, or evicted: the consumer computes it
            items[mm_hash] = {
                "peer_host": self.settings.announced_host,
                "peer_port": self.node.port,
                "size_bytes": entry.nbytes,
                "shape": [entry.nbytes // self.layout.block_bytes, self.layout.hidden],
                "dtype": self.layout.dtype,
                "public_key": self.node.public_key,
                "planes": list(self.settings.planes),
                "versions": list(self.settings.versions),
                "producer_id": self.node.node_id,
                "transport": TRANSPORT,
            }
        return items

    def close(self) -> None:
        self._reserved.clear()
        self._saving.clear()
        self.node.close()
