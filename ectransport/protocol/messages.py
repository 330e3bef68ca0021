"""ECTP wire messages (msgspec Structs, msgpack maps, tagged by ``"k"``): v1's, and the frames
of v2 (``ReqBatch`` / ``AckBatch`` / ``Parked`` / ``Sync`` / ``Offer`` / ``RenewAck``, refused below v2:
:data:`SINCE`), and the :class:`Ticket` a producer's announcement carries through the
orchestrator.

Rules (see ``protocols/ectp-v1.md`` and, for what v2 adds, ``protocols/ectp-v2.md``):

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
#: Protocol versions this build speaks, lowest first (v2: ``protocols/ectp-v2.md``). A node
#: configured with ``versions=(1,)`` speaks v1 only.
SUPPORTED_VERSIONS: tuple[int, ...] = (1, 2)

#: Bounds that keep decoding cheap whatever a peer sends.
MAX_ID_LEN = 128
MAX_HASH_LEN = 256
MAX_DETAIL_LEN = 1024
MAX_LIST_LEN = 64
MAX_GRANT_BYTES = 4 << 20  # plane-specific grant blob (NIXL metadata + descriptors)
MAX_DEST_BYTES = 64 << 10
MAX_LOCALITY_BYTES = 256  # a consumer plane's locality token (Hello.localities)
MAX_ENDPOINT_BYTES = 64 << 10  # the negotiated plane's declaration (Welcome.endpoint)
#: Hello.cert / Welcome.cert on the wire. Larger than the biggest certificate the trust layer
#: verifies (4 KiB, ``ectransport.trust.MAX_CERT_BYTES``), so that an oversized certificate is
#: refused as such, and a later, larger format does not make older nodes refuse the Hello.
MAX_CERT_WIRE_BYTES = 16 << 10

SessionId = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
NodeId = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
MmHash = Annotated[str, msgspec.Meta(max_length=MAX_HASH_LEN)]
CompatHash = Annotated[str, msgspec.Meta(max_length=128)]
Detail = Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_LEN)]
PlaneName = Annotated[str, msgspec.Meta(max_length=64)]
Version = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
GrantId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]
Feature = Annotated[str, msgspec.Meta(max_length=32)]
MAX_FEATURES = 16


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
    #: optional features the consumer asks for (ECTP v2 §10: ``"offers"``); omitted when empty,
    #: ignored by nodes that do not know them
    features: Annotated[list[Feature], msgspec.Meta(max_length=MAX_FEATURES)] = []
    #: the consumer's node certificate from a deployment CA (``protocols/certificates.md``):
    #: binds this connection's CURVE key to a role; omitted when empty (no certificate)
    cert: Annotated[bytes, msgspec.Meta(max_length=MAX_CERT_WIRE_BYTES)] = b""


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
    #: the features of ``Hello.features`` this producer grants the session (ECTP v2 §10);
    #: omitted when empty
    features: Annotated[list[Feature], msgspec.Meta(max_length=MAX_FEATURES)] = []
    #: the producer's node certificate from a deployment CA (``protocols/certificates.md``),
    #: for the CURVE key the consumer dialed; omitted when empty (no certificate)
    cert: Annotated[bytes, msgspec.Meta(max_length=MAX_CERT_WIRE_BYTES)] = b""


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


# -- ECTP v2 (protocols/ectp-v2.md): batches, readiness wait, small entries inline -----------------

#: Most entries one ``ReqBatch`` / ``AckBatch`` names.
MAX_BATCH_ITEMS = 64
#: Largest entry an ``AckItem`` may carry inline (wire bound; the producer's threshold is lower).
MAX_INLINE_BYTES = 1 << 20
#: Longest readiness wait a ``ReqBatch`` may ask for, seconds (the producer may cap it lower).
MAX_WAIT_S = 60.0


class ReqItem(msgspec.Struct, frozen=True):
    """One entry of a ``ReqBatch``: as ``XferReq``'s ``mm_hash`` and ``dest``."""

    mm_hash: MmHash
    dest: Annotated[bytes, msgspec.Meta(max_length=MAX_DEST_BYTES)]


