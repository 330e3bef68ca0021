"""What the ectransport adapter (:mod:`interop.node`) does for each op: nodes of this tree built
from an adapter node description (``interop/ADAPTER.md`` §2).

``node.ext.kind`` selects the node: ``ectransport`` (default: ``ProducerNode`` /
``ConsumerNode``), ``vllm-wire`` (``ectransport.compat.vllm_wire``: ours speaking vLLM's wire) or
``vllm-stock`` (vLLM 0.33.0's own session classes, :mod:`interop.vllm_side`; only in the vLLM
venv). ``node.ext.options``: for ``ectransport`` nodes, settings overrides per section
(``{"control_client": {"handshake_timeout_s": 5.0}}``; sections ``producer``, ``consumer``,
``control_client``, ``control_server``); for ``vllm-wire`` nodes, constructor keywords.
``node.trust`` (ADAPTER.md §4, feature ``trust``): the node's ``[trust]`` settings
(:class:`~ectransport.settings_schema.TrustSettings`), plus ``present_cert``: a certificate file
the node presents as its own without its start-up check (a wrong-role or expired certificate,
which a node refuses to start with: what a misconfigured or hostile peer sends).
``node.advertise_host``: a producer bound to a wildcard ``host`` names this address.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from interop.adapter import entry_rows, sha256_hex

ECTP, VLLM_WIRE, VLLM_STOCK = "ectransport", "vllm-wire", "vllm-stock"


@dataclass
class Node:
    """A started node and its description."""

    id: str
    kind: str
    role: str
    desc: dict[str, Any]
    obj: Any
    block_bytes: int


def lib_versions() -> dict[str, str]:
    """The versions of what this process runs (python, ectransport, its libraries, vLLM)."""
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("ectransport", "nixl", "nixl-cu13", "nixl-cu12", "pyzmq", "ucxx-cu12", "ucxx",
                 "vllm", "ectransport-shm", "msgspec"):
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


def _outcome_error(e: BaseException, prefix: str) -> dict[str, Any]:
    return {"outcome": f"{prefix}:{type(e).__name__}", "detail": str(e)[:300]}


class Nodes:
    """The nodes of this adapter process, by id."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}

    def hello(self) -> dict[str, Any]:
        import ectransport
        from ectransport.data.registry import discover
        from ectransport.protocol import SUPPORTED_VERSIONS

        return {"impl": {"name": "ectransport", "version": getattr(ectransport, "__version__",
                                                                     lib_versions().get(
                                                                         "ectransport", "?"))},
                "libs": lib_versions(), "pid": os.getpid(), "roles": ["producer", "consumer"],
                "versions": list(SUPPORTED_VERSIONS), "planes": sorted(discover()),
                "features": ["announce", "curve", "fetch_many", "plain", "reserve", "trust",
                             "trust_refusal", "vectors", "versions"]}

    # -- start ------------------------------------------------------------------------------
    def start(self, nid: str, desc: dict[str, Any]) -> dict[str, Any]:
        ext = desc.get("ext") or {}
        kind, role = ext.get("kind", ECTP), desc["role"]
        t0 = time.monotonic()
        try:
            from ectransport.protocol import element_size

            block_bytes = int(desc["hidden"]) * element_size(desc["dtype"])
            if desc.get("mem_kind", "DRAM") != "DRAM":
                from ectransport.errors import PlaneUnavailable

                raise PlaneUnavailable(f"{desc['mem_kind']} regions need a GPU; none here")
            if role == "producer":
                obj, res = self._producer(kind, desc, block_bytes)
            else:
                obj, res = self._consumer(kind, desc, block_bytes), {}
        except Exception as e:  # noqa: BLE001 - reported as the cell's observed outcome
            return {**_outcome_error(e, "refused"), "seconds": time.monotonic() - t0}
        self.nodes[nid] = Node(nid, kind, role, desc, obj, block_bytes)
        return {"outcome": "ok", **res, "seconds": time.monotonic() - t0}

    @staticmethod
    def _security(desc: dict[str, Any], producer: bool) -> Any:
        from ectransport.node import Security

        if not desc.get("curve", True):
            return Security(insecure=True)
        pub, sec = desc.get("public_key"), desc.get("secret_key")
        if producer:
            allowed = set(desc.get("allow") or ())
            if not allowed and desc.get("trust"):  # certificates admit: no allow-list at all
                return Security(public_key=pub, secret_key=sec)
            return Security(public_key=pub, secret_key=sec, allow=lambda k: k in allowed)
        return Security(public_key=pub, secret_key=sec)

    @staticmethod
    def _trust(desc: dict[str, Any]) -> dict[str, Any]:
        """``{"trust": TrustSettings}`` of ``node.trust`` (``{}`` without one: the default)."""
        t = desc.get("trust")
        if t is None:
            return {}
        if not isinstance(t, dict):
            raise TypeError(f"node.trust is {type(t).__name__}, expected an object")
        from ectransport.settings_schema import TrustSettings

        kw = {k: v for k, v in t.items() if k in TrustSettings.__struct_fields__}
        for k in ("trust_ca", "revocation_file"):
            if k in kw:
                kw[k] = tuple(kw[k] or ())
        return {"trust": TrustSettings(**kw)}

    @staticmethod
    def _present(desc: dict[str, Any], node: Any) -> None:
        """``node.trust.present_cert``: that certificate is what the node shows from now on,
        past the start-up check of its own certificate (module docstring)."""
        path = (desc.get("trust") or {}).get("present_cert")
        if not path:
            return
        from ectransport.trust.files import read_cert

        if getattr(node, "trust", None) is None:
            raise TypeError("present_cert needs the node's fleet trust (trust_ca)")
        node.trust.admission.own_cert = read_cert(path)

    @staticmethod
    def _layout(desc: dict[str, Any]) -> Any:
        from ectransport.node import Layout

        return Layout(model_id=desc["model"], dtype=desc["dtype"], hidden=int(desc["hidden"]))

    def _producer(self, kind: str, desc: dict[str, Any], block_bytes: int
                  ) -> tuple[Any, dict[str, Any]]:
        host, port = desc["host"], int(desc.get("port") or 0)
        region_bytes = int(desc.get("region_bytes") or 32 << 20)
        opts = dict((desc.get("ext") or {}).get("options") or {})
        if kind == VLLM_STOCK:
            from interop.vllm_side import StockVllmProducer

            node: Any = StockVllmProducer(host=host, port=port or _free_port(host), model=desc["model"],
                                     dtype=desc["dtype"], block_bytes=block_bytes,
                                     num_blocks=region_bytes // block_bytes)
            return node, {"host": host, "port": node.port, "public_key": None,
                          "transports": {"vllm-nixl": "vLLM NixlDataTransport"}}
        sec = self._security(desc, producer=True)
        if kind == VLLM_WIRE:
            from ectransport.compat.vllm_wire import VllmWireProducerNode

            node = VllmWireProducerNode(
                profile=(desc.get("ext") or {}).get("profile"), security=sec,
                layout=self._layout(desc), host=host, port=port, region_bytes=region_bytes,
                budget_bytes=desc.get("budget_bytes"), **opts)
        else:
            from ectransport.node import ProducerNode
            from ectransport.settings_schema import (
                ControlServerSettings,
                NodeSettings,
                ProducerSettings,
            )

            advertise = desc.get("advertise_host")
            node = ProducerNode(
                layout=self._layout(desc), security=sec,
                settings=ProducerSettings(region_bytes=region_bytes, host=host, port=port,
                                          budget_bytes=desc.get("budget_bytes"),
                                          advertise_host=advertise,
                                          **opts.get("producer", {})),
                node=self._node_settings(NodeSettings, desc),
                control_settings=ControlServerSettings(**opts.get("control_server", {})),
                **self._trust(desc))
            try:
                self._present(desc, node)
            except BaseException:
                node.close()
                raise
            host = advertise or host
        node.start()
        return node, {"host": host, "port": node.port, "public_key": node.public_key,
                      "transports": node.plane_transports()}

    @staticmethod
    def _node_settings(cls: Any, desc: dict[str, Any]) -> Any:
        """``NodeSettings`` of the description. An *emulated* version claim (``ext.emulated``:
        a newer node made by override, ADAPTER.md §4) is set past ``NodeSettings``' check, which
        refuses versions this build does not speak; any other claim goes through it."""
        versions = tuple(desc.get("versions") or ())
        if versions and (desc.get("ext") or {}).get("emulated"):
            import msgspec

            ns = cls(planes=tuple(desc["planes"]))
            msgspec.structs.force_setattr(ns, "versions", versions)
            return ns
        return cls(planes=tuple(desc["planes"]), **({"versions": versions} if versions else {}))

    def _consumer(self, kind: str, desc: dict[str, Any], block_bytes: int) -> Any:
        region_bytes = int(desc.get("region_bytes") or 32 << 20)
        opts = dict((desc.get("ext") or {}).get("options") or {})
        if kind == VLLM_STOCK:
            from interop.vllm_side import StockVllmConsumer

            return StockVllmConsumer(model=desc["model"], dtype=desc["dtype"],
                                     block_bytes=block_bytes,
                                     num_blocks=region_bytes // block_bytes)
        if kind == VLLM_WIRE:
            from ectransport.compat.vllm_wire import VllmWireConsumer

            return VllmWireConsumer(profile=(desc.get("ext") or {}).get("profile"),
                                    security=self._security(desc, False),
                                    layout=self._layout(desc), region_bytes=region_bytes, **opts)
        from ectransport.node import ConsumerNode
        from ectransport.settings_schema import (
            ConsumerSettings,
            ControlClientSettings,
            NodeSettings,
        )

        node = ConsumerNode(
            layout=self._layout(desc), security=self._security(desc, False),
            settings=ConsumerSettings(region_bytes=region_bytes, **opts.get("consumer", {})),
            node=self._node_settings(NodeSettings, desc),
            control_settings=ControlClientSettings(**opts.get("control_client", {})),
            **self._trust(desc))
        try:
            self._present(desc, node)
        except BaseException:
            node.close()
            raise
        return node

    # -- producer ops -----------------------------------------------------------------------
    def put(self, node: Node, entries: list[dict[str, Any]]) -> dict[str, Any]:
        stored = 0
        for e in entries:
            rows = entry_rows(int(e["seed"]), int(e["rows"]), node.block_bytes)
            ready = e.get("ready", True)
            if node.kind == VLLM_STOCK:
                node.obj.put(e["mm_hash"], rows, ready=ready)
            elif ready:
                if not node.obj.put(e["mm_hash"], rows):
                    return {"outcome": "error:NoSpace", "stored": stored,
                            "detail": f"{e['mm_hash']} did not fit"}
            else:
                node.obj.reserve(e["mm_hash"], rows.nbytes)
            stored += 1
        return {"outcome": "ok", "stored": stored}

    def announce(self, node: Node, mm_hash: str) -> dict[str, Any]:
        if node.kind != ECTP:
            return {"outcome": "error:BadRequest", "detail": "announce: ECTP producers only"}
        t = node.obj.announce(mm_hash)
        if t is None:
            return {"outcome": "miss:MISSING", "detail": f"{mm_hash} is not stored"}
        return {"outcome": "ok", "ticket": {"producer": t.producer, "hold_id": t.hold_id,
                                            "mm_hash": t.mm_hash}}

    # -- consumer ops -----------------------------------------------------------------------
    @staticmethod
    def _address(node: Node, p: dict[str, Any]) -> Any:
        from ectransport.node import ProducerAddress

        curve = node.desc.get("curve", True)
        return ProducerAddress(p["host"], int(p["port"]), p.get("public_key") if curve else None)

    def connect(self, node: Node, p: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        if node.kind != ECTP:
            return {"outcome": "ok", "detail": "no connect step in the vLLM wire"}
        try:
            addr = self._address(node, p)
            plane = node.obj.connect(addr, timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001
            return {**_outcome_error(e, "error"), "seconds": time.monotonic() - t0}
        return {"outcome": "ok", "plane": plane, "seconds": time.monotonic() - t0,
                "version": getattr(node.obj.session(addr), "version", None)}

    def fetch(self, node: Node, p: dict[str, Any], mm_hash: str, timeout_s: float, *,
              rows: int = 0, ticket: dict[str, Any] | None = None) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            if node.kind == VLLM_STOCK:
                out = node.obj.fetch((p["host"], int(p["port"])), mm_hash, rows,
                                     timeout_s=timeout_s)
                res: dict[str, Any] = {"outcome": f"vllm:{out.state}", "plane": "vllm-nixl",
                                       "retries": out.retries}
                if out.data is not None:
                    res.update(outcome="ok", nbytes=int(out.data.nbytes),
                               sha256=sha256_hex(out.data))
            else:
                addr = self._address(node, p)
                if node.kind == VLLM_WIRE:
                    out = node.obj.fetch(addr, mm_hash, rows * node.block_bytes,
                                         timeout_s=timeout_s)
                else:
                    from ectransport.protocol import Ticket

                    t = Ticket(**ticket) if ticket else None
                    out = node.obj.fetch(addr, mm_hash, timeout_s=timeout_s, ticket=t)
                res = self._outcome(out)
        except Exception as e:  # noqa: BLE001
            res = {**_outcome_error(e, "error"), "trace": traceback.format_exc()[-800:]}
        res["seconds"] = time.monotonic() - t0
        return res

    @staticmethod
    def _outcome(out: Any) -> dict[str, Any]:
        if not out.ok:
            return {"outcome": f"miss:{out.reason.name}", "detail": out.detail}
        res = {"outcome": "ok", "plane": out.plane, "nbytes": int(out.nbytes),
               "sha256": sha256_hex(out.data)}
        del out
        return res

    def fetch_many(self, node: Node, p: dict[str, Any], hashes: list[str], timeout_s: float
                   ) -> dict[str, Any]:
        t0 = time.monotonic()
        if node.kind != ECTP:
            return {"outcome": "error:BadRequest", "detail": "fetch_many: ECTP consumers only"}
        try:
            addr = self._address(node, p)
            items = [{"mm_hash": h, **self._outcome(o)}
                     for h, o in zip(hashes, node.obj.fetch_many(addr, hashes,
                                                                 timeout_s=timeout_s),
                                     strict=True)]
            bad = next((it for it in items if it["outcome"] != "ok"), None)
            res = {"outcome": bad["outcome"] if bad else "ok", "items": items,
                   "plane": items[0].get("plane", ""),
                   "version": getattr(node.obj.session(addr), "version", None)}
            if bad:
                res["detail"] = f"{bad['mm_hash']}: {bad.get('detail', '')}"
        except Exception as e:  # noqa: BLE001
            res = {**_outcome_error(e, "error"), "trace": traceback.format_exc()[-800:]}
        res["seconds"] = time.monotonic() - t0
        return res

    # -- any node ---------------------------------------------------------------------------
    def stats(self, node: Node) -> dict[str, Any]:
        obj = node.obj
        st = obj.stats() if hasattr(obj, "stats") else {}  # vLLM's own classes have none
        return {"outcome": "ok", "stats": {k: int(v) for k, v in st.items()}}

    def close(self, nid: str) -> dict[str, Any]:
        node = self.nodes.pop(nid, None)
        if node is not None:
            try:
                node.obj.close()
            except Exception as e:  # noqa: BLE001
                return _outcome_error(e, "error")
        return {"outcome": "ok"}

    def close_all(self) -> None:
        for nid in list(self.nodes):
            self.close(nid)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
