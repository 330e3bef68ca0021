"""Wire layer: ECTP messages, codec, status codes, compatibility hash. No I/O."""

from ectransport.protocol.codec import MAX_FRAME_BYTES, FrameError, decode, encode
from ectransport.protocol.compat import LAYOUT_ROW, compat_hash, element_size
from ectransport.protocol.messages import (
    FEATURE_DONES,
    FEATURE_OFFERS,
    FEATURE_RENEW_ACK,
    KINDS,
    MAX_BATCH_ITEMS,
    MAX_INLINE_BYTES,
    MAX_WAIT_S,
    PROTOCOL_MAJOR,
    SINCE,
    SUPPORTED_VERSIONS,
    AckBatch,
    AckItem,
    AnyMessage,
    DoneBatch,
    DoneItem,
    Grant,
    Hello,
    Message,
    Nack,
    Offer,
    OfferItem,
    Parked,
    Renew,
    RenewAck,
    ReqBatch,
    ReqItem,
    Sync,
    Ticket,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
)
from ectransport.protocol.status import RETRYABLE, Status

__all__ = [
    "FEATURE_DONES", "FEATURE_OFFERS", "FEATURE_RENEW_ACK", "KINDS", "LAYOUT_ROW", "Offer", "OfferItem", "Sync", "Ticket", "DoneBatch", "DoneItem", "MAX_BATCH_ITEMS", "MAX_FRAME_BYTES", "MAX_INLINE_BYTES", "MAX_WAIT_S",
    "PROTOCOL_MAJOR", "RETRYABLE", "SINCE", "SUPPORTED_VERSIONS", "AckBatch", "AckItem",
    "AnyMessage", "ReqBatch", "ReqItem", "FrameError", "Grant", "Hello", "Message", "Nack", "Parked", "Renew", "RenewAck", "Status", "Welcome",
    "XferAck", "XferDone", "XferReq", "compat_hash", "decode", "element_size", "encode",
]
