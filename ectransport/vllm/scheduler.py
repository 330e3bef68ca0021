"""The scheduler-process delegate of :class:`~ectransport.vllm.ECTransportConnector`.

It creates the shared region (:class:`~ectransport.vllm.region.SharedRegion`) and the node(s):
a :class:`ProducerSide` for ``ec_producer``, a :class:`ConsumerSide` for ``ec_consumer``, both for
``ec_both`` (the region is then split in two halves: served entries, fetched entries), and for
the roles that save, the :class:`~ectransport.vllm.local_tier.LocalTier` (a repeated item is
taken from this instance's own region). The consumer side and the local tier queue their load
orders in one :class:`~ectransport.vllm.loads.LoadLedger`, which hands them to the workers and
counts the ranks' reports. With ``metrics_port`` the connector's Prometheus metrics are served
from this process (:mod:`ectransport.vllm.metrics`). With a fleet directory (``fleet_url``: :mod:`ectransport.vllm.fleet`)
items without ``ec_transfer_params`` are looked up (every role), claimed before they are encoded
(the roles that encode), and the producer node publishes what it holds. Every method is a thin
dispatch; the transfer logic lives in the nodes and sessions.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ectransport.errors import ConfigError
from ectransport.node.common import Layout, Security
from ectransport.vllm.fleet import FleetSide, fleet_trust, holder_announcement
from ectransport.vllm.loads import LoadLedger
from ectransport.vllm.local_tier import LocalTier
from ectransport.vllm.metadata import ECTransportMetadata, ECTransportWorkerMetadata
from ectransport.vllm.metrics import AdapterMetrics
from ectransport.vllm.region import SharedRegion, region_path
from ectransport.vllm.sched_consumer import ConsumerSide
from ectransport.vllm.sched_producer import ProducerSide
from ectransport.vllm.settings import Settings
from ectransport.vllm.trust import ProducerKeys

log = logging.getLogger("ectransport.vllm.scheduler")


def data_parallel_rank(vllm_config: Any) -> int:
    """This engine's data-parallel rank (0 without data parallelism)."""
    dp = getattr(vllm_config.parallel_config, "data_parallel_index", None)
    if dp is None:
        dp = getattr(vllm_config.parallel_config, "data_parallel_rank", 0)
    return int(dp or 0)


def engine_key(vllm_config: Any) -> str:
    """What names this engine's region: the EC engine id and the data-parallel rank."""
    return f"{vllm_config.ec_transfer_config.engine_id}-dp{data_parallel_rank(vllm_config)}"


def expected_load_reports(vllm_config: Any) -> int:
    """Ranks whose load reports reach the scheduler: every TP × PCP rank under the
    multiprocessing executor (vLLM aggregates all of them), one otherwise."""
    pc = vllm_config.parallel_config
    if getattr(pc, "distributed_executor_backend", None) != "mp":
        return 1
    return int(pc.tensor_parallel_size) * int(getattr(pc, "prefill_context_parallel_size", 1) or 1)


def item_metadata(vllm_config: Any) -> Callable[[Any], dict[str, dict[str, Any]]] | None:
    """vLLM's own per-item entries of ``ec_transfer_params`` (``metadata``: the processed fields a
    consumer needs to size an item it receives as a metadata-only reference, e.g. Qwen2-VL's
    ``image_grid_thw``; ``item_indices``), as vLLM's connectors report them from
    ``request_finished``. vLLM's EPD proxy rewrites the consumer's request from them. None where
    the installed vLLM has no such helper (then only our transfer fields are announced)."""
    try:
        from vllm.distributed.ec_transfer.ec_connector.utils import (
            PlaceholderMetadataResolver,
            collect_ec_item_metadata,
        )
    except ImportError:
        return None
    resolver = PlaceholderMetadataResolver(vllm_config.model_config)
    return lambda features: collect_ec_item_metadata(list(features or ()), resolver)


def security_for(settings: Settings, producer: bool) -> Security:
    if settings.insecure:
        return Security(insecure=True)
    assert settings.secret_key_file is not None  # parse_settings requires it without insecure
    return Security.from_files(settings.secret_key_file, settings.allow_dir if producer else None)


