"""The worker-process delegate of :class:`~ectransport.vllm.ECTransportConnector`.

Maps the scheduler's region file (:class:`~ectransport.vllm.region.WorkerMapping`) and moves
bytes between it and vLLM's ``encoder_cache`` (``mm_hash`` → ``[num_tokens, hidden]`` tensor of
the model dtype, on the worker's device):

- **save** (producer; only TP rank 0 of PCP rank 0 on the first PP stage, the ranks that hold the
  encoder output): copy the tensor into the order's blocks. A CUDA copy runs on a side stream and
  is reported only once its event has completed; a CPU copy is complete on return.
- **load** (consumer; every rank): copy the blocks into a new tensor on the worker's device, put it
  into ``encoder_cache[mm_hash]``, report it once the copy has completed (the scheduler then
  unpins the blocks).

Reports go back through :class:`~ectransport.vllm.metadata.ECTransportWorkerMetadata`; a completed
(or failed) save is also marked in the region file (``SaveOrder.mark_offset``), because vLLM's V1
model runner drops the worker's reports of an ``ec_producer``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ectransport.errors import ConfigError
from ectransport.node.common import Layout
from ectransport.vllm.metadata import (
    ECTransportMetadata,
    ECTransportWorkerMetadata,
    LoadOrder,
    SaveOrder,
)
from ectransport.vllm.region import WorkerMapping

log = logging.getLogger("ectransport.vllm.worker")


def _ranks() -> tuple[bool, int]:
    """(is this the saving rank, global rank); a worker without model parallelism is rank 0."""
    saving, rank = True, 0
    try:
        from vllm.distributed import parallel_state as ps

        if getattr(ps, "_TP", None) is not None:
            saving = ps.get_tp_group().rank_in_group == 0
        if getattr(ps, "_PCP", None) is not None:
            saving = saving and ps.get_pcp_group().rank_in_group == 0
        if getattr(ps, "_PP", None) is not None:
            saving = saving and ps.get_pp_group().is_first_rank
    except Exception:  # noqa: BLE001 - no parallel state: a single worker
        pass
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    return saving, rank


def _device(vllm_config: Any) -> torch.device:
    dev = getattr(getattr(vllm_config, "device_config", None), "device", None)
    dev = torch.device(dev if dev is not None else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class WorkerDelegate:
    """Worker-side state of one engine rank (see module docstring)."""

    def __init__(self, vllm_config: Any, layout: Layout, *, producer: bool, consumer: bool):
        self._vllm_config = vllm_config
        self.layout = layout
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        self.producer = producer
        self.consumer = consumer
        self._device: torch.device | None = None
        self._ranks: tuple[bool, int] | None = None
        self._mapping: WorkerMapping | None = None
        self._host: torch.Tensor | None = None
        self._registered = False
        self._save_stream: torch.cuda.Stream | None = None
        self._saves: dict[str, SaveOrder] = {}  # ordered, not yet copied
        self._loads: list[LoadOrder] = []  # this step's
        self._copying: list[tuple[Any, Any, Any]] = []  # (report item, cuda event, keep-alive)
        self._marks: dict[tuple[str, int], int] = {}  # save (mm_hash, entry_id) -> mark offset
        self._cache: dict[str, torch.Tensor] | None = None
        self._report = ECTransportWorkerMetadata()

    # -- properties resolved on first use (parallel state and device exist by then) -----------
    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._device = _device(self._vllm_config)
        return self._device

    @property
    def saving_rank(self) -> bool:
        if self._ranks is None:
            self._ranks = _ranks()
        return self._ranks[0]

    @property
    def rank(self) -> int:
        if self._ranks is None:
            self._ranks = _ranks()
        return self._ranks[1]

    # -- hooks ---------------------------------------------------------------------------------
    def on_bind(self, meta: Any) -> None:
        """Take this step's orders from the scheduler's metadata."""
        if not isinstance(meta, ECTransportMetadata):
            return
        for mm_hash, entry_id in meta.drop_saves:
            o = self._saves.get(mm_hash)
            if o is not None and o.entry_id == entry_id:
                del self._saves[mm_hash]
        self._loads = list(meta.loads) if self.consumer else []
        if meta.saves and self.producer and self.saving_rank:
            for o in meta.saves:
                self._saves[o.mm_hash] = o
        if (self._loads or self._saves) and meta.region_path:
            self._map(meta.region_path, meta.region_bytes)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        self._cache = encoder_cache
        loads, self._loads = self._loads, []
        for o in loads:
            try:
                self._load(o, encoder_cache)
            except Exception as e:  # noqa: BLE001 - reported, the engine goes on
                log.exception("EC worker: load of %s failed", o.mm_hash)
                self._report.load_failed.append((o.transfer_id, self.rank, str(e)))

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Save ordered outputs that are already cached (computed in an earlier step)."""
        self._cache = encoder_cache
        self._save_ready(encoder_cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        self._cache = encoder_cache
        o = self._saves.get(mm_hash)
        if o is not None and mm_hash in encoder_cache:
            self._save(o, encoder_cache[mm_hash])

    def get_finished(self) -> None:
        """End of step: save whatever ordered output has appeared in the cache meanwhile."""
        if self._cache is not None:
            self._save_ready(self._cache)

    def build_worker_meta(self) -> ECTransportWorkerMetadata | None:
        """Reports of the copies that have completed (CUDA ones once their event has fired)."""
        still = []
        for item, event, keep in self._copying:
            if event is None or event.query():
                self._add(item)
            else:
                still.append((item, event, keep))
        self._copying = still
        report, self._report = self._report, ECTransportWorkerMetadata()
        return report if report else None

    def shutdown(self) -> None:
        """Wait for copies in flight, then unmap the region. Idempotent."""
        for _, event, _ in self._copying:
            if event is not None:
                event.synchronize()
        self._copying.clear()
        self._saves.clear()
        self._marks.clear()
        self._unmap()

    # -- internals -----------------------------------------------------------------------------
    def _unmap(self) -> None:
        self._host = None
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._mapping_addr)
            self._registered = False
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def _add(self, item: tuple) -> None:
        if isinstance(item[0], str):
            self._report.saved.append(item)
            self._mark(item, item[1])
        else:
            self._report.loaded.append(item)

    def _mark(self, save: tuple[str, int], value: int) -> None:
        """Write a save's outcome into its mark slot (after the bytes: x86 keeps store order)."""
        off = self._marks.pop(save, -1)
        if off >= 0 and self._host is not None:
            self._host[off: off + 8].view(torch.int64)[0] = value

    def _map(self, path: str, nbytes: int) -> None:
        if self._mapping is not None and self._mapping.path == path:
            return
        self._unmap()  # a new engine region (the scheduler restarted): forget the old one
        self._mapping = WorkerMapping(path, nbytes)
        self._host = self._mapping.tensor()
        self._mapping_addr = self._host.data_ptr()
        if self.device.type == "cuda":
            # page-locked host memory makes the copies asynchronous DMA (vLLM pins its region too)
            err = torch.cuda.cudart().cudaHostRegister(self._mapping_addr, nbytes, 0)
            self._registered = int(getattr(err, "value", err)) == 0
            if not self._registered:
                log.warning("EC worker: cudaHostRegister of %s failed (%s); copies stay "
                            "synchronous", path, err)

    def _save_ready(self, cache: dict[str, torch.Tensor]) -> None:
        for mm_hash in [m for m in self._saves if m in cache]:
            self._save(self._saves[mm_hash], cache[mm_hash])

    def _save(self, o: SaveOrder, tensor: torch.Tensor) -> None:
        del self._saves[o.mm_hash]
        if o.mark_offset >= 0:
            self._marks[(o.mm_hash, o.entry_id)] = o.mark_offset
        try:
            self._copy_in(o, tensor)
        except Exception as e:  # noqa: BLE001 - reported, the entry is dropped
            log.exception("EC worker: save of %s failed", o.mm_hash)
            self._report.save_failed.append((o.mm_hash, o.entry_id, str(e)))
            self._mark((o.mm_hash, o.entry_id), -o.entry_id)

    def _copy_in(self, o: SaveOrder, tensor: torch.Tensor) -> None:
        t = tensor.detach()
        if t.dtype != self.dtype or tuple(t.shape) != tuple(o.shape):
            raise ConfigError(f"encoder output of {o.mm_hash} is {tuple(t.shape)} {t.dtype}, "
                              f"the layout needs {tuple(o.shape)} {self.dtype}")
        if self._host is None:
            raise ConfigError("the region is not mapped")
        src = t.contiguous().view(torch.uint8).reshape(-1)
        if src.device.type == "cuda":
            if self._save_stream is None:
                self._save_stream = torch.cuda.Stream(device=src.device)
            stream = self._save_stream
            stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                self._copy_spans(src, o.spans, into_host=True)
                event = torch.cuda.Event()
                event.record(stream)
            self._copying.append(((o.mm_hash, o.entry_id), event, src))
        else:
            self._copy_spans(src.cpu(), o.spans, into_host=True)
            self._add((o.mm_hash, o.entry_id))

    def _copy_spans(self, dev: torch.Tensor, spans: tuple, *, into_host: bool) -> None:
        assert self._host is not None  # the callers check that the region is mapped
        pos = 0
        for off, n in spans:
            host = self._host[off: off + n]
            if into_host:
                host.copy_(dev[pos: pos + n], non_blocking=dev.device.type == "cuda")
            else:
                dev[pos: pos + n].copy_(host, non_blocking=dev.device.type == "cuda")
            pos += n

    def _load(self, o: LoadOrder, cache: dict[str, torch.Tensor]) -> None:
        if self._host is None:
            raise ConfigError("the region is not mapped")
        rows, hidden = o.shape
        if rows * hidden * self.dtype.itemsize != o.nbytes:
            raise ConfigError(f"load of {o.mm_hash}: {o.nbytes} bytes is not {o.shape} "
                              f"{self.dtype}")
        out = torch.empty((rows, hidden), dtype=self.dtype, device=self.device)
        self._copy_spans(out.view(torch.uint8).reshape(-1), o.spans, into_host=False)
        cache[o.mm_hash] = out
        item = (o.transfer_id, self.rank)
        if out.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(out.device))
            self._copying.append((item, event, None))
        else:
            self._add(item)
