"""Plugin API 2 for the shm plane: reachability, the producer's declaration, binding and refusals,
the socket proof, and stream hygiene (a connection with unexpected bytes is never reused)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading

import msgspec
import pytest
from ectransport.plugin import (
    MAX_ENDPOINT_BYTES,
    MAX_LOCALITY_BYTES,
    ConfigError,
    DataPlaneError,
    Run,
    XferState,
    frame,
)
from ectransport.store import HostRegion
from ectransport.testing.conformance import assert_same, pattern, read_runs, wait_state

from ectransport_shm import ShmPlane
from ectransport_shm.locality import (
    ShmEndpoint,
    ShmLocality,
    current_locality,
    decode_endpoint,
    decode_locality,
    socket_name,
)
from ectransport_shm.wire import (
    SHM_WIRE_VERSION,
    STATUS_OK,
    ShmGrant,
    ShmHello,
    ShmProof,
    ShmReply,
    grant_decoder,
    hello_decoder,
    proof_decoder,
    recv_header,
    reply_decoder,
    request_decoder,
)

BLOCK_BYTES = 64 * 1024
DEADLINE_S = 10.0
ID_A = "aaaaaaaaaaaaaaaa"
ID_B = "bbbbbbbbbbbbbbbb"


_REGIONS: dict[int, HostRegion] = {}


@pytest.fixture
def planes():
    """make(node_id, identity="", **options) -> a plane over its own 64-block region
    (:func:`region_of`)."""
    made: list[tuple[ShmPlane, HostRegion]] = []

    def make(node_id: str, identity: str = "", **options) -> ShmPlane:
        region = HostRegion(64, BLOCK_BYTES)
        region.buf[:] = 0xEE
        try:
            plane = ShmPlane(node_id=node_id, region=region, identity=identity,
                             io_timeout_s=5.0, **options)
        except BaseException:
            region.close()
            raise
        made.append((plane, region))
        _REGIONS[id(plane)] = region
        return plane

    yield make
    for plane, region in reversed(made):
        plane.close()
        region.close()
        _REGIONS.pop(id(plane), None)


def region_of(plane: ShmPlane) -> HostRegion:
    return _REGIONS[id(plane)]


@pytest.fixture
def trio(planes):
    """Producers A (identity ID_A) and B (ID_B), a consumer, and the consumer bound to A."""
    a, b, c = planes("prod-a", ID_A), planes("prod-b", ID_B), planes("cons")
    binding = c.bind_peer(a.endpoint(), peer="10.0.0.1:5555", host="10.0.0.1", identity=ID_A)
    return a, b, c, binding


def _fetch(consumer: ShmPlane, binding, grant: bytes, runs, nbytes: int) -> tuple[XferState, str]:
    handle = consumer.start(binding, grant, runs, nbytes, b"n")
    try:
        return wait_state(consumer, handle, DEADLINE_S), handle.detail
    finally:
        consumer.release(handle)


# -- locality and reachable ------------------------------------------------------------------------
def test_locality_is_small_and_names_this_kernel_and_network_namespace(planes):
    c = planes("c")
    tok = c.locality()
    assert 0 < len(tok) <= MAX_LOCALITY_BYTES
    loc = decode_locality(tok)
    st = os.stat("/proc/self/ns/net")
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert loc == ShmLocality(f.read().strip(), st.st_dev, st.st_ino)
    assert 0 < len(planes("p", ID_A).endpoint()) <= MAX_ENDPOINT_BYTES


def test_reachable_from_this_process(planes):
    p, c = planes("p", ID_A), planes("c")
    assert p.reachable(c.locality()) is True
    assert p.reachable(current_locality()) is True


def test_reachable_from_another_process_in_this_namespace(spawn):
    """What the interop cells on one namespace rely on: another process, same netns: reachable."""
    from ectransport_shm.locality import here

    child = spawn("locality")
    tok = bytes.fromhex(child.readline())
    assert decode_locality(tok) == here()


@pytest.mark.parametrize("token", [
    b"", b"\xc1", b"garbage that is not msgpack", msgspec.msgpack.encode({"boot_id": "x"}),
    msgspec.msgpack.encode(ShmLocality("00000000-0000-0000-0000-000000000000", 4, 1))[:-3],
    b"\x00" * 10_000,
], ids=["empty", "bad-byte", "text", "other-map", "truncated", "huge"])
def test_not_reachable_from_empty_or_garbage_locality(planes, token):
    assert planes("p").reachable(token) is False


def test_not_reachable_from_another_boot_or_namespace(planes):
    p = planes("p")
    here = decode_locality(p.locality())
    other_boot = msgspec.structs.replace(here, boot_id="00000000-0000-0000-0000-000000000000")
    other_ns = msgspec.structs.replace(here, netns_ino=here.netns_ino + 1)
    assert p.reachable(msgspec.msgpack.encode(other_boot)) is False
    assert p.reachable(msgspec.msgpack.encode(other_ns)) is False


def _netns_python(code: str) -> str:
    """Run ``code`` in a fresh network namespace (root + ``ip netns``); its stdout."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and ip(8) for a network namespace")
    ns = f"ectshm-test-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        pytest.skip(f"ip netns add not permitted here: {r.stderr.strip()[:200]}")
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def test_not_reachable_from_another_network_namespace(planes):
    """One host, two network namespaces: the abstract socket does not cross, so shm must not be
    negotiated (the interop matrix's cross-namespace cells)."""
    tok = bytes.fromhex(_netns_python(
        "from ectransport_shm.locality import current_locality; "
        "print(current_locality().hex())"))
    p = planes("p", ID_A)
    theirs, ours = decode_locality(tok), decode_locality(p.locality())
    assert theirs.boot_id == ours.boot_id  # same host ...
    assert (theirs.netns_dev, theirs.netns_ino) != (ours.netns_dev, ours.netns_ino)
    assert p.reachable(tok) is False  # ... but not reachable


