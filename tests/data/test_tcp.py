"""TcpPlane specifics on loopback: hostile clients, revoke mid-transfer, connection reuse, fake
producers that stall or die, a producer in another process. The generic contract is covered by
tests/data/test_conformance.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import msgspec
import numpy as np
import pytest

from ectransport.data.base import TransferModel, XferState
from ectransport.data.tcp import (
    MAX_HEADER_BYTES,
    MAX_NOTIF_BYTES,
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_GRANT,
    TCP_WIRE_VERSION,
    TcpGrant,
    TcpPlane,
    TcpReply,
    TcpRequest,
)
from ectransport.errors import ConfigError, DataPlaneError
from ectransport.store import HostRegion, Run
from ectransport.testing.conformance import notif_arrives, pattern, read_runs, wait_state

BLOCK = 64 * 1024
NUM_BLOCKS = 1100
DEADLINE_S = 10.0
FAST = {"io_timeout_s": 0.5, "connect_timeout_s": 2.0}


@pytest.fixture
def regions():
    prod, cons = HostRegion(NUM_BLOCKS, BLOCK), HostRegion(NUM_BLOCKS, BLOCK)
    yield prod, cons
    prod.close()
    cons.close()


@pytest.fixture
def planes(regions):
    prod_region, cons_region = regions
    producer = TcpPlane(node_id="enc0", region=prod_region, **FAST)
    consumer = TcpPlane(node_id="pd0", region=cons_region, **FAST)
    yield producer, consumer, prod_region, cons_region
    consumer.close()
    producer.close()


def _frame(msg) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return len(body).to_bytes(4, "big") + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _read_reply(sock: socket.socket) -> TcpReply:
    n = int.from_bytes(_recv_exact(sock, 4), "big")
    assert 0 < n <= MAX_HEADER_BYTES
    return msgspec.msgpack.decode(_recv_exact(sock, n), type=TcpReply)


def _raw(plane: TcpPlane, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection((plane.host, plane.port), timeout=timeout_s)


def _round_trip(producer, consumer, prod_region, cons_region, prod_runs, cons_runs, nbytes, seed):
    data = pattern(nbytes, seed)
    prod_region.write(prod_runs, data)
    notif = f"n{seed}".encode()
    grant = producer.describe(prod_runs, nbytes)
    h = consumer.start(None, grant, cons_runs, nbytes, notif)
    try:
        assert wait_state(consumer, h, DEADLINE_S) is XferState.DONE, h.detail
    finally:
        consumer.release(h)
    assert np.array_equal(read_runs(cons_region, cons_runs, nbytes), data)
    assert notif_arrives(producer, notif, DEADLINE_S)
    return grant


def _request(token: bytes, notif: bytes = b"") -> bytes:
    return _frame(TcpRequest(TCP_WIRE_VERSION, token, notif))


# -- hostile clients ------------------------------------------------------------------------------
def test_garbage_clients_do_not_hurt_the_producer(planes):
    producer, consumer, prod_region, cons_region = planes
    good = msgspec.msgpack.decode(producer.describe([Run(0, 1)], 10), type=TcpGrant)
    bad_headers = {
        "huge length": (0xFFFFFFFF).to_bytes(4, "big"),
        "zero length": (0).to_bytes(4, "big"),
        "one over the limit": (MAX_HEADER_BYTES + 1).to_bytes(4, "big"),
        "not msgpack": (5).to_bytes(4, "big") + b"\xc1\xc1\xc1\xc1\xc1",
        "wrong struct": _frame(TcpReply(TCP_WIRE_VERSION, 0, 0)),
        "wrong version": _frame(TcpRequest(TCP_WIRE_VERSION + 1, good.token, b"")),
        "notif too long": _frame(TcpRequest(TCP_WIRE_VERSION, good.token,
                                            b"x" * (MAX_NOTIF_BYTES + 1))),
        "unknown field": _frame({"type": "req", "v": 1, "token": good.token, "notif": b"",
                                 "evil": 1}),
    }
    for label, payload in bad_headers.items():
        with _raw(producer) as s:
            s.sendall(payload)
            reply = _read_reply(s)
            assert reply.status == STATUS_BAD_REQUEST, label
            assert s.recv(1) == b"", f"{label}: connection not closed"
    rng = np.random.default_rng(5)
    for _ in range(30):  # random bytes, random lengths; the producer answers or hangs up
        with _raw(producer) as s:
            try:
                s.sendall(rng.bytes(int(rng.integers(1, 64))))
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):
                    pass
            except OSError:
                pass  # the producer hung up with our garbage unread: a reset
    for cut in (1, 3, 6):  # a truncated header, then EOF
        with _raw(producer) as s:
            s.sendall(_request(good.token)[:cut])
    with _raw(producer):
        pass  # connect and leave
    assert producer.poll_notifications() == []  # nothing was served
    _round_trip(producer, consumer, prod_region, cons_region, [Run(0, 3)], [Run(5, 3)],
                3 * BLOCK - 1, seed=1)
    assert producer.stats["bad"] >= len(bad_headers)


def test_unknown_token_gets_a_status_and_keeps_the_connection(planes):
    producer = planes[0]
    with _raw(producer) as s:
        for _ in range(3):
            s.sendall(_request(os.urandom(16)))
            assert _read_reply(s).status == STATUS_UNKNOWN_GRANT
        grant = msgspec.msgpack.decode(producer.describe([Run(0, 1)], 5), type=TcpGrant)
        s.sendall(_request(grant.token, b"hi"))
        reply = _read_reply(s)
        assert (reply.status, reply.nbytes) == (STATUS_OK, 5)
        assert len(_recv_exact(s, 5)) == 5
    assert notif_arrives(producer, b"hi", DEADLINE_S)


def test_stalled_clients_are_dropped_and_connections_bounded(regions):
    prod_region, cons_region = regions
    producer = TcpPlane(node_id="enc0", region=prod_region, io_timeout_s=0.3,
                        idle_timeout_s=0.6, max_connections=2)
    consumer = TcpPlane(node_id="pd0", region=cons_region, **FAST)
    try:
        slow = _raw(producer)
        slow.sendall(b"\x00\x00")  # half a length prefix, then nothing: dropped after 0.3 s
        idle = _raw(producer)  # sends nothing: dropped after the 0.6 s idle timeout
        time.sleep(0.1)
        third = _raw(producer)  # over max_connections: closed at once
        assert third.recv(1) == b""
        third.close()
        for s in (slow, idle):
            s.settimeout(5.0)
            t0 = time.monotonic()
            assert s.recv(1) == b""
            assert time.monotonic() - t0 < 3.0
            s.close()
        assert producer.stats["refused"] >= 1
        _round_trip(producer, consumer, prod_region, cons_region, [Run(0, 2)], [Run(0, 2)],
                    2 * BLOCK, seed=2)
    finally:
        consumer.close()
        producer.close()


# -- revoke ----------------------------------------------------------------------------------------
def test_revoke_aborts_a_send_in_progress_and_serves_nothing_after(planes):
    producer, _, prod_region, _ = planes
    nbytes = 1024 * BLOCK  # 64 MiB: far more than the socket buffers hold
    runs = [Run(0, 1024)]
    data = pattern(nbytes, 3)
    prod_region.write(runs, data)
    plane_grant = producer.describe(runs, nbytes)
    grant = msgspec.msgpack.decode(plane_grant, type=TcpGrant)
    s = _raw(producer)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    try:
        s.sendall(_request(grant.token, b"never"))
        reply = _read_reply(s)
        assert (reply.status, reply.nbytes) == (STATUS_OK, nbytes)
        head = _recv_exact(s, 1000)  # the send has begun; the client now stops reading
        time.sleep(0.2)  # the producer blocks on full socket buffers
        t0 = time.monotonic()
        producer.revoke(plane_grant)
        assert time.monotonic() - t0 < 2.0, "revoke waited for the consumer"
        prod_region.buf[: nbytes] = 0x55  # the blocks are re-used at once
        got = bytearray(head)
        while chunk := s.recv(1 << 20):  # drain to EOF: only pre-revoke bytes may come
            got += chunk
        assert 1000 <= len(got) < nbytes
        assert bytes(got) == data[: len(got)].tobytes(), "bytes served after revoke"
    finally:
        s.close()
    assert producer.stats["aborted"] == 1
    assert producer.poll_notifications() == []
    with _raw(producer) as s2:  # a later request for it is refused
        s2.sendall(_request(grant.token))
        assert _read_reply(s2).status == STATUS_UNKNOWN_GRANT


def test_revoked_grant_ends_in_err_at_the_consumer(planes):
    producer, consumer, *_ = planes
    plane_grant = producer.describe([Run(0, 2)], 2 * BLOCK)
    producer.revoke(plane_grant)
    h = consumer.start(None, plane_grant, [Run(0, 2)], 2 * BLOCK, b"x")
    assert wait_state(consumer, h, DEADLINE_S) is XferState.ERR
    assert "status 1" in h.detail
    consumer.release(h)


# -- connections -----------------------------------------------------------------------------------
def test_connections_are_pooled_and_reused(planes):
    producer, consumer, prod_region, cons_region = planes
    for i in range(5):
        grant = _round_trip(producer, consumer, prod_region, cons_region, [Run(i, 1)],
                            [Run(10 + i, 1)], BLOCK - i, seed=10 + i)
        producer.revoke(grant)  # as the node does on the notification: the connection stays
    assert producer.stats["accepted"] == 1
    assert producer.stats["aborted"] == 0
    assert producer.stats["served"] == 5
    # concurrent transfers open more connections, which then stay pooled
    hs = [consumer.start(None, producer.describe([Run(100 * i, 50)], 50 * BLOCK),
                         [Run(100 * i, 50)], 50 * BLOCK, b"c") for i in range(4)]
    assert all(wait_state(consumer, h, DEADLINE_S) is XferState.DONE for h in hs)
    for h in hs:
        consumer.release(h)
    accepted = producer.stats["accepted"]
    assert accepted <= 4
    for i in range(4):
        _round_trip(producer, consumer, prod_region, cons_region, [Run(i, 1)], [Run(10, 1)],
                    BLOCK, seed=20 + i)
    assert producer.stats["accepted"] == accepted


def test_stale_pooled_connection_is_retried_transparently(regions):
    prod_region, cons_region = regions
    producer = TcpPlane(node_id="enc0", region=prod_region, idle_timeout_s=0.2)
    consumer = TcpPlane(node_id="pd0", region=cons_region, **FAST)
    try:
        _round_trip(producer, consumer, prod_region, cons_region, [Run(0, 1)], [Run(0, 1)],
                    BLOCK, seed=30)
        time.sleep(0.6)  # the producer drops the idle pooled connection
        _round_trip(producer, consumer, prod_region, cons_region, [Run(1, 1)], [Run(1, 1)],
                    BLOCK, seed=31)
        assert producer.stats["accepted"] == 2
        consumer.forget_peer("enc0")  # drops the pooled connection
        consumer.forget_peer("nobody")
        _round_trip(producer, consumer, prod_region, cons_region, [Run(2, 1)], [Run(2, 1)],
                    BLOCK, seed=32)
        assert producer.stats["accepted"] == 3
    finally:
        consumer.close()
        producer.close()


# -- fake producers --------------------------------------------------------------------------------
class _FakeProducer:
    """A listener that answers one request with ``reply`` then ``send`` bytes, then ``then``."""

    def __init__(self, reply: bytes, send: int, then: str):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply, self.send, self.then = reply, send, then
        self.go_on = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def grant(self, nbytes: int, runs_bytes: int) -> bytes:
        return msgspec.msgpack.encode(TcpGrant("127.0.0.1", self.port, b"t" * 16, nbytes,
                                               runs_bytes))

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            n = int.from_bytes(_recv_exact(conn, 4), "big")
            _recv_exact(conn, n)
            conn.sendall(self.reply + b"\xab" * self.send)
            if self.then == "stall":
                self.go_on.wait(10.0)
                try:
                    conn.sendall(b"\xcd" * (1 << 20))  # after the consumer released
                except OSError:
                    pass

    def close(self) -> None:
        self.go_on.set()
        self.thread.join(10.0)
        self.sock.close()


@pytest.mark.parametrize("then", ["close", "stall"])
def test_a_producer_that_dies_or_stalls_mid_stream_ends_in_err(planes, then):
    _, consumer, _, cons_region = planes
    nbytes = 16 * BLOCK
    fake = _FakeProducer(_frame(TcpReply(TCP_WIRE_VERSION, STATUS_OK, nbytes)), BLOCK, then)
    try:
        cons_region.buf[:] = 0
        t0 = time.monotonic()
        h = consumer.start(None, fake.grant(nbytes, nbytes), [Run(0, 16)], nbytes, b"")
        assert wait_state(consumer, h, DEADLINE_S) is XferState.ERR  # EOF, or io_timeout_s
        assert time.monotonic() - t0 < 5.0
        consumer.release(h)
        fake.go_on.set()
        time.sleep(0.1)
        assert not (cons_region.buf == 0xCD).any()
        assert (cons_region.buf[:BLOCK] == 0xAB).all()
    finally:
        fake.close()


def test_release_mid_transfer_stops_landing(planes):
    _, consumer, _, cons_region = planes
    nbytes = 64 * BLOCK
    fake = _FakeProducer(_frame(TcpReply(TCP_WIRE_VERSION, STATUS_OK, nbytes)), BLOCK, "stall")
    try:
        cons_region.buf[:] = 0
        h = consumer.start(None, fake.grant(nbytes, nbytes), [Run(0, 64)], nbytes, b"")
        end = time.monotonic() + DEADLINE_S
        while cons_region.buf[BLOCK - 1] != 0xAB and time.monotonic() < end:
            time.sleep(0.001)
        assert consumer.check(h) is XferState.PROC
        consumer.release(h)
        assert consumer.check(h) is XferState.ERR
        fake.go_on.set()  # the fake producer now sends more: none of it may land
        time.sleep(0.2)
        assert not (cons_region.buf == 0xCD).any()
        consumer.release(h)
    finally:
        fake.close()


def test_bad_reply_and_unreachable_producer(planes):
    _, consumer, *_ = planes
    fake = _FakeProducer(_frame(TcpReply(TCP_WIRE_VERSION, STATUS_OK, 7)), 7, "close")
    try:  # announces a size other than the grant's
        h = consumer.start(None, fake.grant(BLOCK, BLOCK), [Run(0, 1)], BLOCK, b"")
        assert wait_state(consumer, h, DEADLINE_S) is XferState.ERR
        assert "7 bytes" in h.detail
        consumer.release(h)
    finally:
        fake.close()
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    g = msgspec.msgpack.encode(TcpGrant("127.0.0.1", port, b"t" * 16, BLOCK, BLOCK))
    h = consumer.start(None, g, [Run(0, 1)], BLOCK, b"")
    assert wait_state(consumer, h, DEADLINE_S) is XferState.ERR
    consumer.release(h)


# -- grants, options, declarations -----------------------------------------------------------------
def test_start_validates_the_grant(planes):
    producer, consumer, *_ = planes
    good = msgspec.msgpack.decode(producer.describe([Run(0, 2)], 2 * BLOCK - 3), type=TcpGrant)
    enc = msgspec.msgpack.encode
    for bad in (
        enc(msgspec.structs.replace(good, token=b"short")),
        enc(msgspec.structs.replace(good, port=0)),
        enc(msgspec.structs.replace(good, nbytes=-1)),
        enc({"type": "nixl/1", "agent": "x"}),
    ):
        with pytest.raises(DataPlaneError, match="malformed"):
            consumer.start(None, bad, [Run(0, 2)], 2 * BLOCK - 3, b"")
    with pytest.raises(DataPlaneError, match="same block_bytes"):  # payload size differs
        consumer.start(None, enc(good), [Run(0, 2)], 2 * BLOCK - 4, b"")
    with pytest.raises(DataPlaneError, match="notif"):
        consumer.start(None, enc(good), [Run(0, 2)], 2 * BLOCK - 3, b"x" * (MAX_NOTIF_BYTES + 1))


def test_inflight_receives_are_bounded(regions):
    prod_region, cons_region = regions
    producer = TcpPlane(node_id="enc0", region=prod_region)
    consumer = TcpPlane(node_id="pd0", region=cons_region, max_inflight=1)
    try:
        g = producer.describe([Run(0, 512)], 512 * BLOCK)
        h = consumer.start(None, g, [Run(0, 512)], 512 * BLOCK, b"")
        with pytest.raises(DataPlaneError, match="max_inflight"):
            consumer.start(None, g, [Run(512, 512)], 512 * BLOCK, b"")
        consumer.release(h)
        h = consumer.start(None, g, [Run(512, 512)], 512 * BLOCK, b"")  # room again
        assert wait_state(consumer, h, DEADLINE_S) is XferState.DONE
        consumer.release(h)
    finally:
        consumer.close()
        producer.close()


def test_options_and_declarations(regions):
    region = regions[0]
    caps = TcpPlane.capabilities
    assert caps.transfer_model is TransferModel.PUSH
    assert caps.mem_kinds == frozenset({"DRAM"}) and caps.notifications
    assert TcpPlane.probe() == (True, "stdlib sockets")
    with pytest.raises(ConfigError, match="bogus"):
        TcpPlane(node_id="x", region=region, bogus=1)
    with pytest.raises(ConfigError, match="advertise_host"):
        TcpPlane(node_id="x", region=region, host="0.0.0.0")
    with pytest.raises(ConfigError, match="> 0"):
        TcpPlane(node_id="x", region=region, io_timeout_s=0)
    plane = TcpPlane(node_id="x", region=region, port=0)
    try:
        assert plane.describe_transport() == f"tcp 127.0.0.1:{plane.port}"
        with pytest.raises(ConfigError, match="cannot listen"):
            TcpPlane(node_id="y", region=region, port=plane.port)
    finally:
        plane.close()
    wide = TcpPlane(node_id="x", region=region, host="0.0.0.0", advertise_host="127.0.0.1")
    try:
        grant = msgspec.msgpack.decode(wide.describe([Run(0, 1)], 1), type=TcpGrant)
        assert (grant.host, grant.port, grant.node) == ("127.0.0.1", wide.port, "x")
    finally:
        wide.close()


class _NoBuf:
    """A RegionLike without ``buf``: the plane maps ``addr`` itself."""

    mem_kind = "DRAM"

    def __init__(self, region: HostRegion):
        self.addr, self.nbytes, self.block_bytes = region.addr, region.nbytes, region.block_bytes


def test_region_given_by_address_only(planes):
    producer, _, prod_region, cons_region = planes
    consumer = TcpPlane(node_id="raw", region=_NoBuf(cons_region))
    try:
        _round_trip(producer, consumer, prod_region, cons_region, [Run(3, 5)], [Run(9, 5)],
                    5 * BLOCK - 2, seed=40)
    finally:
        consumer.close()


# -- producer in another process -------------------------------------------------------------------
def _producer_process(conn, seed: int) -> None:
    """Child: serve one grant, report the notifications it received, exit when told."""
    region = HostRegion(16, BLOCK)
    plane = TcpPlane(node_id="enc-child", region=region)
    try:
        runs = [Run(1, 3), Run(9, 2)]
        nbytes = 5 * BLOCK - 11
        region.write(runs, pattern(nbytes, seed))
        conn.send((plane.describe(runs, nbytes), nbytes))
        got: list[bytes] = []
        end = time.monotonic() + 30.0
        while not got and time.monotonic() < end:
            got = plane.poll_notifications()
            time.sleep(0.005)
        conn.send(got)
        conn.poll(30.0)
    finally:
        plane.close()
        region.close()
        conn.close()


@pytest.mark.slow
def test_round_trip_with_a_producer_in_another_process(regions):
    _, cons_region = regions
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_process, args=(child, 1234), daemon=True)
    proc.start()
    consumer = TcpPlane(node_id="pd0", region=cons_region)
    try:
        assert parent.poll(15.0), "producer process sent no grant within 15 s"
        grant, nbytes = parent.recv()
        cons_runs = [Run(40, 1), Run(20, 4)]  # other boundaries than the producer's
        h = consumer.start(None, grant, cons_runs, nbytes, b"cross-process")
        assert wait_state(consumer, h, DEADLINE_S) is XferState.DONE, h.detail
        consumer.release(h)
        assert np.array_equal(read_runs(cons_region, cons_runs, nbytes), pattern(nbytes, 1234))
        assert parent.poll(DEADLINE_S), "producer process reported no notifications"
        assert parent.recv() == [b"cross-process"]
        parent.send("bye")
        proc.join(10.0)
        assert proc.exitcode == 0
    finally:
        consumer.close()
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        parent.close()
