"""Verifying a node certificate: a pure function of the bytes, the connection's CURVE key, the
role wanted, the trusted CAs, their revocation lists and ``now``.

:func:`verify` never raises for any ``cert`` bytes — garbage, truncated, oversized, mutated or
signed by a stranger: the outcome is a value, :class:`Admitted` or :class:`Refused` with a
:class:`RefusalReason` (as a fetch ends in ``Fetched`` or ``Miss``). Only a caller's own bug
(a non-finite ``now``, a negative skew, an unknown role) raises ``ValueError``.

The checks, in order (the first that fails is the reason): presence (``missing``), size before
any decoding (``oversized``, :data:`~ectransport.trust.wire.MAX_CERT_BYTES`), decoding and
canonical form (``malformed``), a trusted signer (``unknown_ca``), the signature
(``bad_signature``), the certificate is for the connection's CURVE key (``wrong_key``) and of
the role wanted (``wrong_role``), not revoked (``revoked``), and the validity period with the
clock-skew tolerance: admitted while ``not_before - skew_s <= now <= not_after + skew_s``
(``not_yet_valid`` / ``expired`` outside). Nothing from the certificate is trusted before its
signature verified.
"""

from __future__ import annotations

import datetime
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

from ectransport.settings_schema import API
from ectransport.trust.errors import TrustError
from ectransport.trust.keys import CaPublicKey
from ectransport.trust.wire import (
    CERT_CONTEXT,
    MAX_CERT_BYTES,
    MAX_REVOCATIONS_BYTES,
    REVOCATIONS_CONTEXT,
    NodeCert,
    RevocationList,
    Role,
    WireError,
    decode_cert_body,
    decode_revocations_body,
    is_curve_key,
    open_sealed,
)

#: The default clock-skew tolerance, s (``[trust] clock_skew_s``).
DEFAULT_SKEW_S: float = API.trust.clock_skew_s


class RefusalReason(str, enum.Enum):
    """Why a peer was not admitted (the values are metric labels and log words)."""

    MISSING = "missing"  #: no certificate, where one is required
    MALFORMED = "malformed"  #: not a canonical sealed certificate of a known format
    OVERSIZED = "oversized"  #: larger than MAX_CERT_BYTES (refused before decoding)
    UNKNOWN_CA = "unknown_ca"  #: signed by a CA this node does not trust
    BAD_SIGNATURE = "bad_signature"  #: the named CA's signature does not verify
    EXPIRED = "expired"  #: now > not_after + skew
    NOT_YET_VALID = "not_yet_valid"  #: now < not_before - skew
    WRONG_KEY = "wrong_key"  #: the certificate is for another CURVE key than the connection's
    WRONG_ROLE = "wrong_role"  #: e.g. a consumer certificate presented by a producer
    REVOKED = "revoked"  #: its serial or its CURVE key is on a trusted revocation list
    NOT_ALLOW_LISTED = "not_allow_listed"  #: the allow-list is required and lacks the key


@dataclass(frozen=True)
class Admitted:
    """The peer with CURVE key ``curve_key`` is admitted as ``role_wanted``, ``by`` its
    certificate, the allow-list, or both. ``cert`` is the verified certificate (None when
    admitted by the allow-list without one; in admission ``either``, a session admitted by its
    certificate keeps it when the allow-list takes over after it expired, so that its
    revocation still ends the session) and ``raw`` its bytes (for re-checking a live session:
    :meth:`ectransport.trust.store.TrustStore.recheck`)."""

    ok: ClassVar[bool] = True
    curve_key: str
    role_wanted: Role
    by: Literal["certificate", "allow_list", "both"]
    cert: NodeCert | None = None
    raw: bytes = b""

    @property
    def not_after(self) -> int | None:
        """When the certificate ends (seconds since the epoch), None without one."""
        return None if self.cert is None else self.cert.not_after


@dataclass(frozen=True)
class Refused:
    """The peer is not admitted: ``reason`` (typed) and ``detail`` (one line for logs and for
    the refusal sent to the peer; it names no secret)."""

    ok: ClassVar[bool] = False
    reason: RefusalReason
    detail: str


