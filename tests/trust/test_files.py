"""Fleet trust on disk: the CA directory (encrypted secret), certificate and revocation files,
and FileTrust reloading them (real files; the reload throttle's clock is an argument)."""

from __future__ import annotations

import logging
import os
import stat
import time

import pytest

from ectransport.settings_schema import TrustSettings
from ectransport.trust import RefusalReason, Role, TrustError, inspect_cert
from ectransport.trust.files import (
    CaPaths,
    init_ca,
    load_ca,
    load_own_cert,
    read_ca_public,
    read_cert,
    read_passphrase_file,
    read_revocations,
    revoke,
    write_cert,
)
from ectransport.trust.verify import check_revocations
from ectransport.trust.watch import FileTrust, policy_from_settings
from tests.trust.helpers import NOW, ca, curve_key, issue

PW = b"correct horse battery staple"


def test_ca_init_writes_an_encrypted_private_secret_and_loads_back(tmp_path):
    authority, paths = init_ca(tmp_path / "ca", PW, now=int(NOW))
    assert stat.S_IMODE(paths.secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.public.stat().st_mode) & 0o077 != 0  # public: readable
    assert b"ENCRYPTED PRIVATE KEY" in paths.secret.read_bytes()
    assert authority.key_id in paths.public.read_text()
    assert read_ca_public(paths.public) == [authority.public]
    again = load_ca(paths.dir, PW)
    assert again.public == authority.public
    (lst,) = read_revocations(paths.revocations)
    from ectransport.trust import check_revocations

    r = check_revocations(lst, trusted_cas={authority.key_id: authority.public})
    assert (r.seq, r.serials, r.curve_keys) == (int(NOW), frozenset(), frozenset())


def test_ca_passphrase_errors_are_clear(tmp_path):
    _, paths = init_ca(tmp_path / "enc", PW, now=int(NOW))
    with pytest.raises(TrustError, match="wrong passphrase"):
        load_ca(paths.dir, b"nope")
    with pytest.raises(TrustError, match="is encrypted: give its passphrase"):
        load_ca(paths.dir, None)
    _, plain = init_ca(tmp_path / "plain", None, now=int(NOW))
    assert b"BEGIN PRIVATE KEY" in plain.secret.read_bytes()
    load_ca(plain.dir, None)
    with pytest.raises(TrustError, match="not encrypted: drop the passphrase"):
        load_ca(plain.dir, PW)
    with pytest.raises(TrustError, match=r"no CA in .*keys ca init"):
        load_ca(tmp_path / "missing", PW)
    with pytest.raises(TrustError, match="already exists"):
        init_ca(paths.dir, PW, now=int(NOW))
    # another CA's public key in the directory: inconsistent
    plain.public.write_text(paths.public.read_text())
    with pytest.raises(TrustError, match="inconsistent"):
        load_ca(plain.dir, None)
    os.chmod(paths.secret, 0o644)
    with pytest.warns(UserWarning, match="chmod 600"):
        load_ca(paths.dir, PW)


def test_passphrase_file(tmp_path):
    f = tmp_path / "pw"
    f.write_bytes(PW + b"\n")
    assert read_passphrase_file(f) == PW
    f.write_bytes(b"\n")
    with pytest.raises(TrustError, match="empty"):
        read_passphrase_file(f)


