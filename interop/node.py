"""The ectransport adapter: ``python -m interop.node`` speaks the adapter protocol
(``interop/ADAPTER.md``, version 1) for this tree's nodes — one process per host slot.

It reads one JSON request per line on stdin and writes one JSON answer per line on stdout (what
native libraries print is redirected to stderr, never into the protocol stream). The ops and
their shapes are ADAPTER.md's; this module parses and validates requests (``error:BadRequest``,
``error:UnknownOp``, ``error:UnknownNode`` for bad input, the process stays healthy) and hands
them to :class:`interop.node_ops.Nodes`, which drives ``ProducerNode`` / ``ConsumerNode`` (and,
through the node description's ``ext.kind``, the vLLM-wire profile or vLLM's own classes when run
in the vLLM venv).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from typing import Any

from interop.adapter import ADAPTER_VERSION, encode_line


class BadRequest(Exception):
    """A request the adapter cannot act on (answered ``error:BadRequest``)."""


class UnknownNode(Exception):
    """A request naming an ``id`` no ``start`` created (answered ``error:UnknownNode``)."""


def field(cmd: dict[str, Any], key: str, typ: type | tuple[type, ...], *,
          default: Any = ..., nullable: bool = False) -> Any:
    """``cmd[key]`` checked against ``typ`` (bool is not an int); a missing key takes
    ``default`` (``...``: required). Raises BadRequest naming the key."""
    if key not in cmd:
        if default is ...:
            raise BadRequest(f"missing field {key!r}")
        return default
    v = cmd[key]
    if v is None and nullable:
        return None
    ok = isinstance(v, typ) and not (isinstance(v, bool) and bool not in _tuple(typ))
    if not ok:
        raise BadRequest(f"field {key!r} is {type(v).__name__}, expected "
                         f"{'/'.join(t.__name__ for t in _tuple(typ))}")
    return v


def _tuple(typ: type | tuple[type, ...]) -> tuple[type, ...]:
    return typ if isinstance(typ, tuple) else (typ,)


def number(cmd: dict[str, Any], key: str, *, default: Any = ...) -> float:
    """A non-negative finite number field."""
    v = float(field(cmd, key, (int, float), default=default))
    if not 0 <= v < 1e9:
        raise BadRequest(f"field {key!r} = {v} is not a non-negative number of seconds")
    return v


class Adapter:
    """Dispatch of one request line to the node operations (:mod:`interop.node_ops`)."""

    def __init__(self) -> None:
        from interop.node_ops import Nodes

        self.nodes = Nodes()

    def handle(self, line: str) -> dict[str, Any]:
        """One request line → its answer (always a dict with ``outcome``; ``seq`` echoed)."""
        try:
            cmd = json.loads(line)
        except json.JSONDecodeError as e:
            return {"seq": None, "outcome": "error:BadRequest", "detail": f"not JSON: {e}"}
        if not isinstance(cmd, dict):
            return {"seq": None, "outcome": "error:BadRequest",
                    "detail": f"a request is a JSON object, got {type(cmd).__name__}"}
        seq = cmd.get("seq")
        res: dict[str, Any]
        try:
            op = field(cmd, "op", str)
            fn = getattr(self, "op_" + op.replace(".", "_"), None)
            if fn is None or op not in OPS:
                res = {"outcome": "error:UnknownOp", "detail": f"unknown op {op!r}"}
            else:
                res = fn(cmd)
        except BadRequest as e:
            res = {"outcome": "error:BadRequest", "detail": str(e)}
        except UnknownNode as e:
            res = {"outcome": "error:UnknownNode", "detail": str(e)}
        except Exception as e:  # noqa: BLE001 - an adapter bug must still answer
            res = {"outcome": f"error:{type(e).__name__}", "detail": str(e)[:300],
                   "trace": traceback.format_exc()[-1500:]}
        res["seq"] = seq
        return res

    # -- ops (shapes: ADAPTER.md §3) ---------------------------------------------------------
    def op_hello(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"outcome": "ok", "adapter": ADAPTER_VERSION, **self.nodes.hello()}

    def op_vectors(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from interop.vectors import check

        versions = field(cmd, "versions", list)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in versions):
            raise BadRequest("versions must be a list of integers")
        return {"outcome": "ok", **check(versions)}

    def op_start(self, cmd: dict[str, Any]) -> dict[str, Any]:
        nid = field(cmd, "id", str)
        desc = field(cmd, "node", dict)
        if nid in self.nodes.nodes:
            raise BadRequest(f"id {nid!r} is in use (close it first)")
        role = field(desc, "role", str)
        if role not in ("producer", "consumer"):
            raise BadRequest(f"node.role is {role!r}, expected producer or consumer")
        for k in ("model", "dtype"):
            field(desc, k, str)
        field(desc, "hidden", int)
        field(desc, "planes", list)
        if role == "producer":
            field(desc, "host", str)
            field(desc, "advertise_host", str, default=None, nullable=True)
        trust = field(desc, "trust", dict, default=None, nullable=True)
        if trust is not None:
            for k in ("trust_ca", "revocation_file"):
                v = field(trust, k, list, default=[])
                if not all(isinstance(x, str) for x in v):
                    raise BadRequest(f"node.trust.{k} must be a list of file names")
            for k in ("cert_file", "present_cert"):
                field(trust, k, str, default=None, nullable=True)
            field(trust, "admission", str, default="allow_list")
        return self.nodes.start(nid, desc)

    def op_put(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node = self._node(cmd, "producer")
        entries = field(cmd, "entries", list)
        for e in entries:
            if not isinstance(e, dict):
                raise BadRequest("entries must be objects {mm_hash, rows, seed, ready}")
            field(e, "mm_hash", str)
            if field(e, "rows", int) <= 0:
                raise BadRequest("entry rows must be positive")
            field(e, "seed", int)
            field(e, "ready", bool, default=True)
        return self.nodes.put(node, entries)

    def op_announce(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self.nodes.announce(self._node(cmd, "producer"), field(cmd, "mm_hash", str))

    def op_connect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node = self._node(cmd, "consumer")
        return self.nodes.connect(node, self._producer(cmd), number(cmd, "timeout_s"))

    def op_fetch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node = self._node(cmd, "consumer")
        ticket = field(cmd, "ticket", dict, default=None, nullable=True)
        return self.nodes.fetch(node, self._producer(cmd), field(cmd, "mm_hash", str),
                                number(cmd, "timeout_s"), rows=field(cmd, "rows", int, default=0),
                                ticket=ticket)

    def op_fetch_many(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node = self._node(cmd, "consumer")
        hashes = field(cmd, "mm_hashes", list)
        if not 0 < len(hashes) <= 64 or not all(isinstance(h, str) for h in hashes):
            raise BadRequest("mm_hashes must be a list of 1..64 strings")
        return self.nodes.fetch_many(node, self._producer(cmd), hashes, number(cmd, "timeout_s"))

    def op_stats(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self.nodes.stats(self._node(cmd))

    def op_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self.nodes.close(field(cmd, "id", str))

    # -- helpers -----------------------------------------------------------------------------
    def _node(self, cmd: dict[str, Any], role: str | None = None) -> Any:
        nid = field(cmd, "id", str)
        node = self.nodes.nodes.get(nid)
        if node is None:
            raise UnknownNode(f"no node {nid!r} (start it first)")
        if role and node.role != role:
            raise BadRequest(f"{cmd.get('op')} needs a {role}; {nid!r} is a {node.role}")
        return node

    @staticmethod
    def _producer(cmd: dict[str, Any]) -> dict[str, Any]:
        p = field(cmd, "producer", dict)
        field(p, "host", str)
        port = field(p, "port", int)
        if not 0 < port < 65536:
            raise BadRequest(f"producer.port {port} out of range")
        field(p, "public_key", str, default=None, nullable=True)
        return p


OPS = ("hello", "vectors", "start", "put", "announce", "connect", "fetch", "fetch_many", "stats",
       "close")


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol stream
    sys.stdout = sys.stderr
    logging.basicConfig(level=os.environ.get("INTEROP_LOG", "WARNING"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    a = Adapter()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
        except json.JSONDecodeError:
            cmd = None
        if isinstance(cmd, dict) and cmd.get("op") == "exit":
            a.nodes.close_all()
            proto.write(encode_line({"seq": cmd.get("seq"), "outcome": "ok", "bye": True}))
            return 0
        proto.write(encode_line(a.handle(line)))
    a.nodes.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
