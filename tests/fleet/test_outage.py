"""Directory outages: Redis SIGSTOPped, killed and restarted, not yet started, or refusing our
credentials. Every call returns within its deadline with a typed outcome; publishing queues and
resumes; what an instance holds is re-published after Redis lost it."""

from __future__ import annotations

import time

import pytest

from ectransport.fleet import Acquired, Directory, DirectoryAuthError, UnavailableReason
from ectransport.fleet.outcomes import DirectoryUnavailable
from tests.conftest import DEADLINE_S, wait_for
from tests.fleet.conftest import (
    FLEET_ACL_USER,
    RedisServer,
    consumer_dir,
    holder_dir,
    identity,
    settings_for,
)

#: what one call may take at most on a stopped Redis: its connect and its read, each bounded by
#: the test settings' 0.5 s, plus scheduling slack on a loaded machine. Generous on purpose:
#: the point is "bounded", against a default that would block for ever.
BOUND_S = 2 * 0.5 + 3.0


def timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_sigstopped_redis_every_call_returns_within_its_deadline_then_recovers(
    redis_server, directories
):
    p = holder_dir(directories, redis_server, "enc")
    p.publish("a", 10)
    assert p.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    assert c.lookup("a")["a"]
    redis_server.pause()
    try:
        got, took = timed(lambda: c.lookup_many(["a", "b"]))
        assert got.unavailable is not None and got.unavailable.reason is UnavailableReason.TIMEOUT
        assert got == {"a": [], "b": []} and took < BOUND_S
        got, took = timed(lambda: c.lookup("a"))  # in the backoff now: answered at once
        assert got.unavailable is not None and took < BOUND_S
        fut = c.submit_lookup(["a"])
        assert not fut.result(BOUND_S).ok
        claim, took = timed(lambda: c.claim("b"))
        assert isinstance(claim, DirectoryUnavailable) and not claim and took < BOUND_S
        acq, took = timed(lambda: c.claim_or_wait("b"))
        assert acq.outcome is Acquired.ENCODE_LOCALLY and acq.unavailable is not None
        assert took < BOUND_S
        _, took = timed(lambda: p.publish("c", 10))  # queued: never blocks
        assert took < BOUND_S
        assert wait_for(lambda: p.stats()["heartbeat_failures"] >= 1)
        assert p.stats()["publish_queue"] >= 1 and p.stats()["directory_down"] == 1
    finally:
        redis_server.resume()
    assert wait_for(lambda: c.lookup("c")["c"] != [])
    assert p.flush(DEADLINE_S)
    assert [h.instance for h in c.lookup("a")["a"]] == ["enc"]
    assert p.stats()["directory_down"] == 0 and p.stats()["reconnects"] >= 1


def test_killed_and_restarted_redis_publishing_resumes_and_holdings_are_republished(
    redis_server, directories
):
    p = holder_dir(directories, redis_server, "enc")
    for m in ("a", "b"):
        p.publish(m, 10)
    assert p.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    assert all(c.lookup_many(["a", "b"]).values())
    redis_server.kill()
    got, took = timed(lambda: c.lookup("a"))
    assert got.unavailable is not None and got.unavailable.reason is UnavailableReason.DOWN
    assert took < BOUND_S
    p.publish("c", 10)  # while Redis is down
    p.unpublish("b")
    assert not p.flush(0.2)
    redis_server.restart()  # empty: no persistence
    assert wait_for(
        lambda: (lambda g: bool(g["a"]) and bool(g["c"]) and not g["b"])(
            c.lookup_many(["a", "b", "c"])
        )
    )
    s = p.stats()
    assert s["resyncs"] >= 2 and s["republished"] >= 2 and s["heartbeat_failures"] >= 1
    assert p.redis.smembers(p.keys.entries("enc", p.incarnation)) == {b"a", b"c"}


def test_a_directory_started_before_redis_goes_live_when_it_comes(tmp_path, directories):
    server = RedisServer(tmp_path)  # its port is chosen, nothing listens yet
    p = Directory(
        settings_for(server), identity=identity("early"), trusted=lambda k, c: True
    ).start()
    directories.append(p)
    p.publish("x", 10)
    c = Directory(
        settings_for(server), trusted=lambda k, c: True, compat_hash=p.identity.compat_hash
    )
    directories.append(c)
    assert c.lookup("x").unavailable is not None
    server.start()
    try:
        assert p.wait_live(DEADLINE_S) and p.flush(DEADLINE_S)
        assert wait_for(lambda: c.lookup("x")["x"] != [])
    finally:
        server.stop()


