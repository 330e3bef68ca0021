"""What the directory answers: holders, lookups, claims, and the typed "unavailable" outcome.

Expected outcomes are values (STYLE.md §4): a lookup during an outage is a :class:`Lookup` whose
``unavailable`` says why (every item a miss), a claim that could not be taken is
:class:`ClaimLost` or :class:`DirectoryUnavailable` — both falsy, so ``if (c := d.claim(h)):``
reads like ``Claim | None``. Exceptions are for misuse (:class:`ectransport.errors.ConfigError`)
and for the explicit checks (:meth:`Directory.check`): :class:`DirectoryError` and subclasses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ectransport.errors import AuthError, ECTransportError


class DirectoryError(ECTransportError):
    """The directory cannot be used: Redis unreachable, too slow, or refusing us."""


class DirectoryAuthError(DirectoryError, AuthError):
    """Redis refused our credentials (AUTH/ACL: wrong user or password, or no permission)."""


class UnavailableReason(enum.Enum):
    """Why a directory call did not reach an answer."""

    #: connection refused, reset or closed (Redis down or restarting)
    DOWN = "down"
    #: no answer within the call's deadline (Redis stopped, slow or unreachable)
    TIMEOUT = "timeout"
    #: AUTH/ACL refused (wrong user or password, missing permission)
    AUTH = "auth"
    #: not tried: a recent call failed and the directory is in its retry backoff
    BACKOFF = "backoff"
    #: not tried: too many asynchronous calls queued
    BUSY = "busy"
    #: Redis answered something unexpected (another server, a bad configuration)
    ERROR = "error"
    #: the directory was closed
    CLOSED = "closed"


@dataclass(frozen=True)
class DirectoryUnavailable:
    """The directory could not answer; callers treat it as a miss (falsy)."""

    reason: UnavailableReason
    detail: str = ""

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"fleet directory unavailable ({self.reason.value}): {self.detail}"


@dataclass(frozen=True)
class Holder:
    """An instance that holds an item and passed every check (see ``docs/fleet.md``).

    The consumer still authenticates it (CURVE: ``public_key`` is the server key to connect
    with) and the producer still checks the compatibility hash: the directory only narrows where
    to ask.

    Attributes:
        mm_hash: the item.
        instance / incarnation: the holder's name and the id of its current run.
        host / port: its control plane.
        public_key: its CURVE public key, Z85.
        cert: its fleet certificate bytes, or None.
        nbytes: the entry's size, bytes.
        compat_hash: its compatibility hash (hex).
        load: its current load figure (from its liveness record).
        same_host: it runs on one of the looking-up instance's hosts.
    """

    mm_hash: str
    instance: str
    incarnation: str
    host: str
    port: int
    public_key: str
    cert: bytes | None
    nbytes: int
    compat_hash: str
    load: float
    same_host: bool = False

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 hosts in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Lookup(dict[str, list[Holder]]):
    """``{mm_hash: [Holder, ...]}`` for every mm_hash asked (best holder first; ``[]`` = miss).

    Attributes:
        unavailable: None when the directory answered; else why it did not (every item is then
            ``[]``).
        elapsed_s: how long the lookup took, s (0 when it was not tried).
    """

    def __init__(self, items: dict[str, list[Holder]], *,
                 unavailable: DirectoryUnavailable | None = None, elapsed_s: float = 0.0):
        super().__init__(items)
        self.unavailable = unavailable
        self.elapsed_s = elapsed_s

    @property
    def ok(self) -> bool:
        return self.unavailable is None


@dataclass(frozen=True)
class Claim:
    """This instance won the claim on ``mm_hash``: encode it, then publish it with
    ``claim=`` (which releases the claim once the holder record is written), or release it.

    Attributes:
        mm_hash: the item.
        token: the claim's secret value (release and renewal compare it).
        ttl_s: the claim expires this long after it was taken (or last renewed), s.
        raw: the claim key's value (the encoded :class:`ClaimRecord`).
    """

    mm_hash: str
    token: str
    ttl_s: float
    raw: bytes = field(repr=False, default=b"")

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class ClaimLost:
    """Another instance holds the claim (``by``: its instance name, "" if unreadable)."""

    mm_hash: str
    by: str = ""

    def __bool__(self) -> bool:
        return False


ClaimOutcome = Claim | ClaimLost | DirectoryUnavailable


class Acquired(enum.Enum):
    """How :meth:`Directory.claim_or_wait` ended."""

    #: holders exist (maybe after waiting for the claimant): fetch from ``holders``
    FOUND = "found"
    #: this instance won the claim: encode, then publish with ``claim=``
    ENCODE = "encode"
    #: no holder and no claim could be had within the wait (or the directory is down):
    #: encode without a claim
    ENCODE_LOCALLY = "encode_locally"


@dataclass(frozen=True)
class Acquisition:
    """The outcome of :meth:`Directory.claim_or_wait`.

    Attributes:
        outcome: see :class:`Acquired`.
        holders: the holders, best first (``FOUND`` only).
        claim: the claim won (``ENCODE`` only).
        waited_s: how long it waited for another claimant, s.
        detail: why ``ENCODE_LOCALLY`` (wait timed out, directory unavailable, ...).
        unavailable: set when the directory could not answer.
    """

    outcome: Acquired
    holders: tuple[Holder, ...] = ()
    claim: Claim | None = None
    waited_s: float = 0.0
    detail: str = ""
    unavailable: DirectoryUnavailable | None = None
