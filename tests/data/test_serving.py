"""Shared pieces of the request-serving planes (tcp, ucx, shm): the producer's notification queue,
the grant registry and its revoke rule, framing, the unread-bytes check before pooling a
connection, the pool's scopes."""

import os
import socket
import threading

import pytest

from ectransport.data.framing import (
    PREFIX_BYTES,
    FrameError,
    PeerClosed,
    close_fds,
    frame,
    recv_frame,
    unread_state,
)
from ectransport.data.serving import ConnectionPool, GrantTable, Notifications
from ectransport.errors import DataPlaneError
from tests.conftest import readable


def test_empty_notif_means_none_requested_and_is_not_queued():
    q = Notifications()
    q.push(b"")  # the consumer asked for no notification (ECTP: XferDone completes the grant)
    q.push(b"1:s:m")
    q.push(b"2:s:m")
    assert q.drain() == [b"1:s:m", b"2:s:m"]
    assert q.drain() == []


def test_unread_state_tells_clean_pending_and_closed_without_blocking():
    a, b = socket.socketpair()
    try:
        a.settimeout(5.0)  # a timeout socket must not wait for readability
        assert unread_state(a) == "clean"
        assert a.gettimeout() == 5.0  # restored
        b.sendall(b"xy")
        readable(a, 5.0)
        assert unread_state(a) == "pending"
        assert a.recv(2) == b"xy"  # peeked, not consumed
        b.close()
        readable(a, 5.0)
        assert unread_state(a) == "closed"
    finally:
        a.close()
        b.close()


def test_pool_scopes_are_dropped_together():
    lock = threading.Lock()
    pool: ConnectionPool[tuple[int, str, int], str] = ConnectionPool(lock, max_idle_per_peer=1)
    with lock:
        assert pool.put_locked((1, "h", 1), "a")
        assert not pool.put_locked((1, "h", 1), "b")  # full
        assert pool.put_locked((2, "h", 1), "c")
        assert pool.drop_where_locked(lambda k: k[0] == 1) == ["a"]
    assert pool.take((1, "h", 1)) is None
    assert pool.take((2, "h", 1)) == "c"


# -- the grant registry and its revoke rule (every socket-serving plane: tcp, shm) ----------------
def _table(wait_s: float = 5.0) -> GrantTable:
    return GrantTable(threading.Lock(), "test plane", grace_s=0.05, wait_s=wait_s)


def test_revoke_shuts_down_a_step_that_does_not_end_and_returns_after_it():
    """A step blocked on its socket (a full buffer, a consumer that stopped reading) is woken by
    a shutdown of the sending connection; revoke returns only once the step ended."""
    table = _table()
    token = table.add([memoryview(b"abc")], 3)
    a, b = socket.socketpair()
    events: list[str] = []
    in_step, revoked = threading.Event(), threading.Event()
    served = table.begin(token, a)
    assert served is not None

    def sender() -> None:
        with served.step() as go:
            assert go
            in_step.set()
            events.append(f"woken {a.recv(1)!r}")  # blocks until the shutdown
        assert revoked.wait(5.0)
        with served.step() as go:
            events.append(f"next step {go}")
        table.end(served, a)

    t = threading.Thread(target=sender)
    t.start()
    try:
        assert in_step.wait(5.0)
        table.revoke(token)
        events.append("revoke returned")
        revoked.set()
        t.join(5.0)
        assert events == ["woken b''", "revoke returned", "next step False"]
        assert table.lookup(token) is None and table.begin(token, a) is None
    finally:
        a.close()
        b.close()


def test_revoke_after_a_send_keeps_its_connection():
    table = _table()
    token = table.add([memoryview(b"abc")], 3)
    a, b = socket.socketpair()
    try:
        served = table.begin(token, a)
        with served.step() as go:
            assert go
        table.end(served, a)
        table.revoke(token)
        table.revoke(token)  # twice, and unknown tokens: no-op
        table.revoke(None)
        a.sendall(b"x")  # still open both ways
        assert b.recv(1) == b"x"
        with served.step() as go:
            assert not go
    finally:
        a.close()
        b.close()


def test_closed_table_revokes_everything_and_registers_nothing():
    lock = threading.Lock()
    table = GrantTable(lock, "test plane", grace_s=0.05, wait_s=1.0)
    token = table.add([memoryview(b"abc")], 3)
    served = table.lookup(token)
    with lock:
        table.close_locked()
    assert served is not None and served.revoked and table.lookup(token) is None
    with pytest.raises(DataPlaneError, match="test plane is closed"):
        table.add([memoryview(b"abc")], 3)


# -- framing ---------------------------------------------------------------------------------------
def test_recv_frame_bounds_the_length_and_reports_eof():
    a, b = socket.socketpair()
    try:
        b.sendall((5).to_bytes(PREFIX_BYTES, "big") + b"hello")
        assert recv_frame(a, 5.0, 5.0, 5) == (b"hello", [])
        for length in (0, 6):
            b.sendall(length.to_bytes(PREFIX_BYTES, "big"))
            with pytest.raises(FrameError, match=f"header length {length} not in 1..5"):
                recv_frame(a, 5.0, 5.0, 5)
        b.sendall(b"\x00\x00")  # half a prefix, then EOF
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(PeerClosed):
            recv_frame(a, 5.0, 5.0, 5)
    finally:
        a.close()
        b.close()


def test_recv_frame_takes_descriptors_with_the_first_bytes():
    a, b = socket.socketpair(socket.AF_UNIX)
    r, w = os.pipe()
    try:
        socket.send_fds(b, [(3).to_bytes(PREFIX_BYTES, "big")], [w])
        b.sendall(b"abc")
        body, fds = recv_frame(a, 5.0, 5.0, 16, want_fds=True)
        assert body == b"abc" and len(fds) == 1
        os.write(fds[0], b"!")
        assert os.read(r, 1) == b"!"
        close_fds(fds)
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_unread_state_of_a_closed_socket():
    a, b = socket.socketpair()
    a.close()
    b.close()
    assert unread_state(a) == "closed"


def test_frame_is_the_length_prefixed_msgpack_body():
    from ectransport.data.tcp_wire import TcpReply

    data = frame(TcpReply(1, 0, 5))
    assert int.from_bytes(data[:PREFIX_BYTES], "big") == len(data) - PREFIX_BYTES
