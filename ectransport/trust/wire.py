"""Wire structures of fleet trust: node certificates and revocation lists (msgspec, msgpack).

A signed object travels as a :class:`Sealed` envelope, the msgpack map
``{"v": 1, "body": bin, "sig": bin}``: ``body`` is the canonical msgpack encoding of a
:class:`NodeCert` (tag ``"node-cert"``) or a :class:`RevocationList` (tag ``"revocations"``) and
``sig`` the CA's Ed25519 signature over ``context + body``, with a context string per kind
(:data:`CERT_CONTEXT`, :data:`REVOCATIONS_CONTEXT`) so that one kind's signature never verifies
as the other's. A verifier checks the signature over the bytes it received and refuses an
envelope or a body that is not in canonical encoding (encoding the decoded value again must give
the same bytes): a certificate has exactly one byte string. Spec: ``protocols/certificates.md``.

Every struct has a **required** format version ``v`` (no default, so it is always encoded) and
forbids unknown fields: a field this build does not know could restrict what the CA meant, so
it is refused rather than ignored. Strings and lists are bounded.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from ectransport.errors import ProtocolError

#: Format version of the envelope and of both bodies written by this build.
FORMAT_VERSION = 1
#: The largest sealed certificate a verifier decodes, bytes (checked before decoding). A
#: certificate of this build is about 330 bytes with a 128-character name.
MAX_CERT_BYTES = 4 << 10
#: The most serials (and, separately, CURVE keys) one revocation list names.
MAX_REVOKED = 65536
#: The largest sealed revocation list decoded, bytes (65536 serials and 65536 keys fit).
MAX_REVOCATIONS_BYTES = 4 << 20
#: The signature contexts (Ed25519 signs ``context + body``).
CERT_CONTEXT = b"ectransport/node-cert/v1\x00"
REVOCATIONS_CONTEXT = b"ectransport/revocations/v1\x00"
#: Hex digits of a CA key id (the first 64 bits of SHA-256 of the raw Ed25519 public key).
KEY_ID_HEX = 16
#: Seconds since the epoch are bounded so that arithmetic on them stays exact in a float.
MAX_EPOCH = (1 << 40) - 1
#: An instance name: letters, digits and ``._:@-``, starting with a letter or digit.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"

Format = Annotated[int, Meta(ge=0, lt=1 << 16)]
Serial = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
KeyId = Annotated[str, Meta(pattern=rf"^[0-9a-f]{{{KEY_ID_HEX}}}$")]
CurveKey = Annotated[str, Meta(min_length=40, max_length=40)]
NodeName = Annotated[str, Meta(min_length=1, max_length=128, pattern=NAME_PATTERN)]
Epoch = Annotated[int, Meta(ge=0, le=MAX_EPOCH)]

_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUE = {c: i for i, c in enumerate(_Z85)}


def is_curve_key(text: object) -> bool:
    """True if ``text`` is a 40-character Z85 string that encodes a 32-byte CURVE key.

    Pure Python (no ``zmq`` import, so the sans-I/O layers can use it). Z85 of 32 bytes is
    canonical: every valid string decodes to one key and back, so keys compare as strings.
    """
    if not isinstance(text, str) or len(text) != 40:
        return False
    for i in range(0, 40, 5):
        acc = 0
        for c in text[i:i + 5]:
            d = _Z85_VALUE.get(c)
            if d is None:
                return False
            acc = acc * 85 + d
        if acc >= 1 << 32:
            return False
    return True


class Role(str, enum.Enum):
    """What a certificate lets its node be: a ``producer`` (serves entries: an encoder
    instance), a ``consumer`` (fetches them: a prefill/decode instance) or ``both``."""

    PRODUCER = "producer"
    CONSUMER = "consumer"
    BOTH = "both"

    def covers(self, wanted: Role) -> bool:
        """Whether a certificate of this role may act as ``wanted`` (``both`` covers each)."""
        return self is Role.BOTH or self is wanted


class NodeCert(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="k",
               tag="node-cert"):
    """The signed statement of a node certificate: the CA ``ca`` bound the CURVE public key
    ``curve_key`` (Z85) to ``role`` and the instance ``name`` from ``not_before`` to
    ``not_after`` (seconds since the epoch, UTC, both inclusive). ``serial`` (1..2^63-1, random)
    names the certificate in revocation lists; ``ca`` is the key id of the signing CA
    (:func:`ectransport.trust.keys.key_id`).

    Raises ``ValueError`` (a ``msgspec.ValidationError`` when decoding) if ``not_after`` is
    before ``not_before`` or ``curve_key`` is not a Z85 CURVE key.
    """

    v: Format
    serial: Serial
    ca: KeyId
    curve_key: CurveKey
    role: Role
    name: NodeName
    not_before: Epoch
    not_after: Epoch

    def __post_init__(self) -> None:
        if self.not_after < self.not_before:
            raise ValueError(f"not_after {self.not_after} is before not_before "
                             f"{self.not_before}")
        if not is_curve_key(self.curve_key):
            raise ValueError("curve_key is not a 40-character Z85 CURVE public key")


class RevocationList(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="k",
                     tag="revocations"):
    """The signed statement of a revocation list: of the certificates the CA ``ca`` issued,
    those with a serial in ``serials`` are revoked, and every certificate (of any trusted CA)
    for a CURVE key in ``curve_keys``. ``seq`` grows with every list the CA issues (a verifier
    never goes back to a lower one); ``issued_at`` is seconds since the epoch. Both lists are
    strictly increasing (canonical: one byte string per content).

    Raises ``ValueError`` (``msgspec.ValidationError`` when decoding) on unsorted or repeated
    entries or a key that is not Z85.
    """

    v: Format
    ca: KeyId
    seq: Serial
    issued_at: Epoch
    serials: Annotated[list[Serial], Meta(max_length=MAX_REVOKED)]
    curve_keys: Annotated[list[CurveKey], Meta(max_length=MAX_REVOKED)]

    def __post_init__(self) -> None:
        if any(a >= b for a, b in zip(self.serials, self.serials[1:])):
            raise ValueError("serials are not strictly increasing")
        if any(a >= b for a, b in zip(self.curve_keys, self.curve_keys[1:])):
            raise ValueError("curve_keys are not strictly increasing")
        if not all(is_curve_key(k) for k in self.curve_keys):
            raise ValueError("a curve_keys entry is not a Z85 CURVE public key")


class Sealed(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A signed body: ``body`` (canonical msgpack of a :class:`NodeCert` or
    :class:`RevocationList`) and ``sig``, the 64-byte Ed25519 signature of ``context + body``."""

    v: Format
    body: Annotated[bytes, Meta(max_length=MAX_REVOCATIONS_BYTES)]
    sig: Annotated[bytes, Meta(min_length=64, max_length=64)]


