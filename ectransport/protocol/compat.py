"""The compatibility hash: two nodes may exchange encoder-cache bytes only if theirs are equal.

It covers everything that changes the *meaning* of the bytes: model id, dtype, hidden size, the
row/block layout and the protocol major version. (vLLM's ECCPUConnector hashes vLLM version, model,
dtype and block bytes; we hash hidden and layout explicitly and leave the framework version out,
since two ectransport releases with the same layout do interoperate.)
"""

from __future__ import annotations

import hashlib
import json

from ectransport.protocol.messages import PROTOCOL_MAJOR

#: The only block layout defined by ECTP v1: one block = one row of ``hidden × element_size``
#: bytes of a C-contiguous ``[num_tokens, hidden]`` tensor (as vLLM's ECCPUConnector lays it out).
LAYOUT_ROW = "row-major/1row-per-block"

_ELEMENT_SIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype named as torch names it without the ``torch.`` prefix.

    Raises:
        ValueError: the dtype is not one ECTP knows.
    """
    name = dtype.removeprefix("torch.")
    try:
        return _ELEMENT_SIZE[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; expected one of {sorted(_ELEMENT_SIZE)}"
        ) from None


def compat_hash(
    model_id: str,
    dtype: str,
    hidden: int,
    *,
    layout: str = LAYOUT_ROW,
    protocol_major: int = PROTOCOL_MAJOR,
    extra: dict[str, str] | None = None,
) -> str:
    """SHA-256 hex digest of a canonical JSON encoding of the compatibility parameters.

    Args:
        model_id: the model name or path the encoder outputs belong to.
        dtype: element dtype, e.g. ``"bfloat16"`` (a ``torch.`` prefix is ignored).
        hidden: row width in elements (vLLM's inputs-embeds width).
        layout: block layout name; ECTP v1 defines only :data:`LAYOUT_ROW`.
        protocol_major: the ECTP major version.
        extra: anything else that changes the meaning of the bytes (string → string).

    Returns:
        64 lowercase hex characters. JSON with sorted keys and fixed separators, so no value can
        contain a separator that makes two different parameter sets collide.

    Raises:
        ValueError: ``hidden`` is not positive or ``dtype`` is unknown.
    """
    if hidden <= 0:
        raise ValueError(f"hidden must be positive, got {hidden}")
    dt = dtype.removeprefix("torch.")
    if dt not in _ELEMENT_SIZE:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_ELEMENT_SIZE)}")
    block_bytes = hidden * _ELEMENT_SIZE[dt]
    doc = {
        "model": model_id,
        "dtype": dt,
        "hidden": hidden,
        "block_bytes": block_bytes,
        "layout": layout,
        "ectp_major": protocol_major,
        "extra": dict(sorted((extra or {}).items())),
    }
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("ascii")).hexdigest()
