"""Connection state of a consumer session (ECTP §8.1): the :class:`Link` enum and its
transition table (h11's rule: an event the table does not list raises, naming state and event);
:class:`Connection`, the narrow view of it a fetch table has, and :func:`refusal`, why a new
fetch on it misses at once."""

from __future__ import annotations

import enum
from typing import Any, Protocol

from ectransport.errors import ProtocolError
from ectransport.protocol.messages import MAX_HASH_LEN
from ectransport.session.commands import Miss, MissReason


class Link(enum.Enum):
    """Connection state of a :class:`ConsumerSession` (ECTP §8.1); see :data:`LINK_TRANSITIONS`.

    Orthogonal to it: the peer quarantine (``blocked_until``), after which the next fetch
    re-sends Hello as a probe (READY → GREETING, the negotiated version kept).
    """

    DOWN = "down"  #: no authenticated control connection (initial; after the connection dropped)
    GREETING = "greeting"  #: Hello sent, Welcome awaited
    BINDING = "binding"  #: Welcome OK; the node binds the producer's declared endpoint
    READY = "ready"  #: negotiated and bound: requests flow
    FAILED = "failed"  #: terminal: auth, version, incompatible, endpoint refused, closing


#: (state, event) → next state, for the events the node (or the session itself) drives. A
#: combination not listed is illegal: the session raises :class:`IllegalTransition` (h11's rule)
#: instead of silently proceeding. Frames from the network are never "illegal events": one that
#: does not fit the state (a second Welcome, an ack for nothing) is hostile or late input and is
#: ignored or refused, never raised.
LINK_TRANSITIONS: dict[tuple[Link, str], Link] = {
    **{(st, "up"): Link.GREETING for st in (Link.DOWN, Link.GREETING, Link.BINDING, Link.READY)},
    (Link.FAILED, "up"): Link.FAILED,
    **{(st, "down"): Link.DOWN for st in (Link.DOWN, Link.GREETING, Link.BINDING, Link.READY)},
    (Link.FAILED, "down"): Link.FAILED,
    (Link.READY, "probe"): Link.GREETING,
    (Link.GREETING, "probe"): Link.GREETING,
    (Link.GREETING, "welcome_ok"): Link.BINDING,
    (Link.BINDING, "bound"): Link.READY,
    **{(st, "fail"): Link.FAILED for st in Link},
}


class IllegalTransition(ProtocolError):
    """The node drove a :class:`ConsumerSession` with an event its state does not allow (e.g. a
    binding answered twice); the message names the state and the event."""

    def __init__(self, state: Link, event: str):
        super().__init__(f"consumer session: event {event!r} is illegal in state {state.name}")
        self.state = state
        self.event = event


class PeerBackoff:
    """The consumer's quarantine of one producer (ECTP §8.3): after a failure it blocks new
    fetches for a backoff that doubles from ``first_s`` up to ``max_s``; the first fetch after it
    probes with a Hello (:attr:`probe_due`); a Welcome lifts it and resets the backoff. Time is
    a parameter (seconds on the session clock)."""

    def __init__(self, first_s: float, max_s: float):
        self.first_s = first_s
        self.max_s = max_s
        self.until = 0.0  #: blocked before this moment (0: never blocked since the last lift)
        self.reason = ""
        self.probe_due = False
        self._next_s = first_s

    def blocked(self, now: float) -> bool:
        return now < self.until

    def penalize(self, now: float, why: str) -> float:
        """Block from ``now`` for the current backoff, then double it; returns the seconds."""
        self.until = now + self._next_s
        self.reason = why
        self._next_s = min(self._next_s * 2, self.max_s)
        self.probe_due = True
        return self.until - now

    def succeeded(self) -> None:
        """A transfer landed: the next failure starts from the first backoff again."""
        self._next_s = self.first_s

    def lift(self) -> bool:
        """A Welcome: unblock; returns whether a quarantine was lifted."""
        was = bool(self.until)
        self.until, self.reason, self.probe_due = 0.0, "", False
        self._next_s = self.first_s
        return was


def refusal(mm_hash: str, now: float, failed: Miss | None, backoff: PeerBackoff,
            in_flight: bool) -> Miss | None:
    """Why a new fetch of ``mm_hash`` misses at once on a session (None: it can start): the
    session failed (``failed``, its miss again), the producer is in its quarantine
    (QUARANTINED), the mm_hash is malformed or already being fetched (``in_flight``: INTERNAL)."""
    if failed is not None:
        return Miss(mm_hash, failed.reason, failed.detail)
    if backoff.blocked(now):
        return Miss(mm_hash, MissReason.QUARANTINED, f"producer quarantined for "
                    f"{backoff.until - now:.1f} s more after: {backoff.reason}")
    if not mm_hash or len(mm_hash) > MAX_HASH_LEN:
        return Miss(mm_hash, MissReason.INTERNAL, f"mm_hash must be 1-{MAX_HASH_LEN} characters")
    if in_flight:
        return Miss(mm_hash, MissReason.INTERNAL, "already being fetched")
    return None


class Connection(Protocol):
    """What a :class:`~ectransport.session.fetches.FetchTable` needs of its session's
    connection (a :class:`~ectransport.session.consumer.ConsumerSession`)."""

    conn: str
    session_id: str
    version: int | None
    plane: str | None
    binding: Any
    compat_hash: str
    max_version: int

    @property
    def live(self) -> bool: ...  # an authenticated control connection (GREETING..READY)

    def penalize(self, now: float, why: str) -> None: ...  # quarantine the producer
    def ignore(self, why: str, detail: str, n: int = 1) -> None: ...  # count hostile input
    def emit(self, event: str, **fields: Any) -> None: ...
    def landed(self) -> None: ...  # a transfer landed: the producer's backoff resets