# -- endpoint and bind_peer ------------------------------------------------------------------------
def test_endpoint_declares_socket_identity_and_locality(planes):
    p = planes("prod-a", ID_A)
    ep = decode_endpoint(p.endpoint())
    assert ep.socket == p.socket_name and ep.socket.startswith(f"ectransport-shm.{ID_A}.")
    assert ep.identity == ID_A and ep.node == "prod-a" and len(ep.key) == 32
    assert msgspec.msgpack.encode(ep.where) == p.locality()


def test_identity_must_be_hex(planes):
    with pytest.raises(ConfigError, match="identity"):
        planes("p", "../../etc")


def _forged(ep: ShmEndpoint, **changes) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(ep, **changes))


def test_bind_peer_refuses_what_the_producer_cannot_own(planes):
    a, b, c = planes("prod-a", ID_A), planes("prod-b", ID_B), planes("cons")
    ep_a = decode_endpoint(a.endpoint())
    here = ep_a.where
    bad = {
        "empty (a node before API 2)": (b"", "declared no shm endpoint"),
        "garbage": (b"\xc1garbage", "malformed"),
        "another identity's declaration": (b.endpoint(), "authenticated"),
        "B's socket under A's identity": (_forged(ep_a, socket=b.socket_name),
                                          "not a socket of identity"),
        "another host": (_forged(ep_a, where=msgspec.structs.replace(here, boot_id="x" * 36)),
                         "another host"),
        "another netns": (_forged(ep_a, where=msgspec.structs.replace(
            here, netns_ino=here.netns_ino + 1)), "network namespace"),
    }
    for label, (declaration, match) in bad.items():
        with pytest.raises(DataPlaneError, match=match):
            c.bind_peer(declaration, peer=label, host="127.0.0.1", identity=ID_A)
    # insecure mode: no identity to compare (the socket name must still be the declared one's)
    plain = planes("prod-plain")
    assert c.bind_peer(plain.endpoint(), peer="p:2", host="h", identity="") is not None
    assert c.bind_peer(a.endpoint(), peer="p:3", host="h", identity="") is not None
    with pytest.raises(DataPlaneError, match="authenticated"):
        c.bind_peer(plain.endpoint(), peer="p:2", host="h", identity=ID_A)
    with pytest.raises(DataPlaneError, match="not a socket of identity"):
        c.bind_peer(_forged(ep_a, socket=b.socket_name), peer="p:4", host="h", identity="")


# -- start refuses grants not covered by the binding -----------------------------------------------
def test_grant_of_another_producer_is_refused_before_any_io(trio):
    a, b, c, bound_a = trio
    grant_b = b.describe([Run(0, 2)], 2 * BLOCK_BYTES)
    with pytest.raises(DataPlaneError, match="declared"):
        c.start(bound_a, grant_b, [Run(0, 2)], 2 * BLOCK_BYTES, b"")
    # a grant of A rewritten to name B's socket (what a compromised A could send)
    g = grant_decoder.decode(a.describe([Run(0, 2)], 2 * BLOCK_BYTES))
    redirected = msgspec.msgpack.encode(msgspec.structs.replace(g, socket=b.socket_name))
    with pytest.raises(DataPlaneError, match="declared"):
        c.start(bound_a, redirected, [Run(0, 2)], 2 * BLOCK_BYTES, b"")
    renamed = msgspec.msgpack.encode(msgspec.structs.replace(g, node="prod-b"))
    with pytest.raises(DataPlaneError, match="declared"):
        c.start(bound_a, renamed, [Run(0, 2)], 2 * BLOCK_BYTES, b"")
    assert b.stats["accepted"] == 0, "the consumer connected to producer B"
    # A's own grant works
    state, detail = _fetch(c, bound_a, msgspec.msgpack.encode(g), [Run(5, 2)], 2 * BLOCK_BYTES)
    assert state is XferState.DONE, detail