def test_a_full_publish_queue_is_replaced_by_a_resync(redis_server, directories):
    p = holder_dir(directories, redis_server, "enc", publish_queue_max=4)
    redis_server.pause()
    try:
        assert wait_for(lambda: p.stats()["heartbeat_failures"] >= 1)
        for i in range(10):
            p.publish(f"q{i}", 10)
        p.unpublish("q0")
        assert p.stats()["publish_dropped"] >= 5
    finally:
        redis_server.resume()
    assert p.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    got = c.lookup_many([f"q{i}" for i in range(10)])
    assert [m for m, hs in got.items() if hs] == [f"q{i}" for i in range(1, 10)]


ACL = ("--user", "default", "off", "--user", *FLEET_ACL_USER)


@pytest.fixture
def acl_server(tmp_path):
    server = RedisServer(tmp_path, extra=ACL).start()
    yield server
    server.stop()


def test_acl_user_and_password_work_and_a_wrong_password_is_a_typed_error(
    acl_server, tmp_path, directories
):
    """The ACL of docs/fleet.md (only the directory's commands, only its namespace) is
    enough for everything; a wrong password is AUTH, never an exception from a lookup."""
    good, bad = tmp_path / "pw", tmp_path / "bad"
    good.write_text("s3cret\n")
    bad.write_text("guess\n")
    kw = {"username": "fleet", "password_file": str(good)}
    p = holder_dir(directories, acl_server, "enc", liveness_ttl_s=0.6, gc_after_s=1.0, **kw)
    p.publish("a", 10)
    assert p.flush(DEADLINE_S)
    c = consumer_dir(directories, acl_server, **kw)
    assert c.check()["server"] in ("redis", "valkey")
    assert c.lookup("a")["a"] and c.claim_or_wait("z").outcome is Acquired.ENCODE
    assert wait_for(lambda: p.stats()["heartbeats"] >= 10)  # a GC round ran too
    assert p.stats()["heartbeat_failures"] == 0
    from ectransport.fleet import status

    assert [r.instance for r in status.instances(c)] == ["enc"] and status.claims(c)
    wrong = consumer_dir(directories, acl_server, username="fleet", password_file=str(bad))
    got = wrong.lookup("a")
    assert got.unavailable is not None and got.unavailable.reason is UnavailableReason.AUTH
    with pytest.raises(DirectoryAuthError, match="refused our credentials"):
        wrong.check()
    anonymous = consumer_dir(directories, acl_server)
    assert anonymous.lookup("a").unavailable.reason is UnavailableReason.AUTH


def make_tls(folder):
    """A CA and a server certificate for localhost (cryptography), as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject, issuer, key, signer, ca):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
            )
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet test CA")])
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    ca = cert(ca_name, ca_name, ca_key, ca_key, True)
    srv = cert(name, ca_name, key, ca_key, False)
    pem = serialization.Encoding.PEM
    (folder / "ca.pem").write_bytes(ca.public_bytes(pem))
    (folder / "server.pem").write_bytes(srv.public_bytes(pem))
    (folder / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return folder


def test_tls_to_redis_with_a_ca_file_and_a_wrong_ca_fails(tmp_path, directories):
    tls = make_tls(tmp_path)
    server = RedisServer(tmp_path, tls=tls).start()
    try:
        kw = {"tls_ca_file": str(tls / "ca.pem")}
        p = holder_dir(directories, server, "tls-enc", **kw)
        p.publish("a", 10)
        assert p.flush(DEADLINE_S)
        c = consumer_dir(directories, server, **kw)
        assert [h.instance for h in c.lookup("a")["a"]] == ["tls-enc"]
        (tmp_path / "other").mkdir()
        other = make_tls(tmp_path / "other")  # another CA: the server's certificate fails it
        wrong = consumer_dir(directories, server, tls_ca_file=str(other / "ca.pem"))
        got = wrong.lookup("a")
        assert got.unavailable is not None and got["a"] == []
        plain = consumer_dir(directories, server, url=f"redis://localhost:{server.port}")
        assert plain.lookup("a").unavailable is not None
    finally:
        server.stop()
