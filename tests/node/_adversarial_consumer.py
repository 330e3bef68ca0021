"""An adversarial consumer in its own OS process (issue 13): an allow-listed CURVE key that speaks
ECTP by hand and tries to read more than it was granted, on one data plane.

    python -m tests.node._adversarial_consumer PLANE BLOCK_BYTES DEST_BLOCKS

It owns its data-plane object (``load_plane(PLANE)(node_id=..., region=HostRegion(...),
identity=...)``), binds each producer's ``Welcome.endpoint`` with it, and — for NIXL — also a raw
``nixl_agent`` of its own that loads only the metadata it was given (the declaration's connection
metadata and each grant's sections) and posts READs with any descriptors it likes.

Protocol: one JSON object per line on stdout (which nothing else writes to: the process's fd 1 is
redirected to stderr, as UCX logs to it). It first prints ``{"ready": true, "public_key": ...}``, then
answers each command read from stdin with one line:

* ``{"cmd": "connect", "host", "port", "server_key", "compat"}`` — new control session (Hello with
  this plane and its ``locality()``), bind the plane to the declared endpoint.
* ``{"cmd": "req", "mm_hash"}`` — ``XferReq``; the grant is kept under ``mm_hash``.
* ``{"cmd": "done", "mm_hash", "ok"}`` — ``XferDone`` for that grant, then a barrier (a request for
  a missing entry): once its NACK is back, the producer's loop has revoked the grant.
* ``{"cmd": "xfer", "mm_hash", "forge": {...}}`` — start a transfer with the kept grant, forged as
  ``forge`` says (see :func:`forge_grant`), on the plane, into this process's own blocks.
* ``{"cmd": "raw_read", "mm_hash", "descs": [[offset, length], ...]}`` — NIXL only: a READ by the raw
  agent of byte ranges of the producer's declared region (offsets from its declared base).
* ``{"cmd": "quit"}``.

A transfer answer says whether it ``started`` (else ``error``), its final ``state`` (``done``,
``err``, or ``proc`` if it did not finish within the deadline), the ``sha256`` of the first
``nbytes`` destination bytes, and ``landed``: every destination byte (base64) after the attempt,
which was zero before it, so the parent can check by content whose bytes arrived.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import sys
import time
import traceback
from typing import Any

XFER_TIMEOUT_S = 10.0  # deadline of one transfer attempt; an attempt must end long before


class Adversary:
    def __init__(self, plane: str, block_bytes: int, dest_blocks: int):
        import zmq

        from ectransport.data.base import identity_of
        from ectransport.data.registry import load_plane
        from ectransport.store import HostRegion

        self.plane_name = plane
        self.block_bytes = block_bytes
        pub, sec = zmq.curve_keypair()
        self.public_key, self.secret_key = pub.decode(), sec.decode()
        self.region = HostRegion(dest_blocks, block_bytes)
        self.plane = load_plane(plane)(node_id="adversary", region=self.region,
                                       identity=identity_of(self.public_key))
        self.client: Any = None
        self.binding: Any = None
        self.endpoint: Any = None  # the decoded NIXL declaration
        self.compat = ""
        self.grants: dict[str, Any] = {}
        self.raw: Any = None
        self.raw_region: Any = None
        if plane == "nixl":
            self._start_raw_agent(dest_blocks)

    # -- control plane -----------------------------------------------------------------------------
    def connect(self, host: str, port: int, server_key: str, compat: str) -> dict:
        from ectransport.data.base import identity_of
        from ectransport.protocol import Status
        from tests.node._ectp_raw import RawClient

        self._disconnect()
        self.client = RawClient(host, port, server_key=server_key, public_key=self.public_key,
                                secret_key=self.secret_key)
        self.compat = compat
        welcome = self.client.hello(compat, planes=(self.plane_name,),
                                    localities={self.plane_name: self.plane.locality()})
        if welcome.status is not Status.OK or welcome.plane != self.plane_name:
            return {"ok": False, "status": int(welcome.status), "plane": welcome.plane}
        self.binding = self.plane.bind_peer(welcome.endpoint, peer=f"{host}:{port}", host=host,
                                            identity=identity_of(server_key))
        if self.plane_name == "nixl":
            import msgspec

            from ectransport.data.nixl import NixlEndpoint

            self.endpoint = msgspec.msgpack.decode(welcome.endpoint, type=NixlEndpoint)
        return {"ok": True, "plane": welcome.plane, "endpoint_bytes": len(welcome.endpoint)}

    def _disconnect(self) -> None:
        if self.binding is not None:
            self.plane.unbind_peer(self.binding)
        if self.client is not None:
            self.client.close()
        self.client = self.binding = self.endpoint = None
        self.grants.clear()

    def req(self, mm_hash: str) -> dict:
        ack = self.client.req(mm_hash, self.compat)
        if ack.grant is not None:
            self.grants[mm_hash] = ack.grant
        return {"status": ack.status.name, "detail": ack.detail,
                "grant_id": ack.grant.grant_id if ack.grant else None,
                "num_blocks": ack.grant.num_blocks if ack.grant else None}

    def done(self, mm_hash: str, ok: bool) -> dict:
        from ectransport.protocol import Status

        self.client.done(mm_hash, self.grants[mm_hash].grant_id, ok=ok)
        barrier = self.client.req(f"barrier-{secrets.token_hex(8)}", self.compat)
        return {"barrier": barrier.status.name, "ok": barrier.status is Status.NACK_MISSING}

    # -- data plane ----------------------------------------------------------------------------------
    def xfer(self, mm_hash: str, forge: dict) -> dict:
        from ectransport.store import Run
        from ectransport.testing.conformance import wait_state

        plane_grant, nbytes = forge_grant(self.plane_name, self.grants[mm_hash].plane_grant, forge,
                                    self.block_bytes, self.endpoint)
        self._zero()
        blocks = -(-nbytes // self.block_bytes)
        try:
            handle = self.plane.start(self.binding, plane_grant, [Run(0, blocks)], nbytes, b"")
        except Exception as exc:  # noqa: BLE001 - a refusal is an expected outcome here
            return self._result(False, f"{type(exc).__name__}: {exc}", "err", nbytes,
                                self.region)
        try:
            state = wait_state(self.plane, handle, XFER_TIMEOUT_S)
        finally:
            self.plane.release(handle)  # no more bytes land once this returns
        detail = getattr(handle, "detail", None)
        return self._result(True, detail, state.value, nbytes, self.region)

    def raw_read(self, mm_hash: str, descs: list[list[int]]) -> dict:
        """A READ by the raw NIXL agent, using only what this consumer was given: the session's
        declared connection metadata and the grant's metadata (its sections)."""
        ep, grant = self.endpoint, self._nixl_grant(mm_hash)
        self._zero()
        nbytes = sum(n for _, n in descs)
        try:
            for meta in (ep.conn, grant.meta):
                if meta:
                    self.raw.add_remote_agent(meta)  # NIXL merges sections of a known agent
            local, off = [], 0
            for _, n in descs:
                local.append((self.raw_region.addr + off, n, 0))
                off += n
            ldl = self.raw.get_xfer_descs(local, "DRAM")
            rdl = self.raw.get_xfer_descs([(ep.base + o, n, ep.dev_id) for o, n in descs], "DRAM")
            xfer = self.raw.initialize_xfer("READ", ldl, rdl, ep.agent, b"")
        except Exception as exc:  # noqa: BLE001 - NIXL's refusal (e.g. NIXL_ERR_NOT_FOUND)
            return self._result(False, f"{type(exc).__name__}: {exc}", "err", nbytes,
                                self.raw_region)
        state = "ERR"
        try:
            state = self.raw.transfer(xfer)
            deadline = time.monotonic() + XFER_TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)  # a poll interval (the agent has no progress thread)
                state = self.raw.check_xfer_state(xfer)
        except Exception as exc:  # noqa: BLE001 - a failure on the plane
            return self._result(True, f"{type(exc).__name__}: {exc}", "err", nbytes,
                                self.raw_region)
        finally:
            try:
                self.raw.release_xfer_handle(xfer)
            except Exception:  # noqa: BLE001 - still in flight: leave it (the child exits)
                pass
        return self._result(True, None, state.lower(), nbytes, self.raw_region)

    def _nixl_grant(self, mm_hash: str) -> Any:
        import msgspec

        from ectransport.data.nixl import NixlGrant

        return msgspec.msgpack.decode(self.grants[mm_hash].plane_grant, type=NixlGrant)

    def _start_raw_agent(self, dest_blocks: int) -> None:
        from ectransport.data.nixl import _import_nixl, new_agent
        from ectransport.store import HostRegion

        nixl_agent, nixl_agent_config = _import_nixl()
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.raw = new_agent(nixl_agent, f"raw-adversary-{secrets.token_hex(4)}", config, 100)
        self.raw_region = HostRegion(dest_blocks, self.block_bytes)
        self.raw.register_memory([(self.raw_region.addr, self.raw_region.nbytes, 0, "")], "DRAM")

    def _zero(self) -> None:
        self.region.buf[:] = 0
        if self.raw_region is not None:
            self.raw_region.buf[:] = 0

    def _result(self, started: bool, error: str | None, state: str, nbytes: int,
                dest: Any) -> dict:
        """The outcome of one attempt into ``dest`` (``landed``: all of this process's blocks,
        the plane's and the raw agent's)."""
        bufs = [self.region.buf] + ([self.raw_region.buf] if self.raw_region is not None else [])
        landed = b"".join(bytes(b) for b in bufs)
        return {"started": started, "error": error, "state": state, "nbytes": nbytes,
                "sha256": hashlib.sha256(bytes(dest.buf[:nbytes])).hexdigest(),
                "landed": base64.b64encode(landed).decode("ascii")}

    def close(self) -> None:
        self._disconnect()
        self.plane.close()


