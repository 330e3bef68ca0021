"""ZmqControlServer / ZmqControlClient over real sockets on 127.0.0.1 with real CURVE."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import zmq

from ectransport.control.base import AuthFailed, Down, PeerId, Received, Up
from ectransport.control.keys import AllowList, allow_key
from ectransport.control.zmqctl import ZmqControlClient, ZmqControlServer
from ectransport.errors import ConfigError
from tests.conftest import DEADLINE_S, new_keypair, poll_until, wait_for

LOCAL = "127.0.0.1"


def is_up(e):
    return isinstance(e, Up)


def is_auth_failed(e):
    return isinstance(e, AuthFailed)


@contextlib.contextmanager
def closing(*planes):
    try:
        yield planes
    finally:
        for p in planes:
            p.close()


def make_server(tmp_path, server_keys, admitted=(), **kw):
    allow_dir = tmp_path / "allow"
    allow_dir.mkdir(exist_ok=True)
    for k in admitted:
        allow_key(allow_dir, k)
    return ZmqControlServer(
        LOCAL, 0, secret_key=server_keys.secret, allow=AllowList(allow_dir), **kw
    )


def connect_up(client, server, server_key, timeout_s=DEADLINE_S):
    conn = client.connect(LOCAL, server.port, server_key)
    ev = poll_until(client, lambda e: isinstance(e, (Up, AuthFailed)), timeout_s)
    assert isinstance(ev, Up), f"expected Up, got {ev!r}"
    return conn


def request(client, conn, server, data, timeout_s=DEADLINE_S, sink=None):
    """Client sends ``data``; returns the server's Received event for it (every server event seen
    meanwhile goes to ``sink``)."""
    assert client.send(conn, data)
    ev = poll_until(server, lambda e: isinstance(e, Received) and e.data == data, timeout_s, sink)
    assert ev is not None, "server did not receive the request"
    return ev


# -- happy path ------------------------------------------------------------------------------
def test_round_trip_with_allowed_key(tmp_path, server_keys, client_keys):
    server = make_server(tmp_path, server_keys, [client_keys.public])
    client = ZmqControlClient(secret_key=client_keys.secret)
    with closing(client, server):
        assert server.public_key == server_keys.public
        assert server.endpoint == f"tcp://{LOCAL}:{server.port}" and server.port > 0
        conn = connect_up(client, server, server_keys.public)
        assert conn == f"{LOCAL}:{server.port}"
        got = request(client, conn, server, b"req-1")
        assert isinstance(got.source, PeerId)
        assert got.source.user == client_keys.public
        assert server.send(got.source, b"reply-1")
        ev = poll_until(client, lambda e: isinstance(e, Received))
        assert ev == Received(conn, b"reply-1")


def test_plain_mode_round_trip_has_empty_user(caplog):
    server = ZmqControlServer(LOCAL, 0, secret_key=None, public_key=None, allow=None, insecure=True)
    client = ZmqControlClient(insecure=True)
    with closing(client, server):
        assert any("INSECURE" in r.getMessage() for r in caplog.records)
        conn = connect_up(client, server, None)
        got = request(client, conn, server, b"hi")
        assert got.source.user == ""
        assert server.send(got.source, b"ho")
        assert poll_until(client, lambda e: e == Received(conn, b"ho"))


# -- authentication failures -----------------------------------------------------------------
@pytest.mark.parametrize("case", ["unknown_client_key", "plain_client", "wrong_server_key"])
def test_auth_failure_is_reported_fast_and_server_sees_nothing(
    tmp_path, server_keys, client_keys, case
):
    admitted = new_keypair()
    server = make_server(tmp_path, server_keys, [admitted.public])
    server_key = server_keys.public
    if case == "unknown_client_key":
        client = ZmqControlClient(secret_key=client_keys.secret)
    elif case == "plain_client":
        client = ZmqControlClient(insecure=True)
        server_key = None
    else:
        client = ZmqControlClient(secret_key=admitted.secret)  # admitted key, wrong server key
        server_key = new_keypair().public
    witness = ZmqControlClient(secret_key=admitted.secret)
    with closing(witness, client, server):
        conn = client.connect(LOCAL, server.port, server_key)
        client_events, server_events = [], []
        failed = None
        deadline = time.monotonic() + DEADLINE_S
        while failed is None and time.monotonic() < deadline:
            assert not client.send(conn, b"should-never-arrive")
            for ev in client.poll(0.02):
                client_events.append(ev)
                if isinstance(ev, AuthFailed):
                    failed = ev
            server_events.extend(server.poll(0.0))
        assert failed is not None, f"no AuthFailed; client saw {client_events}"
        # "fast": the handshake's own verdict (named below), not a handshake timeout
        assert "no handshake" not in failed.reason, failed.reason
        assert failed.conn == conn
        assert not any(isinstance(e, Up) for e in client_events)
        # an admitted client's frame reaches the server: it is serving, and nothing of the
        # refused client came before it
        wconn = connect_up(witness, server, server_keys.public)
        request(witness, wconn, server, b"witness", sink=server_events)
        assert [e.data for e in server_events if isinstance(e, Received)] == [b"witness"]
        assert not client.send(conn, b"after-failure")  # the connection was closed
        if case == "unknown_client_key":
            assert "allow-list" in failed.reason
            assert server.reject_count >= 1
        elif case == "plain_client":
            assert "plain/CURVE mismatch" in failed.reason
        else:
            assert "producer key mismatch" in failed.reason
            assert server.handshake_failures >= 1


def test_curve_client_against_plain_server_fails(client_keys):
    server = ZmqControlServer(LOCAL, 0, insecure=True)
    client = ZmqControlClient(secret_key=client_keys.secret)
    with closing(client, server):
        client.connect(LOCAL, server.port, new_keypair().public)
        ev = poll_until(client, lambda e: isinstance(e, (Up, AuthFailed)))
        assert isinstance(ev, AuthFailed), ev
        assert "plain/CURVE mismatch" in ev.reason  # the handshake's verdict, not a timeout


def test_allow_list_reload_admits_and_revokes_without_restart(tmp_path, server_keys):
    kp = new_keypair()
    server = make_server(tmp_path, server_keys)
    allow_dir = tmp_path / "allow"
    clients = []
    with closing(server):
        try:

            def attempt():
                c = ZmqControlClient(secret_key=kp.secret)
                clients.append(c)
                c.connect(LOCAL, server.port, server_keys.public)
                ev = None
                deadline = time.monotonic() + DEADLINE_S
                while ev is None and time.monotonic() < deadline:
                    server.poll(0.0)
                    for e in c.poll(0.02):
                        if isinstance(e, (Up, AuthFailed)):
                            ev = e
                return c, ev

            def attempt_until(kind):
                """Attempt until the server's verdict is ``kind``: the server re-reads the
                directory on its own (about every 0.5 s), so the change shows up in time."""
                last: list = []

                def verdict() -> bool:
                    last[:] = attempt()
                    return isinstance(last[1], kind)

                assert wait_for(verdict, DEADLINE_S, 0.1), last
                return last

            _, ev = attempt()
            assert isinstance(ev, AuthFailed)

            entry = allow_key(allow_dir, kp.public)
            c2, ev = attempt_until(Up)
            got = request(c2, ev.conn, server, b"admitted")
            assert got.source.user == kp.public

            entry.unlink()
            attempt_until(AuthFailed)
        finally:
            for c in clients:
                c.close()


# -- disconnects -----------------------------------------------------------------------------
def test_consumer_disconnect_reported_as_down(tmp_path, server_keys, client_keys):
    server = make_server(
        tmp_path, server_keys, [client_keys.public], heartbeat_ivl_s=0.2, heartbeat_timeout_s=0.6
    )
    client = ZmqControlClient(
        secret_key=client_keys.secret, heartbeat_ivl_s=0.2, heartbeat_timeout_s=0.6
    )
    other = ZmqControlClient(secret_key=client_keys.secret)
    with closing(other, client, server):
        conn = connect_up(client, server, server_keys.public)
        peer = request(client, conn, server, b"hello").source
        oconn = connect_up(other, server, server_keys.public)
        opeer = request(other, oconn, server, b"other").source
        assert opeer != peer and opeer.user == peer.user  # same key, distinct routes
        client.close()
        ev = poll_until(server, lambda e: isinstance(e, Down))
        assert ev == Down(peer)
        assert server.peers == [opeer]
        assert not server.send(peer, b"gone")
        assert server.send(opeer, b"still-here")
        assert poll_until(other, lambda e: e == Received(oconn, b"still-here"))


def test_producer_disconnect_reported_as_down_to_client(tmp_path, server_keys, client_keys):
    server = make_server(tmp_path, server_keys, [client_keys.public])
    client = ZmqControlClient(
        secret_key=client_keys.secret, heartbeat_ivl_s=0.2, heartbeat_timeout_s=0.6
    )
    with closing(client, server):
        conn = connect_up(client, server, server_keys.public)
        server.close()
        ev = poll_until(client, lambda e: isinstance(e, Down))
        assert ev == Down(conn)
        assert not client.send(conn, b"x")


def test_unreachable_producer_reported_as_down(client_keys):
    with socket.socket() as s:  # find a port with nobody listening
        s.bind((LOCAL, 0))
        port = s.getsockname()[1]
    client = ZmqControlClient(secret_key=client_keys.secret, handshake_timeout_s=0.5)
    with closing(client):
        conn = client.connect(LOCAL, port, new_keypair().public)
        ev = poll_until(client, lambda e: True)
        assert ev == Down(conn)


# -- configuration errors --------------------------------------------------------------------
def test_non_loopback_bind_needs_allow_list_unless_insecure(server_keys):
    with pytest.raises(ConfigError, match="allow-list"):
        ZmqControlServer("0.0.0.0", 0, secret_key=server_keys.secret)
    srv = ZmqControlServer("0.0.0.0", 0, insecure=True)
    srv.close()
    # loopback without an allow-list is accepted (any key-holder on this host may connect)
    srv = ZmqControlServer(LOCAL, 0, secret_key=server_keys.secret)
    srv.close()


def test_secure_server_and_client_need_keys(server_keys):
    with pytest.raises(ConfigError, match="secret key"):
        ZmqControlServer(LOCAL, 0, secret_key=None)
    with pytest.raises(ConfigError, match="does not belong"):
        ZmqControlServer(LOCAL, 0, secret_key=server_keys.secret, public_key=new_keypair().public)
    with pytest.raises(ConfigError, match="secret key"):
        ZmqControlClient()
    client = ZmqControlClient(secret_key=new_keypair().secret)
    with closing(client), pytest.raises(ConfigError, match="server_key"):
        client.connect(LOCAL, 1, None)


def test_port_in_use_is_config_error(server_keys):
    first = ZmqControlServer(LOCAL, 0, secret_key=server_keys.secret)
    in_use = f"port {first.port} on {LOCAL} is in use"
    with closing(first), pytest.raises(ConfigError, match=in_use):
        ZmqControlServer(LOCAL, first.port, secret_key=server_keys.secret)


def test_unknown_interface_is_config_error():
    # libzmq reports the system's ENODEV for an interface name it cannot find (pyzmq has no
    # zmq.ENODEV: this once raised AttributeError)
    with pytest.raises(ConfigError, match="not an address of this host"):
        ZmqControlServer("nosuchif0", 0, insecure=True)


def test_close_is_idempotent(server_keys, client_keys):
    server = ZmqControlServer(LOCAL, 0, secret_key=server_keys.secret)
    client = ZmqControlClient(secret_key=client_keys.secret)
    client.connect(LOCAL, server.port, server_keys.public)
    for plane in (client, server):
        plane.close()
        plane.close()
        assert plane.poll(0.01) == []
        plane.wake()


# -- fairness and bounds ---------------------------------------------------------------------
def test_flooding_peer_cannot_starve_another(tmp_path, server_keys):
    flood_keys, calm_keys = new_keypair(), new_keypair()
    rate, burst = 200.0, 50
    server = make_server(
        tmp_path,
        server_keys,
        [flood_keys.public, calm_keys.public],
        peer_rate_per_s=rate,
        peer_burst=burst,
        max_msgs_per_poll=64,
    )
    flooder = ZmqControlClient(secret_key=flood_keys.secret)
    calm = ZmqControlClient(secret_key=calm_keys.secret)
    with closing(flooder, calm, server):
        fconn = connect_up(flooder, server, server_keys.public)
        cconn = connect_up(calm, server, server_keys.public)
        sent = 0
        for _ in range(5000):
            if flooder.send(fconn, b"flood"):
                sent += 1
        assert sent > burst
        t0 = time.monotonic()
        assert calm.send(cconn, b"calm")
        got_calm = False
        flood_received = 0
        while time.monotonic() - t0 < DEADLINE_S and not got_calm:
            for ev in server.poll(0.05):
                if isinstance(ev, Received):
                    if ev.data == b"calm":
                        got_calm = True
                        assert ev.source.user == calm_keys.public
                    else:
                        flood_received += 1
        elapsed = time.monotonic() - t0
        assert got_calm
        # The token bucket's own bound. Not a stopwatch bound: a slower run only raises the
        # allowance (the bucket was full at t0 and refills at ``rate`` from then on).
        assert flood_received <= burst + rate * elapsed + 20
        # keep draining the flood: whatever the flooder queued beyond its budget is dropped
        drain_deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < drain_deadline and server.rate_dropped + flood_received < sent:
            flood_received += sum(isinstance(e, Received) for e in server.poll(0.05))
        assert server.rate_dropped > 0


def test_oversized_frame_is_not_delivered(tmp_path, server_keys, client_keys):
    server = make_server(tmp_path, server_keys, [client_keys.public], max_frame_bytes=1024)
    client = ZmqControlClient(secret_key=client_keys.secret)
    with closing(client, server):
        conn = connect_up(client, server, server_keys.public)
        client.send(conn, b"x" * 4096)
        seen = []
        # the server drops a connection that sends an oversized frame: the client sees it go
        # down and come back; a frame sent after that arrives, the oversized one never did
        assert poll_until(client, lambda e: e == Down(conn)), "oversized frame did not drop it"
        assert poll_until(client, lambda e: e == Up(conn)), "no reconnection"
        request(client, conn, server, b"after", sink=seen)
        assert [e.data for e in seen if isinstance(e, Received)] == [b"after"]


def test_malformed_envelope_dropped():
    server = ZmqControlServer(LOCAL, 0, insecure=True)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    try:
        raw.connect(server.endpoint)
        raw.send_multipart([b"a", b"b"])
        raw.send(b"ok")
        ev = poll_until(server, lambda e: isinstance(e, Received))
        assert ev is not None and ev.data == b"ok"
        assert server.malformed_dropped == 1
    finally:
        raw.close()
        ctx.term()
        server.close()


@pytest.mark.parametrize("side", ["server", "client"])
def test_wake_interrupts_poll_from_another_thread(server_keys, client_keys, side):
    if side == "server":
        plane = ZmqControlServer(LOCAL, 0, secret_key=server_keys.secret)
    else:
        plane = ZmqControlClient(secret_key=client_keys.secret)
    with closing(plane):
        returned = threading.Event()

        def long_poll() -> None:
            plane.poll(600.0)
            returned.set()

        t = threading.Thread(target=long_poll, daemon=True)
        t.start()
        plane.wake()  # before or during that poll: either way it returns now, not in 600 s
        assert returned.wait(DEADLINE_S), "poll() was not interrupted by wake()"
        t.join()


def test_a_producer_that_never_greets_is_not_called_a_wrong_key():
    """Issue 17 point 4: a peer that accepts TCP and then stays silent (a stalled producer) is
    reported as "no handshake from the producer", not as a key mismatch."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # accepts (in the kernel backlog) and never says a word
    port = listener.getsockname()[1]
    pk, ck = zmq.curve_keypair(), zmq.curve_keypair()
    client = ZmqControlClient(secret_key=ck[1].decode(), public_key=ck[0].decode(),
                              handshake_timeout_s=0.5)
    try:
        client.connect("127.0.0.1", port, pk[0].decode())
        failed = poll_until(client, is_auth_failed)
        assert failed is not None, f"no AuthFailed within {DEADLINE_S} s"
        assert "no handshake from the producer" in failed.reason
        assert "mismatch" not in failed.reason
    finally:
        client.close()
        listener.close()
