"""What a producer session keeps per consumer and per grant, as plain records, and the grant key's
wire form in data-plane notifications (:func:`notif_for` / :func:`parse_notif`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ectransport.protocol import Grant
from ectransport.settings_schema import API
from ectransport.store import Run

#: Session ids are opaque to the producer but must not contain ':' (the notification separator).
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: Most batch items (ECTP v2) one consumer connection may have waiting for readiness at once;
#: beyond it an item is answered NACK_NOT_READY at once, as in v1 (bounds the producer's memory
#: whatever a consumer sends: 64 items per frame, frames rate-limited, waits up to 60 s).
MAX_WAITING_PER_PEER = 1024

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
        max_wait_s: ECTP v2: the longest a batch item for a reserved, not yet ready entry waits
            for its commit before it is answered NACK_NOT_READY; a ``ReqBatch`` asking for longer
            is capped to it [5 s; 0 = answer at once, as v1].
        inline_max_bytes: ECTP v2: an OK entry of at most this many bytes (and at most the
            batch's ``inline_max``) is answered with its bytes inline, without a grant [64 KiB:
            below it, one control frame is faster than grant + READ + XferDone].
        hold_s: ECTP v2: how long an announced entry is held and offered [10 s; see
            :mod:`ectransport.session.holds`].
        hold_share: ECTP v2: the fraction of the region holds may pin [0.25].
    """

    node_id: str
    compat_hash: str
    planes: tuple[str, ...] = API.node.planes
    versions: tuple[int, ...] = API.node.versions
    lease_s: float = API.producer.lease_s
    budget_bytes: int | None = API.producer.budget_bytes
    grace_s: float = API.producer.grace_s
    max_wait_s: float = API.producer.max_wait_s
    inline_max_bytes: int = API.producer.inline_max_bytes
    hold_s: float = API.producer.hold_s
    hold_share: float = API.producer.hold_share


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
    #: ECTP v2: batch id → how many of its items wait for readiness (only batches with some)
    waiting: dict[int, int] = field(default_factory=dict)
    #: ECTP v2 §10: the session was granted offers (then it is sent ``Offer`` frames once it has
    #: an anchor: the ``t`` of its newest ``Sync`` and when this producer received it)
    offers: bool = False
    anchor: tuple[float, float] | None = None

    @property
    def waiting_items(self) -> int:
        return sum(self.waiting.values())


@dataclass
class GrantRecord:
    """One live grant: who holds it, what it pins and charges, its lease deadline, the grant
    itself and its ack (answered again, byte for byte, to a duplicate request; ``b""`` for a
    grant issued in an ``AckBatch`` until a duplicate ``XferReq`` asks for it)."""

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
    grant: Grant | None = None


@dataclass(eq=False)
class WaitingItem:
    """ECTP v2: one item of a ``ReqBatch`` whose entry was reserved but not ready, parked until
    the entry becomes ready, goes away, or ``until`` (session time) passes — then answered in an
    ``AckBatch`` of ``batch_id``. ``answered`` marks it done (the deadline heap drops it lazily).
    """

    peer: Any
    session_id: str
    batch_id: int
    mm_hash: str
    v: int
    inline_max: int
    received: float
    until: float
    answered: bool = False


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
