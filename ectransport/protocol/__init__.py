"""Wire layer: ECTP messages, codec, status codes, compatibility hash. No I/O."""

from ectransport.protocol.codec import MAX_FRAME_BYTES, FrameError, decode, encode
from ectransport.protocol.compat import LAYOUT_ROW, compat_hash, element_size
from ectransport.protocol.messages import (
    KINDS,
    PROTOCOL_MAJOR,
    SUPPORTED_VERSIONS,
    AnyMessage,
    Grant,
    Hello,
    Message,
    Nack,
    Renew,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
)
from ectransport.protocol.status import RETRYABLE, Status

__all__ = [
    "KINDS", "LAYOUT_ROW", "MAX_FRAME_BYTES", "PROTOCOL_MAJOR", "RETRYABLE", "SUPPORTED_VERSIONS",
    "AnyMessage", "FrameError", "Grant", "Hello", "Message", "Nack", "Renew", "Status", "Welcome",
    "XferAck", "XferDone", "XferReq", "compat_hash", "decode", "element_size", "encode",
]
