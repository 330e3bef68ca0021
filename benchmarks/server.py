"""Producer side of the ectransport benchmark: run as a separate OS process by ``harness.py``.

    python benchmarks/server.py --config JSON

It hosts, in one process, everything the consumer (the harness process) measures against:

* ProducerNodes (CURVE on, and with ``--insecure-too`` also plain ZMQ) offering every requested
  plane, each holding ``copies`` distinct entries per size (distinct keys, so pipelined fetches
  of one size never join one another);
* raw NIXL: an agent that registered one pre-touched source buffer per size (the consumer READs
  from it with its own agent: no ectransport code on either side);
* raw TCP: a listener answering ``size index`` requests with ``sendall`` of the source buffer;
* raw ucxx: a listener (ucxx async API) answering the same requests with ``ep.send``;
* raw pyzmq ROUTER echo servers, plain and CURVE, for the control-plane round-trip baseline.

It prints one JSON line ``{"ready": {...}}`` with every address the consumer needs, then serves
until stdin closes (the harness closes it to stop the server).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import socket
import struct
import sys
import threading
import traceback

import numpy as np

ROWS_HEADER = struct.Struct("!q")  # raw tcp / ucxx request: index of the size (int64)


_USER_UCX_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))


@contextlib.contextmanager
def _nixl_env():
    """NIXL agents are created without the UCX_* variables ``import ucxx`` injects (see
    harness.nixl_env: UCX_RNDV_THRESH=8192 slows NIXL READs ~30x here)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ)
             if k.startswith("UCX_") and k not in _USER_UCX_ENV}
    try:
        yield
    finally:
        os.environ.update(saved)


def _touch(buf: np.ndarray) -> np.ndarray:
    buf[::4096] = 1
    return buf


def _sources(sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [_touch(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]


# -- raw TCP ----------------------------------------------------------------------------------


def _tcp_server(sources: list[np.ndarray]) -> int:
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
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return lsock.getsockname()[1]


# -- raw ucxx ---------------------------------------------------------------------------------


def _ucxx_server(sources: list[np.ndarray]) -> int:
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
            lst = ucxx.create_listener(handler, port=0, endpoint_error_handling=False)
            box["port"] = lst.port
            box["lst"] = lst
            ready.set()
            while True:
                await asyncio.sleep(3600)

        try:
            loop.run_until_complete(main())
        except Exception as e:
            box["error"] = f"{type(e).__name__}: {e}"
            ready.set()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(30)
    if "port" not in box:
        raise RuntimeError(box.get("error", "ucxx listener did not start"))
    return int(box["port"])


# -- raw NIXL ---------------------------------------------------------------------------------


def _nixl_source(sources: list[np.ndarray]) -> dict:
    from nixl._api import nixl_agent, nixl_agent_config

    with _nixl_env():
        agent = nixl_agent("bench-raw-producer", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(int(s.ctypes.data), s.nbytes, 0, "") for s in sources], "DRAM")
    _KEEP.append(agent)
    return {"agent": "bench-raw-producer",
            "meta": base64.b64encode(agent.get_agent_metadata()).decode(),
            "descs": [[int(s.ctypes.data), int(s.nbytes)] for s in sources]}


# -- raw pyzmq echo ---------------------------------------------------------------------------


def _zmq_echo(curve: bool) -> dict:
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

    def run() -> None:
        while True:
            try:
                sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
            except zmq.ZMQError:
                return

    threading.Thread(target=run, daemon=True).start()
    _KEEP.append(sock)
    return out


# -- ectransport ------------------------------------------------------------------------------

_KEEP: list = []


def _producer(cfg: dict, sources: list[np.ndarray], insecure: bool) -> dict:
    from ectransport.node.common import Layout, Security
    from ectransport.node.producer import ProducerNode

    layout = Layout(hidden=cfg["hidden"], dtype="bfloat16")
    block = layout.block_bytes
    copies = cfg["copies"]
    need = sum(-(-s.nbytes // block) * c for s, c in zip(sources, copies, strict=True))
    sec = Security(insecure=True) if insecure else Security.from_files(
        cfg["producer_secret"], allow_dir=cfg["allow_dir"])
    with _nixl_env():  # the UcxPlane passes its UCX options explicitly, it does not need them
        node = ProducerNode(layout=layout, region_bytes=(need + 16) * block, security=sec,
                            planes=tuple(cfg["planes"]), lease_s=30.0,
                            node_id="bench-producer-" + ("plain" if insecure else "curve"))
    node.start()
    for i, (src, c) in enumerate(zip(sources, copies, strict=True)):
        rows = src.reshape(-1, block)
        for k in range(c):
            if not node.put(f"s{i}-c{k}", rows):
                raise RuntimeError(f"producer region too small for size {src.nbytes} copy {k}")
    _KEEP.append(node)
    return {"port": node.port, "public_key": node.public_key,
            "transports": node.plane_transports()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = json.loads(ap.parse_args().config)
    sizes = cfg["sizes"]
    planes = cfg["planes"]
    if "ucx" in planes:
        import ectransport.data.ucx  # noqa: F401  (record the user's UCX env before ucxx edits it)
    sources = _sources(sizes)
    info: dict = {"pid": os.getpid(), "raw": {}, "errors": {}}
    info["ect"] = {"curve": _producer(cfg, sources, insecure=False)}
    if cfg.get("insecure_too"):
        info["ect"]["plain"] = _producer(cfg, sources, insecure=True)
    info["raw"]["tcp"] = {"port": _tcp_server(sources)}
    for name, fn in (("nixl", _nixl_source), ("ucx", _ucxx_server)):
        if name not in planes:
            continue
        try:
            r = fn(sources)
            info["raw"][name] = r if isinstance(r, dict) else {"port": r}
        except Exception as e:
            info["errors"][f"raw-{name}"] = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
    info["zmq"] = {"plain": _zmq_echo(False), "curve": _zmq_echo(True)}
    print(json.dumps({"ready": info}), flush=True)
    sys.stdin.read()  # until the harness closes our stdin
    for obj in _KEEP:
        try:
            obj.close()
        except Exception:
            pass
    os._exit(0)  # skip slow native destructors (NIXL/UCX) at interpreter exit


if __name__ == "__main__":
    main()
