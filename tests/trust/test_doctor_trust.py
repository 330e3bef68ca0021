"""``ectransport doctor``'s trust rows: real files from the CA code, checked as a node's
``[trust]`` names them."""

from __future__ import annotations

import time

import msgspec

from ectransport.config.doctor import FAIL, INFO, OK, WARN
from ectransport.config.doctor_trust import check_trust
from ectransport.control.keys import generate_keypair
from ectransport.settings_schema import SecuritySettings, Settings, TrustSettings
from ectransport.trust.files import init_ca, read_cert, revoke, write_cert
from ectransport.trust.verify import inspect_cert


def _node(tmp_path, *, valid_s=30 * 86400, role="producer"):
    ca, paths = init_ca(tmp_path / "ca", None, now=int(time.time()))
    pub_file, secret_file = generate_keypair(tmp_path / "keys", "encoder-0")
    from ectransport.control.keys import load_public

    now = int(time.time())
    cert = ca.issue(curve_key=load_public(pub_file), role=role, name="encoder-0",
                    not_before=now - 60, not_after=now + valid_s)
    write_cert(tmp_path / "encoder-0.cert", cert)
    s = Settings(security=SecuritySettings(key_file=str(secret_file)),
                 trust=TrustSettings(trust_ca=(str(paths.public),),
                                     revocation_file=(str(paths.revocations),),
                                     cert_file=str(tmp_path / "encoder-0.cert"),
                                     admission="certificate"))
    return s, paths


def _rows(s):
    return {(c.name, c.status): c.detail for c in check_trust(s)}


def test_a_consistent_node_is_ok_and_names_what_it_holds(tmp_path):
    s, paths = _node(tmp_path)
    rows = _rows(s)
    assert ("admission", INFO) in rows and ("CA file", OK) in rows
    assert ("revocation list", OK) in rows
    detail = rows[("certificate", OK)]
    assert "encoder-0 (producer)" in detail and "days left" in detail


def test_unconfigured_trust_is_one_info_row():
    (row,) = check_trust(Settings())
    assert row.status == INFO and "allow-lists only" in row.detail


def test_revoked_expiring_and_foreign_certificates_are_flagged(tmp_path):
    s, paths = _node(tmp_path, valid_s=86400)
    assert ("certificate", WARN) in _rows(s)  # under 7 days left
    serial = inspect_cert(read_cert(s.trust.cert_file)).serial
    revoke(paths.dir, None, now=int(time.time()), serials=(serial,))
    assert "revoked" in _rows(s)[("certificate", FAIL)]
    other_pub, other_secret = generate_keypair(tmp_path / "other", "x")
    foreign = msgspec.structs.replace(s, security=SecuritySettings(key_file=str(other_secret)))
    assert "not this node's" in _rows(foreign)[("certificate", FAIL)]
    broken = msgspec.structs.replace(s, trust=msgspec.structs.replace(
        s.trust, trust_ca=(str(tmp_path / "missing.pem"),)))
    assert ("CA file", FAIL) in _rows(broken)
