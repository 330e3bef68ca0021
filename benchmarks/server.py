"""Producer side of the ectransport benchmark: run as a separate OS process by ``harness.py``.

    python benchmarks/server.py --config JSON

It is one long-lived process that opens and closes, on the harness's command, what one
measurement phase needs (see :func:`main` for the line protocol) — never more:

* a ProducerNode (CURVE on or off) offering ONE plane, holding ``copies`` distinct entries per
  size (distinct keys, so pipelined fetches of one size never join one another);
* raw NIXL: an agent that registered one pre-touched source buffer per size (the consumer READs
  from it with its own agent: no ectransport code on either side);
* raw TCP: a listener answering ``size index`` requests with ``sendall`` of the source buffer;
* raw ucxx: a listener (ucxx async API) answering the same requests with ``ep.send``;
* a raw pyzmq ROUTER echo (plain or CURVE) for the control-plane round-trip baseline.

Every NIXL agent runs a progress thread (spinning, at NIXL's Python default): hosting all of them
at once (the first version of this benchmark did) starves every measured path on a 2-core host.
The source buffers (pre-touched) are made once at start and shared by every endpoint.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import socket
import sys
import threading
import traceback
from typing import Any

import msgspec
import numpy as np
from common import ROWS_HEADER, nixl_env

from ectransport.settings_schema import NodeSettings, ProducerSettings


def _touch(buf: np.ndarray) -> np.ndarray:
    buf[::4096] = 1
    return buf


def _sources(sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [_touch(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]


# -- raw TCP ----------------------------------------------------------------------------------


def _tcp_server(sources: list[np.ndarray]) -> tuple:
    conns: list[socket.socket] = []
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(ROWS_HEADER.size)
        try:
            while True:
                view = memoryview(hdr)
                got = 0
                while got < len(hdr):
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        return
                    got += n
                (idx,) = ROWS_HEADER.unpack(hdr)
                conn.sendall(memoryview(sources[idx]))
        except OSError:
            return
        finally:
            conn.close()

    def accept() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    def close() -> None:
        with contextlib.suppress(OSError):
            lsock.shutdown(socket.SHUT_RDWR)
        lsock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    threading.Thread(target=accept, daemon=True).start()
    return _Closer(close), {"port": lsock.getsockname()[1]}


# -- raw ucxx ---------------------------------------------------------------------------------


def _ucxx_server(sources: list[np.ndarray]) -> tuple:
    import asyncio

    import ucxx

    ready = threading.Event()
    box: dict = {}

    async def handler(ep) -> None:
        hdr = np.empty(ROWS_HEADER.size, np.uint8)
        try:
            while True:
                await ep.recv(hdr)
                (idx,) = ROWS_HEADER.unpack(hdr.tobytes())
                await ep.send(sources[idx])
        except Exception:  # peer closed
            return

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main() -> None:
            lst = ucxx.create_listener(handler, port=0, endpoint_error_handling=True)
            box["port"] = lst.port
            box["lst"] = lst
            box["stop"] = stop = asyncio.Event()
            box["loop"] = loop
            ready.set()
            await stop.wait()
            lst.close()

        try:
            loop.run_until_complete(main())
        except Exception as e:
            box["error"] = f"{type(e).__name__}: {e}"
            ready.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    ready.wait(30)
    if "port" not in box:
        raise RuntimeError(box.get("error", "ucxx listener did not start"))

    def close() -> None:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        th.join(10)

    return _Closer(close), {"port": int(box["port"])}


# -- raw NIXL ---------------------------------------------------------------------------------


_NIXL_IDS = iter(range(1 << 30))


def _nixl_source(sources: list[np.ndarray], delay_us: int) -> tuple:
    """A raw NIXL agent (UCX backend, progress thread pausing ``delay_us`` µs between passes; 0
    is NIXL's Python default, a spinning thread) that registered the source buffers."""
    from nixl._api import nixl_agent, nixl_agent_config

    from ectransport.data.nixl import new_agent

    name = f"bench-raw-producer-{next(_NIXL_IDS)}"
    with nixl_env():
        box = {"agent": new_agent(nixl_agent, name, nixl_agent_config(backends=["UCX"]),
                                  delay_us)}
    agent = box["agent"]
    reg = agent.register_memory([(int(s.ctypes.data), s.nbytes, 0, "") for s in sources], "DRAM")
    info = {"agent": name, "meta": base64.b64encode(agent.get_agent_metadata()).decode(),
            "descs": [[int(s.ctypes.data), int(s.nbytes)] for s in sources]}
    del agent

    def close() -> None:
        with contextlib.suppress(Exception):
            box["agent"].deregister_memory(reg)
        box.clear()  # the last reference: the native agent and its progress thread go

    return _Closer(close), info


# -- raw pyzmq echo ---------------------------------------------------------------------------


def _zmq_echo(curve: bool) -> tuple:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    out: dict = {}
    if curve:
        pub, sec = zmq.curve_keypair()
        sock.curve_server = True
        sock.curve_secretkey = sec
        sock.curve_publickey = pub
        out["server_key"] = pub.decode()
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    out["port"] = port

    stop = threading.Event()

    def run() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):  # blocks (no spinning); 100 ms only to notice stop
                sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
        sock.close(linger=0)

    th = threading.Thread(target=run, daemon=True)
    th.start()

    def close() -> None:
        stop.set()
        th.join(5)

    return _Closer(close), out


