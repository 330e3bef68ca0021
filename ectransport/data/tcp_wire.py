"""Wire format of the TCP plane: the grant it hands out and the request/reply headers it frames.

Framing: every header is a 4-byte big-endian length (1..:data:`MAX_HEADER_BYTES`) then a msgpack
body with a required protocol version (:data:`TCP_WIRE_VERSION`); on ``STATUS_OK`` the reply is
followed by exactly ``nbytes`` payload bytes. See :mod:`ectransport.data.tcp` for the protocol.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ectransport.data.binding import HostEndpoint
from ectransport.data.framing import recv_exact
from ectransport.data.serving import (
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_GRANT,
    TOKEN_BYTES,
)

#: Version of the TCP plane's own wire format (request/reply headers), checked on every header.
TCP_WIRE_VERSION = 1
#: Largest header body (request or reply), bytes; a longer length prefix is a bad request.
MAX_HEADER_BYTES = 4096
#: Largest ``notif`` a request may carry, bytes.
MAX_NOTIF_BYTES = 2048

# Reply statuses (STATUS_OK 0, STATUS_UNKNOWN_GRANT 1, STATUS_BAD_REQUEST 2): those of every
# socket-serving plane, ectransport.data.serving.

__all__ = [
    "MAX_HEADER_BYTES", "MAX_NOTIF_BYTES", "STATUS_BAD_REQUEST", "STATUS_OK",
    "STATUS_UNKNOWN_GRANT", "TCP_WIRE_VERSION", "TOKEN_BYTES", "TcpEndpoint", "TcpGrant",
    "TcpReply", "TcpRequest", "recv_exact",
]


class TcpGrant(msgspec.Struct, frozen=True, tag="tcp/1", forbid_unknown_fields=True):
    """The ``plane_grant`` of the TCP plane (msgpack; opaque to everything but this module).

    Attributes:
        host / port: where the producer's listener accepts requests.
        token: 128-bit random capability naming the granted blocks at the producer.
        nbytes: payload bytes the producer will send.
        runs_bytes: bytes of the granted blocks (``count × block_bytes`` summed), so the consumer
            can check that its runs have the same shape.
        node: the producer's node id (for :meth:`TcpPlane.forget_peer`).
    """

    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    token: Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    runs_bytes: Annotated[int, msgspec.Meta(ge=0)]
    node: Annotated[str, msgspec.Meta(max_length=256)] = ""


class TcpEndpoint(HostEndpoint, frozen=True, tag="tcp-ep", forbid_unknown_fields=True):
    """The TCP plane's ``endpoint()`` declaration (fields: :class:`HostEndpoint`); every grant
    of the session must name its ``host``, ``port`` and ``node``."""


class TcpRequest(msgspec.Struct, frozen=True, tag="req", forbid_unknown_fields=True):
    """Consumer → producer: send me the blocks of ``token``; deliver ``notif`` when done."""

    v: int
    token: bytes
    notif: Annotated[bytes, msgspec.Meta(max_length=MAX_NOTIF_BYTES)]


class TcpReply(msgspec.Struct, frozen=True, tag="rep", forbid_unknown_fields=True):
    """Producer → consumer: ``status``; on OK, exactly ``nbytes`` payload bytes follow."""

    v: int
    status: int
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    detail: str = ""


grant_decoder = msgspec.msgpack.Decoder(TcpGrant)
endpoint_decoder = msgspec.msgpack.Decoder(TcpEndpoint)
request_decoder = msgspec.msgpack.Decoder(TcpRequest)
reply_decoder = msgspec.msgpack.Decoder(TcpReply)
