"""Key files (zcert format, 0600 secrets) and the AllowList policy."""

from __future__ import annotations

import os
import stat

import pytest
import zmq.auth

from ectransport.control.keys import (
    AllowList,
    allow_key,
    generate_keypair,
    load_keypair,
    load_public,
)
from ectransport.errors import ConfigError
from tests.conftest import new_keypair


def test_generate_keypair_writes_zcert_files_with_private_secret(tmp_path):
    pub_path, sec_path = generate_keypair(tmp_path, "producer")
    assert pub_path == tmp_path / "producer.key"
    assert sec_path == tmp_path / "producer.key_secret"
    assert stat.S_IMODE(os.stat(sec_path).st_mode) == 0o600
    # Readable by pyzmq's own loader: interoperable zcert files.
    pub_b, sec_b = zmq.auth.load_certificate(sec_path)
    assert zmq.curve_public(sec_b) == pub_b
    pub, sec = load_keypair(sec_path)
    assert pub == pub_b.decode() and sec == sec_b.decode()
    assert load_public(pub_path) == pub
    assert load_public(sec_path) == pub


def test_generate_keypair_refuses_overwrite_unless_forced(tmp_path):
    _, sec_path = generate_keypair(tmp_path, "p")
    old = load_keypair(sec_path)
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        generate_keypair(tmp_path, "p")
    assert load_keypair(sec_path) == old
    generate_keypair(tmp_path, "p", force=True)
    assert load_keypair(sec_path) != old
    assert stat.S_IMODE(os.stat(sec_path).st_mode) == 0o600


def test_generate_keypair_rejects_path_like_name(tmp_path):
    with pytest.raises(ConfigError):
        generate_keypair(tmp_path, "../evil")


def test_world_readable_secret_warns(tmp_path, caplog):
    _, sec_path = generate_keypair(tmp_path, "c")
    os.chmod(sec_path, 0o644)
    with pytest.warns(UserWarning, match="chmod 600"):
        load_keypair(sec_path)
    assert any("group/world" in r.getMessage() for r in caplog.records)


def test_load_public_accepts_z85_and_rejects_garbage(tmp_path):
    kp = new_keypair()
    assert load_public(kp.public) == kp.public
    with pytest.raises(ConfigError, match="neither"):
        load_public("not-a-key")
    bad = tmp_path / "bad.key"
    bad.write_text("hello\n")
    with pytest.raises(ConfigError, match="not a zcert"):
        load_public(bad)


def test_load_keypair_rejects_public_only_file(tmp_path):
    pub_path, _ = generate_keypair(tmp_path, "x")
    with pytest.raises(ConfigError, match="only a public key"):
        load_keypair(pub_path)


def test_allow_key_and_allowlist_reload(tmp_path):
    allow_dir = tmp_path / "allow"
    a, b = new_keypair(), new_keypair()
    allow_key(allow_dir, a.public, name="a")
    al = AllowList(allow_dir, check_interval_s=0.0)
    assert al.admits(a.public) and not al.admits(b.public)
    path_b = allow_key(allow_dir, b.public)
    assert al.admits(b.public)
    path_b.unlink()
    assert not al.admits(b.public)
    assert al.keys == frozenset({a.public})


def test_allowlist_rechecks_at_most_every_interval_and_reload_forces(tmp_path):
    kp = new_keypair()
    al = AllowList(tmp_path, check_interval_s=3600)
    allow_key(tmp_path, kp.public)
    assert not al.admits(kp.public)  # not re-scanned yet
    al.reload()  # e.g. on SIGHUP
    assert al.admits(kp.public)


def test_allowlist_fails_closed_on_unreadable_dir(tmp_path):
    kp = new_keypair()
    allow_key(tmp_path / "d", kp.public)
    al = AllowList(tmp_path / "d", check_interval_s=0.0)
    assert al.admits(kp.public)
    (tmp_path / "d").rename(tmp_path / "moved")
    assert not al.admits(kp.public)
    assert not AllowList(tmp_path / "missing").admits(kp.public)


def test_allowlist_skips_malformed_files(tmp_path):
    kp = new_keypair()
    (tmp_path / "junk.key").write_text("nothing here\n")
    allow_key(tmp_path, kp.public)
    assert AllowList(tmp_path).admits(kp.public)


def test_allowlist_callback(tmp_path):
    a, b = new_keypair(), new_keypair()
    al = AllowList(callback=lambda k: k == a.public)
    assert al.admits(a.public) and not al.admits(b.public)

    def boom(_k: str) -> bool:
        raise RuntimeError("db down")

    assert not AllowList(callback=boom).admits(a.public)
    with pytest.raises(ConfigError):
        AllowList()


def test_allow_key_is_atomic_name_and_idempotent(tmp_path):
    kp = new_keypair()
    p1 = allow_key(tmp_path, kp.public)
    p2 = allow_key(tmp_path, kp.public)
    assert p1 == p2 and p1.suffix == ".key"
    assert [p.name for p in tmp_path.iterdir()] == [p1.name]
    assert load_public(p1) == kp.public
