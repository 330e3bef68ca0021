"""What a producer session keeps per consumer and per grant, as plain records, and the grant key's
wire form in data-plane notifications (:func:`notif_for` / :func:`parse_notif`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ectransport.settings_schema import API
from ectransport.store import Run

#: Session ids are opaque to the producer but must not contain ':' (the notification separator).
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

Describe = Callable[[Sequence[Run], int], bytes]


@dataclass(frozen=True)
class ProducerConfig:
    """Producer-side settings (seconds, bytes).

    Attributes:
        node_id: this node's name, sent in Welcome.
        compat_hash: see :func:`ectransport.protocol.compat_hash`.
        planes: data planes offered, best first.
        versions: protocol versions spoken.
        lease_s: pin lease of a grant [30 s, as vLLM's ECCPUConnector].
        budget_bytes: max bytes pinned per consumer identity; None = a quarter of the region.
        grace_s: how long the blocks of a grant that ended without a confirmed completion stay
            pinned before they may be re-allocated [5 s; the grace rule: the
            ``ectransport.session.producer`` docstring].
    """

    node_id: str
    compat_hash: str
    planes: tuple[str, ...] = API.node.planes
    versions: tuple[int, ...] = API.node.versions
    lease_s: float = API.producer.lease_s
    budget_bytes: int | None = API.producer.budget_bytes
    grace_s: float = API.producer.grace_s


@dataclass
class PeerState:
    """One consumer connection that said Hello (its negotiated version, plane and identity) and
    the keys of its live grants."""

    peer: Any
    session_id: str
    version: int
    plane: str
    identity: str  # budget / quarantine identity: CURVE key, else the session id
    grants: set[tuple[str, str, int]] = field(default_factory=set)
    by_gid: dict[int, tuple[str, str, int]] = field(default_factory=dict)  # for Renew


@dataclass
class GrantRecord:
    """One live grant: who holds it, what it pins and charges, its lease deadline and its ack
    (answered again, byte for byte, to a duplicate request)."""

    key: tuple[str, str, int]
    peer: Any
    identity: str
    entry_id: int
    runs: tuple[Run, ...]
    nbytes: int
    pinned_bytes: int
    deadline: float
    ack: bytes
    plane: str
    plane_grant: bytes
    issued: float = 0.0  # when the grant was issued (observability only)


@dataclass(frozen=True)
class GrantView:
    """A live grant as :meth:`ProducerSession.grants` reports it: a read-only copy.

    Attributes:
        key: ``(session_id, mm_hash, grant_id)``.
        peer: the control-plane peer it was granted to.
        identity: the budget identity charged (CURVE key, else the session id).
        entry_id: the pinned entry's allocation id in the store.
        nbytes: payload bytes; ``pinned_bytes``: whole blocks charged to ``identity``.
        deadline: when the lease ends (session time, seconds; renewals move it).
        plane / plane_grant: the data plane and its grant bytes (as ``Revoke`` will name them).
    """

    key: tuple[str, str, int]
    peer: Any
    identity: str
    entry_id: int
    nbytes: int
    pinned_bytes: int
    deadline: float
    plane: str
    plane_grant: bytes


def notif_for(key: tuple[str, str, int]) -> bytes:
    """Completion notification for a grant: ``b"<grant_id>:<session_id>:<mm_hash>"`` (ASCII)."""
    return f"{key[2]}:{key[0]}:{key[1]}".encode()


def parse_notif(notif: bytes) -> tuple[str, str, int] | None:
    """Inverse of :func:`notif_for`; None for anything malformed."""
    try:
        gid, sid, mm = notif.decode("utf-8").split(":", 2)
    except (UnicodeDecodeError, ValueError):
        return None
    if not (gid.isascii() and gid.isdigit()) or not SESSION_ID.fullmatch(sid):
        return None
    return (sid, mm, int(gid))
