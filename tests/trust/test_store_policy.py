"""TrustStore (CAs + revocation lists, updates, re-checks of live sessions) and TrustPolicy (how
allow-lists and certificates combine), with the clock as an argument."""

from __future__ import annotations

import pytest

from ectransport.trust import (
    AdmissionMode,
    Admitted,
    RefusalReason,
    Role,
    TrustError,
    TrustPolicy,
    TrustStore,
)
from tests.trust.helpers import NOT_AFTER, NOW, SKEW, ca, curve_key, issue, store

R = RefusalReason


def test_store_verifies_and_applies_a_newer_revocation_list_only():
    key = curve_key()
    cert = issue(ca(1), key, serial=5)
    s = store(ca(1), lists=(ca(1).revocation_list(seq=10, issued_at=NOW),))
    assert s.verify(cert, curve_key=key, role_wanted=Role.CONSUMER, now=NOW).ok
    assert s.revocations[ca(1).key_id].seq == 10

    up = s.update_revocations([ca(1).revocation_list(seq=11, issued_at=NOW, serials=[5])])
    assert up.changed == (ca(1).key_id,) and not up.problems
    got = s.verify(cert, curve_key=key, role_wanted=Role.CONSUMER, now=NOW)
    assert not got.ok and got.reason is R.REVOKED

    # an older list (a rollback) and a different list with the same seq change nothing
    up = s.update_revocations(
        [
            ca(1).revocation_list(seq=9, issued_at=NOW),
            ca(1).revocation_list(seq=11, issued_at=NOW, serials=[6]),
        ]
    )
    assert not up.changed and len(up.problems) == 2
    assert "older" in up.problems[0] and "same seq" in up.problems[1]
    assert s.revocations[ca(1).key_id].seq == 11
    # the same list again: no change, no problem; leaving a CA's list out never un-revokes
    up = s.update_revocations([ca(1).revocation_list(seq=11, issued_at=NOW, serials=[5])])
    assert up == type(up)()
    assert s.update_revocations([]) == type(up)()
    assert not s.verify(cert, curve_key=key, role_wanted=Role.CONSUMER, now=NOW).ok
    # a newer list without the serial un-revokes it (the CA's decision, signed)
    s.update_revocations([ca(1).revocation_list(seq=12, issued_at=NOW)])
    assert s.verify(cert, curve_key=key, role_wanted=Role.CONSUMER, now=NOW).ok


def test_store_refuses_forged_lists_and_ignores_those_of_untrusted_cas():
    with pytest.raises(TrustError, match="not a sealed"):
        store(ca(1), lists=(b"garbage",))
    assert not store(ca(1), lists=(ca(2).revocation_list(seq=1, issued_at=NOW),)).revocations
    s = store(ca(1))
    up = s.update_revocations(
        [ca(2).revocation_list(seq=1, issued_at=NOW, serials=[1]), b"garbage"]
    )
    assert not up.changed and len(up.problems) == 1 and len(up.untrusted) == 1
    assert "not trusted" in up.untrusted[0] and not s.revocations
    with pytest.raises(TrustError, match="skew"):
        TrustStore([ca(1).public], skew_s=-1)


def test_set_cas_rotation_drops_lists_of_untrusted_cas():
    key = curve_key()
    s = store(ca(1), lists=(ca(1).revocation_list(seq=1, issued_at=NOW),))
    old, new = issue(ca(1), key), issue(ca(2), key)
    assert not s.verify(new, curve_key=key, role_wanted=Role.CONSUMER, now=NOW).ok
    assert s.set_cas([ca(1).public, ca(2).public])
    assert not s.set_cas([ca(2).public, ca(1).public])  # the same set: no change
    for cert in (old, new):
        assert s.verify(cert, curve_key=key, role_wanted=Role.CONSUMER, now=NOW).ok
    assert s.set_cas([ca(2).public])
    got = s.verify(old, curve_key=key, role_wanted=Role.CONSUMER, now=NOW)
    assert got.reason is R.UNKNOWN_CA and not s.revocations


