"""verify(): every admission and every refusal reason, as the spec lists them
(protocols/certificates.md §4), with the clock as an argument."""

from __future__ import annotations

import msgspec
import pytest

from ectransport.trust import (
    MAX_CERT_BYTES,
    Admitted,
    RefusalReason,
    Refused,
    Role,
    TrustError,
    check_revocations,
    inspect_cert,
    verify,
)
from ectransport.trust.wire import open_sealed, seal
from tests.trust.helpers import NOT_AFTER, NOT_BEFORE, NOW, SKEW, ca, cas_of, curve_key, issue

R = RefusalReason


def check(cert: bytes, key: str, role: Role = Role.CONSUMER, *, cas=None, revs=None,
          now: float = NOW, skew_s: float = SKEW) -> Admitted | Refused:
    return verify(cert, curve_key=key, role_wanted=role,
                  trusted_cas=cas_of(ca(1)) if cas is None else cas,
                  revocations={} if revs is None else revs, now=now, skew_s=skew_s)


def reason(got: Admitted | Refused) -> RefusalReason | None:
    return None if got.ok else got.reason


def revs_of(*blobs: bytes, cas=None) -> dict:
    out = {}
    for b in blobs:
        r = check_revocations(b, trusted_cas=cas_of(ca(1)) if cas is None else cas)
        out[r.ca] = r
    return out


def test_valid_certificate_is_admitted_with_its_contents():
    key = curve_key()
    cert = issue(ca(1), key, Role.CONSUMER, "pd-7", serial=42)
    got = check(cert, key)
    assert isinstance(got, Admitted) and got.ok and got.by == "certificate"
    assert got.cert is not None
    assert (got.cert.name, got.cert.role, got.cert.serial, got.cert.curve_key) == \
        ("pd-7", Role.CONSUMER, 42, key)
    assert got.cert.ca == ca(1).key_id and got.not_after == NOT_AFTER
    assert got.raw == cert and got.curve_key == key and got.role_wanted is Role.CONSUMER
    assert len(cert) < 400


def test_expired_and_not_yet_valid():
    key = curve_key()
    cert = issue(ca(1), key)
    got = check(cert, key, now=NOT_AFTER + SKEW + 1)
    assert reason(got) is R.EXPIRED and "expired at 2026-04-01" in got.detail
    got = check(cert, key, now=NOT_BEFORE - SKEW - 1)
    assert reason(got) is R.NOT_YET_VALID and "valid from 2026-01-01T00:00:00Z" in got.detail


@pytest.mark.parametrize("skew_s", [0.0, 300.0, 3600.0])
def test_skew_tolerance_both_edges_are_inclusive(skew_s):
    key = curve_key()
    cert = issue(ca(1), key)
    assert check(cert, key, now=NOT_BEFORE - skew_s, skew_s=skew_s).ok
    assert reason(check(cert, key, now=NOT_BEFORE - skew_s - 0.001, skew_s=skew_s)) is \
        R.NOT_YET_VALID
    assert check(cert, key, now=NOT_AFTER + skew_s, skew_s=skew_s).ok
    assert reason(check(cert, key, now=NOT_AFTER + skew_s + 0.001, skew_s=skew_s)) is R.EXPIRED


def test_a_certificate_valid_for_one_second():
    key = curve_key()
    cert = issue(ca(1), key, not_before=NOW, not_after=NOW)
    assert check(cert, key, now=NOW, skew_s=0).ok
    assert reason(check(cert, key, now=NOW + 1, skew_s=0)) is R.EXPIRED


def test_wrong_ca_is_unknown_ca():
    key = curve_key()
    got = check(issue(ca(2), key), key)
    assert reason(got) is R.UNKNOWN_CA
    assert ca(2).key_id in got.detail and ca(1).key_id in got.detail
    assert reason(check(issue(ca(1), key), key, cas={})) is R.UNKNOWN_CA


def test_a_certificate_signed_by_another_ca_that_claims_a_trusted_ones_id():
    """A stranger CA writes a trusted CA's key id into its certificate: bad_signature."""
    key = curve_key()
    honest = issue(ca(1), key)
    sealed = open_sealed(honest)
    forged = seal(sealed.body, ca(2).private_key.sign(b"ectransport/node-cert/v1\x00"
                                                      + sealed.body))
    assert reason(check(forged, key)) is R.BAD_SIGNATURE


