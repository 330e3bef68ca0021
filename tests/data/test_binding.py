"""The host rule and grant check shared by the host:port planes (ectransport.data.binding)."""

from __future__ import annotations

import msgspec
import pytest

from ectransport.data.base import MAX_ENDPOINT_BYTES, identity_of
from ectransport.data.binding import (
    ENDPOINT_VERSION,
    HostBinding,
    allowed_addresses,
    bind_host_endpoint,
    check_grant,
)
from ectransport.data.tcp_wire import TcpEndpoint, endpoint_decoder
from ectransport.errors import DataPlaneError

ID = identity_of("P" * 40)


@pytest.mark.parametrize(("declared", "dialed", "want"), [
    ("127.0.0.1", "127.0.0.1", ("127.0.0.1",)),
    ("127.0.0.2", "127.0.0.1", ("127.0.0.2",)),  # loopback is one host when dialed loopback
    ("127.0.0.3", "localhost", ("127.0.0.3",)),
    ("::1", "127.0.0.1", ("::1",)),
    ("[::1]", "[::1]", ("::1",)),
    ("::ffff:10.1.2.3", "10.1.2.3", ("10.1.2.3",)),
    ("10.1.2.3", "10.1.2.3", ("10.1.2.3",)),
])
def test_same_host_is_allowed(declared, dialed, want):
    assert allowed_addresses(declared, dialed) == want


@pytest.mark.parametrize(("declared", "dialed"), [
    ("10.1.2.4", "10.1.2.3"),  # another machine
    ("127.0.0.1", "10.1.2.3"),  # loopback only counts when the consumer dialed loopback
    ("10.1.2.3", "127.0.0.1"),
    ("0.0.0.0", "127.0.0.1"),  # unspecified never matches (connecting to it reaches localhost)
    ("::", "::1"),
    ("no-such-host.invalid", "127.0.0.1"),
])
def test_another_host_is_refused(declared, dialed):
    with pytest.raises(DataPlaneError):
        allowed_addresses(declared, dialed)


def _decl(**kw) -> bytes:
    fields = {"v": ENDPOINT_VERSION, "host": "127.0.0.1", "port": 4000, "node": "enc0",
              "identity": ID, **kw}
    return msgspec.msgpack.encode(TcpEndpoint(**fields))


def _bind(endpoint: bytes, identity: str = ID, host: str = "127.0.0.1"):
    return bind_host_endpoint("tcp", endpoint_decoder, endpoint, peer="127.0.0.1:5555", host=host,
                              identity=identity)


def test_bind_checks_the_declaration():
    b = _bind(_decl())
    assert isinstance(b, HostBinding)
    assert (b.plane, b.host, b.port, b.node, b.identity, b.addrs) == (
        "tcp", "127.0.0.1", 4000, "enc0", ID, ("127.0.0.1",))
    assert _bind(_decl()).scope != b.scope  # every binding is its own scope
    assert _bind(b"") is None  # a producer that declares nothing
    assert _bind(_decl(identity=""), identity="").identity == ""  # insecure mode: no identity
    assert _bind(_decl(), identity="").identity == ID  # nothing to check it against


@pytest.mark.parametrize(("label", "endpoint", "identity", "host"), [
    ("wrong identity", _decl(identity=identity_of("X" * 40)), ID, "127.0.0.1"),
    ("no identity", _decl(identity=""), ID, "127.0.0.1"),
    ("other host", _decl(host="10.9.9.9"), ID, "127.0.0.1"),
    ("wrong version", _decl(v=ENDPOINT_VERSION + 1), ID, "127.0.0.1"),
    ("garbage", b"\xc1\xc1garbage", ID, "127.0.0.1"),
    ("other plane", msgspec.msgpack.encode({"type": "ucx-ep", "v": 1, "host": "127.0.0.1",
                                            "port": 1, "node": "", "identity": ID}), ID,
     "127.0.0.1"),
    ("unknown field", msgspec.msgpack.encode({"type": "tcp-ep", "v": 1, "host": "127.0.0.1",
                                              "port": 1, "node": "", "identity": ID, "x": 1}),
     ID, "127.0.0.1"),
    ("oversized", b"\x00" * (MAX_ENDPOINT_BYTES + 1), ID, "127.0.0.1"),
])
def test_bind_refuses(label, endpoint, identity, host):
    with pytest.raises(DataPlaneError):
        _bind(endpoint, identity, host)


def test_check_grant():
    b = _bind(_decl())
    assert check_grant(b, "tcp", "127.0.0.1", 4000, "enc0") is b
    assert check_grant(b, "tcp", "127.0.0.1", 4000) is b  # a grant without node (ucx)
    for host, port, node in (("127.0.0.1", 4001, "enc0"), ("localhost", 4000, "enc0"),
                             ("127.0.0.1", 4000, "enc1")):
        with pytest.raises(DataPlaneError, match="declared"):
            check_grant(b, "tcp", host, port, node)
    with pytest.raises(DataPlaneError, match="not a binding"):
        check_grant(b, "ucx", "127.0.0.1", 4000)  # another plane's binding
    with pytest.raises(DataPlaneError, match="not a binding"):
        check_grant(object(), "tcp", "127.0.0.1", 4000)
