"""Generate (or check) the golden vectors of fleet trust under ``protocols/vectors/certs/``.

Usage::

    python protocols/gen_cert_vectors.py          # (re)write the vectors and index.json
    python protocols/gen_cert_vectors.py --check  # exit 1 if the files on disk differ

Everything is deterministic: the two CAs' Ed25519 secret keys are fixed 32-byte seeds (listed in
``index.json``; test keys, never for a deployment), the CURVE keys are those of ZeroMQ's RFC 26
examples, serials and times are literals, and Ed25519 signatures are deterministic. Each blob is
written as one line of lowercase hex to ``<name>.hex``; ``index.json`` lists the keys, each
certificate's and revocation list's fields, the ECTP frames carrying a certificate, and
``checks``: verification cases (certificate, CURVE key of the connection, role wanted, trusted
CAs, revocation lists, ``now``, skew) with the expected outcome (``admitted`` or the refusal
reason). Spec: ``protocols/certificates.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from ectransport.protocol import Hello, Status, Welcome, encode
from ectransport.trust.keys import CertificateAuthority
from ectransport.trust.wire import (
    CERT_CONTEXT,
    MAX_CERT_BYTES,
    REVOCATIONS_CONTEXT,
    open_sealed,
    seal,
)

ROOT = Path(__file__).resolve().parent / "vectors" / "certs"

SEED1 = hashlib.sha256(b"ectransport golden-vector CA 1").digest()
SEED2 = hashlib.sha256(b"ectransport golden-vector CA 2").digest()
CA1 = CertificateAuthority.from_seed(SEED1)
CA2 = CertificateAuthority.from_seed(SEED2)
# ZeroMQ RFC 26 example keys (public Z85): the "client" is our consumer, the "server" our producer
CONSUMER_KEY = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
PRODUCER_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
NOT_BEFORE = 1767225600  # 2026-01-01T00:00:00Z
NOT_AFTER = 1775001600  # 2026-04-01T00:00:00Z
NOW = NOT_BEFORE + 10 * 86400
SKEW = 300.0
SID = "0f3c9a7e5b2d4c18a6e1f09b7d3c5a21"
COMPAT = "8eb9fed6814a420db8843a53acafe5c014213d9144f7c1636c6297efd9baea9b"

S_CONSUMER = 0x1D3C5B7A9E8F0123
S_PRODUCER = 0x2A4B6C8D0E1F3546
S_BOTH = 0x3B5D7F9A1C2E4068
S_CA2 = 0x4C6E8A0B2D3F5172


def _issue(ca: CertificateAuthority, key: str, role: str, name: str, serial: int) -> bytes:
    return ca.issue(
        curve_key=key,
        role=role,
        name=name,
        not_before=NOT_BEFORE,
        not_after=NOT_AFTER,
        serial=serial,
    )


def _resign(ca: CertificateAuthority, body_map: dict[str, Any], context: bytes) -> bytes:
    """A sealed object whose body is ``body_map`` encoded as given, properly signed by ``ca``:
    for bodies this build must refuse although their signature verifies."""
    body = msgspec.msgpack.encode(body_map)
    return seal(body, ca.private_key.sign(context + body))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


CERTS: dict[str, tuple[bytes, str]] = {
    "cert_consumer": (
        _issue(CA1, CONSUMER_KEY, "consumer", "pd-0", S_CONSUMER),
        "CA 1 binds the consumer key to role consumer, name pd-0, Q1 2026.",
    ),
    "cert_producer": (
        _issue(CA1, PRODUCER_KEY, "producer", "encoder-0", S_PRODUCER),
        "CA 1 binds the producer key to role producer, name encoder-0.",
    ),
    "cert_both": (
        _issue(CA1, CONSUMER_KEY, "both", "epd-0", S_BOTH),
        "CA 1: an ec_both instance (producer and consumer).",
    ),
    "cert_ca2": (
        _issue(CA2, CONSUMER_KEY, "consumer", "pd-0", S_CA2),
        "CA 2 (the CA a rotation moves to) re-issued pd-0's certificate.",
    ),
}
_C = CERTS["cert_consumer"][0]
_SEALED = open_sealed(_C)
_BODY = msgspec.msgpack.decode(_SEALED.body)

REVOCATIONS: dict[str, tuple[bytes, str]] = {
    "revocations_empty": (
        CA1.revocation_list(seq=1767225600, issued_at=NOT_BEFORE),
        "CA 1's first list (what `keys ca init` writes): nothing revoked.",
    ),
    "revocations_serial": (
        CA1.revocation_list(seq=1767225601, issued_at=NOT_BEFORE + 1, serials=[S_CONSUMER]),
        "CA 1 revokes certificate cert_consumer by its serial.",
    ),
    "revocations_key": (
        CA1.revocation_list(seq=1767225602, issued_at=NOT_BEFORE + 2, curve_keys=[PRODUCER_KEY]),
        "CA 1 revokes the producer's CURVE key (every certificate for it).",
    ),
}

#: name → (bytes, description): blobs a verifier must refuse (see ``checks``)
BAD: dict[str, tuple[bytes, str]] = {
    "cert_bad_signature": (_flip(_C, len(_C) - 1), "cert_consumer with one signature bit flipped."),
    "cert_body_altered": (
        seal(_flip(_SEALED.body, _SEALED.body.index(b"pd-0")), _SEALED.sig),
        "cert_consumer with its name changed to qd-0, signature kept.",
    ),
    "cert_not_canonical": (
        _C.replace(b"\xa1v\x01", b"\xa1v\xcd\x00\x01", 1),
        "cert_consumer with the envelope's v written as a uint16.",
    ),
    "cert_unknown_field": (
        _resign(CA1, {**_BODY, "extra": 1}, CERT_CONTEXT),
        "A correctly signed body with a field this format does not define.",
    ),
    "cert_version_2": (
        _resign(CA1, {**_BODY, "v": 2}, CERT_CONTEXT),
        "A correctly signed body of format version 2.",
    ),
    "cert_truncated": (_C[:-10], "cert_consumer with its last 10 bytes cut off."),
    "cert_oversized": (
        _C + bytes(MAX_CERT_BYTES + 1 - len(_C)),
        f"{MAX_CERT_BYTES + 1} bytes: refused before decoding.",
    ),
    "revocations_forged": (
        _resign(
            CA2,
            msgspec.msgpack.decode(open_sealed(REVOCATIONS["revocations_serial"][0]).body),
            REVOCATIONS_CONTEXT,
        ),
        "revocations_serial's body (naming CA 1) signed by CA 2: refused.",
    ),
}

FRAMES: dict[str, tuple[Hello | Welcome, str]] = {
    "hello_cert": (
        Hello(
            v=2,
            session_id=SID,
            node_id="pd-0",
            versions=[1, 2],
            planes=["nixl"],
            compat_hash=COMPAT,
            mem_kinds=["DRAM"],
            cert=CERTS["cert_consumer"][0],
        ),
        "A consumer's Hello presenting its certificate (cert, last, omitted when empty).",
    ),
    "welcome_cert": (
        Welcome(
            v=2,
            session_id=SID,
            node_id="encoder-0",
            status=Status.OK,
            version=2,
            plane="nixl",
            versions=[1, 2],
            planes=["nixl"],
            compat_hash=COMPAT,
            detail="",
            cert=CERTS["cert_producer"][0],
        ),
        "The producer's Welcome presenting its certificate.",
    ),
    "welcome_trust_refused": (
        Welcome(
            v=2,
            session_id=SID,
            node_id="",
            status=Status.NACK_BAD_REQUEST,
            version=0,
            plane="",
            versions=[],
            planes=[],
            compat_hash="",
            detail="trust: missing: no certificate presented",
        ),
        "A producer's refusal of a Hello that fleet trust did not admit: nothing of the "
        "producer (no node id, versions, planes, hash or certificate), the Hello's v.",
    ),
}


def _check(
    cert: str,
    key: str,
    role: str,
    expect: str,
    *,
    cas: tuple[str, ...] = ("ca1",),
    revocations: tuple[str, ...] = (),
    now: float = NOW,
    why: str = "",
) -> dict[str, Any]:
    return {
        "cert": cert,
        "curve_key": key,
        "role_wanted": role,
        "trusted_cas": list(cas),
        "revocations": list(revocations),
        "now": now,
        "skew_s": SKEW,
        "expect": expect,
        "description": why,
    }


CHECKS: list[dict[str, Any]] = [
    _check("cert_consumer", CONSUMER_KEY, "consumer", "admitted", why="valid"),
    _check("cert_producer", PRODUCER_KEY, "producer", "admitted", why="valid"),
    _check("cert_both", CONSUMER_KEY, "producer", "admitted", why="both covers producer"),
    _check("cert_both", CONSUMER_KEY, "consumer", "admitted", why="both covers consumer"),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "producer",
        "wrong_role",
        why="a consumer certificate presented by a producer",
    ),
    _check(
        "cert_producer",
        PRODUCER_KEY,
        "consumer",
        "wrong_role",
        why="a producer certificate presented by a consumer",
    ),
    _check(
        "cert_consumer",
        PRODUCER_KEY,
        "consumer",
        "wrong_key",
        why="a certificate for another CURVE key than the connection's",
    ),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "consumer",
        "admitted",
        now=NOT_AFTER + SKEW,
        why="last second of the skew tolerance after not_after",
    ),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "consumer",
        "expired",
        now=NOT_AFTER + SKEW + 1,
        why="one second past it",
    ),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "consumer",
        "admitted",
        now=NOT_BEFORE - SKEW,
        why="first second of the skew tolerance before not_before",
    ),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "consumer",
        "not_yet_valid",
        now=NOT_BEFORE - SKEW - 1,
        why="one second before it",
    ),
    _check("cert_ca2", CONSUMER_KEY, "consumer", "unknown_ca", why="CA 2 not trusted"),
    _check(
        "cert_ca2",
        CONSUMER_KEY,
        "consumer",
        "admitted",
        cas=("ca1", "ca2"),
        why="rotation: both CAs trusted",
    ),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "consumer",
        "admitted",
        cas=("ca1", "ca2"),
        why="rotation: the old CA's certificates still admitted",
    ),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "consumer",
        "unknown_ca",
        cas=("ca2",),
        why="after the rotation: CA 1 no longer trusted",
    ),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "consumer",
        "admitted",
        revocations=("revocations_empty",),
        why="an empty list revokes nothing",
    ),
    _check(
        "cert_consumer",
        CONSUMER_KEY,
        "consumer",
        "revoked",
        revocations=("revocations_serial",),
        why="revoked by serial",
    ),
    _check(
        "cert_producer",
        PRODUCER_KEY,
        "producer",
        "revoked",
        revocations=("revocations_key",),
        why="revoked by CURVE key",
    ),
    _check(
        "cert_ca2",
        CONSUMER_KEY,
        "consumer",
        "admitted",
        cas=("ca1", "ca2"),
        revocations=("revocations_serial",),
        why="CA 1's serial revocations do not apply to CA 2's certificates",
    ),
    _check("cert_bad_signature", CONSUMER_KEY, "consumer", "bad_signature", why="bit flip"),
    _check("cert_body_altered", CONSUMER_KEY, "consumer", "bad_signature", why="body changed"),
    _check("cert_not_canonical", CONSUMER_KEY, "consumer", "malformed", why="not canonical"),
    _check("cert_unknown_field", CONSUMER_KEY, "consumer", "malformed", why="unknown field"),
    _check("cert_version_2", CONSUMER_KEY, "consumer", "malformed", why="unknown version"),
    _check("cert_truncated", CONSUMER_KEY, "consumer", "malformed", why="truncated"),
    _check("cert_oversized", CONSUMER_KEY, "consumer", "oversized", why="too large"),
    _check("", CONSUMER_KEY, "consumer", "missing", why="no certificate (empty bytes)"),
]


def _fields(data: bytes) -> dict[str, Any]:
    sealed = open_sealed(data)
    return {
        "envelope": {
            "v": sealed.v,
            "body": "hex:" + sealed.body.hex(),
            "sig": "hex:" + sealed.sig.hex(),
        },
        "body": msgspec.msgpack.decode(sealed.body),
    }


def _frame_fields(msg: Hello | Welcome) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in msg.__struct_fields__:
        v = getattr(msg, f)
        out[f] = (
            "hex:" + v.hex() if isinstance(v, bytes) else int(v) if isinstance(v, Status) else v
        )
    return out


def build() -> dict[str, str]:
    """File name under ``vectors/certs/`` → content."""
    files: dict[str, str] = {}
    index: dict[str, Any] = {
        "spec": "../../certificates.md",
        "bytes_convention": "bin values are 'hex:' + lowercase hex",
        "cas": {
            name: {
                "seed": "hex:" + seed.hex(),
                "public": "hex:" + ca.public.raw.hex(),
                "key_id": ca.key_id,
            }
            for name, seed, ca in (("ca1", SEED1, CA1), ("ca2", SEED2, CA2))
        },
        "curve_keys": {"consumer": CONSUMER_KEY, "producer": PRODUCER_KEY},
        "certificates": [],
        "revocation_lists": [],
        "refused": [],
        "frames": [],
        "checks": CHECKS,
    }
    for name, (data, desc) in CERTS.items():
        files[f"{name}.hex"] = data.hex() + "\n"
        index["certificates"].append(
            {"name": name, "file": f"{name}.hex", "description": desc, **_fields(data)}
        )
    for name, (data, desc) in REVOCATIONS.items():
        files[f"{name}.hex"] = data.hex() + "\n"
        index["revocation_lists"].append(
            {"name": name, "file": f"{name}.hex", "description": desc, **_fields(data)}
        )
    for name, (data, desc) in BAD.items():
        files[f"{name}.hex"] = data.hex() + "\n"
        index["refused"].append({"name": name, "file": f"{name}.hex", "description": desc})
    for name, (msg, desc) in FRAMES.items():
        files[f"{name}.msgpack.hex"] = encode(msg).hex() + "\n"
        index["frames"].append(
            {
                "name": name,
                "file": f"{name}.msgpack.hex",
                "kind": type(msg).__struct_config__.tag,
                "type": type(msg).__name__,
                "description": desc,
                "fields": _frame_fields(msg),
            }
        )
    files["index.json"] = json.dumps(index, indent=2, ensure_ascii=False) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify instead of writing")
    args = ap.parse_args(argv)
    files = build()
    stale = [
        p
        for p, text in files.items()
        if not (ROOT / p).is_file() or (ROOT / p).read_text(encoding="utf-8") != text
    ]
    extra = (
        sorted(p.name for p in ROOT.iterdir() if p.is_file() and p.name not in files)
        if ROOT.is_dir()
        else []
    )
    if args.check:
        for p in stale:
            print(f"stale or missing: certs/{p}", file=sys.stderr)
        for p in extra:
            print(f"not generated: certs/{p}", file=sys.stderr)
        return 1 if stale or extra else 0
    ROOT.mkdir(parents=True, exist_ok=True)
    for p in stale:
        (ROOT / p).write_text(files[p], encoding="utf-8")
    for p in extra:
        print(f"warning: certs/{p} is not generated by this script", file=sys.stderr)
    print(f"{len(files)} files under {ROOT} ({len(stale)} written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
