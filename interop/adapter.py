"""The adapter protocol (``interop/ADAPTER.md``, version :data:`ADAPTER_VERSION`): what the
harness and every node adapter share — op names, features, the outcome vocabulary, the entry
content generator and the line codec. Pure (no I/O beyond what a caller passes in).

An *adapter* is a command line that runs a node under test and speaks JSON lines on its
stdin/stdout; the harness starts one per (host slot, implementation). The generator makes an
entry's bytes from ``(seed, nbytes)`` alone, so a producer in any language stores what the harness
expects and a consumer answers the SHA-256 of what landed; the harness compares digests and no
payload ever crosses the adapter pipe.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import numpy as np

#: Version of the adapter protocol this harness speaks (``hello`` answers ``adapter``).
ADAPTER_VERSION = 1

#: Every op of version 1 (``exit`` ends the process after its answer).
OPS = ("hello", "vectors", "start", "put", "announce", "connect", "fetch", "fetch_many", "stats",
       "close", "exit")
#: Optional capabilities an adapter may declare in ``hello.features``.
FEATURES = frozenset({
    "curve",        # CURVE keys (public_key/secret_key/allow/server key) are honoured
    "plain",        # curve=false (plain ZeroMQ, both sides insecure) is supported
    "versions",     # start honours ``node.versions`` (speaks only those ECTP versions)
    "fetch_many",   # the fetch_many op
    "announce",     # the announce op and fetch with a ticket
    "reserve",      # put with ready=false reserves an entry that never becomes ready
    "vectors",      # the vectors op (the golden-vector check of the node's own codec)
    "trust",        # node.trust (fleet trust: CA files, certificate, admission) is honoured
    "trust_refusal",  # a consumer reports a fleet-trust refusal (a NACK_BAD_REQUEST whose
                      # detail starts "trust: <reason>: ") as error:AuthError / miss:AUTH
})
ROLES = ("producer", "consumer")
#: Outcome strings: ``ok``; ``miss:<REASON>`` (a fetch that did not land); ``error:<Class>``
#: (a call that failed, or an adapter-level error); ``refused:<Class>`` (a node not started).
MISS_REASONS = ("MISSING", "INCOMPATIBLE", "VERSION", "BUSY", "TIMEOUT", "PEER_DOWN",
                "QUARANTINED", "AUTH", "NO_SPACE", "INTERNAL")
CONNECT_ERRORS = ("AuthError", "VersionError", "ProtocolError", "NoCommonPlane", "ConfigError",
                  "ECTransportError")
ADAPTER_ERRORS = ("BadRequest", "UnknownOp", "UnknownNode")
OUTCOME = re.compile(r"^(ok|(miss|error|refused|vllm):[A-Za-z_][A-Za-z0-9_]*)$")

_G = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def entry_bytes(seed: int, nbytes: int) -> np.ndarray:
    """The bytes of an entry: ``[nbytes]`` uint8, SplitMix64 of ``seed`` (ADAPTER.md §4).

    Word ``j`` (0-based) is ``mix(seed + (j + 1) · 0x9E3779B97F4A7C15 mod 2^64)`` written
    little-endian, where ``mix(z)``: ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
    z *= 0x94D049BB133111EB; z ^= z >> 31`` (mod 2^64), i.e. the ``(j+1)``-th output of the
    standard SplitMix64 generator seeded with ``seed``; the stream is cut at ``nbytes``.
    Vectorised: 64 MiB in about 0.3 s.
    """
    words = (nbytes + 7) // 8
    with np.errstate(over="ignore"):
        z = np.arange(1, words + 1, dtype=np.uint64) * _G + np.uint64(seed & _MASK)
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z.astype("<u8").view(np.uint8)[:nbytes]


def entry_rows(seed: int, rows: int, block_bytes: int) -> np.ndarray:
    """:func:`entry_bytes` as ``[rows, block_bytes]`` uint8 (one row per block)."""
    return entry_bytes(seed, rows * block_bytes).reshape(rows, block_bytes)


def sha256_hex(data: Any) -> str:
    """Lowercase hex SHA-256 of a bytes-like object or a C-contiguous array."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    return hashlib.sha256(data).hexdigest()


_digests: dict[tuple[int, int], str] = {}


def expected_sha256(seed: int, nbytes: int) -> str:
    """SHA-256 of :func:`entry_bytes` (memoised: the harness asks once per entry)."""
    key = (seed, nbytes)
    if key not in _digests:
        _digests[key] = sha256_hex(entry_bytes(seed, nbytes))
    return _digests[key]


def encode_line(msg: dict[str, Any]) -> str:
    """One protocol line (compact JSON, no newline inside, ``\\n`` at the end)."""
    return json.dumps(msg, separators=(",", ":"), default=str) + "\n"


def bad_outcome(value: Any) -> str | None:
    """None when ``value`` is a well-formed outcome string, else what is wrong with it."""
    if not isinstance(value, str):
        return f"outcome is {type(value).__name__}, expected a string"
    if not OUTCOME.match(value):
        return f"outcome {value!r} is not ok, miss:R, error:E or refused:E"
    kind, _, name = value.partition(":")
    if kind == "miss" and name not in MISS_REASONS:
        return f"miss reason {name!r} is not one of {', '.join(MISS_REASONS)}"
    return None
