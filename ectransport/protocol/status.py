"""ECTP status codes carried by ``XferAck``, ``Welcome`` and ``Nack``.

Numbering keeps vLLM's ``XferStatus`` values for the six codes both have (OK=0 ... NACK_NOT_READY=5),
so a compatibility profile can map one to the other without a table; ectransport adds BUSY and
BAD_REQUEST after them.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """Outcome of a request, as sent on the wire (msgpack int)."""

    OK = 0
    NACK_MISSING = 1  #: producer does not hold the mm_hash (never saved or evicted)
    NACK_INCOMPAT = 2  #: compatibility hash differs
    NACK_VERSION = 3  #: no common protocol version / frame version not negotiated
    NACK_INTERNAL = 4  #: producer-side failure
    NACK_NOT_READY = 5  #: entry allocated but its save has not landed yet (retryable)
    NACK_BUSY = 6  #: per-peer pin budget exhausted (retryable after backoff)
    NACK_BAD_REQUEST = 7  #: malformed or illegal request (no Hello, empty session id, bad grant)


#: NACKs a consumer retries with backoff until the request's own deadline; all others are terminal.
RETRYABLE = frozenset({Status.NACK_NOT_READY, Status.NACK_BUSY})