def test_bad_signature_every_signature_bit():
    key = curve_key()
    cert = issue(ca(1), key)
    sig_at = len(cert) - 64
    for i in range(64 * 8):
        b = bytearray(cert)
        b[sig_at + i // 8] ^= 1 << (i % 8)
        assert reason(check(bytes(b), key)) is R.BAD_SIGNATURE, i


def test_a_body_changed_under_its_signature_is_bad_signature():
    key = curve_key()
    sealed = open_sealed(issue(ca(1), key, Role.CONSUMER, "pd-0"))
    for old, new in ((b"consumer", b"producer"), (b"pd-0", b"pd-1")):
        body = sealed.body.replace(old, new)
        assert body != sealed.body
        assert reason(check(seal(body, sealed.sig), key, Role.PRODUCER)) is R.BAD_SIGNATURE


def test_certificate_for_another_curve_key_is_wrong_key():
    key, other = curve_key(), curve_key()
    got = check(issue(ca(1), key), other)
    assert reason(got) is R.WRONG_KEY and key[:8] in got.detail and other[:8] in got.detail
    # a connection without a CURVE key (plain text) can never be admitted by certificate
    for bad in ("", "x" * 40, key[:-1]):
        assert reason(check(issue(ca(1), key), bad)) is R.WRONG_KEY


def test_consumer_certificate_presented_for_a_producer_role_and_the_reverse():
    key = curve_key()
    got = check(issue(ca(1), key, Role.CONSUMER), key, Role.PRODUCER)
    assert reason(got) is R.WRONG_ROLE and "is for a consumer, a producer is needed" in got.detail
    got = check(issue(ca(1), key, Role.PRODUCER, "encoder-0"), key, Role.CONSUMER)
    assert reason(got) is R.WRONG_ROLE and "is for a producer, a consumer is needed" in got.detail


@pytest.mark.parametrize("wanted", [Role.PRODUCER, Role.CONSUMER, Role.BOTH])
def test_both_role_covers_either(wanted):
    key = curve_key()
    assert check(issue(ca(1), key, Role.BOTH, "epd-0"), key, wanted).ok
    if wanted is Role.BOTH:  # asking for both: only a "both" certificate has it
        assert reason(check(issue(ca(1), key, Role.PRODUCER), key, wanted)) is R.WRONG_ROLE


def test_revoked_by_serial_and_by_key():
    key, other = curve_key(), curve_key()
    cert = issue(ca(1), key, serial=1001)
    assert check(cert, key, revs=revs_of(ca(1).revocation_list(seq=1, issued_at=NOW))).ok
    got = check(cert, key, revs=revs_of(ca(1).revocation_list(seq=2, issued_at=NOW,
                                                               serials=[7, 1001])))
    assert reason(got) is R.REVOKED and "serial 1001 is revoked" in got.detail
    got = check(cert, key, revs=revs_of(ca(1).revocation_list(seq=3, issued_at=NOW,
                                                               curve_keys=[other, key])))
    assert reason(got) is R.REVOKED and "CURVE key" in got.detail
    # another certificate of the same CA for another key is not affected
    assert check(issue(ca(1), other, serial=1002), other,
                 revs=revs_of(ca(1).revocation_list(seq=2, issued_at=NOW, serials=[1001]))).ok


def test_serial_revocations_are_per_ca_key_revocations_are_not():
    key = curve_key()
    cas = cas_of(ca(1), ca(2))
    cert2 = issue(ca(2), key, serial=1001)
    by_serial = revs_of(ca(1).revocation_list(seq=1, issued_at=NOW, serials=[1001]), cas=cas)
    assert check(cert2, key, cas=cas, revs=by_serial).ok
    by_key = revs_of(ca(1).revocation_list(seq=1, issued_at=NOW, curve_keys=[key]), cas=cas)
    assert reason(check(cert2, key, cas=cas, revs=by_key)) is R.REVOKED


def test_revocation_list_signed_by_another_ca_is_refused():
    lst = ca(1).revocation_list(seq=5, issued_at=NOW, serials=[3])
    body = open_sealed(lst).body
    forged = seal(body, ca(2).private_key.sign(b"ectransport/revocations/v1\x00" + body))
    with pytest.raises(TrustError, match="does not verify with that CA's key"):
        check_revocations(forged, trusted_cas=cas_of(ca(1), ca(2)))
    with pytest.raises(TrustError, match="not trusted here"):
        check_revocations(ca(2).revocation_list(seq=1, issued_at=NOW),
                          trusted_cas=cas_of(ca(1)))
    # a certificate signature never verifies as a revocation list (distinct contexts)
    key = curve_key()
    cert = open_sealed(issue(ca(1), key))
    with pytest.raises(TrustError):
        check_revocations(seal(cert.body, cert.sig), trusted_cas=cas_of(ca(1)))


def test_two_cas_trusted_at_once_rotation():
    key = curve_key()
    old, new = issue(ca(1), key), issue(ca(2), key)
    both = cas_of(ca(1), ca(2))
    assert check(old, key, cas=both).ok and check(new, key, cas=both).ok
    assert reason(check(old, key, cas=cas_of(ca(2)))) is R.UNKNOWN_CA
    assert check(new, key, cas=cas_of(ca(2))).ok


def test_malformed_and_oversized():
    key = curve_key()
    cert = issue(ca(1), key)
    cases = {
        b"\x00": R.MALFORMED,
        b"\xc1": R.MALFORMED,
        cert[:-1]: R.MALFORMED,
        cert + b"\x00": R.MALFORMED,  # trailing bytes
        msgspec.msgpack.encode({"v": 1, "body": b"", "sig": bytes(64)}): R.MALFORMED,
        msgspec.msgpack.encode({"v": 2, **{k: v for k, v in msgspec.msgpack.decode(cert).items()
                                           if k != "v"}}): R.MALFORMED,
        msgspec.msgpack.encode([1, b"x", bytes(64)]): R.MALFORMED,
        bytes(MAX_CERT_BYTES): R.MALFORMED,
        bytes(MAX_CERT_BYTES + 1): R.OVERSIZED,
        b"\xff" * (1 << 20): R.OVERSIZED,
        b"": R.MISSING,
    }
    for data, want in cases.items():
        got = check(data, key)
        assert reason(got) is want, (data[:20], got)
        assert got.detail
    for weird in (None, "text", 42, [cert]):  # not bytes at all
        assert reason(check(weird, key)) is R.MALFORMED  # type: ignore[arg-type]
    assert check(bytearray(cert), key).ok and check(memoryview(cert), key).ok


def test_non_canonical_encodings_are_refused_even_with_a_good_signature():
    key = curve_key()
    cert = issue(ca(1), key)
    assert cert.startswith(b"\x83\xa1v\x01")
    wide = b"\x83\xa1v\xcd\x00\x01" + cert[4:]  # the same map, v as uint16
    assert msgspec.msgpack.decode(wide) == msgspec.msgpack.decode(cert)
    assert reason(check(wide, key)) is R.MALFORMED


def test_a_callers_bug_raises_value_error_not_a_refusal():
    key = curve_key()
    cert = issue(ca(1), key)
    for now in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="now"):
            check(cert, key, now=now)
    with pytest.raises(ValueError, match="skew"):
        check(cert, key, skew_s=-1)
    with pytest.raises(ValueError):
        check(cert, key, role="admin")  # type: ignore[arg-type]


def test_issuing_refuses_bad_input():
    key = curve_key()
    authority = ca(1)
    for kw, needle in (({"curve_key": "nope"}, "Z85"), ({"role": "admin"}, "role"),
                       ({"name": "a b"}, "instance name"), ({"name": ""}, "instance name"),
                       ({"name": "x" * 129}, "instance name"),
                       ({"not_after": NOT_BEFORE - 1}, "before"),
                       ({"not_before": -1}, "not_before"), ({"serial": 0}, "serial"),
                       ({"serial": 1 << 63}, "serial")):
        args = {"curve_key": key, "role": "consumer", "name": "pd-0",
                "not_before": NOT_BEFORE, "not_after": NOT_AFTER, **kw}
        with pytest.raises(TrustError, match=needle):
            authority.issue(**args)
    # random serials are 63-bit and distinct
    serials = {inspect_cert(issue(authority, key)).serial for _ in range(50)}
    assert len(serials) == 50 and all(0 < s < 1 << 63 for s in serials)


def test_issuing_is_deterministic_given_the_serial():
    key = curve_key()
    assert issue(ca(1), key, serial=9) == issue(ca(1), key, serial=9)
    assert issue(ca(1), key, serial=9) != issue(ca(1), key, serial=10)
