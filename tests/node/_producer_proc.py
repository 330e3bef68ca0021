"""A ProducerNode in its own OS process, for the two-process tests.

    python -m tests.node._producer_proc --hidden 3584 --item NAME:ROWS:SEED ... [--lease-s S]
        [--model-id ID]

Keys come from files: ``--key`` (the producer's zcert secret file) and ``--allow-dir`` (allowed
consumer public certs). Each item is a deterministic bf16 tensor from :func:`make_rows`, stored
with ``ProducerNode.put``. Once serving it prints one JSON line
``{"ready": true, "port": ..., "public_key": ...}`` on stdout, then answers commands read from
stdin, one per line: ``stats`` prints ``ProducerNode.stats()`` plus per-item pin counts as JSON;
``exit`` (or end of input) closes the node and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ectransport.settings_schema import NodeSettings, ProducerSettings


def make_rows(rows: int, hidden: int, seed: int) -> np.ndarray:
    """``[rows, hidden]`` bf16 bit patterns (as uint16) of seeded standard-normal floats.

    Pure numpy, so the producer process and the test compute identical bytes.
    """
    f = np.random.default_rng(seed).standard_normal((rows, hidden), dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def make_tensor(rows: int, hidden: int, seed: int):
    """:func:`make_rows` as a torch.bfloat16 tensor ``[rows, hidden]``."""
    import torch

    return torch.from_numpy(make_rows(rows, hidden, seed).view(np.int16)).view(torch.bfloat16)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--model-id", default=None,
                    help="the layout's model id (compatibility hash); default: Layout's")
    ap.add_argument("--item", action="append", default=[])
    ap.add_argument("--lease-s", type=float, default=30.0)
    ap.add_argument("--region-bytes", type=int, default=64 << 20)
    ap.add_argument("--key")
    ap.add_argument("--allow-dir")
    ap.add_argument("--insecure", action="store_true")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)

    from ectransport.node import Layout, ProducerNode, Security

    if args.insecure:
        sec = Security(insecure=True)
    else:
        sec = Security.from_files(args.key, args.allow_dir)
    named = {} if args.model_id is None else {"model_id": args.model_id}
    layout = Layout(hidden=args.hidden, dtype="bfloat16", **named)
    node = ProducerNode(
        layout=layout,
        security=sec,
        settings=ProducerSettings(
            region_bytes=args.region_bytes, lease_s=args.lease_s, port=args.port
        ),
        node=NodeSettings(node_id="producer-child"),
    )
    names = []
    try:
        for spec in args.item:
            name, rows, seed = spec.split(":")
            if not node.put(name, make_tensor(int(rows), args.hidden, int(seed))):
                print(json.dumps({"error": f"put {name} failed"}), flush=True)
                return 2
            names.append(name)
        node.start()
        print(json.dumps({"ready": True, "port": node.port, "public_key": node.public_key}),
              flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "stats":
                pins = {n: (e.pins if (e := node.lookup(n)) else None) for n in names}
                print(json.dumps({**node.stats(), "pins": pins}), flush=True)
            elif cmd == "exit":
                break
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
