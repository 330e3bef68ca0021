"""A certificate-holding ProducerNode in its own OS process, for the fleet-trust tests.

    python -m tests.node._trust_producer JSON

``JSON`` names ``public`` / ``secret`` (this node's CURVE key pair), ``trust`` (the ``[trust]``
section as a dict), ``plane``, ``lease_s``, ``grace_s`` and ``items``: ``[name, rows, seed]``
triples stored with ``ProducerNode.put`` (rows of :data:`LAYOUT`, from :func:`rows`). With
``"stop_at": "serving"`` the process stops itself (SIGSTOP, from the plane's serving thread)
when it is about to send the first granted bytes over a socket plane (``tcp``), after printing
``{"stopped": "serving"}``: the consumer's read is then in flight and stays so until the test
resumes the process with SIGCONT. Once serving it prints ``{"ready": true, "port": ...}``; a
line ``exit`` on stdin (or its end) closes the node.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

import numpy as np

from ectransport.node import Layout

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows


def rows(n: int, seed: int) -> np.ndarray:
    """``[n, block_bytes]`` uint8 rows of a seed: the test computes the same bytes."""
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.block_bytes), dtype=np.uint8)


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    import msgspec

    from ectransport.data.registry import load_plane
    from ectransport.node import ProducerNode, Security
    from ectransport.settings_schema import NodeSettings, ProducerSettings, TrustSettings

    if args.get("stop_at") == "serving":
        cls = load_plane(args["plane"])
        orig = cls._send_grant
        stopped: list[int] = []

        def send_grant(self, *a, **kw):
            if not stopped:
                stopped.append(1)
                print(json.dumps({"stopped": "serving"}), flush=True)
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            return orig(self, *a, **kw)

        cls._send_grant = send_grant
    total = sum(int(n) for _, n, _ in args["items"]) * LAYOUT.block_bytes
    node = ProducerNode(
        layout=LAYOUT,
        security=Security(public_key=args["public"], secret_key=args["secret"]),
        settings=ProducerSettings(
            region_bytes=max(total, 1 << 20), lease_s=args["lease_s"], grace_s=args["grace_s"]
        ),
        node=NodeSettings(planes=(args["plane"],), node_id="trust-producer-child"),
        trust=msgspec.convert(args["trust"], TrustSettings),
    )
    try:
        for name, n, seed in args["items"]:
            if not node.put(name, rows(int(n), int(seed))):
                print(json.dumps({"error": f"put {name} failed"}), flush=True)
                return 2
        node.start()
        print(json.dumps({"ready": True, "port": node.port}), flush=True)
        for line in sys.stdin:
            if line.strip() == "exit":
                break
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
