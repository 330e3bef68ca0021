"""What a consumer's caller gets back: where a producer is, and the outcome of one fetch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ectransport.node.common import Layout
from ectransport.session import Landed, Miss
from ectransport.store import Run


@dataclass(frozen=True)
class ProducerAddress:
    """Where a producer listens and its CURVE public key (Z85; None only in insecure mode)."""

    host: str
    port: int
    public_key: str | None = None

    @property
    def key(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Fetched:
    """A fetched entry.

    ``data`` is a 1-D uint8 array **over the consumer's landing region** (zero copy): the local
    blocks stay pinned for as long as ``data`` or anything derived from it (numpy views, the
    :meth:`tensor`) is alive, and are returned to the region when the last of them is garbage-
    collected. Keep what you need, drop the rest; a consumer whose region is full of held entries
    reports ``Miss(NO_SPACE)``.

    Attributes:
        timings: seconds since the fetch started: ``req`` (XferReq sent), ``ack``, ``posted``
            (data-plane transfer posted), ``landed``; plus ``total`` (until the result was ready).
        plane: the data plane that moved the bytes.
    """

    mm_hash: str
    data: np.ndarray
    layout: Layout
    plane: str
    timings: dict[str, float] = field(default_factory=dict)

    ok = True

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def tensor(self) -> Any:
        """The entry as a torch tensor ``[num_tokens, hidden]`` of ``layout.dtype`` (no copy)."""
        import torch

        dt = getattr(torch, self.layout.dtype)
        return torch.from_numpy(self.data).view(dt).reshape(-1, self.layout.hidden)


@dataclass(frozen=True)
class Held:
    """A fetched entry kept where it landed: READY and pinned in the consumer's region until
    :meth:`ConsumerNode.release_held` (for callers that read the blocks themselves, e.g. another
    process mapping the same ``/dev/shm`` region).

    Attributes:
        mm_hash: the fetched key.
        runs: the landing blocks in the consumer's region, in payload order.
        nbytes: payload size in bytes (the first ``nbytes`` bytes of ``runs``).
        block_bytes: bytes per block of the region.
        local_key / entry_id: the landing entry in the consumer's store (names the release).
        plane / timings: as in :class:`Fetched`.
    """

    mm_hash: str
    runs: tuple[Run, ...]
    nbytes: int
    block_bytes: int
    local_key: str
    entry_id: int
    plane: str
    timings: dict[str, float] = field(default_factory=dict)

    ok = True


Outcome = Fetched | Miss


def fetch_event(conn: str, session_id: str, outcome: Landed | Miss, started: float | None,
                now: float) -> dict[str, Any]:
    """The fields of a consumer's ``fetch`` observer event (see :class:`ConsumerNode`)."""
    fields: dict[str, Any] = {"peer": conn, "session_id": session_id,
                              "mm_hash": outcome.mm_hash[:12], "grant_id": -1,
                              "seconds": (now - started) if started is not None else None}
    if isinstance(outcome, Landed):
        t = outcome.timings
        fields.update(grant_id=outcome.grant_id, outcome="ok", reason="", plane=outcome.plane,
                      nbytes=outcome.entry.nbytes, descriptors=len(outcome.entry.runs),
                      transfer_s=(t["landed"] - t.get("posted", t.get("ack", 0.0)))
                      if "landed" in t else None)
    else:
        fields.update(outcome="miss", reason=outcome.reason.value, detail=outcome.detail)
    return fields
