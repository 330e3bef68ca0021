"""Fleet instances as separate processes, driven over stdin/stdout by tests/fleet.

    python -m tests.fleet._proc holder URL NAME TTL_S MM...   publish MM..., print READY, block
    python -m tests.fleet._proc claimant URL NAME CLAIM_TTL_S MM  claim MM, print CLAIMED, block
    python -m tests.fleet._proc contender URL NAME MM [KEY=VALUE...]  see below

A contender prints READY, waits for "go" on stdin, then runs ``claim_or_wait``. It prints
WAITING once it lost the claim and is waiting; ENCODING if it won (then waits for "finish",
publishes the item with its claim and prints ENCODED); FOUND <instance> if it found a holder;
LOCAL <detail> if it gave up waiting. ``KEY=VALUE`` are ``[fleet]`` settings (floats;
``liveness_ttl_s`` too); the defaults wait 60 s. Every line is flushed at once.
"""

from __future__ import annotations

import sys
import threading

import zmq

from ectransport.fleet import Acquired, Directory, Identity, trust_any
from ectransport.settings_schema import FleetSettings

COMPAT = "c0ffee" * 4


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def directory(url: str, name: str, ttl_s: float = 1.5, **kw: object) -> Directory:
    settings = FleetSettings(
        url=url, liveness_ttl_s=ttl_s, lookup_timeout_s=1.0, op_timeout_s=1.0, **kw
    )  # type: ignore[arg-type]
    ident = Identity(
        instance=name,
        host="127.0.0.1",
        port=6000 + sum(map(ord, name)) % 1000,
        public_key=zmq.curve_keypair()[0].decode(),
        compat_hash=COMPAT,
    )
    d = Directory(settings, identity=ident, trusted=trust_any).start()
    if not d.wait_live(30):
        say("NOT_LIVE")
        sys.exit(1)
    return d


def block() -> None:
    sys.stdin.read()  # until the test closes stdin or kills us


def holder(url: str, name: str, ttl_s: str, *mm_hashes: str) -> None:
    d = directory(url, name, float(ttl_s))
    for m in mm_hashes:
        d.publish(m, 4096)
    if not d.flush(30):
        say("NOT_FLUSHED")
        sys.exit(1)
    say("READY")
    block()


def claimant(url: str, name: str, claim_ttl_s: str, mm_hash: str) -> None:
    d = directory(url, name)
    c = d.claim(mm_hash, ttl_s=float(claim_ttl_s))
    say("CLAIMED" if c else f"NOT_CLAIMED {c}")
    block()


def contender(url: str, name: str, mm_hash: str, *options: str) -> None:
    kw: dict[str, float] = {"claim_wait_s": 60.0, "liveness_ttl_s": 1.5}
    kw.update((k, float(v)) for k, v in (o.split("=", 1) for o in options))
    d = directory(url, name, kw.pop("liveness_ttl_s"), **kw)
    say("READY")
    if sys.stdin.readline().strip() != "go":
        sys.exit(1)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(d.claim_or_wait(mm_hash)), daemon=True)
    t.start()
    while t.is_alive():  # nothing else to wait on: poll the counter, with the thread's deadline
        if d.stats()["claims_lost"] >= 1:
            say("WAITING")
            break
        t.join(0.005)
    t.join()
    got = out[0]
    if got.outcome is Acquired.ENCODE:  # type: ignore[attr-defined]
        say("ENCODING")
        if sys.stdin.readline().strip() != "finish":
            sys.exit(1)
        d.publish(mm_hash, 4096, claim=got.claim)  # type: ignore[attr-defined]
        if not d.flush(30):
            say("NOT_FLUSHED")
            sys.exit(1)
        say("ENCODED")
    elif got.outcome is Acquired.FOUND:  # type: ignore[attr-defined]
        say(f"FOUND {got.holders[0].instance}")  # type: ignore[attr-defined]
    else:
        say(f"LOCAL {got.detail}")  # type: ignore[attr-defined]
    block()
    d.close()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    {"holder": holder, "claimant": claimant, "contender": contender}[role](*args)
