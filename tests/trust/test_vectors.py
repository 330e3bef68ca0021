"""The golden vectors of protocols/vectors/certs/: generated files match the generator, every
verification case gives its listed outcome, and the Hello/Welcome frames carrying a
certificate round-trip through the ECTP codec byte for byte."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ectransport.protocol import Hello, Status, decode, encode
from ectransport.protocol.messages import KINDS
from ectransport.session.admission import trust_reason
from ectransport.session.negotiate import untrusted
from ectransport.trust import (
    CaPublicKey,
    CertificateAuthority,
    RefusalReason,
    Refused,
    Role,
    TrustError,
    check_revocations,
    inspect_cert,
    verify,
)
from ectransport.trust.keys import trusted
from ectransport.trust.wire import open_sealed

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "protocols" / "vectors" / "certs"
INDEX = json.loads((ROOT / "index.json").read_text(encoding="utf-8"))
CAS = {n: CaPublicKey(bytes.fromhex(c["public"][4:])) for n, c in INDEX["cas"].items()}


def blob(name: str, suffix: str = ".hex") -> bytes:
    if not name:
        return b""
    text = (ROOT / f"{name}{suffix}").read_text(encoding="ascii")
    assert text.endswith("\n") and text.count("\n") == 1 and text == text.lower()
    return bytes.fromhex(text.strip())


def _hex(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("hex:"):
        return bytes.fromhex(value[4:])
    return value


def test_generator_matches_files():
    spec = importlib.util.spec_from_file_location(
        "gen_cert_vectors", REPO / "protocols" / "gen_cert_vectors.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0


def test_ca_keys_derive_from_their_seeds():
    for name, c in INDEX["cas"].items():
        authority = CertificateAuthority.from_seed(_hex(c["seed"]))
        assert authority.public == CAS[name] and authority.key_id == c["key_id"]


@pytest.mark.parametrize(
    "vec", INDEX["certificates"] + INDEX["revocation_lists"], ids=lambda v: v["name"]
)
def test_signed_objects_decode_to_their_listed_fields(vec):
    data = blob(vec["name"])
    sealed = open_sealed(data)
    assert sealed.v == vec["envelope"]["v"]
    assert sealed.body == _hex(vec["envelope"]["body"])
    assert sealed.sig == _hex(vec["envelope"]["sig"])
    assert msgspec.msgpack.decode(sealed.body) == vec["body"]
    if vec["name"].startswith("cert_"):
        c = inspect_cert(data)
        assert {"k": "node-cert", **msgspec.structs.asdict(c)} == vec["body"]
    else:
        r = check_revocations(data, trusted_cas=trusted(CAS.values()))
        assert sorted(r.serials) == vec["body"]["serials"]


@pytest.mark.parametrize(
    "case", INDEX["checks"], ids=lambda c: f"{c['cert'] or 'empty'}-{c['expect']}"
)
def test_verification_cases(case):
    cas = trusted(CAS[n] for n in case["trusted_cas"])
    revs = {}
    for name in case["revocations"]:
        r = check_revocations(blob(name), trusted_cas=cas)
        revs[r.ca] = r
    got = verify(
        blob(case["cert"]),
        curve_key=case["curve_key"],
        role_wanted=Role(case["role_wanted"]),
        trusted_cas=cas,
        revocations=revs,
        now=case["now"],
        skew_s=case["skew_s"],
    )
    assert ("admitted" if got.ok else got.reason.value) == case["expect"], got


def test_every_refusal_reason_but_the_policys_has_a_case():
    expected = {c["expect"] for c in INDEX["checks"]}
    assert expected >= {
        "admitted",
        "malformed",
        "oversized",
        "unknown_ca",
        "bad_signature",
        "expired",
        "not_yet_valid",
        "wrong_key",
        "wrong_role",
        "revoked",
        "missing",
    }
    listed = {
        v["file"]
        for k in ("certificates", "revocation_lists", "refused", "frames")
        for v in INDEX[k]
    }
    assert listed | {"index.json"} == {p.name for p in ROOT.iterdir()}


def test_a_forged_revocation_list_is_refused():
    with pytest.raises(TrustError, match="does not verify"):
        check_revocations(blob("revocations_forged"), trusted_cas=trusted(CAS.values()))


@pytest.mark.parametrize("vec", INDEX["frames"], ids=lambda v: v["name"])
def test_hello_and_welcome_with_a_certificate_round_trip(vec):
    data = blob(vec["name"], ".msgpack.hex")
    cls = KINDS[vec["kind"]]
    expected = msgspec.convert({k: _hex(v) for k, v in vec["fields"].items()}, cls)
    got = decode(data, versions=[vec["fields"]["v"]])
    assert got == expected and encode(got) == data
    raw = msgspec.msgpack.decode(data)
    if getattr(got, "status", Status.OK) is not Status.OK:  # a trust refusal: nothing of it
        assert vec["kind"] == "welcome" and trust_reason(got.detail) is not None
        assert (got.node_id, got.compat_hash, got.versions, got.planes) == ("", "", [], [])
        assert "cert" not in raw and "endpoint" not in raw and "features" not in raw
        return
    assert list(raw)[-1] == "cert"  # written last, after every other field
    assert raw["cert"] == blob("cert_consumer" if vec["kind"] == "hello" else "cert_producer")
    # without the certificate the frame is byte for byte the one a node without trust sends
    plain = msgspec.structs.replace(got, cert=b"")
    assert "cert" not in msgspec.msgpack.decode(encode(plain))


def test_the_producers_trust_refusal_is_the_vector_byte_for_byte():
    hello = decode(blob("hello_cert", ".msgpack.hex"), versions=[1, 2])
    assert isinstance(hello, Hello)
    refused = Refused(RefusalReason.MISSING, "no certificate presented")
    assert untrusted(hello, refused) == blob("welcome_trust_refused", ".msgpack.hex")


def test_spec_links_every_vector():
    spec = (REPO / "protocols" / "certificates.md").read_text(encoding="utf-8")
    missing = [p.name for p in ROOT.iterdir() if f"vectors/certs/{p.name}" not in spec]
    assert not missing, f"protocols/certificates.md does not link: {missing}"