_encoder = msgspec.msgpack.Encoder()
_sealed = msgspec.msgpack.Decoder(Sealed)
_cert = msgspec.msgpack.Decoder(NodeCert)
_revocations = msgspec.msgpack.Decoder(RevocationList)


class WireError(ProtocolError):
    """Bytes that are not a canonical sealed object of this format. The verifier turns it into
    a ``malformed`` refusal, the file loaders into a :class:`~ectransport.trust.errors.TrustError`:
    it never reaches a caller of :func:`ectransport.trust.verify.verify`."""


def encode(obj: NodeCert | RevocationList | Sealed) -> bytes:
    """The canonical msgpack bytes of ``obj`` (what is signed, for a body)."""
    return _encoder.encode(obj)


def seal(body: bytes, sig: bytes) -> bytes:
    """The sealed envelope of a signed ``body``."""
    return encode(Sealed(v=FORMAT_VERSION, body=body, sig=sig))


def _canonical(data: bytes, value: NodeCert | RevocationList | Sealed, what: str) -> None:
    if encode(value) != data:
        raise WireError(f"{what} is not in canonical msgpack encoding")


def _version(v: int, what: str) -> None:
    if v != FORMAT_VERSION:
        raise WireError(f"{what} format version {v} is not supported (this build reads "
                        f"{FORMAT_VERSION})")


def open_sealed(data: bytes) -> Sealed:
    """Decode a sealed envelope (no signature check). Raises :class:`WireError`."""
    try:
        sealed = _sealed.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not a sealed certificate or revocation list: {e}") from None
    _version(sealed.v, "envelope")
    _canonical(bytes(data), sealed, "envelope")
    return sealed


def decode_cert_body(body: bytes) -> NodeCert:
    """Decode a certificate body (no signature check). Raises :class:`WireError`."""
    try:
        cert = _cert.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not a node certificate: {e}") from None
    _version(cert.v, "certificate")
    _canonical(body, cert, "certificate body")
    return cert


def decode_revocations_body(body: bytes) -> RevocationList:
    """Decode a revocation list body (no signature check). Raises :class:`WireError`."""
    try:
        lst = _revocations.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not a revocation list: {e}") from None
    _version(lst.v, "revocation list")
    _canonical(body, lst, "revocation list body")
    return lst