def test_cert_file_round_trip_and_errors(tmp_path):
    key = curve_key()
    cert = issue(ca(1), key, Role.PRODUCER, "encoder-3", serial=31)
    path = write_cert(tmp_path / "n.cert", cert)
    text = path.read_text()
    assert "encoder-3" in text and "role producer" in text and key in text
    assert read_cert(path) == cert
    with pytest.raises(TrustError, match="overwrite"):
        write_cert(path, cert)
    write_cert(path, cert, force=True)
    for content, needle in (
        ("", "holds 0 node certificates"),
        (text + text, "holds 2 node certificates"),
        (
            "-----BEGIN ECTRANSPORT NODE CERTIFICATE-----\n!!\n"
            "-----END ECTRANSPORT NODE CERTIFICATE-----\n",
            "not base64",
        ),
    ):
        bad = tmp_path / "bad.cert"
        bad.write_text(content)
        with pytest.raises(TrustError, match=needle):
            read_cert(bad)
    (tmp_path / "bin.cert").write_bytes(b"\xff\xfe")
    with pytest.raises(TrustError, match="not ASCII"):
        read_cert(tmp_path / "bin.cert")
    with pytest.raises(TrustError, match="does not exist"):
        read_cert(tmp_path / "nope.cert")
    (tmp_path / "huge.cert").write_bytes(b"#" * (1 << 20))
    with pytest.raises(TrustError, match="larger than"):
        read_cert(tmp_path / "huge.cert")


def test_revoke_adds_to_the_list_with_a_growing_seq(tmp_path):
    authority, paths = init_ca(tmp_path / "ca", PW, now=1000)
    key = curve_key()
    r1 = revoke(paths.dir, PW, now=1000, serials=(5,))
    assert r1.seq == 1001 and r1.serials == {5}
    old_copy = paths.revocations.read_text()  # seq 1001: serial 5
    r2 = revoke(paths.dir, PW, now=5000, curve_keys=(key,))
    assert r2.seq == 5000 and r2.serials == {5} and r2.curve_keys == {key}
    assert "seq 5000" in paths.revocations.read_text()
    # the published file lost (or an old copy put back): the CA directory's own copy keeps
    # every earlier entry, so the next list revokes them all again — it never un-revokes
    paths.revocations.unlink()
    r3 = revoke(paths.dir, PW, now=6000, serials=(6,))
    assert r3.seq == 6000 and r3.serials == {5, 6} and r3.curve_keys == {key}
    cas = {authority.key_id: authority.public}
    assert [
        check_revocations(b, trusted_cas=cas).serials for b in read_revocations(paths.revocations)
    ] == [{5, 6}]
    paths.revocations.write_text(old_copy)
    r4 = revoke(paths.dir, PW, now=6000, serials=(7,))
    assert r4.seq == 6001 and r4.serials == {5, 6, 7} and r4.curve_keys == {key}
    # the CA's own copy lost too: refused, saying what to do (nothing is written)
    paths.revocations.unlink()
    paths.state.unlink()
    with pytest.raises(TrustError, match="Copy the newest revocation list a node uses"):
        revoke(paths.dir, PW, now=7000, serials=(8,))
    assert not paths.revocations.exists() and not paths.state.exists()
    # a node's copy put back: accepted (it is signed by this CA), and extended
    paths.revocations.write_text(old_copy)
    r5 = revoke(paths.dir, PW, now=7000, serials=(8,))
    assert r5.serials == {5, 8} and r5.seq == 7000
    with pytest.raises(TrustError, match="wrong passphrase"):
        revoke(paths.dir, b"x", now=7000, serials=(7,))
    # a revocation list of another CA in the directory is refused, not extended
    other = init_ca(tmp_path / "other", None, now=1)[1]
    paths.revocations.write_text(other.revocations.read_text())
    with pytest.raises(TrustError, match="not trusted"):
        revoke(paths.dir, PW, now=8000, serials=(8,))
    # a certificate of another CA is refused, naming both CAs
    stranger = init_ca(tmp_path / "stranger", None, now=1)[0]
    paths.revocations.write_text(old_copy)
    cert = stranger.issue(
        curve_key=key, role="consumer", name="pd-9", not_before=1, not_after=10**9
    )
    with pytest.raises(TrustError, match=f"CA {stranger.key_id}.*{authority.key_id}"):
        revoke(paths.dir, PW, now=8000, certs=(("pd-9.cert", cert),))
    mine = authority.issue(
        curve_key=key, role="consumer", name="pd-1", not_before=1, not_after=10**9
    )
    r6 = revoke(paths.dir, PW, now=8000, certs=(("pd-1.cert", mine),))
    assert inspect_cert(mine).serial in r6.serials and {5, 8} <= r6.serials


