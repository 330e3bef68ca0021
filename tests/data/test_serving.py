"""Shared pieces of the request-serving planes (tcp, ucx, shm): the producer's notification queue,
the unread-bytes check before pooling a connection, the pool's scopes."""

import select
import socket
import threading

from ectransport.data.serving import ConnectionPool, Notifications, unread_state


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
        select.select([a], [], [], 5.0)
        assert unread_state(a) == "pending"
        assert a.recv(2) == b"xy"  # peeked, not consumed
        b.close()
        select.select([a], [], [], 5.0)
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
