"""Fuzzed certificates: arbitrary bytes and mutated valid certificates only ever give a typed
refusal — never an exception, never an admission unless the bytes are the original ones."""

from __future__ import annotations

import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ectransport.trust import MAX_CERT_BYTES, Admitted, RefusalReason, Refused, Role, verify
from ectransport.trust.wire import open_sealed, seal
from tests.trust.helpers import NOW, SKEW, ca, cas_of, curve_key, issue

KEY = curve_key()
CERT = issue(ca(1), KEY, Role.BOTH, "epd-0", serial=77)
CAS = cas_of(ca(1), ca(2))
REVS: dict = {}
FUZZ = settings(max_examples=1500, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def outcome(data: object, role: Role = Role.CONSUMER) -> Admitted | Refused:
    got = verify(data, curve_key=KEY, role_wanted=role, trusted_cas=CAS,  # type: ignore[arg-type]
                 revocations=REVS, now=NOW, skew_s=SKEW)
    assert isinstance(got, (Admitted, Refused))
    if isinstance(got, Refused):
        assert isinstance(got.reason, RefusalReason) and isinstance(got.detail, str)
        assert got.detail and len(got.detail) < 2000
    return got


def assert_only_original_admitted(data: bytes) -> None:
    for role in Role:
        got = outcome(data, role)
        if got.ok:
            assert data == CERT, "a modified certificate was admitted"


@FUZZ
@given(st.binary(max_size=MAX_CERT_BYTES + 64))
def test_arbitrary_bytes(data):
    assert_only_original_admitted(data)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]),
                          st.integers(0, len(CERT) + 8), st.integers(0, 255)),
                min_size=1, max_size=6))
def test_mutated_valid_certificate(ops):
    b = bytearray(CERT)
    for op, at, value in ops:
        at = min(at, len(b))
        if op == "flip" and at < len(b):
            b[at] ^= 1 << (value % 8)
        elif op == "set" and at < len(b):
            b[at] = value
        elif op == "insert":
            b[at:at] = bytes([value])
        elif op == "delete":
            del b[at:at + 1 + value % 4]
        elif op == "truncate":
            del b[at:]
    assert_only_original_admitted(bytes(b))


_BODY = msgspec.msgpack.decode(open_sealed(CERT).body)
MSGPACK_INTS = st.integers(-(1 << 63), (1 << 64) - 1)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(_BODY) + ["extra"]),
                       st.one_of(st.none(), st.booleans(), MSGPACK_INTS,
                                 st.text(max_size=50), st.binary(max_size=50),
                                 st.lists(MSGPACK_INTS, max_size=3)),
                       max_size=4))
def test_resigned_bodies_with_hostile_field_values(overrides):
    """Even what a CA signs is checked: a signed body with wrong types, out-of-range numbers,
    unknown fields or a wrong tag is malformed, never an exception."""
    body = msgspec.msgpack.encode({**_BODY, **overrides})
    data = seal(body, ca(1).private_key.sign(b"ectransport/node-cert/v1\x00" + body))
    got = outcome(data, Role.CONSUMER)
    if got.ok:  # only possible if the overrides left the certificate meaning the same
        assert got.cert is not None and msgspec.msgpack.decode(body) == {**_BODY, **overrides}


def test_many_seeded_mutations():
    """A deterministic sweep on top of hypothesis: 20 000 random mutations of one to three
    bytes, plus every single-byte truncation."""
    rng = random.Random(23)
    admitted = 0
    for _ in range(20000):
        b = bytearray(CERT)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        got = outcome(bytes(b), Role.PRODUCER)
        admitted += got.ok
        if got.ok:
            assert bytes(b) == CERT
    assert admitted < 20000 * 0.01  # only the rare no-op mutations (a byte set to itself)
    for n in range(len(CERT)):
        assert not outcome(CERT[:n]).ok
    assert outcome(CERT).ok
