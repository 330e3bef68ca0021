"""One fetch of a consumer session: its states, its record, the consumer's settings, and the
rules a grant must pass before it is used.

**Validity window** (ECTP v1 §6.3; the rule that keeps wrong bytes from ever being reported). A
grant is used only while the consumer can prove its lease is alive, on its own clock, from a
moment that precedes the grant: ``valid_until = (XferReq sent) + lease_s − margin`` with
``margin = min(validity_margin_s, lease_s / 4)`` (:func:`valid_until`). The producer's lease
starts when it issues the grant, after the request was sent, so the producer cannot have unpinned
(or re-used) the blocks before ``valid_until``. Therefore an ack handled after ``valid_until`` is
not used (the grant is given back with ``XferDone(ok=False)`` and the request re-sent while the
fetch deadline allows, at most :data:`MAX_LATE_GRANTS` times), and a transfer whose completion is
observed after it is discarded and reported as a miss (its transfer is quarantined as after a read
timeout). ``Renew`` frames are not confirmed in v1, so the consumer never counts them: a transfer
must complete inside the window of its own request.

**ECTP v2** (protocols/ectp-v2.md). On a session negotiated at v2 every request is a
``ReqBatch`` (:class:`Batch` remembers what it asked), and the same window applies to a grant
in an ``AckBatch``, counted from when that ``ReqBatch`` was sent. Each item must be answered or
named in a ``Parked`` frame within ``ack_timeout_s`` of the send (as an ``XferReq`` in v1);
a parked item's answer is due by :func:`parked_deadline`. An entry answered *inline* (its
bytes in the answer, no grant) needs no window: the bytes are a copy, taken by the producer while
it held the entry; :func:`inline_problem` is what they must pass before they are landed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from ectransport.protocol import MAX_INLINE_BYTES, Status
from ectransport.session.commands import MissReason
from ectransport.settings_schema import API
from ectransport.store import BlockStore, Entry

#: Longest lease a consumer accepts in a grant, seconds (one day). A longer one is nonsensical
#: (and would make the validity window, and the renewals computed from it, unbounded).
MAX_LEASE_S = 86400.0
#: Shortest lease a consumer accepts, seconds: a grant that expires before a round trip could
#: complete is useless (and would make the consumer ask again and again).
MIN_LEASE_S = 0.1
#: How often one fetch asks again after a grant arrived past its validity window.
MAX_LATE_GRANTS = 3

class FetchState(enum.Enum):
    QUEUED = "queued"  #: waiting for the connection to be welcomed
    WAITING_ACK = "waiting_ack"
    BACKOFF = "backoff"  #: a retryable NACK; the request is sent again at ``deadline``
    READING = "reading"
    QUARANTINED = "quarantined"


NACK_REASON = {
    Status.NACK_MISSING: MissReason.MISSING,
    Status.NACK_INCOMPAT: MissReason.INCOMPATIBLE,
    Status.NACK_VERSION: MissReason.VERSION,
    Status.NACK_BUSY: MissReason.BUSY,
    Status.NACK_NOT_READY: MissReason.MISSING,
    Status.NACK_BAD_REQUEST: MissReason.INTERNAL,
    Status.NACK_INTERNAL: MissReason.INTERNAL,
}


@dataclass(frozen=True)
class ConsumerConfig:
    """Consumer-side settings (seconds).

    Attributes:
        node_id: this node's name, sent in Hello.
        compat_hash: must equal the producer's.
        planes: data planes this node can use, best first.
        versions: protocol versions spoken.
        ack_timeout_s: XferReq → XferAck deadline; on v2, ReqBatch → each item's answer or
            its ``Parked`` [2 s, as vLLM's consumer_ack_timeout_s].
        read_timeout_s: data-plane transfer deadline after the ack [20 s].
        quarantine_s: how long a timed-out transfer keeps its local blocks [60 s].
        hello_timeout_s: connection + Hello → Welcome deadline [5 s].
        retry_backoff_s / retry_backoff_max_s: first and largest wait before re-sending an
            XferReq answered NACK_NOT_READY or NACK_BUSY [0.02 s → 0.5 s, doubling].
        peer_backoff_s / peer_backoff_max_s: peer quarantine after a failure [1 s → 60 s].
        mem_kinds: memory kinds of the landing region, sent in Hello (``"DRAM"``, ``"VRAM"``).
        localities: ``(plane, token)`` pairs sent in Hello: each plane's
            ``DataTransport.locality()``, from which the producer judges reachability.
        validity_margin_s: safety margin of the validity window (see the module docstring)
            [0.25 s; at most a quarter of the lease].
        request_notifications: ask the data plane to notify the producer when a transfer
            completes (ECTP v1 §5 accepts the notification or ``XferDone`` as the completion
            signal; this consumer always sends ``XferDone``, so the notification is only a
            backstop for a consumer that dies between the two). Off by default: over NIXL the
            notification is a second UCX message the READ waits for, measured +0.15 ms per
            64 KiB fetch on a 2-core host, nothing at 8.8 MiB. [False]
        inline_max_bytes: ECTP v2: the largest entry, bytes, this consumer accepts inline in an
            ``AckBatch`` (sent as the ``ReqBatch``'s ``inline_max``; clamped to the wire's 1 MiB;
            0 turns inline answers off) [64 KiB].
        wait_margin_s: ECTP v2: a ``ReqBatch`` asks the producer to wait for entries not yet
            ready for the fetch's remaining time minus this margin (at most a quarter of the
            remaining time), so that a NACK_NOT_READY still arrives before the deadline [0.25 s].
        offers: ECTP v2 §10: ask the producer for offers of the entries it announces, so that a
            fetch given their ticket reads with no request
            (:mod:`ectransport.session.consumer_offers`) [True].
    """

    node_id: str
    compat_hash: str
    planes: tuple[str, ...] = API.node.planes
    versions: tuple[int, ...] = API.node.versions
    ack_timeout_s: float = API.consumer.ack_timeout_s
    read_timeout_s: float = API.consumer.read_timeout_s
    quarantine_s: float = API.consumer.quarantine_s
    hello_timeout_s: float = API.consumer.hello_timeout_s
    retry_backoff_s: float = API.consumer.retry_backoff_s
    retry_backoff_max_s: float = API.consumer.retry_backoff_max_s
    peer_backoff_s: float = API.consumer.peer_backoff_s
    peer_backoff_max_s: float = API.consumer.peer_backoff_max_s
    request_notifications: bool = False
    validity_margin_s: float = 0.25
    localities: tuple[tuple[str, bytes], ...] = ()
    mem_kinds: tuple[str, ...] = ("DRAM",)
    inline_max_bytes: int = API.consumer.inline_max_bytes
    wait_margin_s: float = 0.25
    offers: bool = True


@dataclass
class Fetch:
    """One fetch in flight (keyed by mm_hash within a session)."""

    mm_hash: str
    state: FetchState
    deadline: float  # of the current state (ack, read, retry, quarantine)
    final_deadline: float  # the caller's overall deadline
    started: float
    grant_id: int = -1
    lease_s: float = 0.0
    entry: Entry | None = None  # local landing blocks, keyed "<mm_hash>#<n>" in the store
    handle: Any = None
    retry_s: float = 0.0
    req_sent: float = 0.0  # when the latest XferReq of this fetch was sent (consumer clock)
    late_grants: int = 0  # grants that arrived past their validity window
    valid_until: float = float("inf")  # end of the granted lease's validity window
    last_nack: Status | None = None
    timings: dict[str, float] = field(default_factory=dict)
    batch_id: int = -1  # v2: the ReqBatch whose answer is awaited (-1: an XferReq, v1)
    expected_bytes: int | None = None  # the entry's size when the caller knows it
    offer: bool = False  # read on a producer's offer (ECTP v2 §10), not on an answered request


@dataclass
class Batch:
    """A ``ReqBatch`` sent (ECTP v2) whose items are not all answered yet.

    ``items``: the mm_hashes it named; ``waiting``: those not answered yet (an answer for one
    not in ``waiting`` is a second answer or names something never asked: ignored);
    ``inline_max``: what it accepted inline, bytes; ``sent``: when it was sent (consumer
    clock); ``wait_s``: the wait it asked for; ``parked``: the items a ``Parked`` frame named
    (each once: a second naming is ignored), whose answer is due by
    :func:`parked_deadline` instead of ``sent + ack_timeout_s``.
    """

    items: frozenset[str]
    waiting: set[str]
    inline_max: int
    sent: float = 0.0
    wait_s: float = 0.0
    parked: set[str] = field(default_factory=set)


def parked_deadline(sent: float, requested_wait_s: float, parked_wait_s: float,
                    ack_timeout_s: float, final_deadline: float) -> float:
    """When the answer of a parked batch item is due (ECTP v2 §6), seconds on the consumer's
    clock: ``sent + min(parked_wait_s, requested_wait_s) + ack_timeout_s`` — the producer
    answers by the end of the wait it honours, counted from when it received the batch (after
    ``sent``); a ``Parked.wait_s`` above what the batch asked for is not believed — and never
    later than the fetch's ``final_deadline``."""
    wait_s = max(0.0, min(parked_wait_s, requested_wait_s))
    return min(final_deadline, sent + wait_s + ack_timeout_s)


