"""Generate (or check) the ECTP golden vectors under ``protocols/vectors/v1/`` and ``v2/``.

Usage::

    python protocols/gen_vectors.py          # (re)write the vectors and index.json
    python protocols/gen_vectors.py --check  # exit 1 if the files on disk differ from the output

Every *valid* vector is defined below by its field values (literals, not derived from the code's
defaults) and encoded with :func:`ectransport.protocol.encode`; the bytes are written as one line of
lowercase hex to ``<name>.msgpack.hex``. Every *invalid* vector is built by editing the msgpack map
of a valid frame (or by hand) and is listed with the NACK status a decoder must answer with, and
the versions it is decoded with.

``vectors/v1/`` holds the frames of ECTP v1 (unchanged since v1: a v1 node passes them as
before); ``vectors/v2/`` holds what v2 adds — the ``ReqBatch``/``AckBatch``/``Parked`` frames,
the Hello and Welcome of a v2 negotiation, v1 frames at ``v = 2`` — and the frames a decoder must refuse.

JSON convention of ``index.json``: a field whose msgpack type is ``bin`` is written as the string
``"hex:"`` followed by the lowercase hex of its bytes (``"hex:"`` alone is an empty byte string);
every other value is written as itself (``str`` → string, ``int`` → number, ``float`` → number
with a fractional part, ``bool`` → true/false, ``nil`` → null, map → object, array → array). Status
codes are written as their integer wire value.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from ectransport.protocol import (
    KINDS,
    MAX_BATCH_ITEMS,
    MAX_INLINE_BYTES,
    SINCE,
    AckBatch,
    AckItem,
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
    Status,
    Sync,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    encode,
)

VECTORS = Path(__file__).resolve().parent / "vectors"
#: subdirectories of ``vectors/`` another script writes (``certs/``: gen_cert_vectors.py)
OTHER_GENERATORS = ("certs",)
ROOT = VECTORS / "v1"

SID = "0f3c9a7e5b2d4c18a6e1f09b7d3c5a21"  # a UUID4 hex, as the reference consumer draws it
MM = "9b1d0e6c2f4a8b7e3d5c1a0f9e8d7c6b5a493827161504f3e2d1c0b0a9f8e7d6"  # a SHA-256 hex mm_hash
# compat_hash("Qwen/Qwen2.5-VL-3B-Instruct", "bfloat16", 2048); pinned in test_compat.py
COMPAT = "8eb9fed6814a420db8843a53acafe5c014213d9144f7c1636c6297efd9baea9b"
GID = 0x5A17C0DE2B9E4F31  # a 63-bit grant id
# A NIXL plane_grant as the NIXL plane encodes it (``NixlGrant``, msgpack). Opaque to ECTP; it is
# written out by hand here so the control-plane vectors do not depend on the plane's code.
NIXL_GRANT = msgspec.msgpack.encode({
    "type": "nixl/1",
    "agent": "producer-0-1a2b3c4d",
    "meta": bytes(range(16)),
    "mem_kind": "DRAM",
    "dev_id": 0,
    "descs": [[140183574528000, 8192], [140183574552576, 4096]],
})


def _ack(status: Status, detail: str, grant: Grant | None = None) -> XferAck:
    return XferAck(v=1, session_id=SID, mm_hash=MM, status=status, grant=grant, detail=detail)


def _welcome(status: Status, version: int, plane: str, detail: str) -> Welcome:
    return Welcome(v=1, session_id=SID, node_id="producer-0", status=status, version=version,
                   plane=plane, versions=[1], planes=["nixl"], compat_hash=COMPAT, detail=detail)


#: name → (message, one-line description)
VALID: dict[str, tuple[Message, str]] = {
    "hello": (Hello(v=1, session_id=SID, node_id="consumer-0", versions=[1], planes=["nixl"],
                    compat_hash=COMPAT, mem_kinds=["DRAM"]),
              "Consumer's first frame: one version, one plane."),
    "hello_future": (Hello(v=3, session_id=SID, node_id="consumer-1", versions=[1, 2, 3],
                           planes=["ucx", "nixl", "tcp"], compat_hash=COMPAT,
                           mem_kinds=["DRAM", "VRAM"]),
                     ("Hello from a newer consumer (v=3): still decodable by a v1-only node, "
                      "since Hello/Welcome are frozen for the major.")),
    "welcome_ok": (_welcome(Status.OK, 1, "nixl", ""), "Negotiation succeeded: version 1, nixl."),
    "hello_localities": (Hello(v=1, session_id=SID, node_id="consumer-2", versions=[1],
                               planes=["shm", "tcp"], compat_hash=COMPAT, mem_kinds=["DRAM"],
                               localities={"shm": bytes.fromhex("82a4626f6f74a131a36e6574a132")}),
                         ("v1.1: the consumer's planes say where it is (the producer negotiates "
                          "only planes that can reach it); omitted when empty.")),
    "welcome_endpoint": (Welcome(v=1, session_id=SID, node_id="producer-0", status=Status.OK,
                                 version=1, plane="tcp", versions=[1], planes=["tcp"],
                                 compat_hash=COMPAT, detail="",
                                 endpoint=bytes.fromhex("84a168a931302e302e302e35a170cd15e2")),
                         ("v1.1: the negotiated plane's declaration, to which every grant of the "
                          "session is bound; omitted when empty.")),
    "welcome_nack_version": (
        _welcome(Status.NACK_VERSION, 0, "",
                 "no common protocol version: producer speaks [1], consumer [2]"),
        "No common protocol version."),
    "welcome_nack_incompat": (
        _welcome(Status.NACK_INCOMPAT, 0, "",
                 "compatibility hash mismatch: producer 8eb9fed6814a, consumer 000000000000 "
                 "(model/dtype/hidden/layout differ)"),
        "Compatibility hash differs."),
    "welcome_nack_incompat_plane": (
        _welcome(Status.NACK_INCOMPAT, 0, "",
                 "no common data plane: producer offers ['nixl'], consumer offers ['tcp']"),
        "No common data plane (also NACK_INCOMPAT)."),
    "welcome_nack_bad_request": (
        _welcome(Status.NACK_BAD_REQUEST, 0, "", "empty session id"),
        "Hello was illegal (empty session id / session bound to another peer)."),
    "req": (XferReq(v=1, session_id=SID, mm_hash=MM, compat_hash=COMPAT, dest=b""),
            "Transfer request on a one-sided READ plane (empty dest)."),
    "req_dest": (XferReq(v=1, session_id=SID, mm_hash=MM, compat_hash=COMPAT,
                         dest=bytes.fromhex("00ff10207f80fe")),
                 "Transfer request carrying a plane-specific destination (push planes)."),
    "ack_ok": (_ack(Status.OK, "", Grant(grant_id=GID, entry_bytes=11264, num_blocks=3,
                                         block_bytes=4096, lease_s=30.0, plane="nixl",
                                         plane_grant=NIXL_GRANT)),
               "OK with a grant: 2816 bf16 values (11264 bytes) in 3 blocks of 4096, 30 s lease."),
    "ack_ok_max_grant_id": (
        _ack(Status.OK, "", Grant(grant_id=(1 << 63) - 1, entry_bytes=0, num_blocks=0,
                                  block_bytes=4096, lease_s=0.5, plane="tcp", plane_grant=b"")),
        "OK with the largest grant id (uint64 encoding) and an empty entry."),
    "ack_nack_missing": (_ack(Status.NACK_MISSING, "not in this producer's cache"),
                         "Producer does not hold the entry."),
    "ack_nack_incompat": (_ack(Status.NACK_INCOMPAT, "compatibility hash mismatch"),
                          "Request's compatibility hash differs."),
    "ack_nack_version": (_ack(Status.NACK_VERSION,
                              "frame version 2 not acceptable here (expected one of [1])"),
                         "Request's frame version is not the negotiated one."),
    "ack_nack_internal": (_ack(Status.NACK_INTERNAL, "plane error: RuntimeError"),
                          "Producer-side failure."),
    "ack_nack_not_ready": (_ack(Status.NACK_NOT_READY, "entry allocated, save not landed yet"),
                           "Entry exists but is not saved yet (retryable)."),
    "ack_nack_busy": (_ack(Status.NACK_BUSY, "pin budget: 8192+12288 > 16384 bytes"),
                      "Per-peer pin budget exhausted (retryable after backoff)."),
    "ack_nack_bad_request": (_ack(Status.NACK_BAD_REQUEST, "send Hello first"),
                             "Illegal request (no Hello, foreign session, malformed body)."),
    "done_ok": (XferDone(v=1, session_id=SID, mm_hash=MM, grant_id=GID, ok=True),
                "Consumer finished reading; unpin."),
    "done_failed": (XferDone(v=1, session_id=SID, mm_hash=MM, grant_id=GID, ok=False),
                    "Consumer gave up on the grant; unpin."),
    "renew": (Renew(v=1, session_id=SID, grant_ids=[GID, 7, 0], extend_s=15.0),
              "Extend three leases by up to 15 s."),
    "renew_empty": (Renew(v=1, session_id=SID, grant_ids=[], extend_s=0.0),
                    "A heartbeat naming no grant."),
    "nack_bad_request": (Nack(v=1, status=Status.NACK_BAD_REQUEST,
                              detail="unknown message kind 'pull'"),
                         "A frame could not be parsed."),
    "nack_version": (Nack(v=1, status=Status.NACK_VERSION,
                          detail="frame version 2 not acceptable here (expected one of [1])"),
                     "A frame had a version that was not negotiated."),
    "nack_unicode_detail": (Nack(v=1, status=Status.NACK_BAD_REQUEST,
                                 detail="Renew for a foreign session — «ß» ✓"),
                            "Non-ASCII text is UTF-8 in msgpack str."),
}


def _frame(name: str) -> dict[str, Any]:
    """The msgpack map of a valid vector, as a dict in wire order (for editing)."""
    return msgspec.msgpack.decode(encode(VALID[name][0]))


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _with(d: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {**d, **kw}


def _e(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


#: name → (frame bytes, expected status, expected FrameError.kind, description). Decoded with
#: ``versions=[1]``.
INVALID: dict[str, tuple[bytes, Status, str | None, str]] = {
    "missing_v": (_e(_without(_frame("req"), "v")), Status.NACK_BAD_REQUEST, None,
                  "XferReq with the version key removed."),
    "missing_k": (_e(_without(_frame("req"), "k")), Status.NACK_BAD_REQUEST, None,
                  "XferReq with the kind key removed."),
    "unknown_kind": (_e(_with(_frame("req"), k="pull")), Status.NACK_BAD_REQUEST, None,
                     "A kind no ECTP v1 node knows."),
    "v_is_bool": (_e(_with(_frame("nack_bad_request"), v=True)), Status.NACK_BAD_REQUEST, None,
                  "Version encoded as a boolean, not an integer."),
    "not_a_map": (_e(["req", 1, SID, MM]), Status.NACK_BAD_REQUEST, None,
                  "A msgpack array instead of a map."),
    "truncated": (encode(VALID["req"][0])[:-7], Status.NACK_BAD_REQUEST, None,
                  "A valid XferReq with its last 7 bytes cut off."),
    "wrong_field_type": (_e(_with(_frame("req"), mm_hash=42)), Status.NACK_BAD_REQUEST, "req",
                         "XferReq whose mm_hash is an integer."),
    "missing_field": (_e(_without(_frame("req"), "dest")), Status.NACK_BAD_REQUEST, "req",
                      "XferReq without its dest field."),
    "req_version_2": (_e(_with(_frame("req"), v=2)), Status.NACK_VERSION, "req",
                      "XferReq at version 2 where only version 1 is acceptable."),
    "done_version_0": (_e(_with(_frame("done_ok"), v=0)), Status.NACK_VERSION, "done",
                       "XferDone at version 0 where only version 1 is acceptable."),
    "mm_hash_too_long": (_e(_with(_frame("req"), mm_hash="a" * 257)), Status.NACK_BAD_REQUEST,
                         "req", "XferReq whose mm_hash has 257 characters (bound 256)."),
    "status_unknown": (_e(_with(_frame("nack_bad_request"), status=8)), Status.NACK_BAD_REQUEST,
                       "nack", "Nack with status 8, which ECTP v1 does not define."),
    "hello_version_out_of_range": (_e(_with(_frame("hello"), v=1 << 16)),
                                   Status.NACK_BAD_REQUEST, "hello",
                                   "Hello with v=65536 (versions are < 65536)."),
    "grant_id_negative": (_e(_with(_frame("done_ok"), grant_id=-1)), Status.NACK_BAD_REQUEST,
                          "done", "XferDone with a negative grant id."),
}


# -- ECTP v2 (ectp-v2.md) ---------------------------------------------------------------------------

MM2 = "4e8a1f0c7b3d5e9a2c6f8b1d0e7a3c5f9b2d4e6a8c0f1e3d5b7a9c2e4f6a8b0c"  # a second entry
MM3 = "c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2"  # a third entry
BATCH = 0x2C41E9D3A0B75F18  # a batch id as the reference consumer draws it (63 bits)
GID2 = 0x3E5B7F1A9C2D4E60
HOLD = 0x1D7C3A5E9B0F2468  # a hold id (63 bits, as a grant id)
NIXL_GRANT2 = msgspec.msgpack.encode({
    "type": "nixl/1",
    "agent": "producer-0-1a2b3c4d",
    "meta": bytes(range(16)),
    "mem_kind": "DRAM",
    "dev_id": 0,
    "descs": [[140183574564864, 12288]],
})
#: 64 bytes inline: 32 bf16 values (one block of a toy layout with hidden = 32)
INLINE = bytes((7 * i + 3) % 256 for i in range(64))


def _grant(gid: int, entry_bytes: int, num_blocks: int, plane_grant: bytes) -> Grant:
    return Grant(grant_id=gid, entry_bytes=entry_bytes, num_blocks=num_blocks, block_bytes=4096,
                 lease_s=30.0, plane="nixl", plane_grant=plane_grant)


def _item(mm: str, status: Status, detail: str = "", grant: Grant | None = None,
          data: bytes = b"") -> AckItem:
    return AckItem(mm_hash=mm, status=status, grant=grant, data=data, detail=detail)


def _acks(*items: AckItem, batch_id: int = BATCH) -> AckBatch:
    return AckBatch(v=2, session_id=SID, batch_id=batch_id, items=list(items))


DUP_DETAIL = f"mm_hash {MM!r} appears more than once in the batch: name each entry once"


def _reqs(*mms: str, wait_s: float = 5.0, inline_max: int = 65536,
          dest: bytes = b"") -> ReqBatch:
    return ReqBatch(v=2, session_id=SID, batch_id=BATCH, compat_hash=COMPAT, wait_s=wait_s,
                    inline_max=inline_max, items=[ReqItem(mm_hash=m, dest=dest) for m in mms])


VALID_V2: dict[str, tuple[Message, str]] = {
    "hello_v2": (Hello(v=2, session_id=SID, node_id="consumer-0", versions=[1, 2],
                       planes=["nixl"], compat_hash=COMPAT, mem_kinds=["DRAM"]),
                 "A consumer speaking v1 and v2 (the Hello body is v1's)."),
    "welcome_v2": (Welcome(v=2, session_id=SID, node_id="producer-0", status=Status.OK, version=2,
                           plane="nixl", versions=[1, 2], planes=["nixl"], compat_hash=COMPAT,
                           detail=""),
                   "Negotiated v2 (the highest common version)."),
    "welcome_v1_from_v2": (Welcome(v=2, session_id=SID, node_id="producer-0", status=Status.OK,
                                   version=1, plane="nixl", versions=[1, 2], planes=["nixl"],
                                   compat_hash=COMPAT, detail=""),
                           ("A v1+v2 producer answering a v1-only consumer: the session speaks "
                            "v1, byte for byte.")),
    "reqs": (_reqs(MM, MM2, MM3),
             ("Three entries in one frame; items not ready may wait up to 5 s; entries up to "
              "64 KiB may come inline.")),
    "reqs_no_wait_no_inline": (_reqs(MM, wait_s=0.0, inline_max=0,
                                     dest=bytes.fromhex("00ff10207f80fe")),
                               ("One entry, answered at once (NOT_READY as in v1), never "
                                "inline; a push plane's dest.")),
    "acks_multi": (_acks(
        _item(MM, Status.OK, grant=_grant(GID, 11264, 3, NIXL_GRANT)),
        _item(MM2, Status.OK, data=INLINE),
        _item(MM3, Status.NACK_MISSING, "not in this producer's cache")),
        "The frame answering a batch at once: a grant, an inline entry and a miss."),
    "acks_inline": (_acks(_item(MM2, Status.OK, data=INLINE)),
                    "One entry inline: its 64 bytes, no grant, nothing to read or complete."),
    "acks_waited": (_acks(_item(MM3, Status.OK, grant=_grant(GID2, 12288, 3, NIXL_GRANT2))),
                    "A later frame of the same batch: the waiting entry was committed."),
    "acks_not_ready": (_acks(_item(MM3, Status.NACK_NOT_READY,
                                   "entry allocated, save not landed after waiting 5 s")),
                       "The waiting entry was not committed within the wait."),
    "acks_busy_bad_request": (_acks(
        _item(MM, Status.NACK_BUSY, "pin budget: 8192+12288 > 16384 bytes"),
        _item(MM2, Status.NACK_BAD_REQUEST,
              "entry needs 1048576 bytes pinned, more than this consumer's whole pin budget of "
              "524288 bytes: it can never be granted (raise the producer's budget_bytes)"),
        _item(MM3, Status.NACK_INTERNAL, "plane error: RuntimeError")),
        "Per-item NACKs: the budget (retryable), terminal refusals."),
    "acks_refused": (_acks(
        _item(MM, Status.NACK_BAD_REQUEST, DUP_DETAIL),
        _item(MM, Status.NACK_BAD_REQUEST, DUP_DETAIL)),
        "A batch refused as a whole (here: an mm_hash named twice): every item, same NACK."),
    "acks_incompat": (_acks(_item(MM, Status.NACK_INCOMPAT, "compatibility hash mismatch"),
                            _item(MM2, Status.NACK_INCOMPAT, "compatibility hash mismatch")),
                      "A batch with a foreign compatibility hash."),
    "acks_version": (_acks(_item(MM, Status.NACK_VERSION,
                                 "frame version 1 not acceptable here (expected one of [2])")),
                     "A batch frame with the wrong version on a v2 session."),
    "park": (Parked(v=2, session_id=SID, batch_id=BATCH, items=[MM3], wait_s=5.0),
             ("Sent with the frame answering a batch at once: its item whose entry is reserved "
              "but not ready waits, for the 5 s asked for.")),
    "park_capped": (Parked(v=2, session_id=SID, batch_id=BATCH, items=[MM2, MM3], wait_s=2.5),
                    ("Sent alone (nothing was answerable at once): two items wait, for the "
                     "producer's max_wait_s of 2.5 s, less than the batch asked for.")),
    "req_v2": (XferReq(v=2, session_id=SID, mm_hash=MM, compat_hash=COMPAT, dest=b""),
               "A single XferReq is still valid on a v2 session (at v = 2)."),
    "done_v2": (XferDone(v=2, session_id=SID, mm_hash=MM, grant_id=GID, ok=True),
                "XferDone of a grant from an AckBatch, as of one from an XferAck."),
    "renew_v2": (Renew(v=2, session_id=SID, grant_ids=[GID, GID2], extend_s=15.0),
                 "Renew of grants from an AckBatch."),
    "ack_v2": (XferAck(v=2, session_id=SID, mm_hash=MM, status=Status.OK,
                       grant=_grant(GID, 11264, 3, NIXL_GRANT), detail=""),
               "XferAck at v = 2 (the answer to a single XferReq)."),
    "nack_batch_reused": (Nack(v=2, status=Status.NACK_BAD_REQUEST,
                               detail=f"batch {BATCH} still has 1 item(s) waiting: batch "
                                      f"ids must not be reused before every item of the batch "
                                      f"was answered"),
                          "A batch id reused while items of it still wait."),
    "nack_batch_on_v1": (Nack(v=1, status=Status.NACK_VERSION,
                              detail="'reqs' frames exist since version 2, not 1"),
                         "A batch sent on a v1 session: refused, the session goes on."),
    "hello_v2_offers": (Hello(v=2, session_id=SID, node_id="consumer-0", versions=[1, 2],
                              planes=["nixl"], compat_hash=COMPAT, mem_kinds=["DRAM"],
                              features=["offers"]),
                        ("A v2 consumer asking for offers of announced entries (§7; the "
                         "optional features list, omitted when empty).")),
    "welcome_v2_offers": (Welcome(v=2, session_id=SID, node_id="producer-0", status=Status.OK,
                                  version=2, plane="nixl", versions=[1, 2], planes=["nixl"],
                                  compat_hash=COMPAT, detail="", features=["offers"]),
                          "Offers granted: v2, and the hold plane (one-sided READ) negotiated."),
    "sync": (Sync(v=2, session_id=SID, t=81234.125),
             "The consumer's clock when it sent this frame: the anchor of offer windows."),
    "offer": (Offer(v=2, session_id=SID, anchor=81234.125, items=[
        OfferItem(mm_hash=MM, grant=Grant(grant_id=HOLD, entry_bytes=11264, num_blocks=3,
                                          block_bytes=4096, lease_s=10.0, plane="nixl",
                                          plane_grant=NIXL_GRANT), valid_s=9.75)]),
              ("An announced entry held for 10 s: readable until anchor + 9.75 s (minus the "
               "consumer's margin) on the consumer's clock; grant_id is the hold id a ticket "
               "names.")),
    "done_hold": (XferDone(v=2, session_id=SID, mm_hash=MM, grant_id=HOLD, ok=True),
                  "A READ on an offer completed: XferDone names the hold."),
    "dones": (DoneBatch(v=2, session_id=SID, items=[
        DoneItem(mm_hash=MM, grant_id=GID, ok=True), DoneItem(mm_hash=MM2, grant_id=GID2, ok=True),
        DoneItem(mm_hash=MM3, grant_id=HOLD, ok=False)]),
              ("The completions of one step in one frame: two grants read, a READ on an offer "
               "that failed (each item as an XferDone).")),
    "hello_v2_renew_ack": (Hello(v=2, session_id=SID, node_id="consumer-0", versions=[1, 2],
                                 planes=["nixl"], compat_hash=COMPAT, mem_kinds=["DRAM"],
                                 features=["offers", "renew_ack"]),
                           "A v2 consumer asking for offers and for confirmed renewals (§11)."),
    "renew_ack": (RenewAck(v=2, session_id=SID, grant_ids=[GID, GID2], extend_s=3.5),
                  ("The answer to a Renew of these two live grants (§11): each lease now runs "
                   "at least 3.5 s past the producer's receipt of that Renew.")),
    "renew_ack_none": (RenewAck(v=2, session_id=SID, grant_ids=[], extend_s=3.5),
                       "The answer to a Renew whose grants had all ended: it names none."),
}


def _frame2(name: str) -> dict[str, Any]:
    return msgspec.msgpack.decode(encode(VALID_V2[name][0]))


_ONE = {"mm_hash": MM, "dest": b""}

#: name → (frame bytes, acceptable versions, expected status, expected FrameError.kind, text)
INVALID_V2: dict[str, tuple[bytes, list[int], Status, str | None, str]] = {
    "reqs_v1": (_e(_with(_frame2("reqs"), v=1)), [1], Status.NACK_VERSION, "reqs",
                "ReqBatch claiming v = 1 on a v1 session: batch frames exist since v2."),
    "reqs_on_v1_session": (_e(_frame2("reqs")), [1], Status.NACK_VERSION, "reqs",
                           "ReqBatch at v = 2 on a v1 session."),
    "acks_v1": (_e(_with(_frame2("acks_inline"), v=1)), [1, 2], Status.NACK_VERSION, "acks",
                "AckBatch claiming v = 1, even where v1 is acceptable."),
    "req_v1_on_v2_session": (_e(_with(_frame("req"), v=1)), [2], Status.NACK_VERSION, "req",
                             "XferReq at v = 1 on a v2 session."),
    "reqs_empty": (_e(_with(_frame2("reqs"), items=[])), [2], Status.NACK_BAD_REQUEST, "reqs",
                   "ReqBatch without items."),
    "reqs_too_many": (_e(_with(_frame2("reqs"), items=[
        {"mm_hash": f"{i:064x}", "dest": b""} for i in range(MAX_BATCH_ITEMS + 1)])), [2],
        Status.NACK_BAD_REQUEST, "reqs", "ReqBatch with 65 items (bound 64)."),
    "reqs_wait_too_long": (_e(_with(_frame2("reqs"), wait_s=60.5)), [2],
                           Status.NACK_BAD_REQUEST, "reqs", "wait_s = 60.5 (bound 60)."),
    "reqs_wait_negative": (_e(_with(_frame2("reqs"), wait_s=-1.0)), [2],
                           Status.NACK_BAD_REQUEST, "reqs", "wait_s = -1."),
    "reqs_inline_max_too_large": (_e(_with(_frame2("reqs"), inline_max=MAX_INLINE_BYTES + 1)),
                                  [2], Status.NACK_BAD_REQUEST, "reqs",
                                  "inline_max = 1 MiB + 1 (bound 1 MiB)."),
    "reqs_item_without_dest": (_e(_with(_frame2("reqs"), items=[{"mm_hash": MM}])), [2],
                               Status.NACK_BAD_REQUEST, "reqs", "An item without its dest."),
    "reqs_batch_id_negative": (_e(_with(_frame2("reqs"), batch_id=-1)), [2],
                               Status.NACK_BAD_REQUEST, "reqs", "batch_id = -1."),
    "acks_empty": (_e(_with(_frame2("acks_inline"), items=[])), [2], Status.NACK_BAD_REQUEST,
                   "acks", "AckBatch without items."),
    "acks_status_unknown": (_e(_with(_frame2("acks_inline"), items=[
        {**_frame2("acks_inline")["items"][0], "status": 8}])), [2], Status.NACK_BAD_REQUEST,
        "acks", "An item with status 8, which ECTP does not define."),
    "park_v1": (_e(_with(_frame2("park"), v=1)), [1, 2], Status.NACK_VERSION, "park",
                "Parked claiming v = 1, even where v1 is acceptable."),
    "park_on_v1_session": (_e(_frame2("park")), [1], Status.NACK_VERSION, "park",
                           "Parked at v = 2 on a v1 session."),
    "park_empty": (_e(_with(_frame2("park"), items=[])), [2], Status.NACK_BAD_REQUEST, "park",
                   "Parked naming no item."),
    "park_too_many": (_e(_with(_frame2("park"), items=[
        f"{i:064x}" for i in range(MAX_BATCH_ITEMS + 1)])), [2], Status.NACK_BAD_REQUEST, "park",
        "Parked naming 65 items (bound 64)."),
    "park_wait_too_long": (_e(_with(_frame2("park"), wait_s=60.5)), [2],
                           Status.NACK_BAD_REQUEST, "park", "wait_s = 60.5 (bound 60)."),
    "park_wait_negative": (_e(_with(_frame2("park"), wait_s=-1.0)), [2],
                           Status.NACK_BAD_REQUEST, "park", "wait_s = -1."),
    "dones_v1": (_e(_with(_frame2("dones"), v=1)), [1, 2], Status.NACK_VERSION, "dones",
                 "DoneBatch claiming v = 1: it exists since v2."),
    "dones_empty": (_e(_with(_frame2("dones"), items=[])), [2], Status.NACK_BAD_REQUEST,
                    "dones", "DoneBatch naming no grant."),
    "dones_too_many": (_e(_with(_frame2("dones"), items=[
        {"mm_hash": f"{i:064x}", "grant_id": i, "ok": True}
        for i in range(MAX_BATCH_ITEMS + 1)])), [2], Status.NACK_BAD_REQUEST, "dones",
        "DoneBatch naming 65 grants (bound 64)."),
    "renew_ack_v1": (_e(_with(_frame2("renew_ack"), v=1)), [1, 2], Status.NACK_VERSION,
                     "renew_ack", "RenewAck claiming v = 1: confirmed renewals exist since v2."),
    "renew_ack_extend_too_long": (_e(_with(_frame2("renew_ack"), extend_s=86401.0)), [2],
                                  Status.NACK_BAD_REQUEST, "renew_ack",
                                  "extend_s = 86401 (bound one day)."),
    "renew_ack_extend_negative": (_e(_with(_frame2("renew_ack"), extend_s=-1.0)), [2],
                                  Status.NACK_BAD_REQUEST, "renew_ack", "extend_s < 0."),
    "sync_v1": (_e(_with(_frame2("sync"), v=1)), [1, 2], Status.NACK_VERSION, "sync",
                "Sync claiming v = 1: offers exist since v2."),
    "sync_negative": (_e(_with(_frame2("sync"), t=-1.0)), [2], Status.NACK_BAD_REQUEST, "sync",
                      "t = -1."),
    "offer_on_v1_session": (_e(_frame2("offer")), [1], Status.NACK_VERSION, "offer",
                            "Offer at v = 2 on a v1 session."),
    "offer_empty": (_e(_with(_frame2("offer"), items=[])), [2], Status.NACK_BAD_REQUEST,
                    "offer", "Offer naming no entry."),
    "offer_valid_too_long": (_e(_with(_frame2("offer"), items=[
        {**_frame2("offer")["items"][0], "valid_s": 86401.0}])), [2], Status.NACK_BAD_REQUEST,
        "offer", "valid_s = 86401 (bound one day)."),
    "offer_without_grant": (_e(_with(_frame2("offer"), items=[
        _without(_frame2("offer")["items"][0], "grant")])), [2], Status.NACK_BAD_REQUEST,
        "offer", "An offer item without its grant."),
}
assert all(len(d) < 64 << 10 for d, *_ in INVALID_V2.values())


def to_json(value: Any) -> Any:
    """Python field value → index.json value (bytes as ``"hex:..."``)."""
    if isinstance(value, bytes):
        return "hex:" + value.hex()
    if isinstance(value, Status):
        return int(value)
    if isinstance(value, msgspec.Struct):
        return {f: to_json(getattr(value, f)) for f in value.__struct_fields__}
    if isinstance(value, list):
        return [to_json(x) for x in value]
    if isinstance(value, dict):
        return {k: to_json(x) for k, x in value.items()}
    return value


def _build_one(version: int, valid: dict[str, tuple[Message, str]],
               invalid: dict[str, tuple[bytes, list[int], Status, str | None, str]],
               ) -> dict[str, str]:
    """``vectors/v<version>/``: relative path → file content."""
    files: dict[str, str] = {}
    index: dict[str, Any] = {
        "protocol": "ECTP",
        "version": version,
        "spec": f"../../ectp-v{version}.md",
        "bytes_convention": (
            "a field whose msgpack type is bin is written as the string 'hex:' followed by the "
            "lowercase hex of its bytes; status codes are their integer wire values"
        ),
        "kinds": {tag: cls.__name__ for tag, cls in KINDS.items()
                  if SINCE.get(tag, 1) <= version},
        "statuses": {s.name: int(s) for s in Status},
        "valid": [],
        "invalid": [],
    }
    for name, (msg, desc) in valid.items():
        kind = type(msg).__struct_config__.tag
        files[f"{name}.msgpack.hex"] = encode(msg).hex() + "\n"
        index["valid"].append({
            "name": name,
            "file": f"{name}.msgpack.hex",
            "kind": kind,
            "type": type(msg).__name__,
            "description": desc,
            "fields": to_json(msg),
        })
    for name, (data, versions, status, kind, desc) in invalid.items():
        files[f"invalid/{name}.hex"] = data.hex() + "\n"
        index["invalid"].append({
            "name": name,
            "file": f"invalid/{name}.hex",
            "description": desc,
            "versions": versions,
            "status": int(status),
            "status_name": status.name,
            "error_kind": kind,
        })
    files["index.json"] = json.dumps(index, indent=2, ensure_ascii=False) + "\n"
    return files


def build() -> dict[str, str]:
    """Path relative to ``vectors/`` → file content, for every file this script owns."""
    v1 = {name: (data, [1], status, kind, desc)
          for name, (data, status, kind, desc) in INVALID.items()}
    files = {f"v1/{p}": text for p, text in _build_one(1, VALID, v1).items()}
    files.update({f"v2/{p}": text for p, text in _build_one(2, VALID_V2, INVALID_V2).items()})
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify instead of writing")
    args = ap.parse_args(argv)
    files = build()
    root = VECTORS
    stale = [p for p, text in files.items()
             if not (root / p).is_file() or (root / p).read_text(encoding="utf-8") != text]
    extra = sorted(
        str(p.relative_to(root)) for p in root.rglob("*")
        if p.is_file() and str(p.relative_to(root)) not in files
        and p.relative_to(root).parts[0] not in OTHER_GENERATORS
    ) if root.is_dir() else []
    if args.check:
        for p in stale:
            print(f"stale or missing: {p}", file=sys.stderr)
        for p in extra:
            print(f"not generated: {p}", file=sys.stderr)
        return 1 if stale or extra else 0
    for p in stale:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(files[p], encoding="utf-8")
    for p in extra:
        print(f"warning: {p} is not generated by this script", file=sys.stderr)
    print(f"{len(files)} files under {root} ({len(stale)} written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