def _file_trust(paths: CaPaths, **kw) -> FileTrust:
    return FileTrust([paths.public], [paths.revocations], skew_s=300, reload_s=2.0, **kw)


def _ok(ft: FileTrust, cert: bytes, key: str) -> bool:
    return ft.store.verify(cert, curve_key=key, role_wanted=Role.CONSUMER, now=time.time()).ok


def test_revocation_file_reload_picks_up_a_change(tmp_path):
    authority, paths = init_ca(tmp_path / "ca", None, now=int(time.time()))
    key = curve_key()
    now = int(time.time())
    cert = authority.issue(
        curve_key=key, role="consumer", name="pd-0", not_before=now - 60, not_after=now + 3600
    )
    ft = _file_trust(paths)
    assert _ok(ft, cert, key)
    assert ft.reload_if_changed(100.0) is False  # nothing changed
    revoke(paths.dir, None, now=now + 1, serials=(inspect_cert(cert).serial,))
    assert ft.reload_if_changed(101.0) is False  # within reload_s of the last look
    assert _ok(ft, cert, key)
    assert ft.reload_if_changed(102.0) is True  # the next look sees the new list
    got = ft.store.verify(cert, curve_key=key, role_wanted=Role.CONSUMER, now=time.time())
    assert got.reason is RefusalReason.REVOKED
    # the same bytes rewritten (new inode and mtime): no change
    paths.revocations.write_bytes(paths.revocations.read_bytes())
    assert ft.reload() is False


def test_a_broken_or_vanished_file_keeps_what_it_held(tmp_path, caplog):
    authority, paths = init_ca(tmp_path / "ca", None, now=int(time.time()))
    key = curve_key()
    now = int(time.time())
    cert = authority.issue(
        curve_key=key,
        role="consumer",
        name="pd-0",
        not_before=now - 60,
        not_after=now + 3600,
        serial=12,
    )
    revoke(paths.dir, None, now=now, serials=(12,))
    ft = _file_trust(paths)
    assert not _ok(ft, cert, key)
    good = paths.revocations.read_text()
    caplog.set_level(logging.ERROR, logger="ectransport.trust")
    for broken in (
        "-----BEGIN ECTRANSPORT REVOCATION LIST-----\n%%%\n"
        "-----END ECTRANSPORT REVOCATION LIST-----\n",
        None,
    ):
        if broken is None:
            paths.revocations.unlink()
        else:
            paths.revocations.write_text(broken)
        assert ft.reload() is False
        assert not _ok(ft, cert, key), "a broken revocation file un-revoked a node"
    assert caplog.text.count("keeping what") == 2
    assert ft.reload() is False and caplog.text.count("keeping what") == 2  # logged once each
    # an older list put back: refused (no rollback), the revocation stays
    paths.revocations.write_text(good)
    assert ft.reload() is False and not _ok(ft, cert, key)
    # the CA file broken: the CA stays trusted
    paths.public.write_text("garbage\n")
    assert ft.reload() is False
    other = curve_key()
    assert _ok(
        ft,
        authority.issue(
            curve_key=other, role="consumer", name="pd-1", not_before=now - 60, not_after=now + 3600
        ),
        other,
    )


def test_ca_rotation_at_runtime(tmp_path):
    now = int(time.time())
    old, old_paths = init_ca(tmp_path / "old", None, now=now)
    new, new_paths = init_ca(tmp_path / "new", None, now=now)
    bundle = tmp_path / "trusted.pem"
    bundle.write_text(old_paths.public.read_text())
    ft = FileTrust(
        [bundle], [old_paths.revocations, new_paths.revocations], skew_s=300, reload_s=1.0
    )
    assert len(ft.store.revocations) == 1  # the new CA's list waits for its CA
    key = curve_key()
    cert_new = new.issue(
        curve_key=key, role="consumer", name="pd-0", not_before=now - 60, not_after=now + 3600
    )
    assert not _ok(ft, cert_new, key)
    bundle.write_text(old_paths.public.read_text() + new_paths.public.read_text())
    assert ft.reload_if_changed(10.0) is True
    assert _ok(ft, cert_new, key) and len(ft.store.cas) == 2
    assert len(ft.store.revocations) == 2  # applied once its CA is trusted
    bundle.write_text(new_paths.public.read_text())  # the old CA retired
    assert ft.reload_if_changed(20.0) is True
    cert_old = old.issue(
        curve_key=key, role="consumer", name="pd-0", not_before=now - 60, not_after=now + 3600
    )
    assert not _ok(ft, cert_old, key) and _ok(ft, cert_new, key)


