"""Scheduler side of the producer role: reserve, dispatch saves, commit, announce.

Life of one encoder output (mm_hash)::

    update_state_after_alloc ─► ProducerNode.reserve (NOT_READY: consumers get NACK_NOT_READY)
                                and a save-mark slot in the region file
    build_connector_meta     ─► SaveOrder to the workers (the saving rank copies into the blocks,
                                then writes the entry id into the mark slot)
    any scheduler hook       ─► mark seen (poll_marks) or worker report: ProducerNode.commit
                                (READY, servable); failed mark/report or nothing within
                                save_timeout_s: ProducerNode.abort
    request_finished         ─► ec_transfer_params for every feature with an entry, ready or not

The mark is what makes an encoder-only producer work on vLLM's V1 model runner, which drops the
worker's reports of an ``ec_producer`` (its encoder-only path returns an empty output): the
scheduler reads the marks on every hook it gets, including ``has_pending_push_work``, which vLLM
asks before it lets an idle engine sleep. ``busy`` is true only while a save is unfinished (at
most ``save_timeout_s``), so an idle engine sleeps.

Serving runs on the ProducerNode's own thread: grants, leases and completions do not wait for
engine steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ectransport.node.common import Layout, Security
from ectransport.node.producer import ProducerNode
from ectransport.store import AllocFailed
from ectransport.vllm.announcement import TRANSPORT, Announcement
from ectransport.vllm.fleet import offer_targets
from ectransport.vllm.metadata import SaveOrder
from ectransport.vllm.region import RegionPart, SharedRegion
from ectransport.vllm.settings import Settings

log = logging.getLogger("ectransport.vllm.producer")


class ProducerSide:
    """Owns the :class:`ProducerNode` serving ``part`` of the shared region.

    Raises:
        ConfigError / PlaneUnavailable: from the node (port in use, keys, plane missing).
    """

    def __init__(self, settings: Settings, layout: Layout, part: RegionPart, security: Security,
                 node_id: str, marks: SharedRegion | None = None,
                 fleet_trusted: Callable[[str, bytes | None], bool] | None = None):
        self.settings = settings
        self.layout = layout
        self.part = part
        self.marks = marks
        self._free_slots: list[int] = list(range(marks.mark_slots)) if marks is not None else []
        self._cooling: list[tuple[float, int]] = []  # slots of dropped saves, free after a while
        # every producer setting through the mapping `ectransport serve` uses (advertise_host
        # was once left out here: a wildcard host could not serve the tcp/ucx planes)
        self.node = ProducerNode(layout=layout, security=security, region=part,
                                 settings=settings.common.producer,
                                 node=settings.node_section(node_id),
                                 trust=settings.common.trust, fleet=settings.common.fleet,
                                 fleet_trusted=fleet_trusted).start()
        self._reserved: dict[str, SaveOrder] = {}  # reserved, not yet dispatched
        self._saving: dict[str, tuple[int, float, int]] = {}  # dispatched: entry_id, give-up, slot
        self._drops: list[tuple[str, int]] = []
        #: called with an mm_hash once its entry is READY (the fleet side offers it to waiters)
        self.on_ready: Callable[[str], None] | None = None
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
        if self.marks is not None and not self._free_slots:
            log.warning("EC producer: not saving %s: %d saves already in flight", mm_hash,
                        self.marks.mark_slots)
            return
        entry = self.node.reserve(mm_hash, nbytes)
        if isinstance(entry, AllocFailed):
            if entry.reason != "exists":
                log.warning("EC producer: not saving %s (%d bytes): region %s (%d free, %d "
                            "evictable blocks)", mm_hash, nbytes, entry.reason, entry.free_blocks,
                            entry.evictable_blocks)
            return
        mark = -1
        if self.marks is not None:
            slot = self._free_slots.pop()
            self.marks.clear_mark(slot)
            mark = self.marks.mark_offset + 8 * slot
        self._reserved[mm_hash] = SaveOrder(mm_hash, entry.entry_id,
                                            tuple(self.part.spans(entry.runs, nbytes)), nbytes,
                                            (rows, self.layout.hidden), mark)

    def take_orders(self, now: float) -> tuple[list[SaveOrder], list[tuple[str, int]]]:
        """This step's save orders and dropped saves (saves unreported past their deadline)."""
        self.poll_marks()
        for mm_hash, (entry_id, give_up, slot) in list(self._saving.items()):
            if now >= give_up:
                del self._saving[mm_hash]
                self.node.abort(mm_hash, entry_id)
                self._drops.append((mm_hash, entry_id))
                if slot >= 0:  # a late mark of this save must not land on the next user's
                    self._cooling.append((now + self.settings.save_timeout_s, slot))
                log.warning("EC producer: save of %s not reported within %.0f s; dropped",
                            mm_hash, self.settings.save_timeout_s)
        while self._cooling and self._cooling[0][0] <= now:
            self._free_slots.append(self._cooling.pop(0)[1])
        orders = list(self._reserved.values())
        self._reserved.clear()
        for o in orders:
            slot = -1
            if o.mark_offset >= 0:
                assert self.marks is not None  # on_alloc gives a mark only with a marks region
                slot = (o.mark_offset - self.marks.mark_offset) // 8
            self._saving[o.mm_hash] = (o.entry_id, now + self.settings.save_timeout_s, slot)
        drops, self._drops = self._drops, []
        return orders, drops

    def poll_marks(self) -> None:
        """Commit (or abort) the dispatched saves whose mark the saving worker has written."""
        if self.marks is None:
            return
        for mm_hash, (entry_id, _, slot) in list(self._saving.items()):
            if slot < 0:
                continue
            mark = self.marks.mark(slot)
            if mark == entry_id:
                self._saved(mm_hash, entry_id)
            elif mark == -entry_id:
                self._failed(mm_hash, entry_id, "marked failed by the worker")

    def on_reports(self, saved: list[tuple[str, int]], failed: list[tuple[str, int, str]]) -> None:
        """Apply the workers' save reports: completed copies become READY, failed ones go."""
        for mm_hash, entry_id in saved:
            if self._saving.get(mm_hash, (None,))[0] == entry_id:
                self._saved(mm_hash, entry_id)
        for mm_hash, entry_id, why in failed:
            if self._saving.get(mm_hash, (None,))[0] == entry_id:
                self._failed(mm_hash, entry_id, why)
        self.poll_marks()

    def _end(self, mm_hash: str) -> None:
        _, _, slot = self._saving.pop(mm_hash)
        if slot >= 0:
            self._free_slots.append(slot)

    def _saved(self, mm_hash: str, entry_id: int) -> None:
        self._end(mm_hash)
        if self.node.commit(mm_hash, entry_id):
            log.debug("EC producer: %s ready", mm_hash)
            if self.on_ready is not None:
                self.on_ready(mm_hash)

    def _failed(self, mm_hash: str, entry_id: int, why: str) -> None:
        self._end(mm_hash)
        self.node.abort(mm_hash, entry_id)
        log.warning("EC producer: save of %s failed on the worker: %s", mm_hash, why)

    def announce(self, request: Any) -> dict[str, dict[str, Any]]:
        """``ec_transfer_params`` for the request's features that have an entry (ready, or with
        the save still in flight: consumers' requests wait for it), one :class:`Announcement`
        each, as plain dicts. Each is announced (:meth:`ProducerNode.announce`): ``ect_hold``
        names its hold, which consumer sessions were offered, so that they read it with no
        request (ECTP v2 §10); absent when no hold was taken."""
        items: dict[str, dict[str, Any]] = {}
        for feature in request.mm_features or ():
            mm_hash = feature.identifier
            entry = self.node.lookup(mm_hash)
            if entry is None:
                continue  # never saved, or evicted: the consumer computes it
            # held and offered (ECTP v2 §10) to the consumer the request names, if it names one
            ticket = self.node.announce(mm_hash, to=offer_targets(request))
            items[mm_hash] = Announcement(
                peer_host=self.settings.announced_host,
                peer_port=self.node.port,
                size_bytes=entry.nbytes,
                shape=[entry.nbytes // self.layout.block_bytes, self.layout.hidden],
                dtype=self.layout.dtype,
                public_key=self.node.public_key,
                planes=list(self.settings.planes),
                versions=list(self.settings.versions),
                producer_id=self.node.node_id,
                transport=TRANSPORT,
                ect_hold=ticket.hold_id if ticket is not None and ticket.hold_id else None,
            ).to_params()
        return items

    def close(self) -> None:
        self._reserved.clear()
        self._saving.clear()
        self.node.close()
