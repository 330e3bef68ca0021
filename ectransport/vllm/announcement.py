"""One multimodal item's entry of vLLM's ``ec_transfer_params``: the :class:`Announcement`.

A producer writes one per item it holds (``request_finished``); the orchestrator copies the dict
into the consumer's request, where it is read back with :func:`read_announcement`. The entry comes
from the request (an OpenAI client can write it too), so it is validated as a schema, not trusted:
each field has a type and a bound, and a malformed entry is an :class:`AnnouncementError` that
names the field and what was expected — the consumer then encodes that item locally (never a
crash, never a fetch built from a half-read entry).

The keys are those of vLLM's own ECCPUConnector (``peer_host``, ``peer_port``, ``size_bytes``,
``shape``), so that stock vLLM and ectransport read each other's announcements, plus ectransport's
(``dtype``, ``public_key``, ``planes``, ``versions``, ``producer_id``, ``transport`` and the ticket
``ect_hold``, ECTP v2 §10). vLLM's own per-item keys (``modality``, ``metadata``,
``item_indices``, from ``collect_ec_item_metadata``) are read with the types vLLM writes; any
other key (a later vLLM's) is ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ectransport.errors import ProtocolError
from ectransport.node.common import Layout
from ectransport.protocol import Ticket

#: ``transport`` of the entries this connector writes.
TRANSPORT = "ectransport"

_U63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
_Name = Annotated[str, Meta(min_length=1, max_length=128)]


class Announcement(msgspec.Struct, frozen=True, omit_defaults=True):
    """One item's ``ec_transfer_params`` entry (module docstring).

    Attributes:
        peer_host: where the producer's control plane listens (a name or an address; at most
            253 characters, the longest DNS name).
        peer_port: its TCP port, 1..65535.
        size_bytes: the entry's size in bytes (``rows * block_bytes`` of the producer's layout).
        shape: ``[num_tokens, hidden]`` of the encoder output; absent in some producers'.
        dtype: the encoder output's dtype, e.g. ``"bfloat16"`` (a ``"torch."`` prefix is allowed).
        public_key: the producer's Z85 CURVE public key (40 characters); absent without CURVE.
        planes / versions: the data planes and ECTP versions the producer offers.
        producer_id: the producer's node id: the ticket's ``producer``.
        transport: ``"ectransport"`` for this connector's entries.
        ect_hold: the ticket's hold id (> 0) when the producer holds and offers the entry;
            absent or 0: no hold, the consumer asks with a request.
        modality / metadata / item_indices: vLLM's own per-item entries, passed through.
    """

    peer_host: Annotated[str, Meta(min_length=1, max_length=253)]
    peer_port: Annotated[int, Meta(ge=1, le=65535)]
    size_bytes: _U63
    shape: Annotated[list[_U63], Meta(min_length=2, max_length=2)] | None = None
    dtype: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    public_key: Annotated[str, Meta(min_length=40, max_length=40)] | None = None
    planes: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=16)] = []
    versions: Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 16)]], Meta(max_length=16)] = []
    producer_id: _Name | None = None
    transport: Annotated[str, Meta(max_length=64)] | None = None
    ect_hold: _U63 | None = None
    modality: Annotated[str, Meta(max_length=64)] | None = None
    metadata: dict[str, Any] | None = None
    item_indices: list[Annotated[int, Meta(ge=0)]] | None = None

    def to_params(self) -> dict[str, Any]:
        """The plain dict vLLM carries (JSON types only; absent optional fields left out)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    def ticket(self, mm_hash: str) -> Ticket | None:
        """The ticket this entry carries (``ect_hold`` > 0 with ``producer_id``), or None: the
        entry is then fetched with a request."""
        if not self.ect_hold or self.producer_id is None:
            return None
        return Ticket(producer=self.producer_id, hold_id=self.ect_hold, mm_hash=mm_hash)

    def mismatch(self, nbytes: int, rows: int, layout: Layout) -> str | None:
        """Why this entry cannot be fetched into ``rows`` rows of ``layout`` (``nbytes`` bytes),
        or None. The message starts with ``"size mismatch"``."""
        if self.size_bytes != nbytes:
            return (f"size mismatch: announced {self.size_bytes} bytes, this model needs {nbytes} "
                    f"({rows} rows of {layout.hidden} {layout.dtype})")
        if self.shape is not None and self.shape != [rows, layout.hidden]:
            return (f"size mismatch: announced shape {self.shape}, this model needs "
                    f"[{rows}, {layout.hidden}]")
        if self.dtype is not None and self.dtype.removeprefix("torch.") != layout.dtype:
            return f"size mismatch: announced dtype {self.dtype}, this model uses {layout.dtype}"
        return None


class AnnouncementError(ProtocolError):
    """An ``ec_transfer_params`` entry that is not an :class:`Announcement`.

    Attributes:
        mm_hash: the item it announces.
        field: the offending field (``"peer_port"``, ``"shape[1]"``; ``""``: the entry itself).
        expected: what was expected there, and what was found (msgspec's words).
    """

    def __init__(self, mm_hash: str, field: str, expected: str):
        self.mm_hash, self.field, self.expected = mm_hash, field, expected
        where = f"field `{field}`" if field else "the entry"
        super().__init__(f"announcement: ec_transfer_params entry of {mm_hash[:16]}: {where}: "
                         f"{expected}")


_AT = re.compile(r"\s+- at `\$(.*)`$")
_MISSING = re.compile(r"^Object missing required field `(.+)`$")


def _field_of(message: str) -> tuple[str, str]:
    """``(field, expectation)`` from a msgspec ValidationError message."""
    if m := _MISSING.match(message):
        return m.group(1), "required, missing"
    if m := _AT.search(message):
        return m.group(1).lstrip("."), message[:m.start()]
    return "", message


def is_announced(entry: object) -> bool:
    """Whether ``entry`` claims to announce a fetchable item (has a ``peer_host`` key, vLLM's
    own test): vLLM writes entries without one (metadata only) for items it holds no copy of."""
    return not isinstance(entry, dict) or "peer_host" in entry


def read_announcement(mm_hash: str, entry: object) -> Announcement:
    """``entry`` (one value of ``ec_transfer_params``) as an :class:`Announcement`.

    Strict types: ``"5601"`` is not a port and ``true`` is not an int. Keys the schema does not
    name are ignored.

    Raises:
        AnnouncementError: a field has the wrong type, is out of bounds or is missing, or the
            entry is not a JSON object.
    """
    try:
        return msgspec.convert(entry, Announcement, strict=True)
    except msgspec.ValidationError as e:
        field, expected = _field_of(str(e))
        raise AnnouncementError(mm_hash, field, expected) from None