class ReqBatch(Message, frozen=True, tag="reqs"):
    """v2. Consumer → producer: ``XferReq`` for several entries in one frame.

    ``batch_id`` is the consumer's id for this frame (unique per session), echoed by every
    ``AckBatch`` that answers it. ``wait_s``: an item whose entry is reserved but not yet ready
    (would be NACK_NOT_READY) is answered when it becomes ready, or with NACK_NOT_READY once
    ``wait_s`` has passed since the producer received the frame (0: answer at once, as v1).
    ``inline_max``: the largest entry, bytes, the consumer accepts inline in the answer (0: none).
    Mm_hashes are distinct within a batch.
    """

    session_id: SessionId
    batch_id: GrantId
    compat_hash: CompatHash
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WAIT_S)]
    inline_max: Annotated[int, msgspec.Meta(ge=0, le=MAX_INLINE_BYTES)]
    items: Annotated[list[ReqItem], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class AckItem(msgspec.Struct, frozen=True):
    """The answer for one item of a ``ReqBatch``: as ``XferAck`` (``grant`` set iff OK and not
    inline), or, for an OK entry of at most the batch's ``inline_max`` bytes, ``data``: the
    entry's bytes themselves (``grant`` None; nothing to read, pin or complete)."""

    mm_hash: MmHash
    status: Status
    grant: Grant | None
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_INLINE_BYTES)]
    detail: Detail


class AckBatch(Message, frozen=True, tag="acks"):
    """v2. Producer → consumer: answers to some items of the ``ReqBatch`` ``batch_id``.

    Items that can be answered at once come in one frame; items waiting for readiness come in
    later frames of the same ``batch_id``. Every item of the batch is answered exactly once.
    """

    session_id: SessionId
    batch_id: GrantId
    items: Annotated[list[AckItem], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class Parked(Message, frozen=True, tag="park"):
    """v2. Producer → consumer: these ``items`` of the ``ReqBatch`` ``batch_id`` wait at the
    producer for their entries to become ready (ECTP v2 §4.3).

    Sent once per batch that parks items, in the same step as the batch's immediate
    ``AckBatch`` (or alone when nothing was answerable at once), so that a consumer hears from
    every item within its ack timeout — an item neither answered nor parked by then means the
    producer is not responding. ``wait_s`` is the wait the producer honours, seconds from when it
    received the batch: ``min(ReqBatch.wait_s, its max_wait_s)``; the item is answered (an
    ``AckBatch``) at the latest when it is over. Mm_hashes are distinct and named by the batch.
    """

    session_id: SessionId
    batch_id: GrantId
    items: Annotated[list[MmHash], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WAIT_S)]


class DoneItem(msgspec.Struct, frozen=True):
    """One grant a ``DoneBatch`` completes or gives back: as ``XferDone``'s fields."""

    mm_hash: MmHash
    grant_id: GrantId
    ok: bool


class DoneBatch(Message, frozen=True, tag="dones"):
    """v2. Consumer → producer: ``XferDone`` for several grants (or holds) in one frame — the
    completions queued within a short bounded time (e.g. a batch's READs), so that a consumer
    sends one frame, not one per entry (ECTP v2 §4.4). Each item is handled exactly as an
    ``XferDone`` would be."""

    session_id: SessionId
    items: Annotated[list[DoneItem], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


#: ``Hello.features`` / ``Welcome.features``: pushed offers of announced entries (ECTP v2 §10).
FEATURE_OFFERS = "offers"
#: ``Welcome.features``: the producer takes ``DoneBatch`` frames (ECTP v2 §4.4). A consumer sends
#: one only to a producer that says so: the first v2 releases refused it (an unknown kind), and
#: their grants then stayed pinned to the end of their leases.
FEATURE_DONES = "dones"
#: Longest validity an ``Offer`` item may claim, seconds (as the longest lease a consumer takes).
MAX_OFFER_VALID_S = 86400.0


class Sync(Message, frozen=True, tag="sync"):
    """v2. Consumer → producer, on a session granted ``"offers"``: ``t`` is the consumer's clock
    (seconds, its monotonic clock) when it sent this frame. The producer keeps the newest one as
    the session's *anchor*: every ``Offer`` states its validity from the anchor, so the consumer
    measures it on its own clock from a moment that precedes the offer (ECTP v2 §10.3). Sent
    after the session is bound and then periodically (clock drift)."""

    session_id: SessionId
    t: Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]