class SchedulerDelegate:
    """Scheduler-side state of one engine (see module docstring).

    Raises:
        ConfigError / PlaneUnavailable: region, keys, bind address or plane problems; nothing is
            left behind (region file, sockets) when construction fails.
    """

    def __init__(self, vllm_config: Any, settings: Settings, layout: Layout, *, producer: bool,
                 consumer: bool):
        self.settings = settings
        self.layout = layout
        key = engine_key(vllm_config)
        total = settings.region_bytes // layout.block_bytes
        roles = int(producer) + int(consumer)
        if total < roles:
            raise ConfigError(f"region_bytes {settings.region_bytes} holds fewer blocks than "
                              f"roles: one block is one row of {layout.hidden} {layout.dtype} "
                              f"({layout.block_bytes} bytes)")
        self.region = SharedRegion(region_path(settings.shm_dir, key), total, layout.block_bytes)
        self._handlers: dict[int, Any] = {}
        self._unlink_on_termination()
        self.producer: ProducerSide | None = None
        self.consumer: ConsumerSide | None = None
        self.local: LocalTier | None = None
        self.fleet: FleetSide | None = None
        self.metrics: AdapterMetrics | None = None
        self.loads = LoadLedger(expected_load_reports(vllm_config), settings.load_timeout_s)
        self._item_metadata = item_metadata(vllm_config) if producer else None
        fleet = settings.common.fleet.url is not None
        try:
            trusted = fleet_trust(ProducerKeys(settings), fetches=consumer) if fleet else None
            first = 0
            if producer:
                n = total // 2 if consumer else total
                self.producer = ProducerSide(settings, layout, self.region.part(0, n),
                                             security_for(settings, True), f"ect-p-{key}",
                                             marks=self.region, fleet_trusted=trusted)
                first = n
                if settings.local_cache:
                    self.local = LocalTier(self.producer, self.loads, loads=consumer)
            if consumer:
                self.consumer = ConsumerSide(settings, layout,
                                             self.region.part(first, total - first),
                                             security_for(settings, False), f"ect-c-{key}",
                                             self.loads,
                                             local=self.local.has if self.local else None)
            if fleet and trusted is not None:
                pf = self.producer.node.fleet if self.producer is not None else None
                node = self.producer.node if self.producer is not None else None
                self.fleet = FleetSide(
                    settings, layout, trusted=trusted, claims=pf is not None,
                    directory=pf.directory if pf is not None else None,
                    encoding=pf.encoding if pf is not None else None,
                    consumer_id=self.consumer.node.node_id if self.consumer is not None else None,
                    offer=(lambda m, to: node.announce(m, to=to)) if node is not None else None)
                if self.consumer is not None:
                    self.consumer.fleet = self.fleet
                if self.producer is not None and pf is not None:
                    self.producer.on_ready = self.fleet.ready
            self.metrics = self._metrics(vllm_config)
        except BaseException:
            self.shutdown()
            raise

    def _metrics(self, vllm_config: Any) -> AdapterMetrics | None:
        """The connector's Prometheus metrics (:mod:`ectransport.vllm.metrics`) on
        ``metrics_port`` (+ the data-parallel rank), or None when it is unset."""
        port = self.settings.common.metrics.port
        if port is None:
            return None
        if port:
            port += data_parallel_rank(vllm_config)
        nodes = [side.node for side in (self.producer, self.consumer) if side is not None]
        return AdapterMetrics(nodes, self.fleet, port=port,
                              host=self.settings.common.metrics.host)

    def _unlink_on_termination(self) -> None:
        """Remove the region file's name as soon as SIGTERM / SIGINT arrives, then run the
        handler that was there (vLLM's engine-core shutdown). vLLM's process manager kills an
        engine core that is not gone 5 s after its SIGTERM, and its own teardown (waiting for the
        workers) can take that long before the connector's ``shutdown`` runs. Only possible in
        the main thread; the previous handlers come back at :meth:`shutdown`."""
        if threading.current_thread() is not threading.main_thread():
            return
        region = self.region
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)

            def handler(signum: int, frame: Any, prev: Any = prev) -> None:
                region.unlink()
                if callable(prev):
                    prev(signum, frame)
                elif prev == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):
                continue
            self._handlers[sig] = (handler, prev)

    def _restore_handlers(self) -> None:
        for sig, (handler, prev) in getattr(self, "_handlers", {}).items():
            try:
                if signal.getsignal(sig) is handler:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._handlers = {}

    # -- vLLM scheduler hooks ------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return bool((self.consumer is not None and self.consumer.has(identifier)) or
                    (self.local is not None and self.local.has(identifier)) or
                    self._remote(identifier))

    def _remote(self, mm_hash: str) -> bool:
        """An ``ec_producer``'s item held by another fleet instance: not encoded here."""
        return self.consumer is None and self.fleet is not None and \
            self.fleet.remote_holder(mm_hash) is not None

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        if self.consumer is None:
            if self.fleet is None or self.producer is None:
                return True
            node = self.producer.node
            return self.fleet.admit_encoder(request, num_computed_tokens, time.monotonic(),
                                            lambda m: node.lookup(m) is not None,
                                            self.layout.block_bytes)
        return self.consumer.admit(request, num_computed_tokens, time.monotonic())

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        """Local tier hit: pin it and queue its load (ec_both). Otherwise consumer: pin a landed
        feature and queue its load; producer: reserve blocks for a feature the encoder computes
        here (ec_both does not re-serve what it fetched)."""
        mm_hash = request.mm_features[index].identifier
        now = time.monotonic()
        if self.consumer is not None:  # in vLLM's encoder cache from this step on
            self.consumer.in_vllm_cache(mm_hash)
        if self.local is not None and self.local.has(mm_hash) and \
                self.local.on_alloc(request, index, now):
            return
        fetched = self.consumer is not None and self.consumer.has(mm_hash)
        if self.producer is not None and not fetched and not self._remote(mm_hash):
            self.producer.on_alloc(request, index)
            pf = self.producer.node.fleet
            if pf is not None and self.producer.node.lookup(mm_hash) is None:
                pf.gone(mm_hash)  # not saved here (region full): a claim of it is given up
        if self.consumer is not None:
            self.consumer.on_alloc(request, index, now)

    def build_connector_meta(self, scheduler_output: Any) -> ECTransportMetadata:
        now = time.monotonic()
        meta = ECTransportMetadata(region_path=self.region.path,
                                   region_bytes=self.region.file_bytes)
        if self.producer is not None:
            meta.saves, meta.drop_saves = self.producer.take_orders(now)
        if self.consumer is not None:
            self.consumer.vllm_freed(getattr(scheduler_output, "free_encoder_mm_hashes", ()))
            self.consumer.step(now)
        if self.fleet is not None:
            self.fleet.step(now)  # this step's directory lookups: one pipeline
        meta.loads = self.loads.take(now)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(meta, ECTransportWorkerMetadata):
            return
        if self.producer is not None:
            self.producer.on_reports(meta.saved, meta.save_failed)
        self.loads.on_reports(meta.loaded, meta.load_failed)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        if self.consumer is not None:
            self.consumer.on_finished(request)
        if self.producer is None:
            return False, None
        items = self.producer.announce(request)
        if self._remote_any(request):  # held elsewhere in the fleet: announce that holder
            for feature in request.mm_features or ():
                h = self.fleet.remote_holder(feature.identifier) if self.fleet else None
                if h is not None and feature.identifier not in items:
                    items[feature.identifier] = holder_announcement(h, self.layout, self.settings)
        if items and self._item_metadata is not None:
            try:
                vllm_items = self._item_metadata(request.mm_features)
            except Exception:  # noqa: BLE001 - vLLM's metadata is optional; ours is complete
                log.warning("EC producer: vLLM's item metadata for %s failed; announcing the "
                            "transfer fields only", request.request_id, exc_info=True)
                vllm_items = {}
            for mm_hash, theirs in vllm_items.items():
                if mm_hash in items:
                    items[mm_hash] = {**theirs, **items[mm_hash]}
        return False, (items or None)

    def _remote_any(self, request: Any) -> bool:
        return any(self._remote(f.identifier) for f in request.mm_features or ())

    def take_unavailable_requests(self) -> set[str]:
        return self.consumer.take_unavailable() if self.consumer is not None else set()

    def has_pending_push_work(self) -> bool:
        """True only while a step can make progress that nothing else asks for: a save not yet
        marked or reported (CUDA copies are checked by the worker at each step). vLLM asks this
        before it lets an idle engine sleep, so completed saves become READY here too."""
        if self.producer is not None:
            self.producer.poll_marks()
        return bool((self.producer is not None and self.producer.busy) or self.loads.busy)

    def shutdown(self) -> None:
        """Remove the region file's name first (a process killed during the rest of the
        shutdown leaves nothing), close the nodes (in-flight fetches miss, grants are released),
        then unmap the region. Idempotent."""
        if getattr(self, "region", None) is not None:
            self.region.unlink()
        self._restore_handlers()
        loads = getattr(self, "loads", None)  # None when __init__ failed before setting it
        if loads is not None:
            loads.close()  # gives back the load pins while the nodes are still open
        self.local = None
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
            self.metrics = None
        fleet = getattr(self, "fleet", None)  # None when __init__ failed before setting it
        if fleet is not None:
            fleet.close()  # a lookup-only directory; the producer's goes with its node
        for side in (self.consumer, self.producer):
            if side is not None:
                try:
                    side.close()
                except Exception:  # noqa: BLE001 - shutdown goes on whatever one side does
                    log.exception("EC connector: closing %s failed", type(side).__name__)
        self.consumer = self.producer = None
        if getattr(self, "region", None) is not None:
            self.region.close()
