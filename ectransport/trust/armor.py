"""Text armor for certificate and revocation list files (PEM-like, RFC 7468 layout).

A file holds one or more blocks::

    # comment lines (ignored): what the block is, for a human reading the file
    -----BEGIN ECTRANSPORT NODE CERTIFICATE-----
    <base64 of the sealed bytes, 64 columns>
    -----END ECTRANSPORT NODE CERTIFICATE-----

Anything outside blocks is ignored; a block of another label is skipped, so a CA public key
(``PUBLIC KEY``), a certificate and revocation lists can share a file. Pure functions.
"""

from __future__ import annotations

import base64
import binascii
import re

from ectransport.trust.errors import TrustError

CERT_LABEL = "ECTRANSPORT NODE CERTIFICATE"
REVOCATIONS_LABEL = "ECTRANSPORT REVOCATION LIST"
PUBLIC_KEY_LABEL = "PUBLIC KEY"

_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.DOTALL)


class ArmorError(TrustError):
    """A block whose body is not base64."""


def armor(label: str, data: bytes, comment: str = "") -> str:
    """``data`` as one block of ``label``, after ``comment`` lines (each prefixed ``# ``)."""
    b64 = base64.b64encode(data).decode("ascii")
    lines = [f"# {ln}".rstrip() for ln in comment.splitlines()]
    lines.append(f"-----BEGIN {label}-----")
    lines += [b64[i:i + 64] for i in range(0, len(b64), 64)]
    lines.append(f"-----END {label}-----")
    return "\n".join(lines) + "\n"


def blocks(text: str, label: str) -> list[bytes]:
    """The decoded bytes of every ``label`` block in ``text``, in order.

    Raises:
        ArmorError: a ``label`` block whose body is not base64.
    """
    out: list[bytes] = []
    for m in _BLOCK.finditer(text):
        if m.group(1) != label:
            continue
        body = "".join(m.group(2).split())
        try:
            out.append(base64.b64decode(body, validate=True))
        except (binascii.Error, ValueError) as e:
            raise ArmorError(f"a {label} block is not base64: {e}") from None
    return out


def labels(text: str) -> list[str]:
    """The labels of the blocks in ``text``, in order (to tell what a file holds)."""
    return [m.group(1) for m in _BLOCK.finditer(text)]
