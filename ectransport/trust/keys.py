"""Deployment CA keys (Ed25519, ``cryptography``): the public key every node trusts, and the
authority that issues node certificates and revocation lists with the secret key.

Pure: nothing here reads a file or the clock (times are arguments). Files:
:mod:`ectransport.trust.files`.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ectransport.trust.errors import TrustError
from ectransport.trust.wire import (
    CERT_CONTEXT,
    FORMAT_VERSION,
    KEY_ID_HEX,
    MAX_CERT_BYTES,
    MAX_EPOCH,
    MAX_REVOKED,
    NAME_PATTERN,
    REVOCATIONS_CONTEXT,
    NodeCert,
    RevocationList,
    Role,
    encode,
    is_curve_key,
    seal,
)

#: Bytes of a raw Ed25519 public key.
ED25519_PUBLIC_BYTES = 32


def key_id(raw_public: bytes) -> str:
    """The key id of a CA: the first 16 hex digits of SHA-256 of its raw 32-byte Ed25519
    public key (what a certificate's ``ca`` field names)."""
    return hashlib.sha256(raw_public).hexdigest()[:KEY_ID_HEX]


@dataclass(frozen=True)
class CaPublicKey:
    """A CA's Ed25519 public key (``raw``: 32 bytes) and its :func:`key_id`.

    Raises:
        TrustError: ``raw`` is not 32 bytes or not a valid Ed25519 public key.
    """

    raw: bytes
    key_id: str = field(init=False)
    _key: Ed25519PublicKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        raw = bytes(self.raw)
        if len(raw) != ED25519_PUBLIC_BYTES:
            raise TrustError(f"a CA public key is {ED25519_PUBLIC_BYTES} bytes of Ed25519, "
                             f"got {len(raw)} bytes")
        try:
            key = Ed25519PublicKey.from_public_bytes(raw)
        except ValueError as e:
            raise TrustError(f"not an Ed25519 public key: {e}") from None
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "key_id", key_id(raw))
        object.__setattr__(self, "_key", key)

    @classmethod
    def of(cls, key: Ed25519PublicKey) -> CaPublicKey:
        """The CA public key of a ``cryptography`` Ed25519 public key."""
        return cls(key.public_bytes_raw())

    @property
    def key(self) -> Ed25519PublicKey:
        """The ``cryptography`` key object."""
        return self._key

    def verifies(self, context: bytes, body: bytes, sig: bytes) -> bool:
        """Whether ``sig`` is this key's Ed25519 signature of ``context + body``."""
        try:
            self._key.verify(sig, context + body)
        except InvalidSignature:
            return False
        return True


def trusted(cas: Iterable[CaPublicKey]) -> dict[str, CaPublicKey]:
    """Key id → key, the form :func:`ectransport.trust.verify.verify` takes."""
    return {ca.key_id: ca for ca in cas}


def _check_name(name: str) -> None:
    if not isinstance(name, str) or re.fullmatch(NAME_PATTERN, name) is None:
        raise TrustError(f"instance name {name!r} is not allowed in a certificate: 1-128 "
                         "letters, digits and '._:@-', starting with a letter or digit "
                         "(e.g. encoder-0)")


def _check_epoch(what: str, t: int) -> None:
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_EPOCH:
        raise TrustError(f"{what} must be whole seconds since the epoch (0..{MAX_EPOCH}), "
                         f"got {t!r}")


