"""A *hostile* ECTP producer in its own OS process, for the issue-17 tests
(``tests/node/test_hostile_producer.py``): it holds a CURVE key the consumer trusts and answers
with whatever the test asks for — forged Welcome endpoints, grants naming another producer's agent,
region or port, nonsensical leases, floods of unsolicited acks, TCP bytes pushed ahead of time.

    python -m tests.node._hostile_producer        (configuration: one JSON line on stdin)

The control plane is a raw pyzmq ROUTER with CURVE (no ZAP handler: any client key is accepted)
that hand-crafts frames with :mod:`ectransport.protocol`. The data plane is real where a case
needs one: a :class:`NixlPlane` built with ``identity=identity_of(<own public key>)`` (its own
agent, so that a *valid* Welcome can be sent), or a hand-rolled TCP-plane server speaking
:mod:`ectransport.data.tcp_wire` (so that it can misbehave on the stream).

Protocol with the test (JSON lines). First stdin line, the configuration::

    {"public": Z85, "secret": Z85, "plane": "nixl"|"tcp", "block_bytes": 512,
     "region_blocks": 1024, "nixl_agent": bool, "silent_listener": bool,
     "honest_endpoints": {"nixl": hex, "tcp": hex}, "versions": [1] | [1, 2]}

``versions`` (default ``[1]``): the ECTP versions the Welcome offers (the highest common one is
chosen). On a v2 session requests come as ``ReqBatch`` and are answered with ``AckBatch`` frames:
the items not held in one frame (in request order), each held one in a frame of its own on
``release``; SPEC keys for v2 (besides the v1 ones, which apply per item): ``inline`` (answer OK
with the entry's bytes, :func:`hostile_rows`, and no grant), ``inline_pad`` (that many extra
bytes appended to the inline data), ``inline_and_grant`` (inline data *and* a valid grant),
``stray_batch`` (that many answers for this item in AckBatch frames of batch ids never sent,
before the answer), ``not_in_batch`` (that many items for mm_hashes the batch never named,
added to its answer frame), ``dups_after`` (the answer frame sent that many more times: second
answers). A held v2 item (``hold``) is named in one ``Parked`` frame of its batch (after the
batch's answer frame, as a producer waiting for readiness does) unless ``no_park`` (then it is a
silent, hung producer for that item); more ``Parked`` keys: ``park_twice`` (that Parked frame
sent that many more times), ``park_stray`` (that many Parked frames naming 64 items, for batch
ids never sent, and as many naming 64 items the batch never named, before the answer),
``park_after`` (that many Parked frames naming the item after its answer).

stdout then gets ``{"ready": true, "port", "public_key", "identity", "tcp_port", "silent_port"}``.
Later stdin lines are commands, each answered by one ``{"reply": <cmd>, ...}`` line:

* ``{"cmd": "welcome", "endpoint": MODE}`` — what the next Welcomes declare (see
  :meth:`Hostile.endpoint_for`; default ``"own"``).
* ``{"cmd": "acks", "specs": {mm_hash: SPEC}}`` — how to answer requests for these mm_hashes
  (unknown ones get NACK_MISSING). SPEC keys: ``grant`` (kind, see :meth:`Hostile.grant_for`),
  ``rows``, ``seed``, ``lease_s``, ``port`` (for ``grant: "port"``), ``status: "missing"``,
  ``hold`` (never answer until ``release``), ``flood`` / ``flood_foreign`` (that many
  unsolicited OK acks with the requester's / another session id, sent before the answer),
  ``dups_after`` (copies of the answer sent after it), ``push`` (TCP: ``"extra"``: a forged reply
  of the same size follows the payload in the same send; ``"ahead"``: it is kept for ``push``).
* ``{"cmd": "release", "copies": n}`` — answer every held request now, ``n`` times each.
* ``{"cmd": "push", "mm_hash": m}`` — send the forged reply kept for ``m`` (``push: "ahead"``) on
  the connection that served it, once the consumer's kernel acknowledged it (send queue empty).
* ``{"cmd": "stats"}`` — counters: frames by kind, requests per mm_hash, every XferDone
  ``[mm_hash, grant_id, ok]``, TCP connections/requests, silent-listener connections.
* ``{"cmd": "exit"}`` (or end of input) — close and exit 0.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import random
import socket
import struct
import sys
import termios
import threading
import time

import msgspec
import numpy as np

#: Grant kinds whose data the child really holds (their bytes are :func:`hostile_rows`).
DATA_KINDS = ("valid",)


def hostile_rows(rows: int, block_bytes: int, seed: int) -> np.ndarray:
    """The hostile producer's deterministic payload: ``rows × block_bytes`` random bytes (uint8,
    1-D). Pure numpy, so child and test compute the same bytes."""
    return np.random.default_rng(seed).integers(0, 256, rows * block_bytes, dtype=np.uint8)


class _Out:
    """Thread-safe JSON lines on stdout."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, obj: dict) -> None:
        with self.lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()


