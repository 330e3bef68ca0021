"""Two-phase ECTP codec: envelope first (kind + version), then the typed body.

Phase 1 reads only ``k`` and ``v`` from the msgpack map; an unknown kind or an unacceptable
version is rejected *before* the body schema is applied, so a newer or garbage body never reaches
the typed decoder. Phase 2 is strict msgspec validation against the one class named by ``k``.
Encoders and decoders are built once, at import.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import cast

import msgspec

from ectransport.errors import ProtocolError
from ectransport.protocol.messages import (
    KINDS,
    MAX_BATCH_ITEMS,
    SINCE,
    AnyMessage,
    Hello,
    Message,
    Welcome,
)
from ectransport.protocol.status import Status

#: Default upper bound for one control frame, bytes. An OK ack with a NIXL grant is a few KB.
MAX_FRAME_BYTES = 8 << 20


class FrameError(ProtocolError):
    """A frame was rejected. ``status`` is the NACK to answer with; ``kind`` is set if known."""

    def __init__(self, status: Status, detail: str, kind: str | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.kind = kind


class _Envelope(msgspec.Struct):
    k: str
    v: int


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_BODY = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in KINDS.items()}
#: Hello/Welcome bodies are frozen for the whole major, so they are parsed at any version.
_ANY_VERSION = frozenset({Hello.__struct_config__.tag, Welcome.__struct_config__.tag})


def encode(msg: Message) -> bytes:
    """Encode one message as a msgpack map (``{"k": tag, "v": version, ...fields}``)."""
    return _ENCODER.encode(msg)


def decode(
    data: bytes | memoryview,
    *,
    versions: Collection[int],
    max_bytes: int = MAX_FRAME_BYTES,
) -> AnyMessage:
    """Decode one frame.

    Args:
        data: the frame bytes.
        versions: versions acceptable for this frame (the negotiated version, or all supported
            versions before negotiation). ``Hello``/``Welcome`` are accepted at any version.
        max_bytes: frames longer than this are rejected unread.

    Returns:
        The typed message.

    Raises:
        FrameError: with ``status`` NACK_BAD_REQUEST (too large, not msgpack, not a map with a
            string ``k`` and int ``v``, unknown kind, body fails validation) or NACK_VERSION
            (``v`` not acceptable).
    """
    if len(data) > max_bytes:
        raise FrameError(Status.NACK_BAD_REQUEST, f"frame of {len(data)} bytes exceeds {max_bytes}")
    try:
        env = _ENVELOPE.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise FrameError(Status.NACK_BAD_REQUEST, f"not an ECTP frame: {e}") from None
    body = _BODY.get(env.k)
    if body is None:
        raise FrameError(Status.NACK_BAD_REQUEST, f"unknown message kind {env.k[:32]!r}")
    if env.k not in _ANY_VERSION and env.v not in versions:
        raise FrameError(
            Status.NACK_VERSION,
            f"frame version {env.v} not acceptable here (expected one of {sorted(versions)})",
            kind=env.k,
        )
    since = SINCE.get(env.k)  # a kind newer than v1 is refused below its version, whatever A is
    if since is not None and env.v < since:
        raise FrameError(Status.NACK_VERSION,
                         f"{env.k!r} frames exist since version {since}, not {env.v}", env.k)
    try:
        return cast(AnyMessage, body.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise FrameError(Status.NACK_BAD_REQUEST, f"invalid {env.k!r} frame: {e}", env.k) from None


class _Ids(msgspec.Struct):
    session_id: str = ""
    mm_hash: str = ""


_IDS = msgspec.msgpack.Decoder(_Ids)


def peek_ids(data: bytes | memoryview) -> tuple[str, str]:
    """Best-effort ``(session_id, mm_hash)`` of a rejected frame, so a NACK can name its request.

    Returns empty strings for whatever cannot be read; never raises.
    """
    try:
        ids = _IDS.decode(data)
        return ids.session_id[:128], ids.mm_hash[:256]
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return "", ""


class _ItemIds(msgspec.Struct):
    mm_hash: str = ""


class _BatchIds(msgspec.Struct):
    session_id: str = ""
    batch_id: int = -1
    items: list[_ItemIds] = []


_BATCH_IDS = msgspec.msgpack.Decoder(_BatchIds)


def peek_batch(data: bytes | memoryview) -> tuple[str, int, list[str]] | None:
    """Best-effort ``(session_id, batch_id, distinct mm_hashes)`` of a rejected ``ReqBatch``, so
    its NACK can be an ``AckBatch`` naming the batch and its items (ECTP v2 §5).

    Returns None when the batch id or the items cannot be read (no item, more than
    ``MAX_BATCH_ITEMS``, an item that is not a map with a string ``mm_hash``); never raises.
    Strings are truncated to their bounds (128 / 256 characters).
    """
    try:
        ids = _BATCH_IDS.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if not 0 <= ids.batch_id < (1 << 63) or not 0 < len(ids.items) <= MAX_BATCH_ITEMS:
        return None
    mm_hashes = list(dict.fromkeys(it.mm_hash[:256] for it in ids.items))
    return ids.session_id[:128], ids.batch_id, mm_hashes