class CertificateAuthority:
    """A deployment CA: its Ed25519 secret key issues node certificates and revocation lists.

    Ed25519 signatures are deterministic, so issuing is reproducible given the serial (the
    golden vectors rely on it).
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public = CaPublicKey.of(private_key.public_key())

    @classmethod
    def generate(cls) -> CertificateAuthority:
        """A new CA with a fresh random key."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> CertificateAuthority:
        """The CA whose Ed25519 secret key is the 32-byte ``seed`` (deterministic keys for
        tests and golden vectors; a real CA uses :meth:`generate`)."""
        if len(seed) != 32:
            raise TrustError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def private_key(self) -> Ed25519PrivateKey:
        """The secret key (for :mod:`ectransport.trust.files` to store, encrypted)."""
        return self._private

    @property
    def key_id(self) -> str:
        return self.public.key_id

    def issue(self, *, curve_key: str, role: Role | str, name: str, not_before: int,
              not_after: int, serial: int | None = None) -> bytes:
        """A sealed node certificate: this CA binds ``curve_key`` (Z85 CURVE public key) to
        ``role`` and ``name`` from ``not_before`` to ``not_after`` (seconds since the epoch,
        inclusive). ``serial`` defaults to a random 63-bit number (as X.509 practice: serials
        unpredictable, at least 64 bits of randomness less the sign bit).

        Returns the certificate's bytes (at most :data:`~ectransport.trust.wire.MAX_CERT_BYTES`).

        Raises:
            TrustError: a key that is not Z85, an unknown role, a name outside the allowed
                characters, times out of range or ``not_after < not_before``, a serial out of
                1..2^63-1.
        """
        if not is_curve_key(curve_key):
            raise TrustError(f"{curve_key!r} is not a 40-character Z85 CURVE public key "
                             "(`ectransport keys show NODE.key` prints one)")
        try:
            role = Role(role)
        except ValueError:
            raise TrustError(f"role {role!r} is not one of producer, consumer, both") from None
        _check_name(name)
        _check_epoch("not_before", not_before)
        _check_epoch("not_after", not_after)
        if not_after < not_before:
            raise TrustError(f"not_after ({not_after}) is before not_before ({not_before})")
        if serial is None:
            serial = secrets.randbits(63) or 1
        if isinstance(serial, bool) or not isinstance(serial, int) or \
                not 1 <= serial < 1 << 63:
            raise TrustError(f"serial must be 1..2^63-1, got {serial!r}")
        body = encode(NodeCert(v=FORMAT_VERSION, serial=serial, ca=self.key_id,
                               curve_key=curve_key, role=role, name=name,
                               not_before=not_before, not_after=not_after))
        out = seal(body, self._private.sign(CERT_CONTEXT + body))
        assert len(out) <= MAX_CERT_BYTES, len(out)  # bounded fields: at most ~400 bytes
        return out

    def revocation_list(self, *, seq: int, issued_at: int, serials: Iterable[int] = (),
                        curve_keys: Iterable[str] = ()) -> bytes:
        """A sealed revocation list of this CA: the certificates it issued with a serial in
        ``serials`` and every certificate for a key in ``curve_keys`` are revoked. ``seq``
        must exceed that of every list this CA issued before (nodes ignore a lower one).

        Raises:
            TrustError: a serial or ``seq`` out of 1..2^63-1, a key that is not Z85, more than
                :data:`~ectransport.trust.wire.MAX_REVOKED` entries of one kind.
        """
        ss = sorted(set(serials))
        ks = sorted(set(curve_keys))
        for s in [seq, *ss]:
            if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s < 1 << 63:
                raise TrustError(f"serials and seq must be 1..2^63-1, got {s!r}")
        bad = [k for k in ks if not is_curve_key(k)]
        if bad:
            raise TrustError(f"{bad[0]!r} is not a 40-character Z85 CURVE public key")
        if len(ss) > MAX_REVOKED or len(ks) > MAX_REVOKED:
            raise TrustError(f"a revocation list names at most {MAX_REVOKED} serials and "
                             f"{MAX_REVOKED} keys; start a new CA and re-issue instead")
        _check_epoch("issued_at", issued_at)
        body = encode(RevocationList(v=FORMAT_VERSION, ca=self.key_id, seq=seq,
                                     issued_at=issued_at, serials=ss, curve_keys=ks))
        return seal(body, self._private.sign(REVOCATIONS_CONTEXT + body))
