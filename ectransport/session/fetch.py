"""One fetch of a consumer session: its states (each carrying its own data), the transition
table every state change goes through, and the rules a grant or an inline entry must pass before
its bytes are used.

States (:class:`FetchState` names the kind of each)::

    Queued ──ask──► Asked ──grant──► Reading ──(done)──► reported Landed
      │               │ ▲                │
      │ offer         │ │ ask            └─quarantine──► Quarantined ──(settled)──► gone
      └───────────────┼─┼──► Reading
                      ▼ │
                    Backoff (retryable NACK; asked again at ``retry_at``)

Every other way out is a :class:`~ectransport.session.commands.Report` and the fetch leaves the
session's table; :meth:`Fetch.go` raises :class:`IllegalFetchTransition` for a change the table
does not list (h11's rule: never proceed silently).

**Validity window** (ECTP v1 §6.3; the rule that keeps wrong bytes from ever being reported). A
grant is used only while the consumer can prove its lease is alive, on its own clock, from a
moment that precedes the grant: ``valid_until = (request sent) + lease_s − margin`` with
``margin = min(validity_margin_s, lease_s / 4)`` (:func:`valid_until`). The producer's lease
starts when it issues the grant, after the request was sent, so it cannot have unpinned (or
re-used) the blocks before ``valid_until``. An answer handled later is not used (the grant is
given back and the entry asked again, at most :data:`MAX_LATE_GRANTS` times), and a transfer
whose completion is observed after it is discarded and reported as a miss (its transfer is
quarantined as after a read timeout). An unconfirmed ``Renew`` (v1, or a producer that did not
grant ``"renew_ack"``) is never counted: the transfer must complete inside the window of its own
request. A ``RenewAck`` (ECTP v2 §11) moves the window by the same rule, from a moment that
precedes the producer's extension: ``(Renew sent) + extend_s − margin``
(:meth:`~ectransport.session.fetches.FetchTable.on_renew_ack`).

**ECTP v2** (protocols/ectp-v2.md): the same window applies to a grant in an ``AckBatch``,
counted from when its ``ReqBatch`` was sent. Each item must be answered or named in a ``Parked``
frame within ``ack_timeout_s`` of the send; a parked item's answer is due by
:func:`parked_deadline`. An entry answered *inline* (its bytes in the answer, no grant) needs no
window — the bytes are a copy the producer took while it held the entry — but must pass
:func:`inline_problem`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from ectransport.errors import ProtocolError
from ectransport.protocol import MAX_INLINE_BYTES, Grant, Status
from ectransport.session.commands import MissReason
from ectransport.store import BlockStore, Entry

#: Longest lease a consumer accepts in a grant, seconds (one day): a longer one would make the
#: validity window, and the renewals computed from it, unbounded.
MAX_LEASE_S = 86400.0
#: Shortest lease a consumer accepts, seconds: a grant that expires before a round trip could
#: complete is useless (and would make the consumer ask again and again).
MIN_LEASE_S = 0.1
#: How often one fetch asks again after a grant arrived past its validity window.
MAX_LATE_GRANTS = 3


class FetchState(enum.Enum):
    """The kind of a fetch's state (what ``fetch_states()`` and the gauges report)."""

    QUEUED = "queued"  #: waiting for the connection to be welcomed and bound
    WAITING_ACK = "waiting_ack"  #: asked; the answer (or a Parked naming it) is due
    BACKOFF = "backoff"  #: a retryable NACK; asked again at ``retry_at``
    READING = "reading"  #: the data-plane transfer of a usable grant
    QUARANTINED = "quarantined"  #: given up while the DMA may still land: blocks kept


@dataclass(frozen=True)
class Queued:
    """Waiting for the link to be READY; the request leaves then."""

    kind = FetchState.QUEUED


@dataclass(frozen=True)
class Asked:
    """A request for the entry is out: an ``XferReq`` (``batch_id`` None) or an item of the
    ``ReqBatch`` ``batch_id``, sent at ``sent`` (the validity window starts there); its answer,
    or a ``Parked`` naming it, is due by ``due`` (``parked``: a Parked did, and moved ``due`` to
    the end of the producer's wait)."""

    sent: float
    due: float
    batch_id: int | None = None
    parked: bool = False
    kind = FetchState.WAITING_ACK


@dataclass(frozen=True)
class Backoff:
    """A retryable NACK (``nack``): asked again at ``retry_at``. ``hurried``: a grant of ours
    just ended, so a NACK_BUSY retry was moved to now (once)."""

    retry_at: float
    nack: Status
    hurried: bool = False
    kind = FetchState.BACKOFF


@dataclass(frozen=True)
class Reading:
    """The READ (or push) of grant ``grant_id`` into the local ``entry`` is posted (``handle``
    once the plane returned it). Usable until ``valid_until``; given up at ``due``. ``offer``:
    started on a producer's offer (ECTP v2 §10), not on an answered request. ``read_by``: the
    read's own deadline (posted + ``read_timeout_s``); a confirmed renewal (ECTP v2 §11) moves
    ``valid_until`` and ``due`` later, never past it."""

    grant_id: int
    lease_s: float
    entry: Entry
    valid_until: float
    due: float
    offer: bool = False
    handle: Any = None
    read_by: float = math.inf
    kind = FetchState.READING


