"""Per-step payloads between the scheduler delegate and the worker delegates.

vLLM carries them inside ``SchedulerOutput`` / ``ModelRunnerOutput`` through its own IPC, so they
are plain dataclasses of str/int/tuple. Byte positions are offsets into the shared region file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

Spans = tuple[tuple[int, int], ...]  # (file offset, length) in bytes, in payload order


@dataclass(frozen=True)
class SaveOrder:
    """Producer: copy ``encoder_cache[mm_hash]`` (``shape`` = ``[num_tokens, hidden]``) into
    ``spans``; ``entry_id`` names the reservation the report refers to. Once the copy has
    completed, the saving rank also writes ``entry_id`` (``-entry_id`` if it failed) as a
    little-endian int64 at ``mark_offset`` of the region file: the scheduler reads it there when
    vLLM drops the worker's report (the V1 runner does for an ``ec_producer``)."""

    mm_hash: str
    entry_id: int
    spans: Spans
    nbytes: int
    shape: tuple[int, int]
    mark_offset: int = -1


@dataclass(frozen=True)
class LoadOrder:
    """Consumer (or the local tier of ``ec_both``): put the ``nbytes`` at ``spans`` into
    ``encoder_cache[mm_hash]`` as a ``shape`` tensor of the model dtype; ``transfer_id`` is fresh
    per dispatch."""

    mm_hash: str
    transfer_id: int
    spans: Spans
    nbytes: int
    shape: tuple[int, int]


@dataclass
class ECTransportMetadata(ECConnectorMetadata):
    """Scheduler → workers, once per step.

    Attributes:
        region_path / region_bytes: the shared region file the orders refer to.
        saves: new save orders (only the saving rank acts on them).
        drop_saves: ``(mm_hash, entry_id)`` the scheduler gave up on; forget them.
        loads: load orders (every rank acts on them).
    """

    region_path: str = ""
    region_bytes: int = 0
    saves: list[SaveOrder] = field(default_factory=list)
    drop_saves: list[tuple[str, int]] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)


@dataclass
class ECTransportWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker → scheduler, once per step; vLLM folds the ranks' reports with :meth:`aggregate`.

    Attributes:
        saved: ``(mm_hash, entry_id)`` whose copy into the region has completed.
        save_failed: ``(mm_hash, entry_id, why)``.
        loaded: ``(transfer_id, rank)`` whose copy out of the region has completed on ``rank``.
        load_failed: ``(transfer_id, rank, why)``.
    """

    saved: list[tuple[str, int]] = field(default_factory=list)
    save_failed: list[tuple[str, int, str]] = field(default_factory=list)
    loaded: list[tuple[int, int]] = field(default_factory=list)
    load_failed: list[tuple[int, int, str]] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if not isinstance(other, ECTransportWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into "
                            "ECTransportWorkerMetadata (two EC connectors in one engine?)")
        self.saved.extend(other.saved)
        self.save_failed.extend(other.save_failed)
        self.loaded.extend(other.loaded)
        self.load_failed.extend(other.load_failed)
        return self

    def __bool__(self) -> bool:
        return bool(self.saved or self.save_failed or self.loaded or self.load_failed)
