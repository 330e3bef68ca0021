"""One fleet instance in its own process (a ProducerNode with ``[fleet]``, a ConsumerNode and a
claim-taking directory: an ``ec_both`` instance without vLLM), driven by tests/fleet.

    python -m tests.fleet._instance SPEC_JSON

``SPEC_JSON``: ``{"name", "url", "secret", "public", "trusted": [producer keys],
"liveness_ttl_s", "claim_wait_s", "entries", "corrupt", "host"}`` (``corrupt``: what it encodes
is not the encoder's output — a rogue holder; ``host``: the producer's bind address, default
loopback; off loopback its allow-list is ``trusted``, every instance's key). It prints
``{"ready": {...}}`` once its holder record is live, then answers one JSON command per stdin
line with one JSON line:

    {"need": MM}        -> {"mm": MM, "how": "fetched"|"encoded"|"local", "from": instance|None,
                            "ok": bytes equal the encoder's output, "tried": [instances],
                            "waited_s": s}
    {"encode": MM}      -> the same, encoding without asking the directory
    {"lookup": MM}      -> {"holders": [instance, ...]} (the directory's usable holders)
    {"stats": true}     -> {"encodes": n, "fleet": directory stats, "producer": node stats}

Every item's bytes are a pure function of its mm_hash (the "encoder"), so any instance can
check what it fetched. ``need`` is what an encoder instance does before it encodes: find a
holder (fetch from it, the next one on a miss), or win the claim and encode, or wait for the
claimant and then fetch, or encode locally when the wait or the directory fails.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from ectransport.fleet import Acquired, Directory
from ectransport.node import ConsumerNode, Layout, ProducerNode, Security
from ectransport.node.fleet import FleetFetcher
from ectransport.settings_schema import (
    ConsumerSettings,
    FleetSettings,
    NodeSettings,
    ProducerSettings,
)

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
ROWS = 16
NBYTES = ROWS * LAYOUT.block_bytes


def encoder_output(mm_hash: str) -> np.ndarray:
    """The "encoder": ``[ROWS, 512]`` uint8 rows derived from the mm_hash."""
    seed = int.from_bytes(hashlib.sha256(mm_hash.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, (ROWS, LAYOUT.block_bytes), dtype=np.uint8)


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    spec = json.loads(sys.argv[1])
    trusted = set(spec["trusted"])
    fleet = FleetSettings(
        url=spec["url"],
        liveness_ttl_s=spec.get("liveness_ttl_s", 1.5),
        lookup_timeout_s=0.3,
        op_timeout_s=0.5,
        connect_timeout_s=0.3,
        retry_backoff_s=0.05,
        retry_backoff_max_s=0.3,
        claim_wait_s=spec.get("claim_wait_s", 10.0),
        claim_ttl_s=5.0,
    )
    host = spec.get("host", "127.0.0.1")
    security = Security(
        public_key=spec["public"],
        secret_key=spec["secret"],
        allow=None if host == "127.0.0.1" else trusted.__contains__,
    )
    producer = ProducerNode(
        layout=LAYOUT,
        security=security,
        settings=ProducerSettings(region_bytes=spec.get("entries", 8) * NBYTES, host=host),
        node=NodeSettings(planes=("tcp",), node_id=spec["name"]),
        fleet=fleet,
        fleet_trusted=lambda k, c: k in trusted,
    ).start()
    consumer = ConsumerNode(
        layout=LAYOUT,
        security=security,
        settings=ConsumerSettings(
            region_bytes=8 * NBYTES, fetch_timeout_s=5.0, hello_timeout_s=1.0
        ),
        node=NodeSettings(planes=("tcp",)),
    )
    assert producer.fleet is not None
    directory: Directory = producer.fleet.directory
    fetcher = FleetFetcher(consumer, directory)
    encodes = 0
    if not directory.wait_live(30.0):
        say({"error": "not live"})
        return 1
    say({"ready": {"port": producer.port, "name": spec["name"]}})

    def encode(mm: str, claim: object = None) -> bool:
        nonlocal encodes
        encodes += 1
        if claim is not None:
            producer.fleet.encoding(claim)  # type: ignore[union-attr]
        out = encoder_output(mm)
        return producer.put(mm, out ^ 1 if spec.get("corrupt") else out)

    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if "stats" in cmd:
                say({"encodes": encodes, "fleet": directory.stats(), "producer": producer.stats()})
                continue
            if "lookup" in cmd:
                found = directory.lookup(cmd["lookup"], NBYTES)
                say({"holders": [h.instance for h in found.get(cmd["lookup"], [])]})
                continue
            mm = cmd.get("need") or cmd.get("encode")
            t0 = time.monotonic()
            res: dict = {"mm": mm, "from": None, "tried": [], "ok": True}
            if producer.lookup(mm) is not None:
                res["how"] = "held"
            elif "encode" in cmd:
                res["how"] = "encoded" if encode(mm) else "failed"
            else:
                got = directory.claim_or_wait(mm, nbytes=NBYTES)
                res["waited_s"] = round(got.waited_s, 3)
                if got.outcome is Acquired.FOUND:
                    res["tried"] = [h.instance for h in got.holders]
                    out, h = fetcher.fetch_from(mm, got.holders, time.monotonic() + 5.0, NBYTES)
                    if h is not None and out.ok:
                        res.update(
                            how="fetched",
                            ok=bool(np.array_equal(out.data, encoder_output(mm).reshape(-1))),
                        )
                        res["from"] = h.instance
                        del out
                    else:
                        res["how"] = "local" if encode(mm) else "failed"
                        res["miss"] = str(getattr(out, "reason", ""))
                elif got.outcome is Acquired.ENCODE:
                    res["how"] = "encoded" if encode(mm, got.claim) else "failed"
                else:
                    res["how"] = "local" if encode(mm) else "failed"
                    res["detail"] = got.detail[:200]
            res["s"] = round(time.monotonic() - t0, 4)
            say(res)
    finally:
        consumer.close()
        producer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