class _Closer:
    def __init__(self, fn):
        self.close = fn


# -- ectransport ------------------------------------------------------------------------------


def _plane_settings(plane: str, options: dict | None) -> Any:
    """The producer's plane settings with ``options`` for ``plane`` (a built-in plane's section,
    or a plugin's free-form options)."""
    from ectransport.settings_schema import PlanesSettings

    if not options:
        return PlanesSettings()
    builtin = plane in {f.name for f in msgspec.structs.fields(PlanesSettings)} - {"plugins"}
    return msgspec.convert({plane: options} if builtin else {"plugins": {plane: options}},
                           PlanesSettings)


def _producer(cfg: dict, sources: list[np.ndarray], plane: str, insecure: bool,
              plane_options: dict | None = None) -> tuple:
    """A started ProducerNode offering ``plane`` (``plane_options``: that plane's constructor
    options, e.g. ``{"grant_scope": "region"}`` for nixl) holding every size's entries."""
    from ectransport.node.common import Layout, Security
    from ectransport.node.producer import ProducerNode

    layout = Layout(hidden=cfg["hidden"], dtype="bfloat16")
    block = layout.block_bytes
    copies = cfg["copies"]
    need = sum(-(-s.nbytes // block) * c for s, c in zip(sources, copies, strict=True))
    sec = Security(insecure=True) if insecure else Security.from_files(
        cfg["producer_secret"], allow_dir=cfg["allow_dir"])
    with nixl_env():  # the UcxPlane passes its UCX options explicitly, it does not need them
        # pin budget = the whole region (default: a quarter): the harness is one consumer
        # identity whose k-deep window of the largest entries must not wait on NACK_BUSY
        # every entry announced once stored (ECTP v2 §10): held for the whole phase (hold_s at
        # its 1 h bound, holds may pin the whole region), so the announced path reads on tickets
        node = ProducerNode(
            layout=layout,
            security=sec,
            plane_settings=_plane_settings(plane, plane_options),
            settings=ProducerSettings(
                region_bytes=(need + 16) * block,
                lease_s=30.0,
                budget_bytes=(need + 16) * block,
                hold_s=3600.0,
                hold_share=1.0,
            ),
            node=NodeSettings(
                planes=(plane,),
                node_id=f"bench-producer-{plane}-"
                + ("plain" if insecure else "curve")
                + "".join(f"-{v}" for v in (plane_options or {}).values()),
            ),
        )
    try:
        node.start()
        for i, (src, c) in enumerate(zip(sources, copies, strict=True)):
            rows = src.reshape(-1, block)
            for k in range(c):
                if not node.put(f"s{i}-c{k}", rows):
                    raise RuntimeError(f"producer region too small for size {src.nbytes} copy {k}")
        tickets = {}
        for mm in [f"s{i}-c{k}" for i, c in enumerate(copies) for k in range(c)]:
            t = node.announce(mm)
            if t is not None and t.hold_id:
                tickets[mm] = [t.producer, t.hold_id]
    except BaseException:
        node.close()
        raise
    return node, {"port": node.port, "public_key": node.public_key,
                  "transports": node.plane_transports(), "tickets": tickets}


def _open(cfg: dict, sources: list[np.ndarray], req: dict) -> tuple:
    """Open one endpoint; returns (object with close(), info for the consumer)."""
    kind = req["kind"]
    if kind == "ect":
        return _producer(cfg, sources, req["plane"], insecure=not req["curve"],
                         plane_options=req.get("plane_options"))
    if kind == "zmq":
        return _zmq_echo(req["curve"])
    if kind == "vllm":  # vLLM's own ECCPUConnector P2P producer (vllm_p2p.py, issue 16)
        import vllm_p2p

        return vllm_p2p.open_producer(cfg, sources, req, nixl_env)
    if kind == "raw":
        plane = req["plane"]
        if plane == "nixl":
            return _nixl_source(sources, int(req.get("delay_us", 0)))
        if plane == "tcp":
            return _tcp_server(sources)
        if plane == "ucx":
            return _ucxx_server(sources)
    raise ValueError(f"unknown endpoint {req}")


def _plane_info(node) -> dict:
    """Scope and live grant registrations of a ProducerNode's nixl plane (read-only)."""
    plane = getattr(node, "_planes", {}).get("nixl")
    if plane is None:
        return {}
    return {"grant_scope": getattr(plane, "grant_scope", None),
            "exposed_registrations": getattr(plane, "exposed_registrations", None)}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    """Serve commands, one JSON object per line on stdin, one JSON reply per line on stdout:

    * ``{"op": "open", "kind": "ect", "plane": P, "curve": B[, "plane_options": {...}]}`` — a
      ProducerNode offering only plane P (CURVE on/off; that plane's constructor options)
      holding every size's entries;
    * ``{"op": "plane", "id": N}`` — what the plane of ProducerNode N reports about itself (nixl:
      ``grant_scope`` and ``exposed_registrations``, the registrations of granted blocks alive);
    * ``{"op": "open", "kind": "raw", "plane": P[, "delay_us": D]}`` — the raw endpoint of plane
      P (nixl: its agent's progress-thread delay, µs);
    * ``{"op": "open", "kind": "zmq", "curve": B}`` — a pyzmq ROUTER echo;
    * ``{"op": "open", "kind": "vllm"[, "delay_us": D]}`` — vLLM's own ECCPUConnector P2P
      producer holding the same entries (``vllm_p2p.Producer``; imports vLLM, seconds; D: its
      agent's progress-thread pause instead of vLLM's spinning default);
    * ``{"op": "close", "id": N}``; ``{"op": "idle", "seconds": S}`` (threads and CPU use while
      idle, to check that nothing left behind spins).

    Nothing is open between phases: the harness opens what one phase needs and closes it after.
    """
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = json.loads(ap.parse_args().config)
    if "ucx" in cfg["planes"]:
        import ectransport.data.ucx  # noqa: F401  (record the user's UCX env before ucxx edits it)
    sources = _sources(cfg["sizes"])
    import gc
    import time

    handles: dict[int, object] = {}
    ids = iter(range(1, 1 << 30))
    print(json.dumps({"ready": {"pid": os.getpid(), "threads": _threads()}}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "open":
                obj, info = _open(cfg, sources, req)
                h = next(ids)
                handles[h] = obj
                reply = {"id": h, "info": info}
            elif op == "close":
                obj = handles.pop(req["id"])
                obj.close()
                del obj
                gc.collect()
                reply = {"closed": req["id"]}
            elif op == "plane":
                reply = _plane_info(handles[req["id"]])
            elif op == "idle":
                c0 = _cpu_s()
                time.sleep(req.get("seconds", 1.0))
                reply = {"threads": _threads(), "cpu_per_s": (_cpu_s() - c0) / req.get(
                    "seconds", 1.0), "open": len(handles)}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            reply = {"error": f"{type(e).__name__}: {e}"}
        reply["threads"] = reply.get("threads", _threads())
        print(json.dumps(reply), flush=True)
    for obj in handles.values():
        try:
            obj.close()
        except Exception:
            pass
    os._exit(0)  # skip slow native destructors (NIXL/UCX) at interpreter exit


if __name__ == "__main__":
    main()