def valid_until(req_sent: float, lease_s: float, validity_margin_s: float) -> float:
    """End of a grant's validity window on the consumer's clock (module docstring):
    ``req_sent + lease_s − min(validity_margin_s, lease_s / 4)``, seconds."""
    return req_sent + lease_s - min(validity_margin_s, lease_s / 4)


def grant_problem(g: Any, plane: str | None, store: BlockStore) -> str:
    """Why an OK ack's grant cannot be used ("" if it can): it must exist, match the local layout
    and negotiated plane, and carry a finite, positive lease."""
    if g is None:
        return "an OK ack without a grant"
    if g.plane != plane:
        return f"grant for plane {g.plane!r}, negotiated {plane!r}"
    if g.block_bytes != store.block_bytes or g.num_blocks != store.blocks_for(g.entry_bytes):
        return (f"grant of {g.num_blocks} blocks of {g.block_bytes} bytes for {g.entry_bytes} "
                f"bytes does not match the local layout ({store.block_bytes}-byte blocks)")
    if not (math.isfinite(g.lease_s) and MIN_LEASE_S <= g.lease_s <= MAX_LEASE_S):
        return (f"lease_s must be a number of seconds in [{MIN_LEASE_S:g}, {MAX_LEASE_S:g}], "
                f"got {g.lease_s!r}")
    return ""


def inline_problem(data: bytes, inline_max: int, block_bytes: int,
                   expected_bytes: int | None) -> str:
    """Why an entry sent inline cannot be landed ("" if it can): at most ``inline_max`` bytes
    (what the batch accepted, itself at most ``MAX_INLINE_BYTES``), a whole number of rows
    (``block_bytes`` each: the layout's one row per block), and ``expected_bytes`` when the
    caller knows the size."""
    n = len(data)
    if n > min(inline_max, MAX_INLINE_BYTES):
        return f"inline entry of {n} bytes, more than the {inline_max} bytes this batch accepted"
    if block_bytes > 0 and n % block_bytes:
        return (f"inline entry of {n} bytes is not a whole number of {block_bytes}-byte rows "
                f"(the layout)")
    if expected_bytes is not None and n != expected_bytes:
        return f"inline entry of {n} bytes, expected {expected_bytes}"
    return ""