class SilentListener:
    """Accepts TCP connections and never writes a byte (no ZMTP greeting)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # held open, silent


class RawTcpServer:
    """A TCP-plane producer written by hand: it speaks ``tcp_wire`` but may push bytes nobody
    asked for. ``tokens`` maps a grant token to ``(payload, push, fake)``."""

    def __init__(self, out: _Out) -> None:
        from ectransport.data.serving import frame
        from ectransport.data.tcp_wire import (
            STATUS_OK,
            STATUS_UNKNOWN_GRANT,
            TCP_WIRE_VERSION,
            TcpReply,
            recv_exact,
            request_decoder,
        )

        self._w = (STATUS_OK, STATUS_UNKNOWN_GRANT, TCP_WIRE_VERSION, TcpReply, recv_exact,
                   request_decoder, frame)
        self.out = out
        self.lock = threading.Lock()
        self.tokens: dict[bytes, tuple[bytes, str | None, bytes]] = {}
        self.conns = 0
        self.requests = 0
        self.served: dict[bytes, tuple[socket.socket, bytes]] = {}  # token -> (conn, forged)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def push_ahead(self, token: bytes) -> int:
        """Send the forged reply kept for ``token`` on the connection that served it (idle now,
        back in the consumer's pool) and wait until the consumer's kernel acknowledged it; the
        number of bytes pushed."""
        with self.lock:
            conn, forged = self.served.pop(token)
        conn.sendall(forged)
        _wait_acked(conn, 5.0)
        return len(forged)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.conns += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        ok, unknown, ver, reply, recv_exact, request_decoder, frame = self._w
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = recv_exact(conn, 4, 600.0, 30.0)
                req = request_decoder.decode(recv_exact(conn, int.from_bytes(head, "big"),
                                                        30.0, 30.0))
                with self.lock:
                    self.requests += 1
                    spec = self.tokens.get(req.token)
                if spec is None:
                    conn.sendall(frame(reply(ver, unknown, 0, "unknown grant")))
                    continue
                payload, push, fake = spec
                forged = frame(reply(ver, ok, len(fake))) + fake
                if push == "ahead":  # kept for a reply to a request nobody has sent yet; noted
                    with self.lock:  # before the reply, so a ``push`` after it always finds it
                        self.served[req.token] = (conn, forged)
                conn.sendall(frame(reply(ver, ok, len(payload))) + payload
                             + (forged if push == "extra" else b""))
        except (OSError, ValueError, msgspec.DecodeError):
            pass
        finally:
            conn.close()


def _wait_acked(conn: socket.socket, timeout_s: float) -> None:
    """Until the peer's kernel acknowledged everything sent on ``conn`` (its send queue is empty:
    the bytes sit in the consumer's receive buffer), or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queued = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ,
                                                struct.pack("i", 0)))[0]
        if queued == 0:
            return
        time.sleep(0.001)  # a poll interval: the kernel signals no event when its queue drains


