"""vLLM 0.33.0's EC transfer wire (version 2), as msgspec types: the schema is the parser.

Every message travels as the two ZMQ frames ``[b"", payload]`` over a plain DEALER → ROUTER
connection (:mod:`ectransport.compat.wire_control`); the payload is a msgpack map tagged under
``"type"``: ``"req"`` (consumer → producer) or ``"ack"`` (producer → consumer). ``mem_descriptor``
is a msgpack list of ``(addr, size, device_id)`` triples. The types are our own description of
that wire, written from the protocol's facts (``docs/interop.md``), not vLLM's code.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Sequence
from typing import Annotated

import msgspec

#: vLLM 0.33.0's ``EC_CONNECTOR_VERSION``: what a request without a version field means.
VLLM_WIRE_VERSION = 2
#: The vLLM release whose wire this profile speaks (also an input of the compatibility hash).
VLLM_VERSION = "0.33.0"
_MAX_ID = 256


class VllmStatus(enum.IntEnum):
    """vLLM's transfer status codes (same numbers as :class:`ectransport.protocol.Status`)."""

    OK = 0
    NACK_MISSING = 1
    NACK_INCOMPAT = 2
    NACK_VERSION = 3
    NACK_INTERNAL = 4
    NACK_NOT_READY = 5


_Str = Annotated[str, msgspec.Meta(max_length=_MAX_ID)]


class WireReq(msgspec.Struct, tag="req", tag_field="type", frozen=True):
    """Consumer → producer. A missing ``connector_version`` means the sender's default (2):
    vLLM encodes with ``omit_defaults``, so a sender at the default leaves it out (a soft check);
    :func:`encode_req` always writes it."""

    mm_hash: _Str
    compatibility_hash: Annotated[str, msgspec.Meta(max_length=128)]
    session_id: _Str = ""
    connector_version: int = VLLM_WIRE_VERSION


class WireAck(msgspec.Struct, tag="ack", tag_field="type", omit_defaults=True, frozen=True):
    """Producer → consumer. Defaults are omitted on the wire, as vLLM writes them."""

    mm_hash: _Str
    status: int
    session_id: _Str = ""
    src_block_indices: list[int] = []
    agent_metadata: bytes = b""
    mem_descriptor: bytes = b""


#: One NIXL descriptor of the wire: ``(addr, size, device_id)``.
Desc = tuple[int, int, int]

_req_dec = msgspec.msgpack.Decoder(WireReq)
_ack_dec = msgspec.msgpack.Decoder(WireAck)
_desc_dec = msgspec.msgpack.Decoder(list[tuple[int, int, int]])
_enc = msgspec.msgpack.Encoder()
#: What a decoder raises on bytes that are not a valid message.
DecodeErrors = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def encode_req(mm_hash: str, compatibility_hash: str, session_id: str,
               connector_version: int = VLLM_WIRE_VERSION) -> bytes:
    """An XferReq payload with every field written (the version explicitly, never omitted)."""
    return _enc.encode({"type": "req", "mm_hash": mm_hash, "compatibility_hash": compatibility_hash,
                        "session_id": session_id, "connector_version": connector_version})


def encode_ack(ack: WireAck) -> bytes:
    return _enc.encode(ack)


def decode_req(data: bytes) -> WireReq:
    """Raises: one of :data:`DecodeErrors` on anything but a valid request."""
    return _req_dec.decode(data)


def decode_ack(data: bytes) -> WireAck:
    """Raises: one of :data:`DecodeErrors` on anything but a valid ack."""
    return _ack_dec.decode(data)


def encode_descs(descs: Sequence[Desc]) -> bytes:
    return _enc.encode(list(descs))


def decode_descs(data: bytes) -> list[Desc]:
    """Raises: one of :data:`DecodeErrors` on anything but a list of ``(addr, size, dev)``."""
    return _desc_dec.decode(data)


def vllm_compat_hash(vllm_version: str, model: str, dtype: str, block_bytes: int) -> str:
    """vLLM's peer-compatibility fingerprint: SHA-256 hex of the compact JSON array
    ``[vllm_version, model, dtype, block_bytes]`` (UTF-8). ``dtype`` as vLLM prints a torch dtype,
    e.g. ``"torch.bfloat16"``; a bare ``"bfloat16"`` is prefixed."""
    if not dtype.startswith("torch."):
        dtype = f"torch.{dtype}"
    doc = json.dumps([vllm_version, model, dtype, int(block_bytes)], separators=(",", ":"))
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()
