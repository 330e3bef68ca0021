"""The in-memory control pair honours the control contract (ectransport.control.base) — the same
events, in the same order, as the ZeroMQ implementation — so node logic can be tested without
sockets, sleeps or signals (issue 15)."""

from __future__ import annotations

import threading

import pytest

from ectransport.control.base import AuthFailed, Down, Received, Up
from ectransport.control.memory import MemoryControlClient, MemoryControlServer, MemoryNetwork
from ectransport.errors import ConfigError


@pytest.fixture
def pair():
    net = MemoryNetwork()
    server = MemoryControlServer(net, "mem", 5601, allow=lambda key: key != "banned")
    client = MemoryControlClient(net, public_key="consumer-key")
    yield net, server, client
    client.close()
    server.close()


def test_connect_exchange_and_identity(pair):
    _, server, client = pair
    conn = client.connect("mem", 5601, None)
    assert client.poll(0) == [Up(conn)]
    assert client.send(conn, b"hello")
    (ev,) = server.poll(0)
    assert isinstance(ev, Received) and ev.data == b"hello" and ev.source.user == "consumer-key"
    assert server.send(ev.source, b"welcome")
    assert client.poll(0) == [Received(conn, b"welcome")]
    for i in range(5):  # order is kept
        client.send(conn, bytes([i]))
    assert [e.data for e in server.poll(0)] == [bytes([i]) for i in range(5)]


def test_refused_key_is_auth_failed_and_unreachable_is_silent(pair):
    net, server, _ = pair
    banned = MemoryControlClient(net, public_key="banned")
    conn = banned.connect("mem", 5601, None)
    (ev,) = banned.poll(0)
    assert isinstance(ev, AuthFailed) and ev.conn == conn and not banned.send(conn, b"x")
    assert server.poll(0) == [] and server.peers == []
    nowhere = banned.connect("mem", 1, None)  # nothing listens: no event, sends fail
    assert banned.poll(0) == [] and not banned.send(nowhere, b"x")


def test_cut_disconnect_and_close_report_down_on_both_sides(pair):
    net, server, client = pair
    conn = client.connect("mem", 5601, None)
    client.poll(0)
    (peer,) = server.peers
    server.cut(peer)
    assert client.poll(0) == [Down(conn)] and server.poll(0) == [Down(peer)]
    assert not server.send(peer, b"x") and not client.send(conn, b"x")
    conn = client.connect("mem", 5601, None)  # reconnect: a new route
    assert client.poll(0) == [Up(conn)]
    (peer2,) = server.peers
    assert peer2 != peer
    client.disconnect(conn)
    assert server.poll(0) == [Down(peer2)]
    other = MemoryControlClient(net, public_key="k2")
    c2 = other.connect("mem", 5601, None)
    other.poll(0)
    server.close()
    assert other.poll(0) == [Down(c2)]
    with pytest.raises(ConfigError):  # the address is free again, but not twice
        MemoryControlServer(net, "mem", 5601)
        MemoryControlServer(net, "mem", 5601)


def test_a_frozen_consumer_gets_held_frames_in_order_on_release(pair):
    _, server, client = pair
    conn = client.connect("mem", 5601, None)
    client.poll(0)
    client.send(conn, b"req")
    (ev,) = server.poll(0)
    client.freeze(conn)
    server.send(ev.source, b"ack-1")
    server.send(ev.source, b"ack-2")
    assert client.poll(0) == []
    client.freeze(conn, False)
    assert client.poll(0) == [Received(conn, b"ack-1"), Received(conn, b"ack-2")]


def test_wake_interrupts_a_blocked_poll(pair):
    _, server, client = pair
    done = threading.Event()
    got: list = []

    def waiter() -> None:
        got.append(server.poll(30.0))
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    # a wake before the poll started is remembered: the poll returns at once either way
    server.wake()
    assert done.wait(10.0), "poll(30 s) was not woken"
    assert got == [[]]
    t.join(5.0)