def test_file_trust_start_up_errors_and_settings(tmp_path):
    _, paths = init_ca(tmp_path / "ca", None, now=int(NOW))
    with pytest.raises(TrustError, match="does not exist"):
        FileTrust([tmp_path / "nope.pem"], skew_s=1, reload_s=1)
    with pytest.raises(TrustError, match="no CA public key file"):
        FileTrust([], skew_s=1, reload_s=1)
    with pytest.raises(TrustError, match="holds no CA public key"):
        FileTrust([paths.revocations], skew_s=1, reload_s=1)
    _, other = init_ca(tmp_path / "other", None, now=int(NOW))
    assert (
        FileTrust([paths.public], [other.revocations], skew_s=1, reload_s=1).store.revocations == {}
    )  # another CA's list: revokes nothing trusted here, ignored
    (tmp_path / "junk.pem").write_text(
        "-----BEGIN ECTRANSPORT REVOCATION LIST-----\nAAAA\n"
        "-----END ECTRANSPORT REVOCATION LIST-----\n"
    )
    with pytest.raises(TrustError, match="not a sealed"):
        FileTrust([paths.public], [tmp_path / "junk.pem"], skew_s=1, reload_s=1)
    assert FileTrust.from_settings(TrustSettings()) is None
    ft = FileTrust.from_settings(
        TrustSettings(
            trust_ca=(str(paths.public),),
            revocation_file=(str(paths.revocations),),
            admission="certificate",
            clock_skew_s=5,
        )
    )
    assert ft is not None and ft.store.skew_s == 5 and ft.reload_s == 2.0
    with pytest.raises(ValueError, match="needs trust_ca"):
        TrustSettings(admission="either")
    policy, files = policy_from_settings(TrustSettings())
    assert files is None and policy.mode.value == "allow_list" and policy.store is None
    policy, files = policy_from_settings(
        TrustSettings(trust_ca=(str(paths.public),), admission="either"), allow_list=lambda k: False
    )
    assert files is not None and policy.store is files.store and policy.zap_admits_any_key
    with pytest.raises(TrustError, match="either"):  # either needs the allow-list callable
        policy_from_settings(TrustSettings(trust_ca=(str(paths.public),), admission="either"))


def test_load_own_cert(tmp_path):
    key, other = curve_key(), curve_key()
    now = int(time.time())
    authority = ca(1)
    path = write_cert(
        tmp_path / "me.cert",
        authority.issue(
            curve_key=key,
            role="producer",
            name="encoder-0",
            not_before=now - 10,
            not_after=now + 100,
        ),
    )
    assert load_own_cert(path, curve_key=key, role=Role.PRODUCER, now=now) == read_cert(path)
    with pytest.raises(TrustError, match="this node's key is"):
        load_own_cert(path, curve_key=other, role=Role.PRODUCER, now=now)
    with pytest.raises(TrustError, match="--role consumer"):
        load_own_cert(path, curve_key=key, role=Role.CONSUMER, now=now)
    with pytest.raises(TrustError, match="expired"):
        load_own_cert(path, curve_key=key, role=Role.PRODUCER, now=now + 101)
    from tests.trust.helpers import store

    with pytest.raises(TrustError, match="signed by CA"):
        load_own_cert(path, curve_key=key, role=Role.PRODUCER, now=now, store=store(ca(2)))
    assert load_own_cert(path, curve_key=key, role=Role.PRODUCER, now=now, store=store(ca(1)))
