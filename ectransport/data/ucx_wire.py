"""The UCX plane's wire forms: the grant (:class:`UcxGrant`), the producer's declaration
(:class:`UcxEndpoint`), the consumer's request (:class:`UcxRequest`), the 256-byte reply header and
the tag layout (``xid << 20 | segment``); and the loopback rule for the address UCX dials. Pure
msgspec/numpy: importing it imports no ucxx."""

from __future__ import annotations

import ipaddress
import struct
from typing import Annotated

import msgspec
import numpy as np

from ectransport.data.binding import HostEndpoint
from ectransport.data.serving import TOKEN_BYTES

_HEADER_BYTES = 256
_SEG_BITS = 20  # segments per transfer < 2**20; tag = xid << 20 | index
_MAX_SEGS = (1 << _SEG_BITS) - 1
_XID_BITS = 64 - _SEG_BITS  # random transfer ids (ectransport.data.ucx docstring)
_OK, _REFUSED, _BAD, _INTERNAL = 0, 1, 2, 3


class UcxGrant(msgspec.Struct, frozen=True, tag="ucx/1", forbid_unknown_fields=True):
    """The ``plane_grant`` of the UCX plane (msgpack; opaque to everything but this module).

    Attributes:
        host: address the consumer connects to (the producer's ``host`` option).
        port: the producer's UCX listener port.
        token: 16 random bytes naming this grant; revoked when the grant ends.
        nbytes: payload bytes.
        blocks: granted blocks (the consumer's runs must count as many).
        lens: byte lengths of the producer's contiguous pieces, in payload order (sum = nbytes).
    """

    host: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    token: Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    blocks: Annotated[int, msgspec.Meta(gt=0)]
    lens: list[Annotated[int, msgspec.Meta(gt=0)]]


class UcxEndpoint(HostEndpoint, frozen=True, tag="ucx-ep", forbid_unknown_fields=True):
    """The UCX plane's ``endpoint()`` declaration (fields: :class:`HostEndpoint`); every grant of
    the session must name its ``host`` and ``port``."""


class UcxRequest(msgspec.Struct, frozen=True, tag="ucxreq/1", forbid_unknown_fields=True):
    """Consumer → producer (active message): serve ``token`` as segments ``segs`` on tags
    ``xid << 20 | 1..len(segs)`` after a header on ``xid << 20``."""

    token: bytes
    xid: Annotated[int, msgspec.Meta(gt=0, lt=1 << _XID_BITS)]
    notif: bytes
    segs: list[Annotated[int, msgspec.Meta(gt=0)]]


_grant_encoder = msgspec.msgpack.Encoder()
_grant_decoder = msgspec.msgpack.Decoder(UcxGrant)
_request_decoder = msgspec.msgpack.Decoder(UcxRequest)
_endpoint_decoder = msgspec.msgpack.Decoder(UcxEndpoint)

Key = tuple[int, str, int]  # consumer's endpoint key: (binding scope, 0 = unbound; host; port)


def _dial_address(host: str) -> str:
    """The address to give UCX for ``host``: any IPv4 loopback address becomes 127.0.0.1, the
    only one UCX's connection manager accepts on (``ectransport.data.ucx`` docstring); others
    are unchanged."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv4Address) and ip.is_loopback:
        return "127.0.0.1"
    return host


def _header(status: int, detail: str = "") -> np.ndarray:
    raw = detail.encode()[: _HEADER_BYTES - 3]
    buf = np.zeros(_HEADER_BYTES, np.uint8)
    buf[:3] = np.frombuffer(struct.pack("!BH", status, len(raw)), np.uint8)
    buf[3 : 3 + len(raw)] = np.frombuffer(raw, np.uint8)
    return buf


def _parse_header(buf: np.ndarray) -> tuple[int, str]:
    status, n = struct.unpack("!BH", buf[:3].tobytes())
    return status, buf[3 : 3 + min(n, _HEADER_BYTES - 3)].tobytes().decode(errors="replace")

