"""The NIXL plane's wire forms — the grant (:class:`NixlGrant`) and the producer's declaration
(:class:`NixlEndpoint`) — and the checks a consumer makes on them before any NIXL call: whose agent
serialized metadata names (:func:`metadata_agent`) and whether a grant stays inside what its
producer declared (:func:`check_bound`). Pure msgspec: importing it imports no nixl."""

from __future__ import annotations

from typing import Annotated

import msgspec

from ectransport.errors import DataPlaneError

_MD_PREFIX = b"nixlSerDes|Agent"


class NixlGrant(msgspec.Struct, frozen=True, tag="nixl/1", forbid_unknown_fields=True):
    """The ``plane_grant`` of the NIXL plane (msgpack; opaque to everything but this module).

    Attributes:
        agent: the producer's NIXL agent name.
        meta: the producer's agent metadata (``nixl_agent.get_agent_metadata()``, ~0.5 KB).
        mem_kind: memory kind of the producer's region, ``"DRAM"`` or ``"VRAM"``.
        dev_id: device id of the producer's region (0 for DRAM).
        descs: ``(addr, length)`` in bytes, one per contiguous run of granted blocks, in payload
            order; lengths are whole blocks (``count × block_bytes``).
    """

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    meta: bytes
    mem_kind: str
    dev_id: Annotated[int, msgspec.Meta(ge=0)]
    descs: list[tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(gt=0)]]]


class NixlEndpoint(msgspec.Struct, frozen=True, tag="nixl-ep/1", forbid_unknown_fields=True):
    """What a NIXL producer declares once per session (:meth:`NixlPlane.endpoint`).

    Attributes:
        agent: its agent name (``<node_id>-<identity>-<8 hex>``).
        conn: agent metadata to connect with: connection information only (``grant`` scope) or the
            whole region's metadata (``region`` scope).
        identity: the producer's identity (see ``identity_of``); ``""`` in insecure mode.
        mem_kind / dev_id: its region's memory kind and device.
        base / nbytes: its region's address range; every granted descriptor lies inside it.
        scope: ``"grant"`` or ``"region"``.
    """

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    conn: Annotated[bytes, msgspec.Meta(max_length=32 << 10)]
    identity: Annotated[str, msgspec.Meta(max_length=64)]
    mem_kind: str
    dev_id: Annotated[int, msgspec.Meta(ge=0)]
    base: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    nbytes: Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]
    scope: str


def metadata_agent(meta: bytes) -> str | None:
    """The agent name inside serialized NIXL metadata (full or partial), None if unrecognised.

    NIXL's serializer writes ``b"nixlSerDes|Agent"``, an 8-byte little-endian length, then the
    name; checking it lets a consumer refuse metadata of another agent *before* loading it."""
    if not meta.startswith(_MD_PREFIX) or len(meta) < len(_MD_PREFIX) + 8:
        return None
    n = int.from_bytes(meta[len(_MD_PREFIX):len(_MD_PREFIX) + 8], "little")
    name = meta[len(_MD_PREFIX) + 8:len(_MD_PREFIX) + 8 + n]
    if n == 0 or n > 256 or len(name) != n:
        return None
    try:
        return name.decode()
    except UnicodeDecodeError:
        return None


_grant_encoder = msgspec.msgpack.Encoder()
_grant_decoder = msgspec.msgpack.Decoder(NixlGrant)
_endpoint_decoder = msgspec.msgpack.Decoder(NixlEndpoint)

def check_bound(ep: NixlEndpoint, grant: NixlGrant) -> None:
    """Refuse a grant the producer's declaration does not cover (before any NIXL call).

    Raises:
        DataPlaneError: another agent, memory kind or device; metadata of another agent; a
            descriptor outside the declared region (overflow included).
    """
    if grant.agent != ep.agent:
        raise DataPlaneError(f"grant names nixl agent {grant.agent!r}, this producer declared "
                             f"{ep.agent!r}")
    if grant.mem_kind != ep.mem_kind or grant.dev_id != ep.dev_id:
        raise DataPlaneError(f"grant names {grant.mem_kind}:{grant.dev_id}, this producer declared "
                             f"{ep.mem_kind}:{ep.dev_id}")
    if ep.scope == "grant" and grant.meta and metadata_agent(grant.meta) != ep.agent:
        raise DataPlaneError(f"grant carries NIXL metadata of {metadata_agent(grant.meta)!r}, not "
                             f"of the declared agent {ep.agent!r}")
    end = ep.base + ep.nbytes
    for addr, length in grant.descs:
        if addr < ep.base or addr + length > end:
            raise DataPlaneError(f"grant descriptor ({addr:#x}, {length}) lies outside the "
                                 f"declared region [{ep.base:#x}, {end:#x})")
