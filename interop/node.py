"""A node process of the interop matrix: ``python -m interop.node`` (one per host slot).

It reads one JSON command per line on stdin and answers one JSON line on stdout (native libraries
that print are redirected to stderr). Commands (``op``):

* ``hello`` → the process's versions (python, ectransport, nixl, pyzmq, ucxx, vllm if importable);
* ``vectors {versions}`` → the golden-vector check (:mod:`interop.vectors`) with this codec;
* ``producer.start {id, spec, entries, port, keys}`` → starts a ProducerNode (ECTP),
  a VllmWireProducerNode (vLLM wire) or vLLM's own producer session (vLLM stock), stores the
  entries; answers ``{host, port, public_key, transports}`` or ``{outcome: "refused:<Class>"}``;
* ``consumer.open {id, spec, keys}``; ``consumer.connect {id, producer, timeout_s}``;
  ``consumer.fetch {id, producer, entry, timeout_s}`` → ``{outcome, plane, bytes_ok, seconds}``;
* ``close {id}``; ``exit``.

Entries are ``rows`` random rows of the node's block size drawn from ``seed`` on both sides, so the
consumer verifies bytes with no payload on the control channel (SHA-256 of the rows).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

from interop.spec import ECTP, VLLM_STOCK, VLLM_WIRE, Entry, NodeSpec


def rows_for(entry: Entry, block_bytes: int) -> np.ndarray:
    """The entry's bytes: ``[rows, block_bytes]`` uint8, deterministic from its seed."""
    return np.random.default_rng(entry.seed).integers(0, 256, (entry.rows, block_bytes),
                                                      dtype=np.uint8)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data).hexdigest()


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("ectransport", "nixl", "pyzmq", "ucxx-cu12", "ucxx", "vllm", "ectransport-shm",
                 "msgspec"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    try:
        import zmq

        out["libzmq"] = zmq.zmq_version()
    except ImportError:
        pass
    return out


class Worker:
    def __init__(self) -> None:
        self.nodes: dict[str, Any] = {}
        self.specs: dict[str, NodeSpec] = {}

    # -- helpers -----------------------------------------------------------------------------
    def _security(self, spec: NodeSpec, keys: dict[str, list[str]], producer: bool):
        from ectransport.node import Security

        if not spec.curve:
            return Security(insecure=True)
        pub, sec = keys[spec.key]
        if producer:
            allowed = {keys[k][0] for k in spec.allow}
            return Security(public_key=pub, secret_key=sec, allow=lambda k: k in allowed)
        return Security(public_key=pub, secret_key=sec)

    @staticmethod
    def _layout(spec: NodeSpec):
        from ectransport.node import Layout

        return Layout(model_id=spec.model, dtype=spec.dtype, hidden=spec.hidden)

    # -- ops ---------------------------------------------------------------------------------
    def op_hello(self, cmd: dict) -> dict:
        return {"outcome": "ok", "versions": _versions(), "pid": os.getpid()}

    def op_vectors(self, cmd: dict) -> dict:
        from interop.vectors import check

        return {"outcome": "ok", **check(cmd["versions"])}

    def op_producer_start(self, cmd: dict) -> dict:
        spec = NodeSpec.from_json(cmd["spec"])
        host, port, keys = cmd["host"], int(cmd.get("port") or 0), cmd.get("keys", {})
        entries = [Entry(**e) for e in cmd.get("entries", [])]
        t0 = time.monotonic()
        try:
            if spec.mem_kind != "DRAM":
                from ectransport.errors import PlaneUnavailable

                raise PlaneUnavailable(f"{spec.mem_kind} regions need a GPU; none here")
            if spec.impl == VLLM_STOCK:
                from interop.vllm_side import StockVllmProducer

                node = StockVllmProducer(host=host, port=port or _free_port(host),
                                         model=spec.model, dtype=spec.dtype,
                                         block_bytes=spec.block_bytes,
                                         num_blocks=spec.region_bytes // spec.block_bytes)
                for e in entries:
                    node.put(e.mm_hash, rows_for(e, spec.block_bytes), ready=e.ready)
                out_port, pub, transports = node.port, None, {"vllm-nixl": "vLLM NixlDataTransport"}
            else:
                layout = self._layout(spec)
                sec = self._security(spec, keys, producer=True)
                if spec.impl == VLLM_WIRE:
                    from ectransport.compat.vllm_wire import VllmWireProducerNode

                    node = VllmWireProducerNode(
                        profile=spec.profile, security=sec, layout=layout, host=host, port=port,
                        region_bytes=spec.region_bytes, budget_bytes=spec.budget_bytes,
                        **spec.options)
                else:
                    from ectransport.node import ProducerNode

                    kw = dict(spec.options)
                    if spec.versions:
                        kw["versions"] = spec.versions
                    node = ProducerNode(layout=layout, region_bytes=spec.region_bytes, host=host,
                                        port=port, security=sec, planes=spec.planes,
                                        budget_bytes=spec.budget_bytes, **kw)
                for e in entries:
                    if e.ready:
                        assert node.put(e.mm_hash, rows_for(e, spec.block_bytes)), e
                    else:
                        node.reserve(e.mm_hash, e.rows * spec.block_bytes)
                node.start()
                out_port, pub, transports = node.port, node.public_key, node.plane_transports()
        except Exception as e:  # noqa: BLE001 - reported as the cell's observed outcome
            return {"outcome": f"refused:{type(e).__name__}", "detail": str(e)[:300],
                    "seconds": time.monotonic() - t0}
        self.nodes[cmd["id"]] = node
        self.specs[cmd["id"]] = spec
        return {"outcome": "ok", "host": host, "port": out_port, "public_key": pub,
                "transports": transports, "seconds": time.monotonic() - t0}

    def op_consumer_open(self, cmd: dict) -> dict:
        spec = NodeSpec.from_json(cmd["spec"])
        keys = cmd.get("keys", {})
        t0 = time.monotonic()
        try:
            if spec.mem_kind != "DRAM":
                from ectransport.errors import PlaneUnavailable

                raise PlaneUnavailable(f"{spec.mem_kind} regions need a GPU; none here")
            if spec.impl == VLLM_STOCK:
                from interop.vllm_side import StockVllmConsumer

                node = StockVllmConsumer(model=spec.model, dtype=spec.dtype,
                                         block_bytes=spec.block_bytes,
                                         num_blocks=spec.region_bytes // spec.block_bytes)
            elif spec.impl == VLLM_WIRE:
                from ectransport.compat.vllm_wire import VllmWireConsumer

                node = VllmWireConsumer(profile=spec.profile,
                                        security=self._security(spec, keys, False),
                                        layout=self._layout(spec),
                                        region_bytes=spec.region_bytes, **spec.options)
            else:
                from ectransport.node import ConsumerNode

                kw = dict(spec.options)
                if spec.versions:
                    kw["versions"] = spec.versions
                node = ConsumerNode(layout=self._layout(spec), region_bytes=spec.region_bytes,
                                    security=self._security(spec, keys, False),
                                    planes=spec.planes, **kw)
        except Exception as e:  # noqa: BLE001
            return {"outcome": f"refused:{type(e).__name__}", "detail": str(e)[:300]}
        self.nodes[cmd["id"]] = node
        self.specs[cmd["id"]] = spec
        return {"outcome": "ok", "seconds": time.monotonic() - t0}

    def _address(self, cmd: dict, spec: NodeSpec):
        from ectransport.node import ProducerAddress

        p = cmd["producer"]
        key = p.get("public_key")
        if spec.curve and spec.server_key:
            key = cmd.get("keys", {})[spec.server_key][0]
        return ProducerAddress(p["host"], int(p["port"]), key if spec.curve else None)

    def op_consumer_connect(self, cmd: dict) -> dict:
        node, spec = self.nodes[cmd["id"]], self.specs[cmd["id"]]
        t0 = time.monotonic()
        if spec.impl != ECTP:
            return {"outcome": "ok", "detail": "no connect step in the vLLM wire"}
        try:
            plane = node.connect(self._address(cmd, spec), timeout_s=float(cmd["timeout_s"]))
        except Exception as e:  # noqa: BLE001
            return {"outcome": f"error:{type(e).__name__}", "detail": str(e)[:300],
                    "seconds": time.monotonic() - t0}
        s = node.session(self._address(cmd, spec))
        return {"outcome": "ok", "plane": plane, "seconds": time.monotonic() - t0,
                "version": getattr(s, "version", None)}

    def op_consumer_fetch_many(self, cmd: dict) -> dict:
        """``fetch_many`` of several entries (ECTP nodes): ok iff every one landed byte-exact;
        ``version``: the session's negotiated ECTP version."""
        node, spec = self.nodes[cmd["id"]], self.specs[cmd["id"]]
        entries = [Entry(**e) for e in cmd["entries"]]
        t0 = time.monotonic()
        res: dict = {"outcome": "ok", "bytes_ok": True}
        try:
            addr = self._address(cmd, spec)
            outs = node.fetch_many(addr, [e.mm_hash for e in entries],
                                   timeout_s=float(cmd["timeout_s"]))
            for e, out in zip(entries, outs, strict=True):
                if not out.ok:
                    res = {"outcome": f"miss:{out.reason.name}", "detail": f"{e.mm_hash}: "
                           f"{out.detail}"}
                    break
                want = rows_for(e, spec.block_bytes)
                res["plane"] = out.plane
                if out.nbytes != want.nbytes or digest(out.data) != digest(want):
                    res["bytes_ok"] = False
            del outs
            res["version"] = getattr(node.session(addr), "version", None)
        except Exception as e:  # noqa: BLE001
            res = {"outcome": f"error:{type(e).__name__}", "detail": str(e)[:300],
                   "trace": traceback.format_exc()[-800:]}
        res["seconds"] = time.monotonic() - t0
        return res

    def op_consumer_fetch(self, cmd: dict) -> dict:
        node, spec = self.nodes[cmd["id"]], self.specs[cmd["id"]]
        entry = Entry(**cmd["entry"])
        want = rows_for(entry, spec.block_bytes)
        timeout_s = float(cmd["timeout_s"])
        t0 = time.monotonic()
        try:
            if spec.impl == VLLM_STOCK:
                p = cmd["producer"]
                out = node.fetch((p["host"], int(p["port"])), entry.mm_hash, entry.rows,
                                 timeout_s=timeout_s)
                res = {"outcome": f"vllm:{out.state}", "plane": "vllm-nixl",
                       "retries": out.retries}
                if out.data is not None:
                    res["bytes_ok"] = digest(out.data) == digest(want)
                    if res["bytes_ok"]:
                        res["outcome"] = "ok"
            else:
                if spec.impl == VLLM_WIRE:
                    out = node.fetch(self._address(cmd, spec), entry.mm_hash, want.nbytes,
                                     timeout_s=timeout_s)
                else:
                    out = node.fetch(self._address(cmd, spec), entry.mm_hash, timeout_s=timeout_s)
                if out.ok:
                    ok_bytes = out.nbytes == want.nbytes and digest(out.data) == digest(want)
                    res = {"outcome": "ok", "plane": out.plane, "bytes_ok": ok_bytes,
                           "nbytes": out.nbytes}
                    del out
                else:
                    res = {"outcome": f"miss:{out.reason.name}", "detail": out.detail}
        except Exception as e:  # noqa: BLE001
            res = {"outcome": f"error:{type(e).__name__}", "detail": str(e)[:300],
                   "trace": traceback.format_exc()[-800:]}
        res["seconds"] = time.monotonic() - t0
        return res

    def op_stats(self, cmd: dict) -> dict:
        node = self.nodes.get(cmd["id"])
        stats = node.stats() if node is not None and hasattr(node, "stats") else {}
        return {"outcome": "ok", "stats": {k: int(v) for k, v in stats.items()}}

    def op_close(self, cmd: dict) -> dict:
        node = self.nodes.pop(cmd["id"], None)
        self.specs.pop(cmd["id"], None)
        if node is not None:
            try:
                node.close()
            except Exception as e:  # noqa: BLE001
                return {"outcome": f"error:{type(e).__name__}", "detail": str(e)[:300]}
        return {"outcome": "ok"}

    def close_all(self) -> None:
        for nid in list(self.nodes):
            self.op_close({"id": nid})


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol stream
    sys.stdout = sys.stderr
    logging.basicConfig(level=os.environ.get("INTEROP_LOG", "WARNING"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    w = Worker()
    ops = {"hello": w.op_hello, "vectors": w.op_vectors, "producer.start": w.op_producer_start,
           "consumer.open": w.op_consumer_open, "consumer.connect": w.op_consumer_connect,
           "consumer.fetch": w.op_consumer_fetch,
           "consumer.fetch_many": w.op_consumer_fetch_many, "stats": w.op_stats,
           "close": w.op_close}
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            break
        try:
            res = ops[cmd["op"]](cmd)
        except Exception as e:  # noqa: BLE001 - a harness bug must still answer
            res = {"outcome": f"error:{type(e).__name__}", "detail": str(e)[:300],
                   "trace": traceback.format_exc()[-1500:]}
        res["seq"] = cmd.get("seq")
        proto.write(json.dumps(res, default=str) + "\n")
    w.close_all()
    proto.write(json.dumps({"outcome": "ok", "bye": True}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
