"""Adapter-protocol shim for an earlier ectransport release (``interop/ADAPTER.md``, version 1).

Releases before the adapter protocol shipped their own ``interop/node.py`` speaking the
pre-protocol ops (``producer.start`` / ``consumer.open`` / ``consumer.connect`` /
``consumer.fetch`` with a ``NodeSpec`` and a key ring by name, entries generated with numpy's
``default_rng``). This shim runs *inside the release's venv* (``python -I legacy.py --harness
DIR``: isolated, so nothing of the current checkout is importable), imports that release's own
``interop.node.Worker`` from ``DIR`` (the revision's ``interop/`` and ``protocols/``, kept by
:mod:`interop.venvs`) and translates:

* ``start`` → the old ``producer.start`` / ``consumer.open`` with an old ``NodeSpec`` (its
  fields filtered to those the release knows) and a key ring built from the description's keys;
  ``ext.options`` sections ``control_client`` / ``control_server`` become the old
  ``control_options`` keyword;
* ``put`` → the old node's ``put`` / ``reserve``, with the protocol's SplitMix64 entry bytes
  (the release's numpy generator is not used: both sides must agree on the bytes);
* ``connect`` → the old ``consumer.connect`` (+ the negotiated version, read from the node);
* ``fetch`` / ``fetch_many`` → the old ``ConsumerNode.fetch`` / ``fetch_many`` (SHA-256 of what
  landed), ``stats`` / ``close`` → the old ops; ``vectors`` → the release's own
  ``interop.vectors`` against the directory asked for (``root``) or its own.

The protocol's shared definitions (entry generator, line codec) are loaded from this tree's
``interop/adapter.py`` by file path, under another module name, because the name ``interop`` is
the release's here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("interop_adapter_v1", _HERE.parent / "adapter.py")
assert _spec is not None and _spec.loader is not None
proto = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proto)


_P = (int, float)
REQUIRED: dict[str, dict[str, Any]] = {
    "vectors": {"versions": list}, "start": {"id": str, "node": dict},
    "put": {"id": str, "entries": list}, "announce": {"id": str, "mm_hash": str},
    "connect": {"id": str, "producer": dict, "timeout_s": _P},
    "fetch": {"id": str, "producer": dict, "mm_hash": str, "timeout_s": _P},
    "fetch_many": {"id": str, "producer": dict, "mm_hashes": list, "timeout_s": _P},
    "stats": {"id": str}, "close": {"id": str}}
ROLE = {"put": "producer", "announce": "producer", "connect": "consumer", "fetch": "consumer",
        "fetch_many": "consumer"}


class Shim:
    """The release's Worker behind the adapter protocol."""

    def __init__(self, harness: Path):
        sys.path.insert(0, str(harness))
        old_node: Any = importlib.import_module("interop.node")  # the release's, from harness
        old_spec: Any = importlib.import_module("interop.spec")

        self.old, self.spec = old_node, old_spec
        self.worker = old_node.Worker()
        self.fields = {f.name for f in dataclasses.fields(old_spec.NodeSpec)}
        self.desc: dict[str, dict[str, Any]] = {}

    # -- translation helpers -----------------------------------------------------------------
    def _spec_and_keys(self, desc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list]]:
        keys: dict[str, list[str]] = {}
        if desc.get("curve", True):
            keys["self"] = [desc.get("public_key") or "", desc.get("secret_key") or ""]
        allow = []
        for i, k in enumerate(desc.get("allow") or ()):
            keys[f"allow{i}"] = [k, ""]
            allow.append(f"allow{i}")
        opts = dict((desc.get("ext") or {}).get("options") or {})
        old_opts: dict[str, Any] = {}
        for section in ("control_client", "control_server"):
            if section in opts:
                old_opts["control_options"] = dict(opts[section])
        spec = {"role": desc["role"], "host": "slot", "impl": "ectransport",
                "planes": list(desc["planes"]), "versions": desc.get("versions") or None,
                "curve": bool(desc.get("curve", True)), "key": "self", "allow": allow,
                "model": desc["model"], "dtype": desc["dtype"], "hidden": int(desc["hidden"]),
                "mem_kind": desc.get("mem_kind", "DRAM"),
                "region_bytes": int(desc.get("region_bytes") or 32 << 20),
                "budget_bytes": desc.get("budget_bytes"), "options": old_opts}
        return {k: v for k, v in spec.items() if k in self.fields}, keys

    def _node(self, cmd: dict[str, Any]) -> Any:
        node = self.worker.nodes.get(cmd.get("id"))
        if node is None:
            raise LookupError(f"no node {cmd.get('id')!r}")
        return node

    def _block_bytes(self, nid: str) -> int:
        from ectransport.protocol import element_size

        d = self.desc[nid]
        return int(d["hidden"]) * element_size(d["dtype"])

    def _address(self, nid: str, p: dict[str, Any]) -> Any:
        from ectransport.node import ProducerAddress

        curve = self.desc[nid].get("curve", True)
        return ProducerAddress(p["host"], int(p["port"]), p.get("public_key") if curve else None)

    def _version(self, node: Any, addr: Any) -> int | None:
        s = node.session(addr) if hasattr(node, "session") else None
        for obj in (s, getattr(s, "session", None)):
            v = getattr(obj, "version", None)
            if isinstance(v, int):
                return v
        return None

    # -- ops ---------------------------------------------------------------------------------
    def op_hello(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from ectransport.data.registry import discover
        from ectransport.node import ConsumerNode, ProducerNode
        from ectransport.protocol import SUPPORTED_VERSIONS

        libs = self.worker.op_hello({}).get("versions", {})
        features = ["curve", "plain", "reserve", "vectors", "versions"]
        if hasattr(ConsumerNode, "fetch_many"):
            features.append("fetch_many")
        if hasattr(ProducerNode, "announce"):
            features.append("announce")
        return {"outcome": "ok", "adapter": proto.ADAPTER_VERSION,
                "impl": {"name": "ectransport", "version": libs.get("ectransport", "?"),
                         "revision": os.environ.get("ECTRANSPORT_INTEROP_REVISION", "")},
                "libs": libs, "pid": os.getpid(), "roles": ["producer", "consumer"],
                "versions": list(SUPPORTED_VERSIONS), "planes": sorted(discover()),
                "features": sorted(features)}

    def op_vectors(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from interop import vectors

        root = Path(cmd["root"]) if cmd.get("root") else vectors.ROOT
        details, total, passed = [], 0, True
        for v in sorted(set(cmd["versions"])):
            ok, detail, n = vectors.check_version(v, root)
            passed &= ok
            total += n
            details.append(detail)
        return {"outcome": "ok", "passed": passed, "detail": "; ".join(details),
                "vectors": total}

    def op_start(self, cmd: dict[str, Any]) -> dict[str, Any]:
        desc, nid = cmd["node"], cmd["id"]
        spec, keys = self._spec_and_keys(desc)
        self.desc[nid] = desc
        if desc["role"] == "producer":
            r = self.worker.op_producer_start({"id": nid, "spec": spec, "host": desc["host"],
                                               "port": int(desc.get("port") or 0), "keys": keys,
                                               "entries": []})
        else:
            r = self.worker.op_consumer_open({"id": nid, "spec": spec, "keys": keys})
        if r.get("outcome") != "ok":
            self.desc.pop(nid, None)
        return r

    def op_put(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node, bb = self._node(cmd), self._block_bytes(cmd["id"])
        for e in cmd["entries"]:
            rows = proto.entry_rows(int(e["seed"]), int(e["rows"]), bb)
            if e.get("ready", True):
                if not node.put(e["mm_hash"], rows):
                    return {"outcome": "error:NoSpace", "detail": e["mm_hash"]}
            else:
                node.reserve(e["mm_hash"], rows.nbytes)
        return {"outcome": "ok", "stored": len(cmd["entries"])}

    def op_announce(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node = self._node(cmd)
        if not hasattr(node, "announce"):
            return {"outcome": "error:UnknownOp", "detail": "this release has no announce"}
        t = node.announce(cmd["mm_hash"])
        if t is None:
            return {"outcome": "miss:MISSING"}
        return {"outcome": "ok", "ticket": {"producer": t.producer, "hold_id": t.hold_id,
                                            "mm_hash": t.mm_hash}}

    def op_connect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node = self._node(cmd)
        r = self.worker.op_consumer_connect({"id": cmd["id"], "producer": cmd["producer"],
                                             "timeout_s": cmd["timeout_s"], "keys": {}})
        if r.get("outcome") == "ok":
            r["version"] = self._version(node, self._address(cmd["id"], cmd["producer"]))
        return r

    def _landed(self, out: Any) -> dict[str, Any]:
        if not out.ok:
            return {"outcome": f"miss:{out.reason.name}", "detail": out.detail}
        return {"outcome": "ok", "plane": out.plane, "nbytes": int(out.nbytes),
                "sha256": proto.sha256_hex(out.data)}

    def op_fetch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node, t0 = self._node(cmd), time.monotonic()
        addr = self._address(cmd["id"], cmd["producer"])
        res = self._landed(node.fetch(addr, cmd["mm_hash"], timeout_s=float(cmd["timeout_s"])))
        return {**res, "seconds": time.monotonic() - t0}

    def op_fetch_many(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node, t0 = self._node(cmd), time.monotonic()
        if not hasattr(node, "fetch_many"):
            return {"outcome": "error:UnknownOp", "detail": "this release has no fetch_many"}
        addr = self._address(cmd["id"], cmd["producer"])
        outs = node.fetch_many(addr, cmd["mm_hashes"], timeout_s=float(cmd["timeout_s"]))
        items = [{"mm_hash": h, **self._landed(o)} for h, o in zip(cmd["mm_hashes"], outs)]
        bad = next((it for it in items if it["outcome"] != "ok"), None)
        return {"outcome": bad["outcome"] if bad else "ok", "items": items,
                "plane": items[0].get("plane", ""), "version": self._version(node, addr),
                "seconds": time.monotonic() - t0}

    def op_stats(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self._node(cmd)
        return self.worker.op_stats({"id": cmd["id"]})

    def op_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.desc.pop(str(cmd.get("id")), None)
        return self.worker.op_close({"id": cmd.get("id")})

    def validate(self, cmd: dict[str, Any]) -> str | None:
        """What is wrong with ``cmd`` (ADAPTER.md §6), or None."""
        op = cmd["op"]
        for key, typ in REQUIRED.get(op, {}).items():
            v = cmd.get(key)
            if not isinstance(v, typ) or isinstance(v, bool):
                return f"field {key!r} missing or not {typ}"
        if "producer" in REQUIRED.get(op, {}):
            p = cmd["producer"]
            port = p.get("port")
            if not isinstance(p.get("host"), str) or not isinstance(port, int) \
                    or not 0 < port < 65536:
                return "producer must be {host, port, public_key}"
        if "timeout_s" in REQUIRED.get(op, {}) and not 0 <= cmd["timeout_s"] < 1e9:
            return "timeout_s out of range"
        if op == "fetch_many" and not (0 < len(cmd["mm_hashes"]) <= 64 and
                                       all(isinstance(h, str) for h in cmd["mm_hashes"])):
            return "mm_hashes must be 1..64 strings"
        if op == "start":
            if cmd["id"] in self.worker.nodes:
                return f"id {cmd['id']!r} is in use"
            d = cmd["node"]
            if d.get("role") not in ("producer", "consumer") or not isinstance(
                    d.get("planes"), list) or not isinstance(d.get("hidden"), int):
                return "node needs role, planes, model, dtype, hidden"
            return None
        role = ROLE.get(op)
        if op not in ("close", "vectors", "hello") and "id" in REQUIRED.get(op, {}):
            if cmd["id"] not in self.worker.nodes:
                raise LookupError(f"no node {cmd['id']!r}")
            if role and self.desc[cmd["id"]]["role"] != role:
                return f"{op} needs a {role}"
        return None

    def handle(self, line: str) -> dict[str, Any]:
        try:
            cmd = json.loads(line)
        except json.JSONDecodeError as e:
            return {"seq": None, "outcome": "error:BadRequest", "detail": f"not JSON: {e}"}
        if not isinstance(cmd, dict):
            return {"seq": None, "outcome": "error:BadRequest", "detail": "not an object"}
        fn = getattr(self, "op_" + str(cmd.get("op")), None)
        res: dict[str, Any]
        try:
            if fn is None:
                res = {"outcome": "error:UnknownOp", "detail": f"unknown op {cmd.get('op')!r}"}
            elif (bad := self.validate(cmd)) is not None:
                res = {"outcome": "error:BadRequest", "detail": bad}
            else:
                res = fn(cmd)
        except KeyError as e:
            res = {"outcome": "error:BadRequest", "detail": f"missing {e}"}
        except LookupError as e:
            res = {"outcome": "error:UnknownNode", "detail": str(e)}
        except (TypeError, ValueError) as e:
            res = {"outcome": "error:BadRequest", "detail": f"{type(e).__name__}: {e}"}
        except Exception as e:  # noqa: BLE001 - a shim bug must still answer
            res = {"outcome": f"error:{type(e).__name__}", "detail": str(e)[:300],
                   "trace": traceback.format_exc()[-1500:]}
        res["seq"] = cmd.get("seq")
        return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--harness", type=Path, required=True,
                    help="the release's interop/ and protocols/ (built by interop.venvs)")
    args = ap.parse_args()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    shim = Shim(args.harness)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
        except json.JSONDecodeError:
            cmd = None
        if isinstance(cmd, dict) and cmd.get("op") == "exit":
            shim.worker.close_all()
            out.write(proto.encode_line({"seq": cmd.get("seq"), "outcome": "ok", "bye": True}))
            return 0
        out.write(proto.encode_line(shim.handle(line)))
    shim.worker.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
