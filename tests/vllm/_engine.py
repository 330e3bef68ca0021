"""A stand-in for one vLLM engine around an EC connector, faithful to vLLM 0.33.0's call order.

The connectors come from vLLM's own ``ECConnectorFactory`` (scheduler and worker role), and are
driven with vLLM's real ``Request`` / ``MultiModalFeatureSpec`` / ``PlaceholderRange`` /
``SchedulerOutput`` / ``ECConnectorOutput`` objects, in the order vLLM uses:

- scheduler, per waiting request: ``ensure_cache_available`` (False defers it) →
  ``has_cache_item`` per encoder input → ``update_state_after_alloc`` (computed inputs, then
  externally loaded ones); per step: ``build_connector_meta``; after the worker:
  ``update_connector_output``; on finish: ``request_finished``;
- worker, per step: ``bind_connector_metadata`` → ``start_save_caches`` (producer) →
  ``start_load_caches`` (consumer) → the "forward" (the encoder runs for the scheduled inputs,
  then the embeddings are gathered from ``encoder_cache``) → ``save_caches`` for every new cache
  key (producer) → ``get_finished`` → ``build_connector_worker_meta`` →
  ``clear_connector_metadata``.

The "encoder" is deterministic: ``encoder_output(mm_hash, rows, hidden, salt)``; engines use
different salts, so a tensor bit-identical to the producer's can only have been fetched.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch
from vllm import SamplingParams
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request

HIDDEN = 64
DTYPE = torch.bfloat16


def make_config(role: str, extra: dict, engine_id: str | None = None) -> VllmConfig:
    """A model-less VllmConfig for ``role``: vLLM refuses to build one as ``ec_producer``
    without a model, so it is built as ``ec_both`` and the role set afterwards."""
    ec = ECTransferConfig(ec_connector="ECTransportConnector",
                          ec_connector_module_path="ectransport.vllm", ec_role="ec_both",
                          ec_connector_extra_config=dict(extra), engine_id=engine_id)
    cfg = VllmConfig(ec_transfer_config=ec)
    cfg.ec_transfer_config.ec_role = role
    return cfg


def encoder_output(mm_hash: str, rows: int, hidden: int = HIDDEN, salt: str = "") -> torch.Tensor:
    """The deterministic "encoder output" of an item: ``[rows, hidden]`` bf16."""
    seed = int.from_bytes(hashlib.sha256(f"{salt}/{mm_hash}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g).to(DTYPE)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def make_request(rid: str, features: list[tuple[str, int, int]],
                 ec_transfer_params: dict | None = None, text_tokens: int = 4,
                 media: bool = True) -> Request:
    """A real vLLM Request whose prompt holds ``features`` = ``(mm_hash, offset, length)``;
    ``media=False``: the items carry no data (an orchestrator replaced them by references)."""
    end = max((o + n for _, o, n in features), default=0) + text_tokens
    specs = [MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy() if media else None,
                                   modality="image",
                                   identifier=h, mm_position=PlaceholderRange(offset=o, length=n),
                                   mm_hash=h) for h, o, n in features]
    extra_args = {"ec_transfer_params": ec_transfer_params} if ec_transfer_params else None
    return Request(request_id=rid, prompt_token_ids=[7] * end,
                   sampling_params=SamplingParams(max_tokens=1, extra_args=extra_args),
                   pooling_params=None, mm_features=specs)


@dataclass
class Finished:
    """What one request left behind: its ec_transfer_params and, per mm_hash, the embedding the
    model consumed and where it came from (``"loaded"`` or ``"computed"``)."""

    params: dict | None
    error: bool = False  # failed by the scheduler (take_unavailable_requests)
    embeds: dict[str, torch.Tensor] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    steps_deferred: int = 0


class Engine:
    """One vLLM instance: a scheduler connector, a worker connector, an encoder cache."""

    def __init__(self, role: str, extra: dict, salt: str, engine_id: str | None = None):
        self.config = make_config(role, extra, engine_id)
        self.salt = salt
        self.sched = ECConnectorFactory.create_connector(self.config, ECConnectorRole.SCHEDULER)
        try:
            self.worker = ECConnectorFactory.create_connector(self.config, ECConnectorRole.WORKER)
        except BaseException:
            self.sched.shutdown()
            raise
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.waiting: list[Request] = []
        self.finished: dict[str, Finished] = {}
        self.hold_reports = False
        self.drop_worker_meta = False  # as vLLM's V1 runner does for an ec_producer
        self.held: list[tuple] = []
        wd = self.worker._worker
        if wd is not None:  # completed saves stay "in flight" (no report, no mark) while held
            add = wd._add
            wd._add = lambda item: (self.held.append(item)
                                    if self.hold_reports and isinstance(item[0], str)
                                    else add(item))
            self._worker_add = add
        self._deferred: dict[str, int] = {}
        self._finished_ids: set[str] = set()
        self._free: list[str] = []
        self.steps = 0

    # -- driving -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def run(self, timeout_s: float = 30.0, idle_sleep_s: float = 0.005) -> int:
        """Step until nothing waits and the connector has no pending work; returns the steps.

        Raises:
            AssertionError: still busy after ``timeout_s`` (a stuck request).
        """
        deadline = time.monotonic() + timeout_s
        n = 0
        while self.waiting or self.sched.has_pending_push_work():
            assert time.monotonic() < deadline, \
                f"engine stuck: waiting={[r.request_id for r in self.waiting]} " \
                f"pending_work={self.sched.has_pending_push_work()}"
            progressed = self.step()
            n += 1
            if not progressed:
                time.sleep(idle_sleep_s)
        return n

    def release_reports(self) -> None:
        """Complete the saves held back by ``hold_reports`` (still "in flight" until now): the
        worker reports and marks them, the next step delivers the reports."""
        held, self.held = self.held, []
        for item in held:
            self._worker_add(item)

    def step(self) -> bool:
        """One engine step; True if a request was scheduled."""
        self.steps += 1
        sched = self.sched
        scheduled: list[tuple[Request, list[int]]] = []
        for req in list(self.waiting):
            if req.mm_features and not sched.ensure_cache_available(req, req.num_computed_tokens):
                self._deferred[req.request_id] = self._deferred.get(req.request_id, 0) + 1
                continue
            compute, external = [], []
            for i, f in enumerate(req.mm_features):
                if f.identifier in self.encoder_cache and f.identifier not in self._free:
                    # already in the encoder cache: shared, nothing to schedule (an entry this
                    # step frees is not: vLLM's encoder-cache manager never both keeps and
                    # frees one — a request admitted at once, its fetch landed within the
                    # step, would otherwise find it gone)
                    continue
                if sched.has_cache_item(f.identifier):
                    external.append(i)
                else:
                    compute.append(i)
            for i in compute + external:
                sched.update_state_after_alloc(req, i)
            self.waiting.remove(req)
            scheduled.append((req, compute))
        out = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(r, ([],)) for r, _ in scheduled],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={r.request_id: r.num_tokens for r, _ in scheduled},
            total_num_scheduled_tokens=sum(r.num_tokens for r, _ in scheduled),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={r.request_id: c for r, c in scheduled if c},
            finished_req_ids=self._finished_ids,
            free_encoder_mm_hashes=self._free,
        )
        self._finished_ids, self._free = set(), []
        out.ec_connector_metadata = sched.build_connector_meta(out)
        ec_out, embeds = self._execute(out, [r for r, _ in scheduled])
        if ec_out is not None and not ec_out.is_empty() and not self.drop_worker_meta:
            sched.update_connector_output(ec_out)
        for rid in sched.take_unavailable_requests():  # update_from_output fails these
            req = next(r for r in self.waiting if r.request_id == rid)
            self.waiting.remove(req)
            sched.request_finished(req)
            self.finished[rid] = Finished(None, error=True,
                                          steps_deferred=self._deferred.pop(rid, 0))
            self._finished_ids.add(rid)
        for req, compute in scheduled:  # max_tokens=1: every request ends after its prefill
            _, params = sched.request_finished(req)
            computed = {req.mm_features[i].identifier for i in compute}
            fin = Finished(params, steps_deferred=self._deferred.pop(req.request_id, 0))
            for f in req.mm_features:
                if f.identifier in embeds:
                    fin.embeds[f.identifier] = embeds[f.identifier]
                fin.source[f.identifier] = "computed" if f.identifier in computed else "loaded"
            self.finished[req.request_id] = fin
            self._finished_ids.add(req.request_id)
            self._free += [f.identifier for f in req.mm_features]
        return bool(scheduled)

    def _execute(self, out: SchedulerOutput, reqs: list[Request]):
        """The worker's execute_model around the EC connector (vLLM's runner wrapper)."""
        w = self.worker
        for mm_hash in out.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        ec_out = ECConnectorOutput()
        w.bind_connector_metadata(out.ec_connector_metadata)
        if w.is_producer:
            w.start_save_caches(encoder_cache=self.encoder_cache)
        if w.is_consumer:
            w.start_load_caches(self.encoder_cache)
        before = set(self.encoder_cache)
        embeds: dict[str, torch.Tensor] = {}
        try:
            by_id = {r.request_id: r for r in reqs}
            for rid, inputs in out.scheduled_encoder_inputs.items():  # the encoder
                for i in inputs:
                    f = by_id[rid].mm_features[i]
                    self.encoder_cache[f.identifier] = encoder_output(
                        f.identifier, f.mm_position.get_num_embeds(), salt=self.salt)
            for r in reqs:  # gather the multimodal embeddings (vLLM asserts they exist)
                for f in r.mm_features:
                    if not w.is_consumer and f.identifier not in self.encoder_cache:
                        continue  # an encoder-only instance gathers nothing (skipped encoder)
                    t = self.encoder_cache[f.identifier]
                    assert t.shape == (f.mm_position.get_num_embeds(), HIDDEN), t.shape
                    assert t.dtype == DTYPE
                    embeds[f.identifier] = t.clone()
            if w.is_producer:
                for mm_hash in set(self.encoder_cache) - before:
                    w.save_caches(encoder_cache=self.encoder_cache, mm_hash=mm_hash)
        finally:
            ec_out.finished_sending, ec_out.finished_recving = w.get_finished(
                out.finished_req_ids)
            ec_out.ec_connector_worker_meta = w.build_connector_worker_meta()
            w.clear_connector_metadata()
        return ec_out, embeds

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()
