"""``ECTransportConnector``: vLLM's encoder-cache connector API on top of ectransport.

vLLM builds one instance in the scheduler process (``ECConnectorRole.SCHEDULER``) and one in each
worker process (``ECConnectorRole.WORKER``); each forwards to its delegate
(:class:`~ectransport.vllm.scheduler.SchedulerDelegate`,
:class:`~ectransport.vllm.worker.WorkerDelegate`). Select it with::

    --ec-transfer-config '{"ec_connector": "ECTransportConnector",
                           "ec_connector_module_path": "ectransport.vllm",
                           "ec_role": "ec_producer", "ec_connector_extra_config": {...}}'

Settings: :mod:`ectransport.vllm.settings`. Deployment: ``docs/vllm.md``. Fleet metrics go
through vLLM's EC connector stats path (:mod:`ectransport.vllm.ec_stats`).
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from ectransport.vllm.layout import layout_for
from ectransport.vllm.scheduler import SchedulerDelegate
from ectransport.vllm.settings import parse_settings
from ectransport.vllm.worker import WorkerDelegate

_stats: ModuleType | None
try:  # vLLM's EC connector stats path (0.33); an older vLLM has none
    from ectransport.vllm import ec_stats as _stats
except ImportError:
    _stats = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request


class ECTransportConnector(ECConnectorBase):
    """Encoder-cache transfers between vLLM instances over ectransport (CURVE + NIXL).

    Raises (constructor):
        ConfigError: bad ``ec_connector_extra_config``, keys, bind address or region.
        PlaneUnavailable: a configured data plane cannot run here.
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config, role)
        ec = vllm_config.ec_transfer_config
        self.settings = parse_settings(ec.ec_connector_extra_config, producer=self.is_producer,
                                       consumer=self.is_consumer)
        self.layout = layout_for(vllm_config, self.settings)
        self._scheduler: SchedulerDelegate | None = None
        self._worker: WorkerDelegate | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = SchedulerDelegate(vllm_config, self.settings, self.layout,
                                                producer=self.is_producer,
                                                consumer=self.is_consumer)
        else:
            self._worker = WorkerDelegate(vllm_config, self.layout, producer=self.is_producer,
                                          consumer=self.is_consumer)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    # -- worker side ---------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.on_bind(connector_metadata)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_caches(encoder_cache)

    def start_save_caches(self, **kwargs: Any) -> None:
        cache = kwargs.get("encoder_cache")
        if self._worker is not None and cache is not None:
            self._worker.start_save_caches(cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str,
                    **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_caches(encoder_cache, mm_hash)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is not None:
            self._worker.get_finished()
        return None, None

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return self._worker.build_worker_meta() if self._worker is not None else None

    # -- scheduler side ------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler is not None and self._scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._scheduler is None:
            return True
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._scheduler is not None, "build_connector_meta runs on the scheduler side"
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request)

    def take_unavailable_requests(self) -> set[str]:
        """Requests whose remote encoding failed and that carry no media to compute it."""
        if self._scheduler is None:
            return set()
        return self._scheduler.take_unavailable_requests()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # -- stats (vLLM's EC connector stats path: ectransport.vllm.ec_stats) ---------------------
    def get_ec_connector_stats(self) -> Any:
        """The fleet directory's counters of the last interval (scheduler side), or None."""
        if self._scheduler is None or self._scheduler.fleet is None or _stats is None:
            return None
        data = self._scheduler.fleet.interval_stats(time.monotonic())
        return _stats.ECTransportStats(data=data) if data else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if _stats is None:
            return None
        return _stats.ECTransportStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        if _stats is None:
            return None
        return _stats.ECTransportPromMetrics(vllm_config, metric_types, labelnames,
                                             per_engine_labelvalues)