@dataclass(frozen=True)
class Quarantined:
    """Given up while its DMA may still land: the local ``entry`` is kept and ``handle`` is
    released when the plane reports the transfer over, or at ``until``."""

    entry: Entry | None
    handle: Any
    until: float
    grant_id: int
    kind = FetchState.QUARANTINED


State = Queued | Asked | Backoff | Reading | Quarantined

#: (state kind, event) → the kind the event leads to. Everything that changes a fetch's state
#: goes through :meth:`Fetch.go`, which refuses any pair not listed here. Leaving the session's
#: table (a report) is not a state: it is allowed from every state but Quarantined, whose only
#: way out is being settled.
FETCH_TRANSITIONS: dict[tuple[FetchState, str], FetchState] = {
    (FetchState.QUEUED, "ask"): FetchState.WAITING_ACK,
    (FetchState.BACKOFF, "ask"): FetchState.WAITING_ACK,
    (FetchState.WAITING_ACK, "ask"): FetchState.WAITING_ACK,  # a grant past its window: again
    (FetchState.WAITING_ACK, "parked"): FetchState.WAITING_ACK,
    (FetchState.WAITING_ACK, "retryable"): FetchState.BACKOFF,
    (FetchState.BACKOFF, "hurry"): FetchState.BACKOFF,
    (FetchState.WAITING_ACK, "grant"): FetchState.READING,
    (FetchState.QUEUED, "offer"): FetchState.READING,
    (FetchState.READING, "posted"): FetchState.READING,
    (FetchState.READING, "renewed"): FetchState.READING,  # a RenewAck (ECTP v2 §11)
    (FetchState.READING, "quarantine"): FetchState.QUARANTINED,
}


class IllegalFetchTransition(ProtocolError):
    """A fetch was driven with an event its state does not allow; names both."""

    def __init__(self, mm_hash: str, state: FetchState, event: str):
        super().__init__(f"fetch {mm_hash[:12]!r}: event {event!r} is illegal in state "
                         f"{state.name}")
        self.state = state
        self.event = event


@dataclass(eq=False)
class Fetch:
    """One fetch in flight, keyed by mm_hash within a session.

    Attributes:
        mm_hash: what is fetched.
        final_deadline: the caller's deadline (session clock, seconds): reported by then.
        started: when the fetch started.
        state: the current :data:`State` (change it only with :meth:`go`).
        expected_bytes: the entry's size when the caller knows it (an inline answer of another
            size is refused); None when it does not.
        retry_s: the current retry backoff (doubles per retryable NACK).
        last_nack: the latest retryable NACK, reported if the deadline comes first.
        late_grants: grants that arrived past their validity window.
        timings: seconds on the session clock at each step (``req``, ``ack``, ``posted``,
            ``offer``, ``landed``); reported relative to ``started``.
    """

    mm_hash: str
    final_deadline: float
    started: float
    state: State = field(default_factory=Queued)
    expected_bytes: int | None = None
    retry_s: float = 0.0
    last_nack: Status | None = None
    late_grants: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def kind(self) -> FetchState:
        return self.state.kind

    @property
    def due(self) -> float:
        """When this fetch must be looked at next: its state's own deadline, capped by the
        caller's (a queued fetch waits only for the caller's)."""
        match self.state:
            case Asked(due=d) | Reading(due=d):
                return min(d, self.final_deadline)
            case Backoff(retry_at=d):
                return min(d, self.final_deadline)
            case Quarantined(until=d):
                return d
            case _:
                return self.final_deadline

    def go(self, event: str, state: State) -> None:
        """Move to ``state`` on ``event``.

        Raises:
            IllegalFetchTransition: :data:`FETCH_TRANSITIONS` does not lead from the current
                kind to ``state``'s kind on ``event``.
        """
        if FETCH_TRANSITIONS.get((self.state.kind, event)) is not state.kind:
            raise IllegalFetchTransition(self.mm_hash, self.state.kind, event)
        self.state = state

    def relative_timings(self) -> dict[str, float]:
        return {k: v - self.started for k, v in self.timings.items()}


@dataclass
class Batch:
    """A ``ReqBatch`` sent (ECTP v2) whose items are not all answered yet.

    ``items``: the mm_hashes it named; ``waiting``: those not answered yet (an answer for one
    not in ``waiting`` is a second answer or names something never asked: ignored);
    ``inline_max``: what it accepted inline, bytes; ``sent``: when it was sent (consumer
    clock); ``wait_s``: the wait it asked for; ``parked``: the items a ``Parked`` frame named
    (each once: a second naming is ignored).
    """

    items: frozenset[str]
    waiting: set[str]
    inline_max: int
    sent: float
    wait_s: float
    parked: set[str] = field(default_factory=set)


NACK_REASON = {
    Status.NACK_MISSING: MissReason.MISSING,
    Status.NACK_INCOMPAT: MissReason.INCOMPATIBLE,
    Status.NACK_VERSION: MissReason.VERSION,
    Status.NACK_BUSY: MissReason.BUSY,
    Status.NACK_NOT_READY: MissReason.MISSING,
    Status.NACK_BAD_REQUEST: MissReason.INTERNAL,
    Status.NACK_INTERNAL: MissReason.INTERNAL,
}


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


def grant_problem(g: Grant | None, plane: str | None, store: BlockStore) -> str:
    """Why an OK answer's grant cannot be used ("" if it can): it must exist, match the local
    layout (``store``'s block size; one row per block) and the negotiated ``plane``, and carry a
    finite lease in ``[MIN_LEASE_S, MAX_LEASE_S]``."""
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