def test_start_without_or_after_a_binding_is_refused(trio):
    a, _, c, bound_a = trio
    grant = a.describe([Run(0, 1)], 10)
    for prepared in (None, object(), "not a binding"):
        with pytest.raises(DataPlaneError, match="binding"):
            c.start(prepared, grant, [Run(0, 1)], 10, b"")
    c.unbind_peer(bound_a)
    c.unbind_peer(bound_a)  # idempotent
    c.unbind_peer(None)  # never raises
    with pytest.raises(DataPlaneError, match="ended"):
        c.start(bound_a, grant, [Run(0, 1)], 10, b"")
    assert a.stats["accepted"] == 0


def test_unbind_closes_the_sessions_pooled_connections(trio):
    a, _, c, bound_a = trio
    second = c.bind_peer(a.endpoint(), peer="10.0.0.1:5555", host="10.0.0.1", identity=ID_A)
    data = pattern(3 * BLOCK_BYTES, 4)
    region_of(a).write([Run(0, 3)], data)
    for binding in (bound_a, second):
        grant = a.describe([Run(0, 3)], 3 * BLOCK_BYTES)
        assert _fetch(c, binding, grant, [Run(9, 3)], 3 * BLOCK_BYTES)[0] is XferState.DONE
    assert a.stats["accepted"] == 1  # one pooled connection served both sessions
    c.unbind_peer(bound_a)  # the other session still uses it
    grant = a.describe([Run(0, 3)], 3 * BLOCK_BYTES)
    assert _fetch(c, second, grant, [Run(9, 3)], 3 * BLOCK_BYTES)[0] is XferState.DONE
    assert a.stats["accepted"] == 1
    c.unbind_peer(second)
    again = c.bind_peer(a.endpoint(), peer="10.0.0.1:5555", host="10.0.0.1", identity=ID_A)
    grant = a.describe([Run(0, 3)], 3 * BLOCK_BYTES)
    assert _fetch(c, again, grant, [Run(9, 3)], 3 * BLOCK_BYTES)[0] is XferState.DONE
    assert a.stats["accepted"] == 2  # the pooled connection went with the last binding


# -- the socket proof -----------------------------------------------------------------------------
class FakeProducer:
    """A listener on an abstract socket name of ``identity`` that speaks the shm wire: it answers
    the hello with ``proof(key)`` (a random MAC when ``key`` is None), then serves every request
    with a 0-byte OK reply followed by ``extra`` bytes. Records the requests' tokens and how many
    connections it accepted; serves one connection at a time."""

    def __init__(self, identity: str, key: bytes | None, extra: bytes = b""):
        self.name = socket_name(identity, os.getpid(), os.urandom(8).hex())
        self.key, self.extra, self.identity = key, extra, identity
        self.requests: list[bytes] = []
        self.accepted = 0
        self.closed = False
        self.conn: socket.socket | None = None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.name)
        self.listener.listen(8)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from ectransport_shm.locality import proof

        while True:
            conn, _ = self.listener.accept()
            if self.closed:
                conn.close()
                return
            self.accepted += 1
            self.conn = conn
            with conn:
                try:
                    hello = hello_decoder.decode(recv_header(conn, 5.0, 5.0, False)[0])
                    mac = proof(self.key, hello.nonce, self.name, self.identity) if self.key \
                        else os.urandom(32)
                    conn.sendall(frame(ShmProof(SHM_WIRE_VERSION, mac)))
                    while True:
                        req = request_decoder.decode(recv_header(conn, 5.0, 5.0, False)[0])
                        self.requests.append(req.token)
                        conn.sendall(frame(ShmReply(SHM_WIRE_VERSION, STATUS_OK, 0)) + self.extra)
                except (OSError, ValueError, msgspec.DecodeError):
                    continue

    def endpoint(self, where: ShmLocality) -> bytes:
        return msgspec.msgpack.encode(ShmEndpoint(self.name, where, self.identity,
                                                  self.key or os.urandom(32), "fake", "h"))

    def grant(self, boot_id: str) -> bytes:
        return msgspec.msgpack.encode(ShmGrant(self.name, boot_id, "h", os.urandom(16), 0,
                                               BLOCK_BYTES, "fake"))

    def close(self) -> None:
        """Wake the thread (shut its connection down, connect once) and join it."""
        self.closed = True
        if self.conn is not None:
            try:
                self.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\0" + self.name)
        self.thread.join(DEADLINE_S)
        self.listener.close()
        assert not self.thread.is_alive()


