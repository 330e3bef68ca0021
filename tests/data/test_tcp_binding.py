"""TcpPlane under plugin API 2 (issue 17): grants bound to the producer that declared them, and
stream hygiene against a hostile producer (plain sockets in a thread) that pushes extra bytes,
pushes bytes ahead of a request, or announces more bytes than it granted. After each, a transfer
from an honest producer plane works and gets exactly its bytes."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from ectransport.data.base import MAX_ENDPOINT_BYTES, XferState, identity_of
from ectransport.data.serving import unread_state
from ectransport.data.tcp import (
    STATUS_OK,
    TCP_WIRE_VERSION,
    TcpEndpoint,
    TcpGrant,
    TcpPlane,
    TcpReply,
    TcpRequest,
)
from ectransport.errors import DataPlaneError
from ectransport.store import HostRegion, Run
from ectransport.testing.conformance import notif_arrives, pattern, read_runs, wait_state
from tests.conftest import readable

BLOCK = 64 * 1024
NUM_BLOCKS = 1100
DEADLINE_S = 10.0
FAST = {"io_timeout_s": 2.0, "connect_timeout_s": 2.0}
HONEST_ID = identity_of("H" * 40)
EVIL_ID = identity_of("E" * 40)
CONSUMER_ID = identity_of("C" * 40)


@pytest.fixture
def regions():
    prod, cons = HostRegion(NUM_BLOCKS, BLOCK), HostRegion(NUM_BLOCKS, BLOCK)
    yield prod, cons
    prod.close()
    cons.close()


@pytest.fixture
def planes(regions):
    prod_region, cons_region = regions
    producer = TcpPlane(node_id="enc0", region=prod_region, identity=HONEST_ID, **FAST)
    consumer = TcpPlane(node_id="pd0", region=cons_region, identity=CONSUMER_ID, **FAST)
    yield producer, consumer, prod_region, cons_region
    consumer.close()
    producer.close()


def _bind(consumer: TcpPlane, producer: TcpPlane, identity: str = HONEST_ID):
    return consumer.bind_peer(producer.endpoint(), peer=f"127.0.0.1:{producer.port + 1}",
                              host="127.0.0.1", identity=identity)


def _honest_round_trip(producer, consumer, prod_region, cons_region, binding, seed: int,
                       nbytes: int = 3 * BLOCK - 1) -> None:
    """A transfer from the honest producer gets exactly its bytes."""
    runs, cons_runs = [Run(10, 3)], [Run(900, 3)]
    data = pattern(nbytes, seed)
    prod_region.write(runs, data)
    notif = f"honest-{seed}".encode()
    h = consumer.start(binding, producer.describe(runs, nbytes), cons_runs, nbytes, notif)
    try:
        assert wait_state(consumer, h, DEADLINE_S) is XferState.DONE, h.detail
    finally:
        consumer.release(h)
    assert np.array_equal(read_runs(cons_region, cons_runs, nbytes), data)
    assert notif_arrives(producer, notif, DEADLINE_S)


# -- declaration and binding -----------------------------------------------------------------------
def test_endpoint_declares_where_and_who(planes):
    producer = planes[0]
    raw = producer.endpoint()
    assert isinstance(raw, bytes) and len(raw) <= MAX_ENDPOINT_BYTES
    decl = msgspec.msgpack.decode(raw, type=TcpEndpoint)
    assert (decl.v, decl.host, decl.port, decl.node, decl.identity) == (
        1, "127.0.0.1", producer.port, "enc0", HONEST_ID)


def test_bound_round_trip_and_refused_declarations(planes):
    producer, consumer, prod_region, cons_region = planes
    binding = _bind(consumer, producer)
    _honest_round_trip(producer, consumer, prod_region, cons_region, binding, seed=1)
    with pytest.raises(DataPlaneError, match="identity"):
        _bind(consumer, producer, identity=EVIL_ID)
    with pytest.raises(DataPlaneError, match="dialed"):
        consumer.bind_peer(producer.endpoint(), peer="x:1", host="192.0.2.77", identity=HONEST_ID)
    with pytest.raises(DataPlaneError, match="malformed"):
        consumer.bind_peer(b"\x01garbage", peer="x:1", host="127.0.0.1", identity=HONEST_ID)
    assert consumer.bind_peer(b"", peer="x:1", host="127.0.0.1", identity=HONEST_ID) is None


def test_a_grant_outside_the_binding_never_connects(regions):
    """A hostile producer (its own plane, bound) hands out a grant naming another producer's
    listener, or an unrelated port: start refuses before any connection is attempted."""
    prod_region, cons_region = regions
    evil = TcpPlane(node_id="evil", region=prod_region, identity=EVIL_ID)
    honest_region = HostRegion(16, BLOCK)
    honest = TcpPlane(node_id="enc0", region=honest_region, identity=HONEST_ID)
    consumer = TcpPlane(node_id="pd0", region=cons_region, **FAST)
    bystander = socket.create_server(("127.0.0.1", 0))
    bystander.setblocking(False)
    try:
        binding = _bind(consumer, evil, identity=EVIL_ID)
        forged = {
            "another producer": honest.describe([Run(0, 1)], BLOCK),
            "unrelated port": msgspec.msgpack.encode(TcpGrant(
                "127.0.0.1", bystander.getsockname()[1], b"t" * 16, BLOCK, BLOCK, "evil")),
            "same port, other host name": msgspec.msgpack.encode(TcpGrant(
                "localhost", evil.port, b"t" * 16, BLOCK, BLOCK, "evil")),
            "another node's name": msgspec.msgpack.encode(TcpGrant(
                "127.0.0.1", evil.port, b"t" * 16, BLOCK, BLOCK, "enc0")),
        }
        for label, grant in forged.items():
            with pytest.raises(DataPlaneError, match="declared"):
                consumer.start(binding, grant, [Run(0, 1)], BLOCK, b"")
            assert label  # (for the traceback)
        with pytest.raises(BlockingIOError):
            bystander.accept()  # nothing connected to the unrelated port
        assert honest.stats["accepted"] == 0  # nor to the other producer
        # the honest producer's own binding still works, and the hostile one's grants too
        _honest_round_trip(honest, consumer, honest_region, cons_region, _bind(consumer, honest),
                           seed=2, nbytes=BLOCK)
    finally:
        bystander.close()
        consumer.close()
        honest.close()
        evil.close()
        honest_region.close()


def test_unbound_grants_are_served_with_one_warning(planes, caplog):
    producer, consumer, prod_region, cons_region = planes
    with caplog.at_level(logging.WARNING, logger="ectransport.data.tcp"):
        _honest_round_trip(producer, consumer, prod_region, cons_region, None, seed=3)
        _honest_round_trip(producer, consumer, prod_region, cons_region, None, seed=4)
    warnings = [r for r in caplog.records if "without a session binding" in r.getMessage()]
    assert len(warnings) == 1


def test_each_binding_has_its_own_connections_and_unbind_closes_them(planes):
    producer, consumer, prod_region, cons_region = planes
    first, second = _bind(consumer, producer), _bind(consumer, producer)
    _honest_round_trip(producer, consumer, prod_region, cons_region, first, seed=5)
    _honest_round_trip(producer, consumer, prod_region, cons_region, first, seed=6)
    assert producer.stats["accepted"] == 1  # pooled within the session
    _honest_round_trip(producer, consumer, prod_region, cons_region, second, seed=7)
    assert producer.stats["accepted"] == 2  # never shared across sessions
    consumer.unbind_peer(first)
    consumer.unbind_peer(first)  # idempotent
    consumer.unbind_peer(None)  # not a binding: no-op
    _honest_round_trip(producer, consumer, prod_region, cons_region, second, seed=8)
    assert producer.stats["accepted"] == 2
    rebound = _bind(consumer, producer)
    _honest_round_trip(producer, consumer, prod_region, cons_region, rebound, seed=9)
    assert producer.stats["accepted"] == 3


# -- hostile producer ------------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _frame(msg) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return len(body).to_bytes(4, "big") + body


def _ok(nbytes: int) -> bytes:
    return _frame(TcpReply(TCP_WIRE_VERSION, STATUS_OK, nbytes))


def _closed_by_peer(conn: socket.socket, timeout_s: float = DEADLINE_S) -> bool:
    """Whether the consumer closed ``conn`` (EOF or reset) within ``timeout_s``; data it might
    still send is read and dropped."""
    conn.settimeout(timeout_s)
    try:
        while conn.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


class HostileProducer:
    """A plain-socket producer that declares itself like a TcpPlane and answers by ``script``.

    ``script(conn, index)`` runs for the ``index``-th accepted connection on the server thread;
    whatever it returns or raises is recorded in ``results`` (``index`` → value or exception).
    """

    def __init__(self, script: Callable[[socket.socket, int], object]):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.script = script
        self.results: dict[int, object] = {}
        self.finished = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True, name="hostile-producer")
        self.thread.start()

    def endpoint(self) -> bytes:
        return msgspec.msgpack.encode(TcpEndpoint(1, "127.0.0.1", self.port, "evil", EVIL_ID))

    def grant(self, nbytes: int, token: bytes = b"t" * 16) -> bytes:
        runs_bytes = max(1, -(-nbytes // BLOCK)) * BLOCK
        return msgspec.msgpack.encode(TcpGrant("127.0.0.1", self.port, token, nbytes,
                                               runs_bytes, "evil"))

    def wait_result(self, index: int, timeout_s: float = DEADLINE_S) -> object:
        with self.finished:
            assert self.finished.wait_for(lambda: index in self.results, timeout_s), \
                f"the hostile producer's connection {index} did not finish"
            return self.results[index]

    def _run(self) -> None:
        index = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._one, args=(conn, index), daemon=True).start()
            index += 1

    def _one(self, conn: socket.socket, index: int) -> None:
        try:
            with conn:
                conn.settimeout(DEADLINE_S)
                result: object = self.script(conn, index)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
            result = exc
        with self.finished:
            self.results[index] = result
            self.finished.notify_all()

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.thread.join(DEADLINE_S)


def read_request(conn: socket.socket) -> TcpRequest:
    n = int.from_bytes(_recv_exact(conn, 4), "big")
    return msgspec.msgpack.decode(_recv_exact(conn, n), type=TcpRequest)


@pytest.fixture
def hostile_env(planes):
    """(make_hostile, honest producer, consumer, prod_region, cons_region, honest binding)."""
    producer, consumer, prod_region, cons_region = planes
    made: list[HostileProducer] = []

    def make(script) -> tuple[HostileProducer, object]:
        fake = HostileProducer(script)
        made.append(fake)
        binding = consumer.bind_peer(fake.endpoint(), peer=f"127.0.0.1:{fake.port + 1}",
                                     host="127.0.0.1", identity=EVIL_ID)
        return fake, binding

    yield make, producer, consumer, prod_region, cons_region, _bind(consumer, producer)
    for fake in made:
        fake.close()


def test_extra_bytes_after_a_reply_fail_the_transfer(hostile_env):
    make, producer, consumer, prod_region, cons_region, honest = hostile_env
    nbytes = 1000

    def script(conn, index):
        read_request(conn)
        payload = b"\xab" * nbytes
        conn.sendall(_ok(nbytes) + payload[:-1])
        # the last payload byte and the extra bytes in one segment: both are there together
        conn.sendall(payload[-1:] + b"\xcd" * 64)
        return _closed_by_peer(conn)

    fake, binding = make(script)
    cons_region.buf[:] = 0
    # meanwhile a large transfer from the honest producer runs; it must not be disturbed
    big_runs, big = [Run(0, 512)], 512 * BLOCK
    big_data = pattern(big, 77)
    prod_region.write(big_runs, big_data)
    hb = consumer.start(honest, producer.describe(big_runs, big), [Run(500, 512)], big, b"")
    h = consumer.start(binding, fake.grant(nbytes), [Run(0, 1)], nbytes, b"")
    assert wait_state(consumer, h, DEADLINE_S) is XferState.ERR
    assert "more than the 1000 bytes granted" in h.detail
    consumer.release(h)
    assert fake.wait_result(0) is True, "the consumer kept the out-of-sync connection"
    assert wait_state(consumer, hb, DEADLINE_S) is XferState.DONE, hb.detail
    consumer.release(hb)
    assert np.array_equal(read_runs(cons_region, [Run(500, 512)], big), big_data)
    assert not (cons_region.buf[:500 * BLOCK] == 0xCD).any()  # no extra byte landed
    _honest_round_trip(producer, consumer, prod_region, cons_region, honest, seed=10)


def test_bytes_pushed_ahead_of_a_request_are_never_taken_for_its_reply(hostile_env):
    """Issue 17 item 3: the producer serves one request, then, while the connection sits in the
    consumer's pool, pushes a complete forged reply for "the next fetch". The next fetch must not
    take it: the poisoned connection is closed and a fresh one is used."""
    make, producer, consumer, prod_region, cons_region, honest = hostile_env
    nbytes = 2 * BLOCK
    pushed = threading.Event()
    push_now = threading.Event()

    def script(conn, index):
        read_request(conn)
        conn.sendall(_ok(nbytes) + b"\x11" * nbytes)  # honest answer to request 1 (or 2)
        if index == 0:
            assert push_now.wait(DEADLINE_S)
            conn.sendall(_ok(nbytes) + b"\x66" * nbytes)  # forged reply, nobody asked
            pushed.set()
            return _closed_by_peer(conn)
        return _closed_by_peer(conn)

    fake, binding = make(script)
    cons_region.buf[:] = 0
    h1 = consumer.start(binding, fake.grant(nbytes), [Run(0, 2)], nbytes, b"")
    assert wait_state(consumer, h1, DEADLINE_S) is XferState.DONE, h1.detail
    h1.thread.join(DEADLINE_S)  # the connection is back in the pool
    consumer.release(h1)
    key = (binding.scope, "127.0.0.1", fake.port)
    pooled = [c.sock for c in consumer._pool._idle[key]]  # noqa: SLF001 - white box
    assert len(pooled) == 1
    push_now.set()
    assert pushed.wait(DEADLINE_S)
    readable(pooled[0], DEADLINE_S)  # the forged bytes are there
    assert unread_state(pooled[0]) == "pending"
    h2 = consumer.start(binding, fake.grant(nbytes), [Run(10, 2)], nbytes, b"")
    assert wait_state(consumer, h2, DEADLINE_S) is XferState.DONE, h2.detail
    consumer.release(h2)
    assert (cons_region.buf[10 * BLOCK:12 * BLOCK] == 0x11).all(), "forged bytes were taken"
    assert not (cons_region.buf == 0x66).any()
    assert fake.wait_result(0) is True, "the poisoned connection was not closed"
    _honest_round_trip(producer, consumer, prod_region, cons_region, honest, seed=11)


def test_bytes_pushed_before_the_first_request_never_reach_the_next_fetch(hostile_env):
    """A producer that pushes a reply as soon as it accepts, then answers the request as well:
    the stream holds two replies. The first fetch reads one of them (ERR if it sees the second one
    waiting, else DONE with that producer's own bytes: nothing on the wire tells them apart), but
    the left-over reply is never taken for the next fetch's: that connection is closed."""
    make, producer, consumer, prod_region, cons_region, honest = hostile_env
    nbytes = 1000
    second_sent = threading.Event()

    def script(conn, index):
        if index == 0:
            conn.sendall(_ok(nbytes) + b"\x66" * nbytes)  # before reading anything
            read_request(conn)
            conn.sendall(_ok(nbytes) + b"\x66" * nbytes)
            second_sent.set()
        else:
            read_request(conn)
            conn.sendall(_ok(nbytes) + b"\x11" * nbytes)
        return _closed_by_peer(conn)

    fake, binding = make(script)
    cons_region.buf[:] = 0
    h = consumer.start(binding, fake.grant(nbytes), [Run(0, 1)], nbytes, b"")
    assert wait_state(consumer, h, DEADLINE_S) in (XferState.ERR, XferState.DONE)
    h.thread.join(DEADLINE_S)
    consumer.release(h)
    assert second_sent.wait(DEADLINE_S)
    key = (binding.scope, "127.0.0.1", fake.port)
    pooled = [c.sock for c in consumer._pool._idle.get(key, [])]  # noqa: SLF001 - white box
    if pooled:  # DONE and pooled before the second reply came: wait until it is there
        readable(pooled[0], DEADLINE_S)
        assert unread_state(pooled[0]) == "pending"
    h2 = consumer.start(binding, fake.grant(nbytes), [Run(10, 1)], nbytes, b"")
    assert wait_state(consumer, h2, DEADLINE_S) is XferState.DONE, h2.detail
    consumer.release(h2)
    assert (cons_region.buf[10 * BLOCK:10 * BLOCK + nbytes] == 0x11).all(), \
        "a left-over reply was taken for the next fetch's"
    assert fake.wait_result(0) is True, "the out-of-sync connection was not closed"
    _honest_round_trip(producer, consumer, prod_region, cons_region, honest, seed=12)


def test_a_reply_larger_than_the_grant_is_not_read(hostile_env):
    make, producer, consumer, prod_region, cons_region, honest = hostile_env
    nbytes = 4 * BLOCK

    def script(conn, index):
        read_request(conn)
        try:
            conn.sendall(_ok(nbytes + BLOCK) + b"\xcd" * (nbytes + BLOCK))
        except OSError:
            return True  # the consumer closed while we sent: fine
        return _closed_by_peer(conn)

    fake, binding = make(script)
    cons_region.buf[:] = 0
    h = consumer.start(binding, fake.grant(nbytes), [Run(0, 4)], nbytes, b"")
    assert wait_state(consumer, h, DEADLINE_S) is XferState.ERR
    assert f"expected {nbytes}" in h.detail
    consumer.release(h)
    assert fake.wait_result(0) is True, "the connection was kept"
    assert not (cons_region.buf == 0xCD).any(), "bytes of an oversized reply landed"
    _honest_round_trip(producer, consumer, prod_region, cons_region, honest, seed=13)
