"""A certificate-holding ConsumerNode in its own OS process, for the fleet-trust tests.

    python -m tests.node._trust_consumer JSON

``JSON`` names ``host``, ``port``, ``server_key`` (the producer's CURVE key), ``public`` /
``secret`` (this node's key pair), ``trust`` (the ``[trust]`` section as a dict), ``plane``,
``fetches`` (mm_hashes, fetched one after the other) and ``stop_at``: ``"posted"`` stops the
process (SIGSTOP, from the I/O thread) once the first fetch's data-plane READ is posted, printing
``{"stopped": "posted"}`` first; the test resumes it with SIGCONT. Each fetch's outcome is one
JSON line: ``ok``, ``sha256`` of the bytes when fetched, ``reason`` and ``detail`` when missed.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import threading


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    import msgspec

    from ectransport.data.registry import load_plane
    from ectransport.node import ConsumerNode, Layout, ProducerAddress, Security
    from ectransport.settings_schema import ConsumerSettings, NodeSettings, TrustSettings

    if args.get("stop_at") == "posted":
        cls = load_plane(args["plane"])
        orig_start = cls.start
        stopped: list[int] = []

        def start(self, *a, **kw):
            handle = orig_start(self, *a, **kw)
            if not stopped:
                stopped.append(1)
                print(json.dumps({"stopped": "posted"}), flush=True)
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            return handle

        cls.start = start
    node = ConsumerNode(
        layout=Layout(hidden=256, dtype="bfloat16"),
        security=Security(public_key=args["public"], secret_key=args["secret"]),
        # inline_max_bytes=0: every entry is granted and READ (ECTP v2 could send it inline)
        settings=ConsumerSettings(region_bytes=4 << 20, inline_max_bytes=0),
        node=NodeSettings(planes=(args["plane"],)),
        trust=msgspec.convert(args["trust"], TrustSettings))
    addr = ProducerAddress(args["host"], int(args["port"]), args["server_key"])
    try:
        for mm in args["fetches"]:
            out = node.fetch(addr, mm, timeout_s=30.0)
            if out.ok:
                res = {"ok": True, "sha256": hashlib.sha256(out.data.tobytes()).hexdigest()}
            else:
                res = {"ok": False, "reason": out.reason.value, "detail": out.detail}
            print(json.dumps(res), flush=True)
            del out
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
