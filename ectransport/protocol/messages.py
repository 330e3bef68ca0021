"""ECTP v1 wire messages (msgspec Structs, msgpack maps, tagged by ``"k"``).

Rules (see ``protocols/ectp-v1.md``):

* every frame carries ``v`` — the protocol version — as a **required** field. It has no default, so
  msgspec always writes it and a frame without it fails validation (vLLM's ``connector_version`` is a
  defaulted field that ``omit_defaults`` drops, which makes its version check silently pass);
* ``Hello`` and ``Welcome`` bodies are frozen for the whole major version, so any two nodes can
  always negotiate; every other frame must carry the version negotiated for its session;
* frames are msgpack decoded by msgspec into typed Structs, never Python object serialisation;
  bytes stay msgpack ``bin``; bulk data never travels on the control plane;
* strings and lists have upper bounds, so a hostile peer cannot make the decoder allocate much.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ectransport.protocol.status import Status

#: Major version of ECTP: part of the compatibility hash. Versions 1..N of the same major keep the
#: ``Hello``/``Welcome`` bodies unchanged.
PROTOCOL_MAJOR = 1
#: Protocol versions this build speaks, lowest first.
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)

#: Bounds that keep decoding cheap whatever a peer sends.
MAX_ID_LEN = 128
MAX_HASH_LEN = 256
MAX_DETAIL_LEN = 1024
MAX_LIST_LEN = 64
MAX_GRANT_BYTES = 4 << 20  # plane-specific grant blob (NIXL metadata + descriptors)
MAX_DEST_BYTES = 64 << 10
MAX_LOCALITY_BYTES = 256  # a consumer plane's locality token (Hello.localities)
MAX_ENDPOINT_BYTES = 64 << 10  # the negotiated plane's declaration (Welcome.endpoint)

SessionId = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
NodeId = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
MmHash = Annotated[str, msgspec.Meta(max_length=MAX_HASH_LEN)]
CompatHash = Annotated[str, msgspec.Meta(max_length=128)]
Detail = Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_LEN)]
PlaneName = Annotated[str, msgspec.Meta(max_length=64)]
Version = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
GrantId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]


class Message(msgspec.Struct, frozen=True, tag_field="k"):
    """Base of every frame. ``v`` (protocol version) is required and always encoded."""

    v: Version


class Hello(Message, frozen=True, tag="hello", omit_defaults=True):
    """Consumer → producer, first frame of a connection (sent only after CURVE succeeded).

    ``v`` is the highest version the sender speaks; ``versions`` lists all of them; ``planes`` lists
    the data planes the consumer can use, best first; ``session_id`` is the consumer session's
    random id (UUID4 hex), to which the producer binds the authenticated peer.

    ``localities`` (added in v1.1; optional and omitted when empty, so v1.0 frames keep their exact
    bytes and v1.0 nodes ignore it; ``omit_defaults`` is safe here because ``v`` and every v1.0
    field have no default and are always encoded): plane
    name → that plane's locality token (``DataTransport.locality()``), from which the producer's
    plane judges whether it can reach this consumer; a plane it cannot reach is not negotiated.
    """

    session_id: SessionId
    node_id: NodeId
    versions: Annotated[list[Version], msgspec.Meta(max_length=MAX_LIST_LEN)]
    planes: Annotated[list[PlaneName], msgspec.Meta(max_length=MAX_LIST_LEN)]
    compat_hash: CompatHash
    mem_kinds: Annotated[list[PlaneName], msgspec.Meta(max_length=8)]
    localities: Annotated[
        dict[PlaneName, Annotated[bytes, msgspec.Meta(max_length=MAX_LOCALITY_BYTES)]],
        msgspec.Meta(max_length=MAX_LIST_LEN),
    ] = {}


class Welcome(Message, frozen=True, tag="welcome", omit_defaults=True):
    """Producer → consumer, answer to ``Hello``.

    On ``status == OK``: ``version`` and ``plane`` are the negotiated choices (highest common
    version; the first plane in the consumer's list that the producer offers). Otherwise ``status``
    is NACK_VERSION, NACK_INCOMPAT or NACK_BAD_REQUEST and ``detail`` says why; ``versions`` and
    ``planes`` are the producer's own offer so the consumer can name both lists in its error.

    ``endpoint`` (added in v1.1; optional, omitted when empty like ``Hello.localities``): the negotiated plane's declaration of how it is
    reached (``DataTransport.endpoint()``: for NIXL its agent name and metadata, for TCP its
    address). It travels only over this authenticated session, and every grant of the session must
    name nothing else, so that a compromised producer cannot point the consumer elsewhere.
    """

    session_id: SessionId
    node_id: NodeId
    status: Status
    version: Version
    plane: PlaneName
    versions: Annotated[list[Version], msgspec.Meta(max_length=MAX_LIST_LEN)]
    planes: Annotated[list[PlaneName], msgspec.Meta(max_length=MAX_LIST_LEN)]
    compat_hash: CompatHash
    detail: Detail
    endpoint: Annotated[bytes, msgspec.Meta(max_length=MAX_ENDPOINT_BYTES)] = b""


class XferReq(Message, frozen=True, tag="req"):
    """Consumer → producer: "pin ``mm_hash`` for me and tell me how to reach its blocks".

    ``dest`` is a plane-specific destination (push planes: where the producer must send the bytes);
    empty for one-sided READ planes such as NIXL.
    """

    session_id: SessionId
    mm_hash: MmHash
    compat_hash: CompatHash
    dest: Annotated[bytes, msgspec.Meta(max_length=MAX_DEST_BYTES)]


class Grant(msgspec.Struct, frozen=True):
    """What an OK ``XferAck`` hands out: access to exactly the granted blocks, under a lease.

    ``entry_bytes`` is the size of the tensor (``num_tokens × hidden × element_size``);
    ``num_blocks × block_bytes`` ≥ ``entry_bytes``. ``plane_grant`` is opaque to the control plane:
    the negotiated data plane's description of the granted blocks only (for NIXL: agent metadata plus
    one descriptor per contiguous run of granted blocks). ``lease_s`` is the lease length in seconds.
    """

    grant_id: GrantId
    entry_bytes: NonNeg
    num_blocks: NonNeg
    block_bytes: NonNeg
    lease_s: float
    plane: PlaneName
    plane_grant: Annotated[bytes, msgspec.Meta(max_length=MAX_GRANT_BYTES)]


class XferAck(Message, frozen=True, tag="ack"):
    """Producer → consumer: the answer to one ``XferReq``; ``grant`` is set iff ``status == OK``."""

    session_id: SessionId
    mm_hash: MmHash
    status: Status
    grant: Grant | None
    detail: Detail


class XferDone(Message, frozen=True, tag="done"):
    """Consumer → producer: the consumer finished (``ok``) or gave up on a grant; unpin it now."""

    session_id: SessionId
    mm_hash: MmHash
    grant_id: GrantId
    ok: bool


class Renew(Message, frozen=True, tag="renew"):
    """Consumer → producer heartbeat: extend the leases of grants still being read.

    The producer extends each lease to ``max(old_deadline, now + extend_s)`` (never shortening),
    capped at its own lease length.
    """

    session_id: SessionId
    grant_ids: Annotated[list[GrantId], msgspec.Meta(max_length=4096)]
    extend_s: float


class Nack(Message, frozen=True, tag="nack"):
    """Either side: a frame could not be parsed or attributed to a transfer.

    ``status`` is NACK_BAD_REQUEST (malformed, unknown kind, no Hello yet) or NACK_VERSION (frame
    version not negotiated).
    """

    status: Status
    detail: Detail


AnyMessage = Hello | Welcome | XferReq | XferAck | XferDone | Renew | Nack

#: tag → class, for the first decoding phase and for docs/tests.
KINDS: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (Hello, Welcome, XferReq, XferAck, XferDone, Renew, Nack)
}
