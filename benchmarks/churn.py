"""Capacity under churn: how long the pins of SIGKILLed consumers stay in the producer's region.

    python benchmarks/churn.py                        # 32 consumers, 16 killed, the defaults
    python benchmarks/churn.py --lease-s 30 --grace-s 5   # the former defaults, same harness
    python benchmarks/churn.py --n 8 --kill 4 --out /tmp/churn.json

One producer (a ProducerNode in this process: the nixl plane, CURVE on, loopback) holds
``entries`` entries of ``size`` bytes. ``n`` consumer processes (``--worker``), each a
ConsumerNode with its own CURVE key (its own pin budget), connect and fetch one entry (checked
byte for byte); when every one is warm, all fetch back to back (one fetch in flight each) and,
``settle_s`` later, ``kill`` of them are SIGKILLed at one instant. The survivors stop fetching at
once (they stay connected); the producer keeps serving.

Measured, on the producer's own clock, for the killed consumers' identities: how many had pins
(live grants or grace pins) at the kill, their pinned bytes then, and when each identity's last
pin was released — the region capacity a death costs and for how long. A one-sided READ plane
(NIXL) cannot revoke a grant, so a killed consumer's grants keep their blocks until their lease
deadline plus the grace period (ECTP v1 §8.4): the lease is what this measures (with the former
30 s lease: 35.3 s). With confirmed renewals (ECTP v2 §11) the default lease is short, and the
pins come back within lease + grace.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

HIDDEN = 3584
BLOCK = HIDDEN * 2


def _pattern(i: int, nbytes: int) -> bytes:
    import numpy as np

    return np.random.default_rng(1000 + i).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


# -- consumer process ---------------------------------------------------------------------------


def worker(spec: dict) -> int:
    """One consumer: JSON lines on stdout (``warm``, ``stopped``, ``error``); stdin: ``go``,
    ``stop``, ``exit``."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(**msg: object) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    from ectransport.node import ConsumerNode, Layout, ProducerAddress, Security
    from ectransport.settings_schema import ConsumerSettings, ControlClientSettings, NodeSettings

    rows = -(-spec["nbytes"] // BLOCK)
    node = ConsumerNode(layout=Layout(hidden=HIDDEN),
                        security=Security(secret_key=spec["secret"], public_key=spec["public"]),
                        settings=ConsumerSettings(region_bytes=(2 * rows + 1) * BLOCK,
                                                  fetch_timeout_s=60.0),
                        node=NodeSettings(planes=("nixl",)),
                        control_settings=ControlClientSettings(handshake_timeout_s=60.0))
    addr = ProducerAddress("127.0.0.1", spec["port"], spec["producer_key"])
    try:
        want = _pattern(0, spec["nbytes"])
        out = node.fetch(addr, "e0")
        if not out.ok or bytes(out.data) != want:
            say(error=f"first fetch: {getattr(out, 'reason', 'wrong bytes')}")
            return 1
        del out
        say(warm=os.getpid())
        if sys.stdin.readline().strip() != "go":
            return 1
        stop = threading.Event()

        def read_stop() -> None:
            sys.stdin.readline()
            stop.set()

        threading.Thread(target=read_stop, daemon=True).start()
        j, misses = 0, 0
        while not stop.is_set():
            r = node.fetch(addr, f"e{(spec['index'] + j) % spec['entries']}")
            misses += not r.ok
            del r
            j += 1
        say(stopped={"fetches": j, "misses": misses})
        sys.stdin.readline()  # exit
    finally:
        node.close()
    os._exit(0)


# -- orchestration ------------------------------------------------------------------------------


def _dead_pins(node, dead: set[str]) -> dict[str, int]:
    """Bytes pinned now per dead identity: live grants and grace pins (the node's lock held)."""
    with node.driver.lock:
        pinned = node.session.pinned_by_identity()
    return {k: v for k, v in pinned.items() if k in dead and v > 0}


def run(n: int = 32, kill: int = 16, lease_s: float | None = None, grace_s: float | None = None,
        size: int = int(4.7 * (1 << 20)), entries: int = 8, settle_s: float = 1.0,
        ready_timeout_s: float = 600.0) -> dict:
    """Measure once (module docstring); returns the result as a dict (all times in seconds)."""
    import zmq

    from ectransport.node import Layout, ProducerNode, Security
    from ectransport.settings_schema import API, NodeSettings

    settings = API.producer
    kw = {k: v for k, v in (("lease_s", lease_s), ("grace_s", grace_s)) if v is not None}
    import msgspec

    settings = msgspec.structs.replace(settings, region_bytes=(entries + 4 * n) *
                                       (-(-size // BLOCK)) * BLOCK + (64 << 20), **kw)
    pub, sec = (k.decode() for k in zmq.curve_keypair())
    producer = ProducerNode(layout=Layout(hidden=HIDDEN), security=Security(secret_key=sec,
                                                                             public_key=pub),
                            settings=settings, node=NodeSettings(planes=("nixl",))).start()
    import numpy as np

    rows = size // BLOCK
    nbytes = rows * BLOCK
    for i in range(entries):
        data = np.frombuffer(_pattern(0, nbytes) if i == 0 else _pattern(i, nbytes),
                             dtype=np.uint8).reshape(rows, BLOCK)
        assert producer.put(f"e{i}", data)
    keys = [tuple(k.decode() for k in zmq.curve_keypair()) for _ in range(n)]
    q: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    for w in range(n):
        spec = {"index": w, "nbytes": nbytes, "entries": entries, "port": producer.port,
                "producer_key": pub, "public": keys[w][0], "secret": keys[w][1]}
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                              json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, bufsize=1,
                             env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
        procs.append(p)

        def pump(i: int = w, p: subprocess.Popen = p) -> None:
            for line in p.stdout:  # type: ignore[union-attr]
                if line.startswith("{"):
                    q.put((i, json.loads(line)))
            q.put((i, {"exited": p.wait()}))

        threading.Thread(target=pump, daemon=True).start()
    result: dict = {"n": n, "killed": kill, "lease_s": settings.lease_s,
                    "grace_s": settings.grace_s, "entry_bytes": nbytes, "plane": "nixl"}
    try:
        warm: set[int] = set()
        while len(warm) < n:
            i, msg = q.get(timeout=max(0.1, ready_timeout_s - (time.monotonic() - t0)))
            if "warm" in msg:
                warm.add(i)
            elif "error" in msg or "exited" in msg:
                raise RuntimeError(f"consumer {i}: {msg}")
        result["warm_s"] = round(time.monotonic() - t0, 2)
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        time.sleep(settle_s)  # every consumer fetching back to back: the measured churn instant
        victims = list(range(kill))
        dead = {keys[w][0] for w in victims}
        for w in victims:
            os.kill(procs[w].pid, signal.SIGKILL)
        t_kill = producer.driver.clock()
        for p in procs[kill:]:
            p.stdin.write("stop\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        at_kill = _dead_pins(producer, dead)
        result["killed_with_pins"] = len(at_kill)
        result["pinned_bytes_at_kill"] = sum(at_kill.values())
        released: dict[str, float] = {}
        limit = settings.lease_s + settings.grace_s + 30.0
        while producer.driver.clock() - t_kill < limit:
            left = _dead_pins(producer, dead)
            now = producer.driver.clock() - t_kill
            for ident in at_kill:
                if ident not in left and ident not in released:
                    released[ident] = now
            if not left:
                break
            time.sleep(0.01)
        times = sorted(released.values())
        result["released_after_s"] = {"min": round(times[0], 3) if times else None,
                                      "max": round(times[-1], 3) if times else None,
                                      "all_released": len(released) == len(at_kill)}
        result["bound_s"] = settings.lease_s + settings.grace_s
        stats = producer.stats()
        result["producer"] = {k: stats.get(k, 0) for k in ("released_peer_down", "expired",
                                                              "completed", "grants")}
    finally:
        for p in procs:
            try:
                p.stdin.write("exit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        producer.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--kill", type=int, default=16)
    ap.add_argument("--lease-s", type=float, default=None, help="default: the settings'")
    ap.add_argument("--grace-s", type=float, default=None, help="default: the settings'")
    ap.add_argument("--out", type=Path, default=None, help="append the result to this JSON list")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    res = run(args.n, args.kill, args.lease_s, args.grace_s)
    print(json.dumps(res, indent=2))
    if args.out is not None:
        old = json.loads(args.out.read_text()) if args.out.is_file() else []
        args.out.write_text(json.dumps([*old, res], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
