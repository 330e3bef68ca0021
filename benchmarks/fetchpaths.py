"""The paths the benchmark measures, each ``name``, ``one(size_index, slot) -> seconds`` and
(pipelined) ``window(size_index, k, m) -> seconds``, ``close()``: ectransport's consumer over each
plane (:class:`EctPath`, and on the producer's tickets :class:`AnnouncedPath`), the raw planes
without ectransport (:class:`RawNixl`, :class:`RawTcp`, :class:`RawUcxx`), single-core
:class:`Memcpy` and vLLM ECExampleConnector's :class:`Safetensors` path. The producer halves are
in ``server.py``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import socket
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

import numpy as np
from common import BLOCK, FETCH_PHASES, HIDDEN, RAW_NIXL_DELAY_US, ROWS_HEADER, log, nixl_env

from ectransport.settings_schema import ConsumerSettings, NodeSettings


class EctPath:
    def __init__(self, name: str, plane: str, curve: bool, ect: dict, consumer_secret: str,
                 sizes: list[int], max_k: dict[int, int], versions: tuple[int, ...] | None = None,
                 offers: bool = False):
        """``ect``: what the server's ``open kind=ect`` answered (port, public_key);
        ``versions``: the ECTP versions the consumer speaks (None: the build's; ``(1,)``: the v1
        path); ``offers``: take the producer's offers (a fetch then reads an offered entry
        with no request: :class:`AnnouncedPath`); off, every fetch measures the request path."""
        from ectransport.node.common import Layout, Security
        from ectransport.node.consumer import ConsumerNode, ProducerAddress

        self.name, self.plane, self.curve = name, plane, curve
        self.addr = ProducerAddress("127.0.0.1", ect["port"], ect["public_key"] if curve else None)
        sec = Security.from_files(consumer_secret) if curve else Security(insecure=True)
        # landing region: max_k[i] entries of size i in flight, plus one being given back
        need = max(-(-sizes[i] // BLOCK) * (k + 1) for i, k in max_k.items())
        with nixl_env() if plane == "nixl" else contextlib.nullcontext():
            node = NodeSettings(planes=(plane,)) if versions is None else \
                NodeSettings(planes=(plane,), versions=versions)
            self.node = ConsumerNode(
                layout=Layout(hidden=HIDDEN), security=sec, node=node,
                settings=ConsumerSettings(region_bytes=need * BLOCK + BLOCK, fetch_timeout_s=60.0,
                                          offers=offers))
        self.node.connect(self.addr, timeout_s=30.0)
        self.transport = self.node.plane_transports().get(plane, plane)
        self.rtts: list[float] = []
        #: size index -> fetch phase -> seconds (``Fetched.timings`` deltas), when not None
        self.breakdown: dict[int, dict[str, list[float]]] | None = None

    def one(self, i: int, slot: int) -> float:
        t0 = time.perf_counter()
        out = self.node.fetch(self.addr, f"s{i}-c{slot}")
        dt = time.perf_counter() - t0
        if not out.ok:
            raise RuntimeError(f"{self.name}: fetch missed: {out.reason} {out.detail}")
        t = out.timings
        if "ack" in t and "req" in t:
            self.rtts.append(t["ack"] - t["req"])
        if self.breakdown is not None:
            prev, mine = 0.0, self.breakdown.setdefault(i, {})
            for ph in FETCH_PHASES:
                if ph in t:
                    mine.setdefault(ph, []).append(t[ph] - prev)
                    prev = t[ph]
            mine.setdefault("wall", []).append(dt)
        del out  # zero copy: dropping the Fetched returns its blocks to the region
        return dt

    def batch(self, i: int, n: int) -> float:
        """n distinct entries of size i asked for together (``fetch_many``: one ReqBatch on
        ECTP v2, n XferReqs on v1; driven on this thread, as ``one`` drives ``fetch``), until
        all landed; wall seconds."""
        t0 = time.perf_counter()
        outs = self.node.fetch_many(self.addr, [f"s{i}-c{slot}" for slot in range(n)])
        dt = time.perf_counter() - t0
        bad = [r for r in outs if not r.ok]
        if bad:
            raise RuntimeError(f"{self.name}: batch fetch missed: {bad[0].reason} "
                               f"{bad[0].detail}")
        del outs  # the Fetched hold their landing blocks: drop them first
        return dt

    def window(self, i: int, k: int, m: int) -> float:
        """m fetches of size i with k in flight (one distinct key per slot); wall seconds."""
        node, addr = self.node, self.addr
        left = m
        t0 = time.perf_counter()
        pending = {}
        for slot in range(min(k, m)):
            pending[node.submit(addr, f"s{i}-c{slot}")] = slot
            left -= 1
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            free = []
            for f in done:
                free.append(pending.pop(f))
                r = f.result()
                if not r.ok:
                    raise RuntimeError(f"{self.name}: fetch missed: {r.reason} {r.detail}")
            # a Future holds its Fetched (and so the pinned landing blocks): drop both before
            # the next submit so the blocks are back in the region first
            del done, f, r
            for slot in free:
                if left:
                    pending[node.submit(addr, f"s{i}-c{slot}")] = slot
                    left -= 1
        return time.perf_counter() - t0

    def close(self) -> None:
        self.node.close()
        self.node = None


class AnnouncedPath(EctPath):
    """An ectransport consumer fetching on the producer's tickets (ECTP v2 §10): every entry was
    announced by the producer, so each fetch READs at once on the offer its session holds, with
    no request (``ect-<plane>-announced``)."""

    def __init__(self, name: str, plane: str, curve: bool, ect: dict, *args, **kw):
        super().__init__(name, plane, curve, ect, *args, offers=True, **kw)
        from ectransport.protocol import Ticket

        self.tickets = {mm: Ticket(producer=p, hold_id=h, mm_hash=mm)
                        for mm, (p, h) in (ect.get("tickets") or {}).items()}
        deadline = time.monotonic() + 30.0  # the holds' offers, replayed at the first Sync
        while self.node.stats()["offers_held"] < len(self.tickets) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        self.offered = self.node.stats()["offers_held"]

    def one(self, i: int, slot: int) -> float:
        mm = f"s{i}-c{slot}"
        t0 = time.perf_counter()
        out = self.node.fetch(self.addr, mm, ticket=self.tickets.get(mm))
        dt = time.perf_counter() - t0
        if not out.ok:
            raise RuntimeError(f"{self.name}: fetch missed: {out.reason} {out.detail}")
        del out
        return dt

    def batch(self, i: int, n: int) -> float:
        names = [f"s{i}-c{slot}" for slot in range(n)]
        t0 = time.perf_counter()
        outs = self.node.fetch_many(self.addr, names,
                                    tickets=[self.tickets.get(m) for m in names])
        dt = time.perf_counter() - t0
        bad = [r for r in outs if not r.ok]
        if bad:
            raise RuntimeError(f"{self.name}: batch fetch missed: {bad[0].reason}")
        del outs
        return dt


def _slots(n: int, nbytes: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        b = np.empty(nbytes, np.uint8)
        b[::4096] = 0
        out.append(b)
    return out


class RawNixl:
    _ids = itertools.count()

    def __init__(self, r: dict, sizes: list[int], slots: int, delay_us: int = RAW_NIXL_DELAY_US):
        """``delay_us``: the agent's progress-thread pause (µs; 0 = NIXL's spinning default)."""
        from nixl._api import nixl_agent, nixl_agent_config

        from ectransport.data.nixl import new_agent

        self.name = "raw-nixl"
        self.remote = r["agent"]
        self.descs = r["descs"]
        with nixl_env():
            self.agent = new_agent(nixl_agent, f"bench-raw-consumer-{next(self._ids)}",
                                   nixl_agent_config(backends=["UCX"]), delay_us)
        self.bufs = _slots(slots, max(sizes))
        self.reg = self.agent.register_memory(
            [(int(b.ctypes.data), b.nbytes, 0, "") for b in self.bufs], "DRAM")
        self.agent.add_remote_agent(base64.b64decode(r["meta"]))
        self.transport = "nixl/UCX (raw agents)"

    def _post(self, i: int, slot: int):
        addr, n = self.descs[i]
        ldl = self.agent.get_xfer_descs([(int(self.bufs[slot].ctypes.data), n, 0)], "DRAM")
        rdl = self.agent.get_xfer_descs([(addr, n, 0)], "DRAM")
        x = self.agent.initialize_xfer("READ", ldl, rdl, self.remote, b"")
        st = self.agent.transfer(x)
        if st == "ERR":
            raise RuntimeError("raw nixl: transfer failed")
        return x

    def _poll(self, x) -> bool:
        st = self.agent.check_xfer_state(x)
        if st == "ERR":
            raise RuntimeError("raw nixl: transfer failed")
        if st == "DONE":
            x.release()
            return True
        return False

    def one(self, i: int, slot: int) -> float:
        t0 = time.perf_counter()
        x = self._post(i, slot % len(self.bufs))
        while not self._poll(x):
            pass
        return time.perf_counter() - t0

    def window(self, i: int, k: int, m: int) -> float:
        t0 = time.perf_counter()
        left = m
        live = []
        for slot in range(min(k, m)):
            live.append((self._post(i, slot), slot))
            left -= 1
        while live:
            nxt = []
            for x, slot in live:
                if self._poll(x):
                    if left:
                        nxt.append((self._post(i, slot), slot))
                        left -= 1
                else:
                    nxt.append((x, slot))
            live = nxt
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.agent.remove_remote_agent(self.remote)
        except Exception:
            pass
        try:
            self.agent.deregister_memory(self.reg)
        except Exception:
            pass
        self.agent = None  # the last reference: the native agent and its progress thread go


class RawTcp:
    def __init__(self, r: dict, sizes: list[int], slots: int):
        self.name = "raw-tcp"
        self.port = r["port"]
        self.sizes = sizes
        self.bufs = _slots(slots, max(sizes))
        self.socks = []
        for _ in range(slots):
            s = socket.create_connection(("127.0.0.1", self.port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(s)
        self.transport = "TCP loopback, sendall/recv_into, 1 connection per in-flight transfer"

    def _get(self, i: int, slot: int) -> None:
        s = self.socks[slot]
        s.sendall(ROWS_HEADER.pack(i))
        view = memoryview(self.bufs[slot])[: self.sizes[i]]
        got, n = 0, self.sizes[i]
        while got < n:
            r = s.recv_into(view[got:])
            if r == 0:
                raise RuntimeError("raw tcp: server closed")
            got += r

    def one(self, i: int, slot: int) -> float:
        t0 = time.perf_counter()
        self._get(i, slot % len(self.socks))
        return time.perf_counter() - t0

    def window(self, i: int, k: int, m: int) -> float:
        per = [m // k + (1 if s < m % k else 0) for s in range(k)]
        t0 = time.perf_counter()
        ths = [threading.Thread(target=lambda s=s: [self._get(i, s) for _ in range(per[s])])
               for s in range(k)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        return time.perf_counter() - t0

    def close(self) -> None:
        for s in self.socks:
            s.close()


class RawUcxx:
    def __init__(self, r: dict, sizes: list[int], slots: int):
        import ucxx

        self.name = "raw-ucx"
        self.sizes = sizes
        self.port = r["port"]
        self.loop = asyncio.new_event_loop()

        async def connect():
            # error handling on, as on the listener (benchmarks/server.py): asked for off on
            # both sides, ucxx 0.52 still connects with it on one side, and UCX refuses the
            # pair ("error handling level mismatch": the peer-info exchange then failed with
            # UCXXMessageTruncatedError). On, UCX keeps bulk data off CMA (as the plane's
            # peer_error_handling=true does): a floor for small entries only
            return [await ucxx.create_endpoint("127.0.0.1", self.port,
                                               endpoint_error_handling=True)
                    for _ in range(slots)]

        self.eps = self.loop.run_until_complete(connect())
        self.bufs = _slots(slots, max(sizes))
        try:
            tls = ucxx.get_active_transports()
        except Exception:
            tls = "?"
        self.transport = f"ucxx tag send/recv, endpoint error handling on ({tls})"

    async def _get(self, i: int, slot: int) -> None:
        ep = self.eps[slot]
        await ep.send(np.frombuffer(ROWS_HEADER.pack(i), np.uint8))
        await ep.recv(self.bufs[slot][: self.sizes[i]])

    def one(self, i: int, slot: int) -> float:
        t0 = time.perf_counter()
        self.loop.run_until_complete(self._get(i, slot % len(self.eps)))
        return time.perf_counter() - t0

    def window(self, i: int, k: int, m: int) -> float:
        per = [m // k + (1 if s < m % k else 0) for s in range(k)]

        async def lane(s: int) -> None:
            for _ in range(per[s]):
                await self._get(i, s)

        async def all_lanes() -> None:
            await asyncio.gather(*(lane(s) for s in range(k)))

        t0 = time.perf_counter()
        self.loop.run_until_complete(all_lanes())
        return time.perf_counter() - t0

    def close(self) -> None:
        async def shut():
            for ep in self.eps:
                try:
                    await ep.close()
                except Exception:
                    pass

        try:
            self.loop.run_until_complete(shut())
        except Exception:
            pass


class Memcpy:
    name = "memcpy"

    def __init__(self, sizes: list[int]):
        rng = np.random.default_rng(1)
        self.src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        self.dst = _slots(1, max(sizes))[0]

    def one(self, i: int, slot: int) -> float:
        src = self.src[i]
        dst = self.dst[: src.nbytes]
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0


class Safetensors:
    """vLLM ECExampleConnector's path: the producer ``save_file``s the tensor into a shared
    directory, the consumer ``load_file``s it (no fsync, as in vLLM); timed save + load."""

    def __init__(self, name: str, directory: Path, sizes: list[int]):
        import torch

        self.name = name
        self.dir = directory
        rng = np.random.default_rng(2)
        self.tensors = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
                        .view(torch.bfloat16).reshape(-1, HIDDEN) for n in sizes]

    def one(self, i: int, slot: int) -> float:
        from safetensors.torch import load_file, save_file

        path = str(self.dir / f"entry-{i}-{slot}.safetensors")
        t0 = time.perf_counter()
        save_file({"ec_cache": self.tensors[i]}, path)
        out = load_file(path)["ec_cache"]
        dt = time.perf_counter() - t0
        del out
        os.unlink(path)
        return dt


RAW = {"nixl": RawNixl, "tcp": RawTcp, "ucx": RawUcxx}


def open_raw(ph, result: dict, plane: str, sizes: list[int], slots: int,
              delay_us: int = RAW_NIXL_DELAY_US):
    """Open plane's raw endpoint on both sides (None, error recorded, if it cannot run);
    ``delay_us``: nixl agents' progress-thread pause on both sides."""
    try:
        r = ph.open(f"raw-{plane}", kind="raw", plane=plane, delay_us=delay_us)
    except Exception as e:
        result["errors"][f"raw-{plane}"] = str(e)
        log(f"raw {plane} unavailable (server side): {e}")
        return None
    try:
        raw = ph.add(RawNixl(r, sizes, slots, delay_us) if plane == "nixl"
                     else RAW[plane](r, sizes, slots))
    except Exception as e:
        result["errors"][f"raw-{plane}"] = f"{type(e).__name__}: {e}"
        log(f"raw {plane} unavailable: {e}")
        ph.close_remote(r["id"])
        return None
    result["transports"][raw.name] = raw.transport
    raw.remote_id = r["id"]
    return raw
