"""Connection state of a consumer session (ECTP §8.1): the :class:`Link` enum and its
transition table (h11's rule: an event the table does not list raises, naming state and event)."""

from __future__ import annotations

import enum

from ectransport.errors import ProtocolError


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
