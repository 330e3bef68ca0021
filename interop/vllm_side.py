"""vLLM 0.33.0's own EC P2P classes, driven the way its scheduler drives them (no reimplementation).

* :class:`StockVllmProducer`: vLLM's ``ProducerSession`` over its ``ZmqServerTransport``, its
  ``NixlDataTransport`` and its ``EmbeddingCache``, on a host buffer laid out as vLLM lays out its
  region (one row per block); ``poll_step()`` runs on a thread, as the scheduler would once per
  engine step.
* :func:`stock_vllm_fetch`: vLLM's ``ConsumerSession`` over its ``ZmqClientTransport`` and
  ``NixlDataTransport``: ``start_xfer`` → ``poll`` / ``take_results`` until completed, tombstoned or
  the deadline, re-issuing retryable transfers as the scheduler does.

Importing this module imports vLLM (seconds); run it in the vLLM venv (``.venv-vllm``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field

for _k, _v in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"),
               ("VLLM_NO_USAGE_STATS", "1")):
    os.environ.setdefault(_k, _v)

import numpy as np  # noqa: E402
import vllm.version  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.cpu.control.zmq import (  # noqa: E402
    ZmqClientTransport,
    ZmqServerTransport,
)
from vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl import NixlDataTransport  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.cpu.protocol import (  # noqa: E402
    EC_CONNECTOR_VERSION,
    compute_ec_compatibility_hash,
)
from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler.embedding_cache import (  # noqa: E402
    EmbeddingCache,
)
from vllm.distributed.ec_transfer.ec_connector.cpu.session import (  # noqa: E402
    ConsumerSession,
    ProducerSession,
)

VLLM_VERSION = vllm.version.__version__


def vllm_hash(model: str, dtype: str, block_bytes: int, version: str = VLLM_VERSION) -> str:
    """The compatibility hash a vLLM scheduler computes (``dtype`` as ``torch.<name>``)."""
    dt = dtype if dtype.startswith("torch.") else f"torch.{dtype}"
    return compute_ec_compatibility_hash(vllm_version=version, model=model, dtype=dt,
                                         block_size_bytes=block_bytes)


class _Region:
    """A page-aligned host buffer of ``num_blocks`` rows of ``block_bytes`` (vLLM's layout)."""

    def __init__(self, num_blocks: int, block_bytes: int):
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self._raw = np.zeros(num_blocks * block_bytes + 4096, dtype=np.uint8)
        off = (-self._raw.ctypes.data) % 4096
        self.buf = self._raw[off:off + num_blocks * block_bytes]
        self.addr = int(self.buf.ctypes.data)

    def rows(self, block_ids) -> np.ndarray:
        return np.concatenate([self.buf[b * self.block_bytes:(b + 1) * self.block_bytes]
                               for b in block_ids])


class StockVllmProducer:
    """vLLM's producer session on ``host:port`` (see module docstring)."""

    def __init__(self, *, host: str, port: int, model: str, dtype: str, block_bytes: int,
                 num_blocks: int, engine_id: str | None = None):
        self.region = _Region(num_blocks, block_bytes)
        self.cache = EmbeddingCache(num_blocks)
        self.compat_hash = vllm_hash(model, dtype, block_bytes)
        self.data = NixlDataTransport(agent_name=engine_id or f"vllm-e-{uuid.uuid4().hex[:6]}",
                                      base_ptr=self.region.addr, num_blocks=num_blocks,
                                      block_size_bytes=block_bytes,
                                      total_size_bytes=num_blocks * block_bytes)
        self.transport = ZmqServerTransport(host=host, port=port)
        self.host = host
        self.port = port
        self.session = ProducerSession(transport=self.transport, data=self.data, cache=self.cache,
                                       compat_hash=self.compat_hash)
        self._lock = threading.Lock()
        self._rows: dict[str, int] = {}  # mm_hash -> rows (blocks) it holds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-producer", daemon=True)
        self._thread.start()

    def put(self, mm_hash: str, rows: np.ndarray, *, ready: bool = True) -> None:
        """Store ``rows`` ([n, block_bytes] uint8) as vLLM's save path would, then mark ready."""
        n = rows.shape[0]
        with self._lock:
            entry = self.cache.alloc(mm_hash, n, (n, rows.shape[1]))
            assert entry is not None, "vLLM region full"
            self._rows[mm_hash] = n
            for i, b in enumerate(entry.block_ids):
                bb = self.region.block_bytes
                self.region.buf[b * bb:(b + 1) * bb] = rows[i]
            if ready:
                self.cache.mark_ready(mm_hash)

    def mark_ready(self, mm_hash: str) -> None:
        with self._lock:
            self.cache.mark_ready(mm_hash)

    def pinned(self, mm_hash: str) -> int:
        e = self.cache.get(mm_hash)
        return 0 if e is None else max(0, e._pin_count)

    def stats(self) -> dict[str, int]:
        """``pinned_bytes``: the bytes of the entries vLLM's cache holds pinned for a consumer
        now (vLLM's session keeps no such count: read from its cache's pin counts), and
        ``entries``."""
        with self._lock:
            pinned = sum(n * self.region.block_bytes for h, n in self._rows.items()
                         if self.pinned(h))
            return {"pinned_bytes": pinned, "entries": len(self._rows)}

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self.session.poll(self.transport.poll(timeout_ms=5))
            time.sleep(0.001)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.session.close()
        self.data.deregister()


@dataclass
class StockFetch:
    """Outcome of :func:`stock_vllm_fetch`: ``state`` is completed | tombstoned | timeout."""

    state: str
    data: np.ndarray | None = None
    retries: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class StockVllmConsumer:
    """vLLM's consumer side: one ``ZmqClientTransport``, one ``NixlDataTransport``, one
    ``ConsumerSession`` per producer address (as its scheduler keeps them)."""

    def __init__(self, *, model: str, dtype: str, block_bytes: int, num_blocks: int,
                 compat_hash: str | None = None, engine_id: str | None = None):
        self.region = _Region(num_blocks, block_bytes)
        self.cache = EmbeddingCache(num_blocks)
        self.compat_hash = compat_hash or vllm_hash(model, dtype, block_bytes)
        self.data = NixlDataTransport(agent_name=engine_id or f"vllm-pd-{uuid.uuid4().hex[:6]}",
                                      base_ptr=self.region.addr, num_blocks=num_blocks,
                                      block_size_bytes=block_bytes,
                                      total_size_bytes=num_blocks * block_bytes)
        self.transport = ZmqClientTransport()
        self.sessions: dict[tuple[str, int], ConsumerSession] = {}

    def session(self, addr: tuple[str, int]) -> ConsumerSession:
        s = self.sessions.get(addr)
        if s is None:
            s = self.sessions[addr] = ConsumerSession(
                addr=addr, zmq_conn=self.transport.connect(addr), transport=self.transport,
                data=self.data, compat_hash=self.compat_hash)
        return s

    def fetch(self, addr: tuple[str, int], mm_hash: str, num_rows: int, *,
              timeout_s: float = 20.0, ack_timeout_s: float = 2.0) -> StockFetch:
        """Fetch like vLLM's scheduler: allocate, start_xfer, poll each 'step', retry retryables."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        s = self.session(addr)
        out = StockFetch("timeout")
        entry = None
        key = ""
        while time.monotonic() < deadline:
            if entry is None:  # local cache key: unique per attempt, the wire key is mm_hash
                key = f"{mm_hash}#{uuid.uuid4().hex[:6]}"
                entry = self.cache.alloc(key, num_rows, (num_rows, self.region.block_bytes))
                assert entry is not None, "vLLM consumer region full"
                s.start_xfer(mm_hash, list(entry.block_ids), time.monotonic() + ack_timeout_s)
            msgs = self.transport.poll().get(addr, [])
            s.poll(msgs, time.monotonic())
            r = s.take_results()
            if mm_hash in r.completed:
                self.cache.mark_ready(key)  # ready + unpinned: evictable, as after a load
                out = StockFetch("completed", self.region.rows(entry.block_ids).copy(),
                                 out.retries)
                entry = None
                break
            if mm_hash in r.tombstoned:
                out = StockFetch("tombstoned", retries=out.retries)
                break
            if mm_hash in r.quarantined:  # DMA may still land: keep the blocks
                out = StockFetch("quarantined", retries=out.retries)
                entry = None
                break
            if mm_hash in r.retryable:
                self.cache.discard(key)
                entry = None
                out.retries += 1
                time.sleep(0.02)
                continue
            time.sleep(0.001)
        if entry is not None:
            self.cache.discard(key)
        out.seconds = time.monotonic() - t0
        return out

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.transport.close()
        self.data.deregister()


__all__ = ["EC_CONNECTOR_VERSION", "VLLM_VERSION", "StockFetch", "StockVllmConsumer",
           "StockVllmProducer", "vllm_hash"]
