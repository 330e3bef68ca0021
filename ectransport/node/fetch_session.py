"""What a :class:`~ectransport.node.consumer_driver.ConsumerDriver` needs from a consumer-side
session: ECTP's :class:`~ectransport.session.ConsumerSession` satisfies it as it is, and a wire
profile brings its own sans-I/O session (``ectransport.compat.wire_session``) behind the same
Protocol — one driver, one I/O loop, several wires.

Every method takes ``now`` (the driver's clock) and returns commands
(:mod:`ectransport.session.commands`) for the driver to execute; none performs I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast, runtime_checkable

from ectransport.protocol import Ticket
from ectransport.session import Command, FetchState, Miss


class FetchSession(Protocol):
    """Fetches from one producer connection (``conn``), many in flight; every fetch ends in
    exactly one :class:`~ectransport.session.Report` by its deadline."""

    @property
    def conn(self) -> str: ...  # the control connection key, Send.peer
    @property
    def session_id(self) -> str: ...
    @property
    def plane(self) -> str | None: ...  # negotiated data plane (None until negotiated)
    @property
    def binding(self) -> Any: ...  # the plane's binding of this producer (or None)
    @property
    def welcomed(self) -> bool: ...  # negotiated on the current connection
    @property
    def failed(self) -> Miss | None: ...  # terminal session failure
    @property
    def blocked_until(self) -> float: ...  # peer quarantine end (0: none)
    @property
    def blocked_reason(self) -> str: ...
    @property
    def producer_id(self) -> str: ...
    @property
    def version(self) -> int | None: ...

    def in_flight(self) -> int: ...
    def fetch_states(self) -> dict[str, FetchState]: ...
    def reading(self) -> list[tuple[str, Any]]: ...  # (key, handle) the driver polls
    def next_deadline(self) -> float | None: ...

    def fetch(self, mm_hash: str, now: float, deadline: float) -> list[Command]: ...
    def fetch_probe(self, now: float) -> list[Command]: ...
    def on_up(self, now: float) -> list[Command]: ...
    def on_auth_failed(self, reason: str, now: float) -> list[Command]: ...
    def on_peer_down(self, now: float) -> list[Command]: ...
    def on_frame(self, data: bytes, now: float) -> list[Command]: ...
    def on_read_posted(self, mm_hash: str, handle: Any, now: float) -> list[Command]: ...
    def on_read_failed(self, mm_hash: str, detail: str, now: float) -> list[Command]: ...
    def on_read_state(self, mm_hash: str, state: str, now: float,
                      detail: str = "") -> list[Command]: ...
    def on_bound(self, binding: Any, now: float) -> list[Command]: ...
    def on_bind_failed(self, detail: str, now: float) -> list[Command]: ...
    def poll(self, now: float) -> list[Command]: ...
    def close(self) -> list[Command]: ...


@runtime_checkable
class SizedFetch(Protocol):
    """A session whose wire does not carry the entry's size (the vLLM wire: the caller knows it
    from the scheduler's transfer parameters); the driver starts such fetches with the size."""

    def fetch_sized(self, mm_hash: str, nbytes: int, now: float,
                    deadline: float) -> list[Command]: ...


@runtime_checkable
class BatchFetch(Protocol):
    """A session that can ask for several entries in one request (ECTP v2's ``ReqBatch``); the
    driver starts :meth:`ConsumerNode.submit_many`'s fetches with it, and one by one on a session
    without it."""

    def fetch_many(self, mm_hashes: list[str], now: float, deadline: float, *,
                   tickets: Mapping[str, Ticket] | None = None) -> list[Command]: ...


_CAPABLE: dict[tuple[type, type], bool] = {}


def _capable(session: object, proto: type) -> bool:
    """``isinstance(session, proto)`` for a runtime-checkable Protocol, decided once per class:
    such a check walks the Protocol's members every time (about 15 µs in Python 3.11, on every
    fetch), while what a session class implements never changes."""
    key = (type(session), proto)
    hit = _CAPABLE.get(key)
    if hit is None:
        hit = _CAPABLE[key] = isinstance(session, proto)
    return hit


def sized(session: FetchSession) -> SizedFetch | None:
    """``session`` as a :class:`SizedFetch`, or None if it is not one."""
    return cast(SizedFetch, session) if _capable(session, SizedFetch) else None


def batching(session: FetchSession) -> BatchFetch | None:
    """``session`` as a :class:`BatchFetch`, or None if it is not one."""
    return cast(BatchFetch, session) if _capable(session, BatchFetch) else None
