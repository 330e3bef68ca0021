"""The consumer driver's inbox: one small frozen type per command a caller thread hands over.

Any thread appends (``collections.deque.append`` is atomic); whichever thread drives the node
takes them in order at its next :meth:`ConsumerDriver.step`. A command never changes meaning
with its position: each names its own fields.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ectransport.node.results import ProducerAddress
from ectransport.protocol import Ticket


@dataclass(frozen=True, eq=False)
class StartFetch:
    """Fetch ``mm_hash`` from ``producer`` by ``deadline`` (driver clock, seconds); ``future``
    resolves to Fetched/Miss, or to Held when ``held``. ``nbytes``: the entry's size when the
    wire cannot tell it (the vLLM wire profile), else None."""

    producer: ProducerAddress
    mm_hash: str
    deadline: float
    future: Future[Any]
    held: bool = False
    nbytes: int | None = None
    ticket: Ticket | None = None  # the producer's announcement (ECTP v2 §10)


@dataclass(frozen=True, eq=False)
class StartBatch:
    """Fetch several entries from one ``producer`` together (:meth:`ConsumerNode.submit_many`):
    each of ``items`` (same producer and deadline) resolves on its own; on an ECTP v2 session the
    new ones are asked for in one ``ReqBatch`` and their READs posted together."""

    producer: ProducerAddress
    deadline: float
    items: tuple[StartFetch, ...]


@dataclass(frozen=True, eq=False)
class Connect:
    """Connect and negotiate with ``producer``; ``future`` resolves to the negotiated plane or
    raises a typed error (see :meth:`ConsumerNode.connect`)."""

    producer: ProducerAddress
    deadline: float
    future: Future[str]


@dataclass(frozen=True)
class ReleaseFetched:
    """The last view of a zero-copy :class:`Fetched` was collected: give its blocks back."""

    local_key: str
    entry_id: int


@dataclass(frozen=True)
class ReleaseHeld:
    """:meth:`ConsumerNode.release_held`: drop one pin of a :class:`Held` landing entry."""

    local_key: str
    entry_id: int


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Compute :meth:`ConsumerDriver.gauges` on the driving thread (a consistent copy)."""

    future: Future[dict[str, int]]


InboxItem = StartFetch | StartBatch | Connect | ReleaseFetched | ReleaseHeld | Snapshot