class Hostile:
    """The ROUTER loop and the forgeries (see the module docstring)."""

    def __init__(self, cfg: dict, out: _Out) -> None:
        import zmq

        from ectransport.data.base import identity_of
        from ectransport.store import HostRegion

        self.zmq = zmq
        self.out = out
        self.public, self.secret = cfg["public"], cfg["secret"]
        self.identity = identity_of(self.public)
        self.plane = cfg["plane"]
        self.bb = int(cfg["block_bytes"])
        self.honest = {k: bytes.fromhex(v) for k, v in cfg.get("honest_endpoints", {}).items()}
        self.region = HostRegion(int(cfg.get("region_blocks", 1024)), self.bb)
        self.region.buf[:] = 0
        self.next_block = 0
        self.nixl = None
        self.tcp = None
        if self.plane == "nixl" and cfg.get("nixl_agent", True):
            from ectransport.data.nixl import NixlPlane

            self.nixl = NixlPlane(node_id="hostile", region=self.region, identity=self.identity)
        if self.plane == "tcp":
            self.tcp = RawTcpServer(out)
        self.silent = SilentListener() if cfg.get("silent_listener") else None

        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)  # a flood is queued, never dropped
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.CURVE_SERVER, 1)
        self.router.setsockopt(zmq.CURVE_SECRETKEY, self.secret.encode("ascii"))
        self.router.bind("tcp://127.0.0.1:0")
        self.port = int(self.router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])

        self.welcome_mode = "own"
        self.specs: dict[str, dict] = {}
        self.held: list[tuple] = []  # (rid, XferReq) or (rid, ReqBatch, mm_hash)
        self.frames: collections.Counter[str] = collections.Counter()
        self.reqs: collections.Counter[str] = collections.Counter()
        self.dones: list[list] = []
        self.tokens: dict[str, bytes] = {}  # mm_hash -> token of its latest TCP grant
        self.versions = [int(v) for v in cfg.get("versions", [1])]
        self.version = 1  # negotiated with the latest Hello
        self.batches: list[list] = []  # every ReqBatch: [batch_id, wait_s, inline_max, n items]

    # -- forgeries -------------------------------------------------------------------------------
    def endpoint_for(self, mode: str) -> bytes:
        """What a Welcome declares. ``own``: this process's real plane endpoint; ``none``: nothing.
        NIXL: ``honest`` (the honest producer's declaration, verbatim), ``honest-relabeled`` (it,
        with this producer's identity), ``honest-meta`` (an agent name carrying this identity over
        the honest agent's metadata). TCP: ``honest`` (verbatim), ``honest-port`` (this identity,
        the honest producer's port on the same host), ``other-host`` (this identity, another host).
        """
        from ectransport.data.binding import ENDPOINT_VERSION
        from ectransport.data.nixl import NixlEndpoint, _endpoint_decoder
        from ectransport.data.tcp_wire import TcpEndpoint, endpoint_decoder

        enc = msgspec.msgpack.encode
        if mode == "none":
            return b""
        if mode == "honest":
            return self.honest[self.plane]
        if self.plane == "nixl":
            if mode == "own":
                return self.nixl.endpoint()
            h = _endpoint_decoder.decode(self.honest["nixl"])
            agent = h.agent if mode == "honest-relabeled" else f"hostile-{self.identity}-deadbeef"
            return enc(NixlEndpoint(agent, h.conn, self.identity, h.mem_kind, h.dev_id, h.base,
                                    h.nbytes, h.scope))
        host, port = "127.0.0.1", self.tcp.port
        if mode == "honest-port":
            port = endpoint_decoder.decode(self.honest["tcp"]).port
        elif mode == "other-host":
            host = "10.255.255.1"
        return enc(TcpEndpoint(ENDPOINT_VERSION, host, port, "hostile", self.identity))

    def _place(self, rows: int, seed: int):
        from ectransport.store import Run

        run = Run(self.next_block, rows)
        self.next_block += rows
        if self.next_block > self.region.num_blocks:
            raise RuntimeError("hostile region full")
        self.region.write([run], hostile_rows(rows, self.bb, seed))
        return run

    def grant_for(self, spec: dict) -> tuple[bytes, int, int]:
        """``(plane_grant, entry_bytes, block_bytes)`` for a grant kind.

        NIXL: ``valid`` (own blocks holding :func:`hostile_rows`), ``honest-agent`` (the honest
        agent, its metadata and region), ``honest-agent-bare`` (the same without metadata: the
        start of the honest region, as far as the consumer loaded it), ``honest-region`` (own agent and metadata, the honest
        region's address), ``beyond`` (just past the declared region), ``addr-max`` (address
        2**64-1), ``foreign-meta`` (own agent name, the honest agent's metadata), ``unregistered``
        (inside the declared region, outside the registration the grant's metadata names).
        TCP: ``valid``, ``port`` (spec["port"]), ``honest-port``, ``host`` (127.0.0.2), ``node``
        (another node id). Both: ``layout`` (another block size).
        """
        from ectransport.data.nixl import NixlGrant, _endpoint_decoder, _grant_decoder
        from ectransport.data.serving import new_token
        from ectransport.data.tcp_wire import TcpGrant, endpoint_decoder

        kind = spec.get("grant", "valid")
        rows = int(spec.get("rows", 4))
        nbytes = rows * self.bb
        enc = msgspec.msgpack.encode
        if kind == "layout":
            return b"\x00", nbytes, self.bb * 2
        if self.plane == "nixl":
            run = self._place(rows, int(spec.get("seed", 0)))
            own = _grant_decoder.decode(self.nixl.describe([run], nbytes))
            if kind == "valid":
                return enc(own), nbytes, self.bb
            h = _endpoint_decoder.decode(self.honest["nixl"])
            agent, meta, addr = own.agent, own.meta, own.descs[0][0]
            if kind == "honest-agent":
                agent, meta, addr = h.agent, h.conn, h.base
            elif kind == "honest-agent-bare":  # no metadata: only what the consumer has loaded
                agent, meta, addr = h.agent, b"", h.base
            elif kind == "honest-region":
                addr = h.base
            elif kind == "beyond":
                addr = self.region.addr + self.region.nbytes
            elif kind == "addr-max":
                addr = 2**64 - 1
            elif kind == "foreign-meta":
                meta = h.conn
            elif kind == "unregistered":
                addr = self.region.addr + self.next_block * self.bb
                self._place(rows, 0)
            else:
                raise ValueError(f"unknown nixl grant kind {kind!r}")
            return enc(NixlGrant(agent, meta, own.mem_kind, own.dev_id, [(addr, nbytes)])), \
                nbytes, self.bb
        token = new_token()
        host, port, node = "127.0.0.1", self.tcp.port, "hostile"
        if kind == "valid":
            payload = hostile_rows(rows, self.bb, int(spec.get("seed", 0))).tobytes()
            fake = hostile_rows(rows, self.bb, 999_999).tobytes()  # same size as the real one
            with self.tcp.lock:
                self.tcp.tokens[token] = (payload, spec.get("push"), fake)
            self.tokens[spec["mm_hash"]] = token
        elif kind == "port":
            port = int(spec["port"])
        elif kind == "honest-port":
            port = endpoint_decoder.decode(self.honest["tcp"]).port
        elif kind == "host":
            host = "127.0.0.2"
        elif kind == "node":
            node = "honest"
        else:
            raise ValueError(f"unknown tcp grant kind {kind!r}")
        return enc(TcpGrant(host, port, token, nbytes, nbytes, node)), nbytes, self.bb

    # -- frames ----------------------------------------------------------------------------------
    def send(self, rid: bytes, msg) -> None:
        from ectransport.protocol import encode

        self.router.send_multipart([rid, encode(msg)])

    def ack(self, session_id: str, mm_hash: str, spec: dict):
        from ectransport.protocol import Grant, Status, XferAck

        if spec.get("status") == "missing":
            return XferAck(v=1, session_id=session_id, mm_hash=mm_hash,
                           status=Status.NACK_MISSING, grant=None, detail="hostile: missing")
        if spec.get("grant") == "none":
            return XferAck(v=1, session_id=session_id, mm_hash=mm_hash, status=Status.OK,
                           grant=None, detail="")
        plane_grant, nbytes, bb = self.grant_for({**spec, "mm_hash": mm_hash})
        grant = Grant(grant_id=random.getrandbits(63), entry_bytes=nbytes,
                      num_blocks=-(-nbytes // bb), block_bytes=bb,
                      lease_s=float(spec.get("lease_s", 30.0)), plane=self.plane,
                      plane_grant=plane_grant)
        return XferAck(v=1, session_id=session_id, mm_hash=mm_hash, status=Status.OK,
                       grant=grant, detail="")

    def ack_item(self, mm_hash: str, spec: dict, inline_max: int):
        """v2: the AckItem for one item, as :meth:`ack` answers an XferReq (plus ``inline``)."""
        from ectransport.protocol import AckItem, Status

        if spec.get("inline") or spec.get("inline_and_grant"):
            rows = int(spec.get("rows", 4))
            data = hostile_rows(rows, self.bb, int(spec.get("seed", 0))).tobytes()
            data += b"\x07" * int(spec.get("inline_pad", 0))
            grant = self.ack("", mm_hash, spec).grant if spec.get("inline_and_grant") else None
            return AckItem(mm_hash=mm_hash, status=Status.OK, grant=grant, data=data, detail="")
        a = self.ack("", mm_hash, spec)
        return AckItem(mm_hash=mm_hash, status=a.status, grant=a.grant, data=b"",
                       detail=a.detail)

    def on_batch(self, rid: bytes, msg) -> None:
        """v2: answer a ReqBatch (see the module docstring)."""
        from ectransport.protocol import AckBatch, AckItem, Parked, Status

        def park(batch_id: int, names: list[str]) -> Parked:
            return Parked(v=2, session_id=msg.session_id, batch_id=batch_id, items=names[:64],
                          wait_s=msg.wait_s)

        self.frames["reqs"] += 1
        self.batches.append([msg.batch_id, msg.wait_s, msg.inline_max, len(msg.items)])
        now_items, extra, dups = [], [], 0
        parked, park_copies, after = [], 0, []
        for it in msg.items:
            self.reqs[it.mm_hash] += 1
            spec = self.specs.get(it.mm_hash, {"status": "missing"})
            for i in range(int(spec.get("park_stray", 0))):
                self.send(rid, park(msg.batch_id + 2_000_000 + i,
                                    [f"stray-{j}" for j in range(64)]))
                self.send(rid, park(msg.batch_id, [f"unasked-{i}-{j}" for j in range(64)]))
            after += [it.mm_hash] * int(spec.get("park_after", 0))
            if spec.get("hold"):
                self.held.append((rid, msg, it.mm_hash))
                if not spec.get("no_park"):
                    parked.append(it.mm_hash)
                    park_copies = max(park_copies, int(spec.get("park_twice", 0)))
                continue
            for i in range(int(spec.get("stray_batch", 0))):
                self.send(rid, AckBatch(v=2, session_id=msg.session_id,
                                        batch_id=msg.batch_id + 1_000_000 + i,
                                        items=[self.ack_item(it.mm_hash, spec, msg.inline_max)]))
            for i in range(int(spec.get("not_in_batch", 0))):
                extra.append(AckItem(mm_hash=f"unasked-{i}", status=Status.OK, grant=None,
                                     data=b"\x01" * self.bb, detail=""))
            dups = max(dups, int(spec.get("dups_after", 0)))
            now_items.append(self.ack_item(it.mm_hash, spec, msg.inline_max))
        items = (now_items + extra)[:64]
        if items:
            answer = AckBatch(v=2, session_id=msg.session_id, batch_id=msg.batch_id, items=items)
            for _ in range(1 + dups):
                self.send(rid, answer)
        if parked:
            for _ in range(1 + park_copies):
                self.send(rid, park(msg.batch_id, parked))
        for mm in after:
            self.send(rid, park(msg.batch_id, [mm]))

    def on_frame(self, rid: bytes, data: bytes) -> None:
        from ectransport.protocol import (
            SUPPORTED_VERSIONS,
            DoneBatch,
            FrameError,
            Grant,
            Hello,
            Nack,
            Renew,
            ReqBatch,
            Status,
            Welcome,
            XferAck,
            XferDone,
            XferReq,
            decode,
        )

        try:
            msg = decode(data, versions=sorted({*SUPPORTED_VERSIONS, *self.versions}))
        except FrameError:
            self.frames["bad"] += 1
            return
        if isinstance(msg, Hello):
            self.frames["hello"] += 1
            self.version = max(set(self.versions) & set(msg.versions), default=1)
            self.send(rid, Welcome(
                v=1, session_id=msg.session_id, node_id="hostile", status=Status.OK,
                version=self.version, plane=self.plane, versions=self.versions,
                planes=[self.plane], compat_hash=msg.compat_hash,
                detail="", endpoint=self.endpoint_for(self.welcome_mode)))
        elif isinstance(msg, ReqBatch):
            self.on_batch(rid, msg)
        elif isinstance(msg, XferReq):
            self.frames["req"] += 1
            self.reqs[msg.mm_hash] += 1
            spec = self.specs.get(msg.mm_hash, {"status": "missing"})
            if spec.get("hold"):
                self.held.append((rid, msg))
                return
            bogus = Grant(grant_id=1, entry_bytes=self.bb, num_blocks=1, block_bytes=self.bb,
                          lease_s=30.0, plane=self.plane, plane_grant=b"\x00")
            for i in range(int(spec.get("flood", 0))):
                self.send(rid, XferAck(v=1, session_id=msg.session_id, mm_hash=f"unasked-{i}",
                                       status=Status.OK, grant=bogus, detail=""))
            for _ in range(int(spec.get("flood_foreign", 0))):
                self.send(rid, XferAck(v=1, session_id="f" * 32, mm_hash=msg.mm_hash,
                                       status=Status.OK, grant=bogus, detail=""))
            answer = self.ack(msg.session_id, msg.mm_hash, spec)
            for _ in range(1 + int(spec.get("dups_after", 0))):
                self.send(rid, answer)
        elif isinstance(msg, XferDone):
            self.frames["done"] += 1
            self.dones.append([msg.mm_hash, msg.grant_id, msg.ok])
        elif isinstance(msg, DoneBatch):  # v2: a step's completions in one frame
            self.frames["dones"] += 1
            self.dones += [[it.mm_hash, it.grant_id, it.ok] for it in msg.items]
        elif isinstance(msg, Renew):
            self.frames["renew"] += 1
        elif isinstance(msg, Nack):
            self.frames["nack"] += 1
        else:
            self.frames[type(msg).__name__] += 1

    # -- commands --------------------------------------------------------------------------------
    def command(self, cmd: dict) -> bool:
        """Run one command; a failing one is answered with its error (the child keeps serving)."""
        try:
            return self.on_command(cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            self.out({"reply": cmd.get("cmd"), "error": f"{type(exc).__name__}: {exc}"})
            return True

    def on_command(self, cmd: dict) -> bool:
        name = cmd.get("cmd")
        if name == "welcome":
            self.welcome_mode = cmd["endpoint"]
            self.out({"reply": name})
        elif name == "acks":
            self.specs.update(cmd["specs"])
            self.out({"reply": name})
        elif name == "release":
            from ectransport.protocol import AckBatch

            held, self.held = self.held, []
            for rid, req, *item in held:
                if item:  # a v2 item: its own AckBatch frame of the batch that asked
                    spec = {**self.specs[item[0]], "hold": False}
                    answer = AckBatch(v=2, session_id=req.session_id, batch_id=req.batch_id,
                                      items=[self.ack_item(item[0], spec, req.inline_max)])
                else:
                    answer = self.ack(req.session_id, req.mm_hash,
                                      {**self.specs[req.mm_hash], "hold": False})
                for _ in range(int(cmd.get("copies", 1))):
                    self.send(rid, answer)
            self.out({"reply": name, "released": len(held)})
        elif name == "push":
            self.out({"reply": name, "bytes": self.tcp.push_ahead(self.tokens[cmd["mm_hash"]])})
        elif name == "stats":
            self.out({"reply": name, "frames": dict(self.frames), "reqs": dict(self.reqs),
                      "dones": self.dones, "batches": self.batches, "version": self.version,
                      "tcp_conns": self.tcp.conns if self.tcp else 0,
                      "tcp_requests": self.tcp.requests if self.tcp else 0,
                      "silent_conns": len(self.silent.conns) if self.silent else 0})
        elif name == "exit":
            return False
        else:
            self.out({"reply": name, "error": f"unknown command {name!r}"})
        return True

    def run(self, lines: _Lines) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(lines.fd, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll(1000):
                if sock is self.router:
                    while True:
                        try:
                            rid, data = self.router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.on_frame(rid, data)
                else:
                    more = lines.fill()
                    while (line := lines.pop()) is not None:
                        if line.strip() and not self.command(json.loads(line)):
                            return
                    if not more:
                        return

    def close(self) -> None:
        self.router.close(linger=0)
        self.ctx.destroy(linger=0)
        if self.nixl is not None:
            self.nixl.close()


class _Lines:
    """Lines from stdin, read with ``os.read`` (no hidden buffer, so ``fd`` can be polled)."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.buf = b""

    def fill(self) -> bool:
        """Read what is there (blocks if nothing is); False at end of input."""
        chunk = os.read(self.fd, 65536)
        self.buf += chunk
        return bool(chunk)

    def pop(self) -> bytes | None:
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        return line


def main() -> int:
    out = _Out()
    lines = _Lines()
    while (first := lines.pop()) is None:
        if not lines.fill():
            return 1
    h = Hostile(json.loads(first), out)
    try:
        out({"ready": True, "port": h.port, "public_key": h.public, "identity": h.identity,
             "tcp_port": h.tcp.port if h.tcp else None,
             "silent_port": h.silent.port if h.silent else None})
        h.run(lines)
    finally:
        h.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