@dataclass(frozen=True)
class Revocations:
    """A verified revocation list, indexed: the CA ``ca`` revoked the certificates it issued
    with a serial in ``serials``, and every certificate for a key in ``curve_keys``."""

    ca: str
    seq: int
    issued_at: int
    serials: frozenset[int]
    curve_keys: frozenset[str]

    @classmethod
    def of(cls, lst: RevocationList) -> Revocations:
        return cls(
            lst.ca, lst.seq, lst.issued_at, frozenset(lst.serials), frozenset(lst.curve_keys)
        )


def iso(t: float) -> str:
    """``2026-01-01T00:00:00Z`` for seconds since the epoch (numbers beyond year 9999 as
    ``<n> s``): for messages."""
    try:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
    except (OverflowError, ValueError, OSError):
        return f"{t} s"


def _check_caller(now: float, skew_s: float) -> None:
    if not math.isfinite(now):
        raise ValueError(f"now must be a finite number of seconds since the epoch, got {now!r}")
    if not (math.isfinite(skew_s) and skew_s >= 0):
        raise ValueError(f"skew_s must be a finite number >= 0, got {skew_s!r}")


def key_revocation(curve_key: str, revocations: Mapping[str, Revocations]) -> str | None:
    """Why ``curve_key`` is revoked (a CURVE-key entry of any trusted CA's list), or None."""
    for r in revocations.values():
        if curve_key in r.curve_keys:
            return f"CURVE key {curve_key[:8]}... is revoked by CA {r.ca} (list seq {r.seq})"
    return None


def _revocation(cert: NodeCert, revocations: Mapping[str, Revocations]) -> str | None:
    own = revocations.get(cert.ca)
    if own is not None and cert.serial in own.serials:
        return f"serial {cert.serial} is revoked by CA {cert.ca} (list seq {own.seq})"
    return key_revocation(cert.curve_key, revocations)


def _check_verified(
    cert: NodeCert,
    curve_key: str,
    role_wanted: Role,
    revocations: Mapping[str, Revocations],
    now: float,
    skew_s: float,
) -> Refused | None:
    if not is_curve_key(curve_key):
        return Refused(
            RefusalReason.WRONG_KEY,
            "the connection has no CURVE key (a plain-text session cannot be "
            "admitted by certificate)",
        )
    if cert.curve_key != curve_key:
        return Refused(
            RefusalReason.WRONG_KEY,
            f"certificate {cert.serial} ({cert.name}) is for CURVE key "
            f"{cert.curve_key[:8]}..., this connection's key is {curve_key[:8]}...",
        )
    if not cert.role.covers(role_wanted):
        return Refused(
            RefusalReason.WRONG_ROLE,
            f"certificate {cert.serial} ({cert.name}) is for a {cert.role.value}, "
            f"a {role_wanted.value} is needed here",
        )
    why = _revocation(cert, revocations)
    if why is not None:
        return Refused(RefusalReason.REVOKED, f"certificate {cert.serial} ({cert.name}): {why}")
    if now < cert.not_before - skew_s:
        return Refused(
            RefusalReason.NOT_YET_VALID,
            f"certificate {cert.serial} ({cert.name}) is valid from "
            f"{iso(cert.not_before)}; it is {iso(now)} here (skew tolerance "
            f"{skew_s:g} s)",
        )
    if now > cert.not_after + skew_s:
        return Refused(
            RefusalReason.EXPIRED,
            f"certificate {cert.serial} ({cert.name}) expired at "
            f"{iso(cert.not_after)}; it is {iso(now)} here (skew tolerance "
            f"{skew_s:g} s)",
        )
    return None


