"""Stream framing and socket hygiene shared by the planes that serve bytes over a stream socket
(TCP, the shm plugin): length-prefixed msgpack frames, bounded reads, and the "nothing unread"
check that decides whether a connection may be reused.

A frame is a 4-byte big-endian length (1..``max_bytes``) and a msgpack body; the wire formats
built on it (``ectransport.data.tcp_wire``, ``ectransport_shm.wire``) define the bodies. Every
read here has a deadline and a bound: nothing waits forever, nothing reads past what was asked.
"""

from __future__ import annotations

import os
import socket
import time

import msgspec

#: Bytes of a frame's big-endian length prefix.
PREFIX_BYTES = 4
#: Most descriptors accepted with one frame (``SCM_RIGHTS``); more are closed by the kernel.
MAX_FDS = 4

_encoder = msgspec.msgpack.Encoder()


class PeerClosed(ConnectionError):
    """EOF before the expected bytes."""


class FrameError(ValueError):
    """A frame's length prefix is out of range (0, or more than the reader allows): the stream
    cannot be trusted any more; reply ``STATUS_BAD_REQUEST`` (producer) or fail (consumer) and
    close the connection."""


def frame(msg: msgspec.Struct) -> bytes:
    """``msg`` as msgpack behind its 4-byte big-endian length."""
    body = _encoder.encode(msg)
    return len(body).to_bytes(PREFIX_BYTES, "big") + body


def recv_exact(sock: socket.socket, n: int, first_timeout_s: float, timeout_s: float,
               first: bytes = b"") -> bytes:
    """``n`` bytes (``first``, already received, counts): the first new byte may take
    ``first_timeout_s`` seconds, the rest ``timeout_s`` seconds in all.

    Raises:
        PeerClosed: EOF first. TimeoutError / OSError: a stall or a socket error.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = len(first)
    view[:got] = first
    sock.settimeout(first_timeout_s)
    deadline = None
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"stalled after {got} of {n} bytes")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed(f"peer closed after {got} of {n} bytes")
        got += k
        if deadline is None:
            deadline = time.monotonic() + timeout_s
    return bytes(buf)


def recv_frame(sock: socket.socket, first_timeout_s: float, timeout_s: float, max_bytes: int,
               want_fds: bool = False) -> tuple[bytes, list[int]]:
    """One frame's body and the descriptors that came with its first bytes (``want_fds``:
    ``SCM_RIGHTS`` on a Unix socket, at most :data:`MAX_FDS`; the caller closes them).

    The first byte may take ``first_timeout_s`` seconds (e.g. an idle timeout between requests),
    the rest of the prefix ``timeout_s``, the body ``timeout_s`` more; the body is at most
    ``max_bytes`` bytes.

    Raises:
        PeerClosed: EOF first. TimeoutError / OSError: a stall or a socket error.
        FrameError: a length of 0 or more than ``max_bytes`` (nothing more was read).
    """
    fds: list[int] = []
    try:
        if want_fds:
            sock.settimeout(first_timeout_s)
            data, fds, _flags, _addr = socket.recv_fds(sock, PREFIX_BYTES, MAX_FDS,
                                                       socket.MSG_CMSG_CLOEXEC)
            if not data:
                raise PeerClosed("peer closed before a frame")
            head = recv_exact(sock, PREFIX_BYTES, timeout_s, timeout_s, data)
        else:
            head = recv_exact(sock, PREFIX_BYTES, first_timeout_s, timeout_s)
        length = int.from_bytes(head, "big")
        if not 0 < length <= max_bytes:
            raise FrameError(f"header length {length} not in 1..{max_bytes}")
        return recv_exact(sock, length, timeout_s, timeout_s), fds
    except BaseException:
        close_fds(fds)
        raise


def unread_state(sock: socket.socket) -> str:
    """Whether anything is left on ``sock`` after a complete exchange, without blocking:
    ``"clean"`` (nothing pending, open), ``"pending"`` (unread bytes: the stream is out of sync,
    e.g. bytes a producer pushed ahead of a request) or ``"closed"`` (EOF, an error, or a closed
    socket). Never raises.

    A connection goes back to a pool, and a pooled one is reused, only when
    ``"clean"``, so that bytes pushed ahead of time are never taken for the next request's
    reply. The socket's timeout is restored.
    """
    try:
        prev = sock.gettimeout()
        sock.settimeout(0.0)  # a timeout socket would wait for readability before the recv
    except OSError:
        return "closed"
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return "clean"
    except OSError:
        return "closed"
    finally:
        try:
            sock.settimeout(prev)
        except OSError:
            pass
    return "pending" if data else "closed"


def shutdown_quietly(sock: socket.socket | None) -> None:
    """``shutdown(SHUT_RDWR)`` (wakes a thread blocked on it); None and errors are ignored."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def close_quietly(sock: socket.socket | None) -> None:
    """``close()``; None and errors are ignored."""
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


def close_fds(fds: list[int]) -> None:
    """Close every descriptor of ``fds``; errors are ignored."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
