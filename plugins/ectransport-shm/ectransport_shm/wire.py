"""The shm plane's own wire: its grant, and the frames on its Unix-socket connections.

Every frame is a 4-byte big-endian length (1..:data:`MAX_HEADER_BYTES`) and a msgpack body that
carries :data:`SHM_WIRE_VERSION`. A connection is, in order:

1. consumer → :class:`ShmHello` ``{nonce}``; producer → :class:`ShmProof` ``{mac}`` (the listener
   proves it is the plane the session declared, see :mod:`ectransport_shm.locality`);
2. any number of consumer → :class:`ShmRequest`, producer → :class:`ShmReply` (+ a segment
   descriptor the first time), then, on OK, one 8-byte progress record per chunk and one ack byte
   (``0x01``) from the consumer for every ring slot the producer must reuse.

Anything else on the stream (another frame, a short or oversized header, an ack byte other than
``0x01``, bytes left over after a transfer) closes the connection; it is never pooled again.

Sizes are bytes; every receive is bounded by a deadline (``ectransport.plugin.recv_frame``) and by
what the grant announced. The reply statuses are those of every socket-serving plane
(``ectransport.plugin.STATUS_*``) plus :data:`STATUS_INTERNAL`.
"""

from __future__ import annotations

import socket
from typing import Annotated

import msgspec
from ectransport.plugin import (
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_GRANT,
    TOKEN_BYTES,
    recv_frame,
)

from ectransport_shm.locality import NONCE_BYTES

#: Version of the shm plane's wire format, checked on every frame. 2: the connection starts with
#: the Hello/Proof challenge (plugin API 2).
SHM_WIRE_VERSION = 2
MAX_HEADER_BYTES = 4096
MAX_NOTIF_BYTES = 2048
PROGRESS_BYTES = 8  # one progress record: big-endian end offset of a chunk
ACK = b"\x01"

__all__ = [
    "ACK", "MAX_HEADER_BYTES", "MAX_NOTIF_BYTES", "PROGRESS_BYTES", "SHM_WIRE_VERSION",
    "STATUS_BAD_REQUEST", "STATUS_INTERNAL", "STATUS_OK", "STATUS_UNKNOWN_GRANT", "ShmGrant",
    "ShmHello", "ShmProof", "ShmReply", "ShmRequest", "grant_decoder", "hello_decoder",
    "proof_decoder", "recv_header", "reply_decoder", "request_decoder",
]

STATUS_INTERNAL = 3  #: e.g. the producer cannot create a segment (/dev/shm full)


class ShmGrant(msgspec.Struct, frozen=True, tag="shm/1", forbid_unknown_fields=True):
    """The ``plane_grant`` of the shm plane (msgpack; opaque to everything but this plugin).

    Attributes:
        socket: abstract Unix socket name of the producer's plane (without the leading NUL); the
            consumer refuses it unless it is the socket of the session's binding.
        boot_id: the producer machine's boot id (same-host check, for a clear message).
        host: the producer's host name, for error messages.
        token: 128-bit random capability naming the granted blocks at the producer.
        nbytes: payload bytes.
        runs_bytes: bytes of the granted blocks (``count × block_bytes`` summed).
        node: the producer's node id (must be the binding's).
    """

    socket: Annotated[str, msgspec.Meta(min_length=1, max_length=107)]
    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    host: Annotated[str, msgspec.Meta(max_length=255)]
    token: Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    runs_bytes: Annotated[int, msgspec.Meta(ge=0)]
    node: Annotated[str, msgspec.Meta(max_length=256)] = ""


class ShmHello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """Consumer → producer, first frame of a connection: prove you are the declared plane."""

    v: int
    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]


class ShmProof(msgspec.Struct, frozen=True, tag="proof", forbid_unknown_fields=True):
    """Producer → consumer: ``mac`` = :func:`ectransport_shm.locality.proof` of the nonce."""

    v: int
    mac: Annotated[bytes, msgspec.Meta(max_length=64)]


class ShmRequest(msgspec.Struct, frozen=True, tag="req", forbid_unknown_fields=True):
    """Consumer → producer: copy the blocks of ``token`` through the segment; then ``notif``."""

    v: int
    token: bytes
    notif: Annotated[bytes, msgspec.Meta(max_length=MAX_NOTIF_BYTES)]


class ShmReply(msgspec.Struct, frozen=True, tag="rep", forbid_unknown_fields=True):
    """Producer → consumer. On OK, ``ceil(nbytes / chunk_bytes)`` progress records follow.

    ``fd_attached``: this header carries (``SCM_RIGHTS``) a read-only descriptor of a new segment
    of ``segment_bytes`` bytes that replaces the connection's previous one.
    """

    v: int
    status: int
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    segment_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    chunk_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    fd_attached: bool = False
    detail: str = ""


grant_decoder = msgspec.msgpack.Decoder(ShmGrant)
hello_decoder = msgspec.msgpack.Decoder(ShmHello)
proof_decoder = msgspec.msgpack.Decoder(ShmProof)
request_decoder = msgspec.msgpack.Decoder(ShmRequest)
reply_decoder = msgspec.msgpack.Decoder(ShmReply)


def recv_header(sock: socket.socket, first_timeout_s: float, timeout_s: float,
                want_fds: bool = False) -> tuple[bytes, list[int]]:
    """One frame body of at most :data:`MAX_HEADER_BYTES` (the first byte may take
    ``first_timeout_s``, the rest ``timeout_s``) and the descriptors that came with it (the
    caller closes them): ``ectransport.plugin.recv_frame``.

    Raises:
        PeerClosed / OSError: EOF, stall or socket error. FrameError (a ValueError): a length out
        of range.
    """
    return recv_frame(sock, first_timeout_s, timeout_s, MAX_HEADER_BYTES, want_fds)
