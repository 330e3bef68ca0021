"""Revoke: the rule every socket-serving plane shares (``ectransport.plugin.GrantTable``): a
revoked grant is refused from then on, and a transfer in progress copies no further chunk of the
region once ``revoke`` returns (the consumer then sees the connection close)."""

from __future__ import annotations

import os
import socket
import time

import pytest
from ectransport.plugin import STATUS_OK, STATUS_UNKNOWN_GRANT, Run, frame
from ectransport.store import HostRegion

from ectransport_shm import ShmPlane
from ectransport_shm.wire import (
    PROGRESS_BYTES,
    SHM_WIRE_VERSION,
    ShmHello,
    ShmRequest,
    grant_decoder,
    recv_header,
    reply_decoder,
)

BLOCK_BYTES = 64 * 1024
DEADLINE_S = 10.0


@pytest.fixture
def producer():
    """A producer with a 4-slot ring of 64 KiB chunks over a 64-block region."""
    region = HostRegion(64, BLOCK_BYTES)
    plane = ShmPlane(node_id="prod", region=region, io_timeout_s=5.0,
                     segment_bytes=4 * BLOCK_BYTES, chunk_bytes=BLOCK_BYTES)
    yield plane
    plane.close()
    region.close()


def _client(plane: ShmPlane) -> socket.socket:
    """A raw connection to ``plane`` past the hello (the proof is read, not checked)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(DEADLINE_S)
    s.connect("\0" + plane.socket_name)
    s.sendall(frame(ShmHello(SHM_WIRE_VERSION, os.urandom(16))))
    recv_header(s, DEADLINE_S, DEADLINE_S)
    return s


def _request(s: socket.socket, token: bytes):
    s.sendall(frame(ShmRequest(SHM_WIRE_VERSION, token, b"never")))
    body, fds = recv_header(s, DEADLINE_S, DEADLINE_S, True)
    for fd in fds:
        os.close(fd)
    return reply_decoder.decode(body)


def _read(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        assert chunk, f"EOF after {len(got)} of {n} bytes"
        got += chunk
    return got


def test_revoke_stops_a_transfer_in_progress_and_refuses_the_grant(producer):
    nbytes = 8 * BLOCK_BYTES  # 8 chunks through 4 slots: the producer waits for acks
    plane_grant = producer.describe([Run(0, 8)], nbytes)
    token = grant_decoder.decode(plane_grant).token
    with _client(producer) as s:
        reply = _request(s, token)
        assert (reply.status, reply.nbytes) == (STATUS_OK, nbytes)
        _read(s, 4 * PROGRESS_BYTES)  # chunks 0-3 copied: the ring is full, no ack sent yet
        t0 = time.monotonic()
        producer.revoke(plane_grant)
        assert time.monotonic() - t0 < 2.0, "revoke waited for the consumer"
        s.sendall(b"\x01")  # slot 0 is free: a live grant would copy chunk 4 now
        rest = b""
        while chunk := s.recv(64):  # EOF ends this (bounded by the socket timeout)
            rest += chunk
        assert rest == b"", "a chunk of the revoked grant was copied after revoke returned"
    assert producer.stats["aborted"] == 1 and producer.stats["served"] == 0
    assert producer.poll_notifications() == []
    with _client(producer) as s2:  # a later request for it is refused; the connection stays
        assert _request(s2, token).status == STATUS_UNKNOWN_GRANT
        assert _request(s2, token).status == STATUS_UNKNOWN_GRANT


def test_revoke_after_the_transfer_keeps_the_connection(producer):
    plane_grant = producer.describe([Run(0, 1)], 100)
    token = grant_decoder.decode(plane_grant).token
    with _client(producer) as s:
        reply = _request(s, token)
        assert (reply.status, reply.nbytes) == (STATUS_OK, 100)
        assert int.from_bytes(_read(s, PROGRESS_BYTES), "big") == 100
        producer.revoke(plane_grant)
        producer.revoke(plane_grant)  # twice: no-op
        producer.revoke(b"\xc1garbage")  # malformed: no-op
        assert _request(s, token).status == STATUS_UNKNOWN_GRANT  # same connection
    assert producer.stats["served"] == 1 and producer.stats["aborted"] == 0
    assert producer.poll_notifications() == [b"never"]
