"""Effects returned by the sans-I/O sessions; the node executes them.

Every command is a small frozen dataclass. Sessions never perform I/O themselves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ectransport.store import Entry, Run


@dataclass(frozen=True)
class Send:
    """Send ``data`` (an encoded ECTP frame) to ``peer`` (a PeerId or a connection key)."""

    peer: Any
    data: bytes


@dataclass(frozen=True)
class Revoke:
    """Producer: a grant ended (completed, expired, peer down): the ``plane`` must stop serving
    ``plane_grant`` before its blocks can be re-allocated (planes that cannot revoke ignore it)."""

    plane: str
    plane_grant: bytes


@dataclass(frozen=True)
class PostRead:
    """Consumer: start the data-plane transfer of ``key`` into local ``runs``."""

    key: str
    plane_grant: bytes
    runs: tuple[Run, ...]
    nbytes: int
    notif: bytes
    prepared: Any = None


@dataclass(frozen=True)
class Land:
    """Consumer (ECTP v2): copy ``data`` — an entry the producer sent inline, in its answer —
    into the local ``runs`` (its first ``len(data)`` bytes). Executed in order: the
    :class:`Report` of that fetch follows it in the same command list, so the bytes are in place
    before anyone is told they landed. No data-plane transfer, nothing to release."""

    runs: tuple[Run, ...]
    data: bytes


@dataclass(frozen=True)
class Bind:
    """Consumer: the producer was welcomed on ``plane`` and declared ``endpoint`` (its plane's
    ``DataTransport.endpoint()``); validate it with the plane's ``bind_peer`` and answer with
    :meth:`ConsumerSession.on_bound` or :meth:`ConsumerSession.on_bind_failed`. Fetches wait until
    then, so that no grant of this producer is ever used without its binding."""

    plane: str
    endpoint: bytes


@dataclass(frozen=True)
class Release:
    """Release a data-plane handle (exactly once per handle)."""

    handle: Any


class MissReason(enum.Enum):
    """Why a fetch did not produce bytes; the caller recomputes locally."""

    MISSING = "missing"  #: the producer does not hold the mm_hash
    INCOMPATIBLE = "incompatible"  #: compatibility hash or data planes differ
    VERSION = "version"  #: no common protocol version
    BUSY = "busy"  #: the producer's budget for us stayed exhausted until our deadline
    TIMEOUT = "timeout"  #: no ack / no completion within the deadline
    PEER_DOWN = "peer_down"  #: the producer went away
    QUARANTINED = "quarantined"  #: the producer is quarantined after recent failures
    AUTH = "auth"  #: authentication with the producer failed
    NO_SPACE = "no_space"  #: the local region cannot hold the entry
    INTERNAL = "internal"  #: anything else (plane error, bad grant, producer NACK_INTERNAL)


@dataclass(frozen=True)
class Miss:
    """A fetch that ended without bytes. ``detail`` is one human-readable line."""

    mm_hash: str
    reason: MissReason
    detail: str = ""

    ok = False


@dataclass(frozen=True)
class Landed:
    """A fetch whose bytes landed in the local ``entry`` (READY in the consumer's store)."""

    mm_hash: str
    entry: Entry
    plane: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    grant_id: int = -1  #: the producer's grant that moved the bytes (for logs and metrics)

    ok = True


@dataclass(frozen=True)
class Report:
    """Consumer: the terminal outcome of one fetch (exactly one per request)."""

    outcome: Landed | Miss


Command = Send | Revoke | PostRead | Land | Bind | Release | Report