class OfferItem(msgspec.Struct, frozen=True):
    """One announced entry the producer holds: ``grant`` as in an OK ``XferAck`` (its
    ``grant_id`` is the hold id a :class:`Ticket` names; ``lease_s`` the hold's length), and
    ``valid_s``: how long after the producer received the anchoring ``Sync`` the hold surely
    lasts, seconds."""

    mm_hash: MmHash
    grant: Grant
    valid_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_OFFER_VALID_S)]


class Offer(Message, frozen=True, tag="offer"):
    """v2. Producer → consumer, on a session granted ``"offers"``: entries announced and held,
    readable with no request (ECTP v2 §10). ``anchor`` is the ``t`` of a ``Sync`` of this session;
    an item is usable until ``anchor + valid_s`` (minus the consumer's margin) on the
    consumer's clock. Sent when an entry is announced, and for every live hold when the
    session's first ``Sync`` arrives."""

    session_id: SessionId
    anchor: Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]
    items: Annotated[list[OfferItem], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


#: ``Hello.features`` / ``Welcome.features``: confirmed lease renewals (ECTP v2 §11): the
#: producer answers every ``Renew`` of the session with a ``RenewAck``.
FEATURE_RENEW_ACK = "renew_ack"
#: Longest extension a ``RenewAck`` may state, seconds (as the longest lease a consumer takes).
MAX_RENEW_S = 86400.0


class RenewAck(Message, frozen=True, tag="renew_ack"):
    """v2. Producer → consumer, on a session granted ``"renew_ack"``: the answer to one
    ``Renew`` (every ``Renew`` of such a session is answered, in the order received; ECTP v2
    §11). ``grant_ids``: the grants that ``Renew`` named which are live, in its order; the lease
    of each now runs at least ``extend_s`` seconds past the moment the producer *received* that
    ``Renew``. ``extend_s``: the extension applied, ``min(Renew.extend_s, lease_s)``. The
    consumer counts the extension from when it *sent* the ``Renew`` (a moment that precedes the
    producer's), never from this frame's arrival."""

    session_id: SessionId
    grant_ids: Annotated[list[GrantId], msgspec.Meta(max_length=4096)]
    extend_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_RENEW_S)]


class Ticket(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a producer's announcement of ``mm_hash`` carries through the orchestrator (e.g. in
    vLLM's ``ec_transfer_params``) besides the producer's address: the producer's node id and
    the id of the hold it took (``hold_id`` 0: no hold — fetched the v1 way).

    It is a reference, not a capability: the descriptors and the NIXL metadata needed to read
    the entry travel only in ``Offer`` frames over the producer's authenticated session, so a
    ticket is useless without that session, and a forged or copied one can only name a hold of
    the same producer for the same mm_hash (any other is fetched the v1 way) (ECTP v2 §10.1)."""

    producer: NodeId
    hold_id: GrantId
    mm_hash: MmHash


AnyMessage = (Hello | Welcome | XferReq | XferAck | XferDone | Renew | Nack | ReqBatch | AckBatch
              | Parked | Sync | Offer | DoneBatch | RenewAck)

#: tag → class, for the first decoding phase and for docs/tests.
KINDS: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (Hello, Welcome, XferReq, XferAck, XferDone, Renew, Nack, ReqBatch, AckBatch,
                Parked, Sync, Offer, DoneBatch, RenewAck)
}
#: tag → the protocol version that introduced it; a frame of that kind with an older ``v`` is
#: refused (NACK_VERSION), so a v1 session never sees v2 frames, whatever ``v`` they claim.
SINCE: dict[str, int] = {"reqs": 2, "acks": 2, "park": 2, "sync": 2, "offer": 2, "dones": 2,
                         "renew_ack": 2}
