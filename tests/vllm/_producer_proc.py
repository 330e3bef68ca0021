"""The producer vLLM instance of the two-instance tests, as a separate process.

Reads one JSON command per line on stdin; answers one line ``@@<json>`` on stdout (vLLM logs to
stdout too, so replies are marked). Commands:

    {"cmd": "init", "role": "ec_producer", "extra": {...}, "salt": "..."}
        -> {"port", "public_key", "region", "pid"}
    {"cmd": "encode", "requests": [{"id": "r1", "features": [[mm_hash, offset, length], ...]}],
     "hold_reports": false}
        -> {"params": {rid: ec_transfer_params}, "digests": {mm_hash: sha256 of the bytes}}
    {"cmd": "release_reports"} -> {}     (saves held "in flight" become READY)
    {"cmd": "stats"} -> {"nacks": {status name: count}, "grants": n, "entries": n}
    {"cmd": "shutdown"} -> {}            (then the process exits)
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engine import Engine, digest, make_request  # noqa: E402


def main() -> None:
    engine: Engine | None = None
    out = sys.stdout
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        try:
            reply: dict = {}
            if cmd == "init":
                engine = Engine(msg["role"], msg["extra"], msg["salt"])
                node = engine.sched._scheduler.producer.node
                reply = {"port": node.port, "public_key": node.public_key,
                         "region": engine.sched._scheduler.region.path, "pid": os.getpid()}
            elif cmd == "encode":
                engine.hold_reports = bool(msg.get("hold_reports"))
                for r in msg["requests"]:
                    engine.add(make_request(r["id"], [tuple(f) for f in r["features"]]))
                if engine.hold_reports:
                    while engine.waiting:
                        engine.step()
                else:
                    engine.run(timeout_s=30.0)
                reply = {"params": {rid: engine.finished[rid].params
                                    for rid in (r["id"] for r in msg["requests"])},
                         "digests": {h: digest(t) for r in msg["requests"]
                                     for h, t in engine.finished[r["id"]].embeds.items()}}
            elif cmd == "release_reports":
                engine.hold_reports = False
                engine.release_reports()
                engine.run(timeout_s=30.0)
            elif cmd == "stats":
                node = engine.sched._scheduler.producer.node
                reply = {"nacks": {s.name: n for s, n in node.session.nacks.items()},
                         **node.stats()}
            elif cmd == "shutdown":
                if engine is not None:
                    engine.shutdown()
                out.write("@@{}\n")
                out.flush()
                return
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception:  # noqa: BLE001 - report to the test, keep serving
            reply = {"error": traceback.format_exc()}
        out.write("@@" + json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