def forge_grant(plane: str, plane_grant: bytes, spec: dict, block_bytes: int, endpoint: Any
          ) -> tuple[bytes, int]:
    """The ``plane_grant`` to start with and its payload bytes, per ``spec``:

    * ``{}``: the grant as received;
    * NIXL ``{"descs": [[offset, length], ...]}``: descriptors replaced by byte ranges of the
      producer's declared region (offsets from the declared base);
    * tcp/ucx/shm ``{"token": "own"|"random"|"flip", "blocks": n}``: the grant's token kept, made up,
      or with one bit flipped, and its sizes made ``n`` whole blocks.
    """
    import msgspec

    cls = _grant_class(plane)
    grant = msgspec.msgpack.decode(plane_grant, type=cls)
    if not spec:
        return plane_grant, _grant_nbytes(plane, grant, block_bytes)
    if plane == "nixl":
        descs = [(endpoint.base + o, n) for o, n in spec["descs"]]
        grant = msgspec.structs.replace(grant, descs=descs)
        return msgspec.msgpack.encode(grant), sum(n for _, n in descs)
    token = {"own": grant.token, "random": os.urandom(len(grant.token)),
             "flip": grant.token[:-1] + bytes([grant.token[-1] ^ 1])}[spec["token"]]
    nbytes = int(spec["blocks"]) * block_bytes
    if plane == "ucx":
        grant = msgspec.structs.replace(grant, token=token, nbytes=nbytes,
                                        blocks=int(spec["blocks"]), lens=[nbytes])
    else:
        grant = msgspec.structs.replace(grant, token=token, nbytes=nbytes, runs_bytes=nbytes)
    return msgspec.msgpack.encode(grant), nbytes