@pytest.fixture
def fake():
    made: list[FakeProducer] = []

    def make(*args, **kw) -> FakeProducer:
        made.append(FakeProducer(*args, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_a_listener_without_the_declared_key_gets_no_request(planes, fake):
    """E.g. a process that took a dead producer's socket name: the proof fails, the grant's token
    is never sent, the transfer ends in ERR."""
    c = planes("cons")
    where = decode_locality(c.locality())
    impostor = fake(ID_A, key=None)  # answers with a random MAC
    declared_key = os.urandom(32)
    ep = msgspec.msgpack.encode(ShmEndpoint(impostor.name, where, ID_A, declared_key, "fake",
                                            "h"))
    binding = c.bind_peer(ep, peer="p:1", host="127.0.0.1", identity=ID_A)
    state, detail = _fetch(c, binding, impostor.grant(where.boot_id), [Run(0, 1)], 0)
    assert state is XferState.ERR and "not the shm plane" in detail
    assert impostor.requests == []
    assert c.stats["proof_failed"] == 1


def test_a_real_producer_with_another_key_is_refused(trio):
    a, _, c, _ = trio
    forged = _forged(decode_endpoint(a.endpoint()), key=os.urandom(32))
    binding = c.bind_peer(forged, peer="p:9", host="h", identity=ID_A)
    state, detail = _fetch(c, binding, a.describe([Run(0, 1)], 10), [Run(0, 1)], 10)
    assert state is XferState.ERR and "not the shm plane" in detail
    assert a.stats["served"] == 0


# -- stream hygiene --------------------------------------------------------------------------------
def test_connection_with_stray_bytes_is_not_reused(planes, fake):
    c = planes("cons")
    where = decode_locality(c.locality())
    key = os.urandom(32)
    noisy = fake(ID_A, key=key, extra=b"stray bytes after the reply")
    binding = c.bind_peer(noisy.endpoint(where), peer="p:1", host="h", identity=ID_A)
    for _ in range(2):
        state, detail = _fetch(c, binding, noisy.grant(where.boot_id), [Run(0, 1)], 0)
        assert state is XferState.DONE, detail
    assert noisy.accepted == 2, "a connection with unread bytes went back to the pool"
    assert c.stats["stray"] == 2


def test_clean_connection_is_reused(planes, fake):
    c = planes("cons")
    where = decode_locality(c.locality())
    quiet = fake(ID_A, key=os.urandom(32))
    binding = c.bind_peer(quiet.endpoint(where), peer="p:1", host="h", identity=ID_A)
    for _ in range(3):
        assert _fetch(c, binding, quiet.grant(where.boot_id), [Run(0, 1)], 0)[0] is \
            XferState.DONE
    assert quiet.accepted == 1 and len(quiet.requests) == 3


def test_producer_closes_a_connection_that_sends_a_bad_ack(planes):
    """Small ring (4 slots of 64 KiB), 8 chunks: after 4 progress records the producer waits for
    ack bytes; anything but 0x01 ends the connection."""
    p = planes("prod", segment_bytes=256 << 10, chunk_bytes=64 << 10)
    nbytes = 8 * BLOCK_BYTES
    grant = grant_decoder.decode(p.describe([Run(0, 8)], nbytes))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(DEADLINE_S)
        s.connect("\0" + p.socket_name)
        s.sendall(frame(ShmHello(SHM_WIRE_VERSION, os.urandom(16))))
        proof_decoder.decode(recv_header(s, DEADLINE_S, DEADLINE_S, False)[0])
        from ectransport_shm.wire import ShmRequest

        s.sendall(frame(ShmRequest(SHM_WIRE_VERSION, grant.token, b"")))
        body, fds = recv_header(s, DEADLINE_S, DEADLINE_S, True)
        for fd in fds:
            os.close(fd)
        assert reply_decoder.decode(body).nbytes == nbytes
        got = b""
        while len(got) < 4 * 8:
            got += s.recv(4 * 8 - len(got))
        s.sendall(b"\x02")  # not an ack
        rest = b""
        while chunk := s.recv(4096):  # EOF ends this (bounded by the socket timeout)
            rest += chunk
        assert rest == b""
    assert p.stats["bad"] == 1 and p.stats["served"] == 0


def test_round_trip_after_binding_is_byte_exact(trio):
    a, _, c, bound_a = trio
    nbytes = 40 * BLOCK_BYTES - 7
    data = pattern(nbytes, 9)
    region_of(a).write([Run(0, 40)], data)
    grant = a.describe([Run(0, 40)], nbytes)
    state, detail = _fetch(c, bound_a, grant, [Run(20, 40)], nbytes)
    assert state is XferState.DONE, detail
    assert_same(read_runs(region_of(c), [Run(20, 40)], nbytes), data)