def test_recheck_ends_a_live_session_on_expiry_revocation_or_distrust():
    key = curve_key()
    s = store(ca(1), ca(2))
    adm = s.verify(issue(ca(1), key, serial=8), curve_key=key, role_wanted=Role.CONSUMER, now=NOW)
    assert isinstance(adm, Admitted)
    assert s.recheck(adm, now=NOW + 3600) is adm
    assert s.recheck(adm, now=NOT_AFTER + SKEW) is adm
    assert s.recheck(adm, now=NOT_AFTER + SKEW + 1).reason is R.EXPIRED
    s.update_revocations([ca(1).revocation_list(seq=2, issued_at=NOW, serials=[8])])
    assert s.recheck(adm, now=NOW).reason is R.REVOKED
    s.update_revocations([ca(1).revocation_list(seq=3, issued_at=NOW)])
    assert s.recheck(adm, now=NOW) is adm
    s.set_cas([ca(2).public])
    assert s.recheck(adm, now=NOW).reason is R.UNKNOWN_CA
    # an allow-list admission ends only when its key is revoked
    other = curve_key()
    by_list = Admitted(curve_key=other, role_wanted=Role.CONSUMER, by="allow_list")
    assert s.recheck(by_list, now=NOT_AFTER * 2) is by_list
    s.update_revocations([ca(2).revocation_list(seq=1, issued_at=NOW, curve_keys=[other])])
    assert s.recheck(by_list, now=NOW).reason is R.REVOKED


# -- TrustPolicy -------------------------------------------------------------------------------

LISTED, UNLISTED = curve_key(), curve_key()


def policy(mode: str, **kw) -> TrustPolicy:
    return TrustPolicy(mode, store(ca(1)), allow_list=lambda k: k == LISTED, **kw)


def admit(p: TrustPolicy, key: str, cert: bytes = b"", role: Role = Role.CONSUMER):
    return p.admit(curve_key=key, cert=cert, role_wanted=role, now=NOW)


@pytest.mark.parametrize(
    "mode, listed_no_cert, listed_bad_cert, listed_good, unlisted_good, unlisted_no_cert",
    [
        (
            "allow_list",
            "allow_list",
            "allow_list",
            "allow_list",
            R.NOT_ALLOW_LISTED,
            R.NOT_ALLOW_LISTED,
        ),
        ("certificate", R.MISSING, R.UNKNOWN_CA, "certificate", "certificate", R.MISSING),
        ("either", "allow_list", "allow_list", "both", "certificate", R.MISSING),
        ("both", R.MISSING, R.UNKNOWN_CA, "both", R.NOT_ALLOW_LISTED, R.NOT_ALLOW_LISTED),
    ],
)
def test_admission_modes(
    mode, listed_no_cert, listed_bad_cert, listed_good, unlisted_good, unlisted_no_cert
):
    p = policy(mode)
    cases = {
        "listed_no_cert": (LISTED, b""),
        "listed_bad_cert": (LISTED, issue(ca(2), LISTED)),  # from an untrusted CA
        "listed_good": (LISTED, issue(ca(1), LISTED)),
        "unlisted_good": (UNLISTED, issue(ca(1), UNLISTED)),
        "unlisted_no_cert": (UNLISTED, b""),
    }
    want = {
        "listed_no_cert": listed_no_cert,
        "listed_bad_cert": listed_bad_cert,
        "listed_good": listed_good,
        "unlisted_good": unlisted_good,
        "unlisted_no_cert": unlisted_no_cert,
    }
    for name, (key, cert) in cases.items():
        got = admit(p, key, cert)
        if isinstance(want[name], RefusalReason):  # (a str enum: test it first)
            assert not got.ok and got.reason is want[name], (name, got)
        else:
            assert got.ok and got.by == want[name], (name, got)
            assert (got.cert is not None) == (want[name] != "allow_list")
    assert p.zap_admits_any_key == (mode in ("certificate", "either"))


@pytest.mark.parametrize("mode", ["allow_list", "certificate", "either", "both"])
def test_a_revocation_wins_in_every_mode(mode):
    s = store(
        ca(1),
        lists=(ca(1).revocation_list(seq=1, issued_at=NOW, curve_keys=[LISTED], serials=[99]),),
    )
    p = TrustPolicy(mode, s, allow_list=lambda k: True)
    got = admit(p, LISTED, issue(ca(1), LISTED))
    assert not got.ok and got.reason is R.REVOKED
    other = curve_key()
    got = admit(p, other, issue(ca(1), other, serial=99))  # revoked certificate, listed key
    if mode == "allow_list":
        assert got.ok  # certificates are not looked at in this mode
    else:
        assert not got.ok and got.reason is R.REVOKED


