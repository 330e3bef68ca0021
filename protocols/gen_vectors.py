"""Generate (or check) the ECTP v1 golden vectors under ``protocols/vectors/v1/``.

Usage::

    python protocols/gen_vectors.py          # (re)write the vectors and index.json
    python protocols/gen_vectors.py --check  # exit 1 if the files on disk differ from the output

Every *valid* vector is defined below by its field values (literals, not derived from the code's
defaults) and encoded with :func:`ectransport.protocol.encode`; the bytes are written as one line of
lowercase hex to ``<name>.msgpack.hex``. Every *invalid* vector is built by editing the msgpack map
of a valid frame (or by hand) and is listed with the NACK status a decoder must answer with.

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
    Grant,
    Hello,
    Message,
    Nack,
    Renew,
    Status,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    encode,
)

ROOT = Path(__file__).resolve().parent / "vectors" / "v1"

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


def build() -> dict[str, str]:
    """Relative path → file content, for every file this script owns."""
    files: dict[str, str] = {}
    index: dict[str, Any] = {
        "protocol": "ECTP",
        "version": 1,
        "spec": "../../ectp-v1.md",
        "bytes_convention": (
            "a field whose msgpack type is bin is written as the string 'hex:' followed by the "
            "lowercase hex of its bytes; status codes are their integer wire values"
        ),
        "kinds": {tag: cls.__name__ for tag, cls in KINDS.items()},
        "statuses": {s.name: int(s) for s in Status},
        "valid": [],
        "invalid": [],
    }
    for name, (msg, desc) in VALID.items():
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
    for name, (data, status, kind, desc) in INVALID.items():
        files[f"invalid/{name}.hex"] = data.hex() + "\n"
        index["invalid"].append({
            "name": name,
            "file": f"invalid/{name}.hex",
            "description": desc,
            "versions": [1],
            "status": int(status),
            "status_name": status.name,
            "error_kind": kind,
        })
    files["index.json"] = json.dumps(index, indent=2, ensure_ascii=False) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify instead of writing")
    args = ap.parse_args(argv)
    files = build()
    stale = [p for p, text in files.items()
             if not (ROOT / p).is_file() or (ROOT / p).read_text(encoding="utf-8") != text]
    extra = sorted(
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
        if p.is_file() and str(p.relative_to(ROOT)) not in files
    ) if ROOT.is_dir() else []
    if args.check:
        for p in stale:
            print(f"stale or missing: {p}", file=sys.stderr)
        for p in extra:
            print(f"not generated: {p}", file=sys.stderr)
        return 1 if stale or extra else 0
    for p in stale:
        (ROOT / p).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / p).write_text(files[p], encoding="utf-8")
    for p in extra:
        print(f"warning: {p} is not generated by this script", file=sys.stderr)
    print(f"{len(files)} files under {ROOT} ({len(stale)} written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
