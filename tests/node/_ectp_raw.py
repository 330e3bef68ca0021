"""A hand-rolled ECTP client: one raw pyzmq DEALER speaking the wire protocol directly.

Used by the node tests to play a consumer that misbehaves on purpose (never completes, sends
garbage, disappears). Runnable as a script for the peer-down test: it connects, says Hello, asks
for one grant, prints ``{"grant_id": ...}`` on stdout and then sleeps until it is killed.

    python -m tests.node._ectp_raw HOST PORT MM_HASH COMPAT_HASH
"""

from __future__ import annotations

import json
import sys
import time
import uuid

import zmq

from ectransport.protocol import (
    SUPPORTED_VERSIONS,
    Hello,
    Nack,
    Renew,
    Welcome,
    XferAck,
    XferDone,
    XferReq,
    decode,
    encode,
)


class RawClient:
    """A DEALER connected to a producer; every receive has a deadline (no hangs)."""

    def __init__(self, host: str, port: int, *, server_key: str | None = None,
                 public_key: str | None = None, secret_key: str | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key is not None:
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode("ascii"))
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public_key.encode("ascii"))
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret_key.encode("ascii"))
        self.sock.connect(f"tcp://{host}:{port}")
        self.session_id = uuid.uuid4().hex
        self.version = max(SUPPORTED_VERSIONS)
        self.closed = False

    # -- raw frames ----------------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        self.sock.send(data)

    def recv_raw(self, timeout_s: float = 3.0) -> bytes:
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no frame from the producer within {timeout_s}s")
        return self.sock.recv()

    def recv(self, timeout_s: float = 3.0):
        return decode(self.recv_raw(timeout_s), versions=SUPPORTED_VERSIONS)

    def expect_silence(self, timeout_s: float) -> bool:
        """True if nothing arrives within ``timeout_s``."""
        return not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN)

    # -- ECTP ----------------------------------------------------------------------------------
    def hello(self, compat_hash: str, *, planes=("nixl",), versions=SUPPORTED_VERSIONS,
              localities: dict[str, bytes] | None = None) -> Welcome:
        """Say Hello; ``localities`` (plane name → that plane's ``locality()``) is sent only when
        given (a plane such as shm is negotiated only for a consumer that says where it is)."""
        self.send_raw(encode(Hello(
            v=max(versions), session_id=self.session_id, node_id="raw-" + self.session_id[:6],
            versions=list(versions), planes=list(planes), compat_hash=compat_hash,
            mem_kinds=["DRAM"], localities=dict(localities or {}))))
        msg = self.recv()
        assert isinstance(msg, Welcome), f"expected Welcome, got {msg!r}"
        if msg.status == 0:
            self.version = msg.version  # from now on, frames carry the negotiated version
        return msg

    def req(self, mm_hash: str, compat_hash: str, *, v: int | None = None) -> XferAck:
        self.send_req(mm_hash, compat_hash, v=v)
        msg = self.recv()
        assert isinstance(msg, XferAck), f"expected XferAck, got {msg!r}"
        return msg

    def send_req(self, mm_hash: str, compat_hash: str, *, v: int | None = None) -> None:
        self.send_raw(encode(XferReq(v=self.version if v is None else v,
                                     session_id=self.session_id, mm_hash=mm_hash,
                                     compat_hash=compat_hash, dest=b"")))

    def done(self, mm_hash: str, grant_id: int, ok: bool = True) -> None:
        self.send_raw(encode(XferDone(v=self.version, session_id=self.session_id,
                                      mm_hash=mm_hash, grant_id=grant_id, ok=ok)))

    def renew(self, grant_ids: list[int], extend_s: float) -> None:
        self.send_raw(encode(Renew(v=self.version, session_id=self.session_id,
                                   grant_ids=list(grant_ids), extend_s=extend_s)))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close(linger=0)
            self.ctx.term()


__all__ = ["Nack", "RawClient", "Welcome", "XferAck"]


def main(argv: list[str]) -> int:
    host, port, mm_hash, compat = argv[0], int(argv[1]), argv[2], argv[3]
    c = RawClient(host, port)
    w = c.hello(compat)
    ack = c.req(mm_hash, compat)
    print(json.dumps({"welcome": int(w.status), "status": int(ack.status),
                      "grant_id": ack.grant.grant_id if ack.grant else None}), flush=True)
    time.sleep(120)  # hold the grant, silent, until killed: the behaviour under test
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