def verify(
    cert: bytes,
    *,
    curve_key: str,
    role_wanted: Role,
    trusted_cas: Mapping[str, CaPublicKey],
    revocations: Mapping[str, Revocations],
    now: float,
    skew_s: float = DEFAULT_SKEW_S,
) -> Admitted | Refused:
    """Whether the peer presenting ``cert`` on a connection authenticated with ``curve_key``
    is admitted as ``role_wanted``.

    Args:
        cert: the sealed certificate as received (``Hello.cert`` / ``Welcome.cert``), any bytes.
        curve_key: the connection's authenticated CURVE public key, Z85 (on the producer the
            ZAP ``User-Id``, ``PeerId.user``; on the consumer the producer key it dialed).
        role_wanted: the role the peer must hold (a producer admits ``Role.CONSUMER``).
        trusted_cas: key id → CA public key (:func:`ectransport.trust.keys.trusted`).
        revocations: CA key id → that CA's verified revocation list (:func:`check_revocations`).
        now: seconds since the epoch (wall clock, ``time.time()``), UTC.
        skew_s: clock-skew tolerance at both ends of the validity period, s.

    Returns:
        :class:`Admitted` (``by="certificate"``, with the certificate) or :class:`Refused`.

    Raises:
        ValueError: only for a caller's bug: ``now`` not finite, ``skew_s`` negative or not
            finite, ``role_wanted`` not a role.
    """
    _check_caller(now, skew_s)
    role_wanted = Role(role_wanted)
    if not isinstance(cert, (bytes, bytearray, memoryview)):
        return Refused(
            RefusalReason.MALFORMED, f"a certificate is bytes, got {type(cert).__name__}"
        )
    size = cert.nbytes if isinstance(cert, memoryview) else len(cert)
    if size == 0:
        return Refused(RefusalReason.MISSING, "no certificate presented")
    if size > MAX_CERT_BYTES:
        return Refused(
            RefusalReason.OVERSIZED,
            f"certificate of {size} bytes; at most {MAX_CERT_BYTES} are accepted",
        )
    data = bytes(cert)
    try:
        sealed = open_sealed(data)
        body = decode_cert_body(sealed.body)
    except WireError as e:
        return Refused(RefusalReason.MALFORMED, str(e)[:300])
    ca = trusted_cas.get(body.ca)
    if ca is None:
        return Refused(
            RefusalReason.UNKNOWN_CA,
            f"certificate {body.serial} ({body.name}) is signed by CA {body.ca}; "
            f"this node trusts {sorted(trusted_cas) or 'no CA'}",
        )
    if not ca.verifies(CERT_CONTEXT, sealed.body, sealed.sig):
        return Refused(
            RefusalReason.BAD_SIGNATURE,
            f"certificate {body.serial} ({body.name}): the signature does not "
            f"verify with CA {body.ca}'s key (altered or forged)",
        )
    refused = _check_verified(body, curve_key, role_wanted, revocations, now, skew_s)
    if refused is not None:
        return refused
    return Admitted(
        curve_key=curve_key, role_wanted=role_wanted, by="certificate", cert=body, raw=data
    )


def inspect_cert(data: bytes) -> NodeCert:
    """The certificate in ``data`` *without* checking its signature (for display: ``keys
    show``). Raises :class:`TrustError` when it is not a certificate."""
    if len(data) > MAX_CERT_BYTES:
        raise TrustError(f"certificate of {len(data)} bytes; at most {MAX_CERT_BYTES}")
    try:
        return decode_cert_body(open_sealed(data).body)
    except WireError as e:
        raise TrustError(str(e)) from None


class UntrustedCaError(TrustError):
    """A revocation list of a CA that is not trusted here: it revokes nothing this node
    accepts (a store ignores it; e.g. the next CA's list, configured before its key)."""


def check_revocations(data: bytes, *, trusted_cas: Mapping[str, CaPublicKey]) -> Revocations:
    """A revocation list's contents, after checking it was signed by the trusted CA it names.

    Raises:
        UntrustedCaError: (a TrustError) the list names a CA that is not trusted.
        TrustError: not a canonical sealed revocation list, larger than
            :data:`~ectransport.trust.wire.MAX_REVOCATIONS_BYTES`, or its signature does not
            verify with the key of the CA it names (e.g. signed by another CA).
    """
    if len(data) > MAX_REVOCATIONS_BYTES:
        raise TrustError(f"revocation list of {len(data)} bytes; at most {MAX_REVOCATIONS_BYTES}")
    try:
        sealed = open_sealed(data)
        lst = decode_revocations_body(sealed.body)
    except WireError as e:
        raise TrustError(str(e)) from None
    ca = trusted_cas.get(lst.ca)
    if ca is None:
        raise UntrustedCaError(
            f"revocation list seq {lst.seq} is of CA {lst.ca}, which is not "
            f"trusted here (trusted: {sorted(trusted_cas) or 'none'})"
        )
    if not ca.verifies(REVOCATIONS_CONTEXT, sealed.body, sealed.sig):
        raise TrustError(
            f"revocation list seq {lst.seq} names CA {lst.ca} but its signature "
            "does not verify with that CA's key (signed by another CA, or "
            "altered): refused"
        )
    return Revocations.of(lst)