def _grant_class(plane: str) -> type:
    if plane == "nixl":
        from ectransport.data.nixl import NixlGrant

        return NixlGrant
    if plane == "tcp":
        from ectransport.data.tcp_wire import TcpGrant

        return TcpGrant
    if plane == "ucx":
        from ectransport.data.ucx import UcxGrant

        return UcxGrant
    if plane == "shm":
        from ectransport_shm.wire import ShmGrant

        return ShmGrant
    raise ValueError(f"no grant forger for plane {plane!r}")


def _grant_nbytes(plane: str, grant: Any, block_bytes: int) -> int:
    if plane == "nixl":
        return sum(n for _, n in grant.descs)
    return int(grant.nbytes)


def main(argv: list[str]) -> int:
    plane, block_bytes, dest_blocks = argv[0], int(argv[1]), int(argv[2])
    # answers go to the original stdout alone; native libraries (UCX logs to fd 1) get stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    adv = Adversary(plane, block_bytes, dest_blocks)
    print(json.dumps({"ready": True, "public_key": adv.public_key,
                      "transport": adv.plane.describe_transport()}), file=answers, flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("cmd")
            if op == "quit":
                break
            try:
                out = getattr(adv, op)(**cmd)
            except Exception as exc:  # noqa: BLE001 - report, let the parent decide
                out = {"exception": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-2000:]}
            print(json.dumps(out), file=answers, flush=True)
    finally:
        adv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
