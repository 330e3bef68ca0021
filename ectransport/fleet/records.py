"""The directory's records: msgspec Structs as msgpack (plain data, no Python objects), versioned.

Every record carries ``v`` (:data:`RECORD_VERSION`), a required field. Decoding is two-phase, as
for ECTP frames: first only ``v`` (an envelope), then the body; a record that is not msgpack, is
not a map, has another version, or whose fields have wrong types or out-of-range values is
:class:`Rejected` with a reason — never an exception to the caller. Unknown extra fields are
ignored (a later minor revision may add some).

- :class:`InstanceRecord` — one per live instance (``instances`` hash): who it is, where its
  control plane listens, its CURVE public key, its certificate (opaque bytes for the fleet
  trust layer), its compatibility hash and a load figure;
- :class:`HolderRecord` — one per (mm_hash, instance) (an item's ``holders`` hash): the same
  identity, the incarnation that published it, and the entry's size in bytes;
- :class:`ClaimRecord` — the value of an item's claim key: who claimed it, a random token
  that only the claimant knows (release and renewal compare it), and whether the claimant's
  liveness record vouches for it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

#: Version of every directory record; a record of another version is dropped and counted.
RECORD_VERSION = 1

Name = Annotated[str, Meta(min_length=1, max_length=128)]
Host = Annotated[str, Meta(min_length=1, max_length=255)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Z85Key = Annotated[str, Meta(min_length=40, max_length=40)]
Cert = Annotated[bytes, Meta(max_length=64 << 10)]
Hex = Annotated[str, Meta(min_length=1, max_length=128)]
MmHash = Annotated[str, Meta(min_length=1, max_length=1024)]
Load = Annotated[float, Meta(ge=0)]


class _Envelope(msgspec.Struct):
    v: int


class InstanceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A live instance (field ``instance`` of the ``instances`` hash).

    Attributes:
        v: :data:`RECORD_VERSION`.
        instance / incarnation: the instance's name in the fleet and a random id of this run of
            it (a restarted instance has a new one: records of an older run are stale).
        host / port: its control plane (``host:port`` consumers connect to).
        public_key: its CURVE public key, Z85 (40 characters).
        cert: its fleet certificate (opaque bytes; see ``ectransport.trust``), or None.
        compat_hash: its compatibility hash (hex; ``Layout.compat_hash``).
        load: a load figure (lower = less loaded; the holder ordering's second rule).
        roles: what it does (``producer``, ``consumer``), informational.
        started_ms: when this incarnation started, ms since the epoch (its own clock).
    """

    v: int
    instance: Name
    incarnation: Hex
    host: Host
    port: Port
    public_key: Z85Key
    cert: Cert | None = None
    compat_hash: Hex
    load: Load = 0.0
    roles: tuple[Name, ...] = ()
    started_ms: int = 0


class HolderRecord(msgspec.Struct, frozen=True, kw_only=True):
    """``instance`` holds ``mm_hash`` (field ``instance`` of the item's ``holders`` hash).

    Attributes:
        v: :data:`RECORD_VERSION`.
        mm_hash: the item (must be the key's item).
        instance / incarnation / host / port / public_key / cert / compat_hash: the holder's
            identity, equal to its :class:`InstanceRecord`'s (a mismatch is dropped).
        nbytes: the entry's size, bytes (``[num_tokens, hidden]`` × element size).
        load: the holder's load figure when it published.
        published_ms: when it published, ms since the epoch (its own clock).
    """

    v: int
    mm_hash: MmHash
    instance: Name
    incarnation: Hex
    host: Host
    port: Port
    public_key: Z85Key
    cert: Cert | None = None
    nbytes: Annotated[int, Meta(ge=1)]
    compat_hash: Hex
    load: Load = 0.0
    published_ms: int = 0


class ClaimRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The value of a claim key: ``instance`` is encoding the item; ``token`` proves it.

    Attributes:
        liveness: the claimant keeps a liveness record (an instance with an identity): once
            that record lapses or names another incarnation, waiters treat the claim as
            released and one of them takes it over. False (a lookup-only claimant, or a record
            of an earlier release): only the claim's expiry releases it.
    """

    v: int
    instance: Name
    incarnation: Hex
    token: Hex
    taken_ms: int = 0
    liveness: bool = False


Record = InstanceRecord | HolderRecord | ClaimRecord
Reason = Literal["malformed", "version"]


class Rejected(msgspec.Struct, frozen=True):
    """A record that could not be used: ``reason`` ``malformed`` (not msgpack, wrong types,
    out of range) or ``version`` (another record version); ``detail`` for logs."""

    reason: Reason
    detail: str


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_DECODERS: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls) for cls in (InstanceRecord, HolderRecord, ClaimRecord)
}


def encode(record: Record) -> bytes:
    """The msgpack bytes of a record."""
    return _ENCODER.encode(record)


def decode(raw: object, cls: type[Any]) -> Any:
    """Decode ``raw`` (bytes from Redis) as ``cls`` (one of the record classes), two-phase.

    Returns:
        The record, or :class:`Rejected` (never raises on any input).
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        return Rejected("malformed", f"not bytes: {type(raw).__name__}")
    try:
        version = _ENVELOPE.decode(raw).v
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Rejected("malformed", f"no record envelope: {e}")
    if version != RECORD_VERSION:
        return Rejected("version", f"record version {version}, this node reads {RECORD_VERSION}")
    try:
        return _DECODERS[cls].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Rejected("malformed", f"{cls.__name__}: {e}")
