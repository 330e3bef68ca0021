"""A consumer's connection that closes: what it sent last still counts, and nothing else ends.

A consumer's last frames are often the completions that give its grants back (``XferDone``);
lost, the producer holds the grants' blocks until their leases end. Real ZeroMQ sockets and
CURVE; where the server's file descriptors matter, the clients run in a process of their own
(``tests/control/_clients_proc.py``).
"""

from __future__ import annotations

import gc
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from ectransport.control.base import Down, PeerId, Received
from ectransport.control.zmqctl import ZmqControlClient
from ectransport.errors import ConfigError
from tests.conftest import DEADLINE_S, new_keypair, poll_until, wait_for
from tests.control.test_control_zmq import closing, connect_up, make_server, request

ROOT = Path(__file__).resolve().parents[2]


def test_frames_sent_just_before_close_still_leave(tmp_path, server_keys, client_keys):
    """Frames queued when the client closes reach the producer (a consumer's last completions
    give its grants back: dropped, the producer kept them pinned until their lease ended). With
    ``close_linger_s=0`` this fails: 16 MiB are not on the wire by the time close returns (5 s
    here, not the default 0.5 s: on a loaded host encrypting 16 MiB may take longer)."""
    server = make_server(tmp_path, server_keys, [client_keys.public])
    client = ZmqControlClient(secret_key=client_keys.secret, close_linger_s=5.0)
    with closing(server):
        conn = connect_up(client, server, server_keys.public)
        frames = [bytes([i]) * (1 << 20) for i in range(16)]
        for f in frames:
            assert client.send(conn, f)
        client.close()
        got: list[bytes] = []
        wait_for(lambda: got.extend(e.data for e in server.poll(0.05)
                                    if isinstance(e, Received)) or len(got) == len(frames), 5.0)
        assert got == frames


def test_a_closed_connections_last_frames_come_before_its_down(tmp_path, server_keys, client_keys):
    """The frames a consumer sent just before it closed are received before its ``Down`` (once
    received after it, as a gone route's, they were dropped: a grant's completion among them
    left the grant pinned until its lease ended)."""
    server = make_server(tmp_path, server_keys, [client_keys.public])
    client = ZmqControlClient(secret_key=client_keys.secret)
    with closing(server):
        conn = connect_up(client, server, server_keys.public)
        peer = request(client, conn, server, b"hello").source
        last = [b"done-%d" % i for i in range(3)]
        for f in last:
            assert client.send(conn, f)
        client.close()
        # the server has not polled since: let its monitor report the close first
        mon = zmq.Poller()
        mon.register(server._mon, zmq.POLLIN)
        assert mon.poll(DEADLINE_S * 1000), "the server's monitor never saw the close"
        events = []
        assert poll_until(server, lambda e: isinstance(e, Down), sink=events) == Down(peer)
        assert [e.data for e in events if isinstance(e, Received)] == last


class Clients:
    """Drives ``tests/control/_clients_proc.py`` (one command, one ``ok``, within a deadline)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.control._clients_proc"], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        # one selector for every answer: a new one per wait would take a descriptor each time
        # (the one a test waits to see handed to the next connection)
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def __call__(self, *words: object) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        assert self._sel.select(DEADLINE_S), f"no answer to {words[0]!r}"
        answer = self.proc.stdout.readline().strip()
        assert answer == "ok", f"{words[0]}: {answer or 'the clients process ended'}"

    def close(self) -> None:
        self._sel.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _received(server, data: bytes, seen: list) -> Received | None:
    """Poll ``server`` until a frame ``data`` arrives; every event of every poll goes to
    ``seen`` (those after it in the same poll too)."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        events = server.poll(0.05)
        seen += events
        for e in events:
            if isinstance(e, Received) and e.data == data:
                return e
    return None


def _fill_holes_below(fd: int) -> list[int]:
    """Take every free descriptor below ``fd`` (``/dev/null``), so the kernel hands out ``fd``
    next once it is free; returns them, to close afterwards."""
    gc.collect()  # sockets of earlier tests waiting to be closed
    taken = []
    while (h := os.open(os.devnull, os.O_RDONLY)) < fd:
        taken.append(h)
    os.close(h)
    return taken


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.parametrize("probe", [False, True], ids=["next-consumer", "probe-then-consumer"])
def test_a_reused_descriptor_neither_loses_last_frames_nor_ends_the_new_connection(
        tmp_path, server_keys, probe):
    """Consumer P sends its last frames and closes; before the producer polls again its fd is
    taken by consumer B (first by a bare TCP probe that closes at once, with ``probe``) and B
    sends. P's frames all come before P's ``Down``, and B is not reported down: it keeps being
    heard. (Once, B's first frame ended P at once, losing P's later frames; and with the
    router read before the monitor, the probe's close was taken for B's.)"""
    p, b = new_keypair(), new_keypair()
    server = make_server(tmp_path, server_keys, [p.public, b.public])
    clients = Clients()
    try:
        clients("connect", "P", p.secret, server.port, server_keys.public)
        clients("send", "P", "hello")
        hello = poll_until(server, lambda e: isinstance(e, Received) and e.data == b"hello")
        assert hello is not None, "P's hello never arrived"
        fds = [fd for fd, peer in server._fd_peer.items() if peer == hello.source]
        assert len(fds) == 1, server._fd_peer
        fd = fds[0]
        holes = _fill_holes_below(fd)  # so that P's fd is the next one this process hands out
        last = [f"done-{i}" for i in range(5)]
        for frame in last:
            clients("send", "P", frame)
        clients("close", "P")
        # the producer does not poll until B has sent: only wait for ZeroMQ to close P's fd
        assert wait_for(lambda: not _is_open(fd)), "P's descriptor was never closed"
        if probe:
            clients("probe", server.port)
            assert wait_for(lambda: _is_open(fd)), "the probe did not get P's descriptor"
            clients("unprobe")
            assert wait_for(lambda: not _is_open(fd)), "the probe's descriptor stayed open"
        clients("connect", "B", b.secret, server.port, server_keys.public)
        clients("send", "B", "fetch-1")
        seen: list = []
        first = _received(server, b"fetch-1", seen)
        assert first is not None, f"B's first frame never arrived: {seen}"
        assert server._fd_peer.get(fd) == first.source, "B did not get P's descriptor"
        clients("send", "B", "fetch-2")
        assert _received(server, b"fetch-2", seen) is not None, f"B is no longer heard: {seen}"
        from_p = [e.data.decode() for e in seen
                  if isinstance(e, Received) and e.source == hello.source]
        assert from_p == last, seen
        downs = [e.source for e in seen if isinstance(e, Down)]
        assert downs == [hello.source], seen
        assert seen.index(Down(hello.source)) > max(
            i for i, e in enumerate(seen) if isinstance(e, Received) and e.source == hello.source)
        assert isinstance(first.source, PeerId) and first.source not in downs
    finally:
        for h in locals().get("holes", ()):
            os.close(h)
        clients.close()
        server.close()


@pytest.mark.parametrize("linger_s", [-1.0, float("nan"), float("inf"), 3e6])
def test_an_impossible_close_linger_is_refused_when_the_client_is_made(client_keys, linger_s):
    """Not at ``close()``, where ZeroMQ's overflow left the context and sockets open."""
    with pytest.raises(ConfigError, match="close_linger_s"):
        ZmqControlClient(secret_key=client_keys.secret, close_linger_s=linger_s)
