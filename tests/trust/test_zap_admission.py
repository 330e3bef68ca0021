"""Admission by certificate over real CurveZMQ sockets: the control server's ZAP handler admits
any CURVE key (``admit_any_key``), and the producer decides with one call —
``TrustPolicy.admit(curve_key=PeerId.user, cert=Hello.cert, ...)`` — on the authenticated key
ZeroMQ reports, so a certificate copied from another node is useless."""

from __future__ import annotations

import contextlib
import time

import pytest

from ectransport.control.base import Received, Up
from ectransport.control.keys import AllowList
from ectransport.control.zmqctl import ZmqControlClient, ZmqControlServer
from ectransport.errors import ConfigError
from ectransport.protocol import Hello, decode, encode
from ectransport.trust import RefusalReason, Role, TrustPolicy
from tests.conftest import DEADLINE_S, new_keypair, poll_until
from tests.trust.helpers import ca, store

LOCAL = "127.0.0.1"
COMPAT = "8eb9fed6814a420db8843a53acafe5c014213d9144f7c1636c6297efd9baea9b"


def hello(cert: bytes, node: str) -> bytes:
    return encode(Hello(v=2, session_id="0f3c9a7e5b2d4c18a6e1f09b7d3c5a21", node_id=node,
                        versions=[1, 2], planes=["tcp"], compat_hash=COMPAT,
                        mem_kinds=["DRAM"], cert=cert))


def now_cert(key: str, role: Role = Role.CONSUMER, name: str = "pd-0") -> bytes:
    t = int(time.time())
    return ca(1).issue(curve_key=key, role=role, name=name, not_before=t - 60,
                       not_after=t + 3600)


@contextlib.contextmanager
def closing(*things):
    try:
        yield things
    finally:
        for t in things:
            t.close()


def test_zap_admits_any_key_and_the_hello_certificate_decides():
    server_keys = new_keypair()
    good, thief, stranger = new_keypair(), new_keypair(), new_keypair()
    policy = TrustPolicy("certificate", store(ca(1)))
    assert policy.zap_admits_any_key
    # a wildcard bind (not loopback): without admit_any_key it would need an allow-list
    server = ZmqControlServer("0.0.0.0", 0, secret_key=server_keys.secret, admit_any_key=True)
    clients = {name: ZmqControlClient(secret_key=k.secret)
               for name, k in (("good", good), ("thief", thief), ("stranger", stranger))}
    good_cert = now_cert(good.public)
    frames = {"good": hello(good_cert, "pd-0"),
              "thief": hello(good_cert, "pd-x"),  # presents another node's certificate
              "stranger": hello(b"", "pd-y")}
    outcomes = {}
    with closing(server, *clients.values()):
        for name, client in clients.items():
            conn = client.connect(LOCAL, server.port, server_keys.public)
            assert isinstance(poll_until(client, lambda e: isinstance(e, Up)), Up), name
            assert client.send(conn, frames[name])
            ev = poll_until(server, lambda e, f=frames[name]: isinstance(e, Received)
                            and e.data == f, DEADLINE_S)
            assert ev is not None, f"{name}: the server received nothing"
            msg = decode(ev.data, versions=[1, 2])
            assert isinstance(msg, Hello)
            outcomes[name] = (ev.source.user, policy.admit(
                curve_key=ev.source.user, cert=msg.cert, role_wanted=Role.CONSUMER,
                now=time.time()))
        assert server.reject_count == 0  # nobody refused at the handshake
    assert outcomes["good"][0] == good.public and outcomes["good"][1].ok
    assert outcomes["good"][1].cert.name == "pd-0"
    assert outcomes["thief"][0] == thief.public
    assert outcomes["thief"][1].reason is RefusalReason.WRONG_KEY
    assert outcomes["stranger"][1].reason is RefusalReason.MISSING


def test_admit_any_key_configuration():
    server_keys = new_keypair()
    with pytest.raises(ConfigError, match="allow-list"):
        ZmqControlServer(LOCAL, 0, secret_key=server_keys.secret, admit_any_key=True,
                         allow=AllowList(callback=lambda k: True))
    with pytest.raises(ConfigError, match="insecure"):
        ZmqControlServer(LOCAL, 0, admit_any_key=True, insecure=True)
    # a non-loopback bind needs an allow-list, unless admission is by certificate
    with pytest.raises(ConfigError, match="allow-list"):
        ZmqControlServer("0.0.0.0", 0, secret_key=server_keys.secret)
    srv = ZmqControlServer("0.0.0.0", 0, secret_key=server_keys.secret, admit_any_key=True)
    srv.close()