def test_without_an_allow_list_callable_the_zap_handler_is_trusted_to_have_checked():
    s = store(ca(1))
    assert admit(TrustPolicy("allow_list"), UNLISTED).ok
    assert admit(TrustPolicy("both", s), UNLISTED, issue(ca(1), UNLISTED)).by == "both"
    with pytest.raises(TrustError, match="either"):
        TrustPolicy("either", s)
    with pytest.raises(TrustError, match="trust_ca"):
        TrustPolicy("certificate")
    with pytest.raises(TrustError, match="not one of"):
        TrustPolicy("sometimes", s)
    assert TrustPolicy(AdmissionMode.CERTIFICATE, s).mode is AdmissionMode.CERTIFICATE


def test_a_raising_allow_list_admits_nobody():
    def boom(key: str) -> bool:
        raise OSError("allow dir vanished")

    got = admit(TrustPolicy("allow_list", allow_list=boom), LISTED)
    assert not got.ok and got.reason is R.NOT_ALLOW_LISTED
    got = admit(TrustPolicy("either", store(ca(1)), allow_list=boom), LISTED, issue(ca(1), LISTED))
    assert got.ok and got.by == "certificate"


def test_either_mode_refusal_names_both_reasons_and_roles_are_checked():
    p = policy("either")
    got = admit(p, UNLISTED, issue(ca(1), UNLISTED, Role.CONSUMER), Role.PRODUCER)
    assert got.reason is R.WRONG_ROLE and "not on the allow-list" in got.detail
    got = admit(p, UNLISTED, issue(ca(1), LISTED))  # someone else's certificate
    assert got.reason is R.WRONG_KEY


def test_policy_recheck():
    p = policy("certificate")
    adm = admit(p, UNLISTED, issue(ca(1), UNLISTED, serial=4))
    assert p.recheck(adm, now=NOW) is adm
    assert p.recheck(adm, now=NOT_AFTER + SKEW + 1).reason is R.EXPIRED
    assert p.store is not None
    p.store.update_revocations([ca(1).revocation_list(seq=1, issued_at=NOW, serials=[4])])
    assert p.recheck(adm, now=NOW).reason is R.REVOKED
    bare = TrustPolicy("allow_list")
    by_list = admit(bare, LISTED)
    assert bare.recheck(by_list, now=NOW) is by_list


@pytest.mark.parametrize("mode", ["certificate", "either", "both"])
def test_a_recheck_applies_the_admission_rules_of_the_mode(mode):
    """A live session is re-checked as a new Hello with the same certificate would be
    admitted: in ``either`` a listed key outlives its certificate (the allow-list admits it),
    an unlisted one does not; in ``certificate`` and ``both`` the certificate must hold."""
    p = policy(mode)
    late = NOT_AFTER + SKEW + 1
    listed_cert = issue(ca(1), LISTED, serial=21)
    adm = admit(p, LISTED, listed_cert)
    assert adm.ok and adm.by == ("certificate" if mode == "certificate" else "both")
    got = fallback = p.recheck(adm, now=late)
    new_hello = p.admit(curve_key=LISTED, cert=listed_cert, role_wanted=Role.CONSUMER, now=late)
    assert got.ok == new_hello.ok, (got, new_hello)
    if mode == "either":
        assert got.ok and got.by == "allow_list" and got.curve_key == LISTED
        assert p.recheck(got, now=late) == got  # and it stays so
    else:
        assert got.reason is R.EXPIRED
    unlisted = admit(p, UNLISTED, issue(ca(1), UNLISTED))
    if mode != "both":
        got = p.recheck(unlisted, now=late)
        assert got.reason is R.EXPIRED
        if mode == "either":
            assert "not on the allow-list" in got.detail
    # a revocation of the certificate still wins, also after the allow-list took over
    assert p.store is not None
    p.store.update_revocations([ca(1).revocation_list(seq=1, issued_at=NOW, serials=[21])])
    for a in (adm, fallback) if fallback.ok else (adm,):
        assert p.recheck(a, now=NOW).reason is R.REVOKED
        assert p.recheck(a, now=late).reason is R.REVOKED


def test_either_details_say_what_is_true_of_the_allow_list():
    s = store(ca(1), lists=(ca(1).revocation_list(seq=1, issued_at=NOW, serials=[31]),))
    p = TrustPolicy("either", s, allow_list=lambda k: k == LISTED)
    got = admit(p, LISTED, issue(ca(1), LISTED, serial=31))
    assert got.reason is R.REVOKED
    assert "not on the allow-list" not in got.detail
    assert "on the allow-list" in got.detail and "revoked" in got.detail
    got = admit(p, UNLISTED, issue(ca(1), UNLISTED, serial=31))
    assert got.reason is R.REVOKED and "not on the allow-list" in got.detail
