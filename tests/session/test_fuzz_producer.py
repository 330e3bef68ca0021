"""Fuzzing ``ProducerSession.on_frame`` (decode and dispatch) with random and mutated frames.

A seeded ``random.Random`` generates the bulk (hypothesis would be far too slow for that many) from
several peers: mutations of valid frames (bit flips, truncation, splicing two
frames, maps with the right keys and wrong types, huge lists and strings) plus pure random bytes. A
smaller hypothesis test covers structured maps. Checked throughout: no exception escapes, every
answer is a ``Send``/``Revoke``, no pin is ever taken for a peer that never completed a valid Hello,
the store's invariants hold; afterwards a fresh, well-behaved peer still gets an OK grant.

The frame count and the seed come from the environment, so the same test runs short in CI and long
by hand (see docs/security.md, "Fuzzing the sessions")::

    ECT_FUZZ_FRAMES=1000000 ECT_FUZZ_SEED=7 python -m pytest tests/session/test_fuzz_producer.py -q

``ECT_FUZZ_FRAMES`` defaults to :data:`DEFAULT_FRAMES`; ``ECT_FUZZ_SEED`` (any integer) to 1.
"""

from __future__ import annotations

import os
import random
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ectransport.protocol import (
    AckBatch,
    FrameError,
    Hello,
    Parked,
    Status,
    Welcome,
    XferAck,
    decode,
)
from ectransport.session import ProducerSession, Revoke, Send
from ectransport.session.grants import PlaneFacts
from ectransport.store import BlockStore

from .helpers import BLOCK, COMPAT, describe, make_consumer, producer_config, put

#: Frames per fuzz test when ``ECT_FUZZ_FRAMES`` is unset: what CI affords on a 2-core host.
DEFAULT_FRAMES = 100_000
DEFAULT_SEED = 1
ENC = msgspec.msgpack.encode

HELLO_SIDS = {"h0": "hello0", "h1": "hello1"}  # peers that say a proper Hello first (v1)
V2_SIDS = {"h2": "hello2"}  # peers that say a proper Hello first and negotiate v2
#: entries saved in two steps: requests for them wait (v2) until the fuzz commits or aborts them
RESERVED = ("nr", "w1", "w2")
VERSIONS = (1, 2)
STRANGERS = ("s0", "s1", "s2", "s3")  # peers that only ever send fuzz (which may say Hello)
NEVER = ("n0", "n1")  # peers whose fuzz never contains a valid Hello: they must never be pinned for


pytestmark = pytest.mark.usefixtures("quiet_session_logs")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """Integer setting ``name`` from the environment (``default`` if unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def fuzz_frames() -> int:
    """``ECT_FUZZ_FRAMES``: frames per fuzz test (≥ 1)."""
    return env_int("ECT_FUZZ_FRAMES", DEFAULT_FRAMES, minimum=1)


def fuzz_seed() -> int:
    """``ECT_FUZZ_SEED``: seed of the fuzz generator (any integer)."""
    return env_int("ECT_FUZZ_SEED", DEFAULT_SEED)


def base_frames(sid: str, v: int = 1) -> list[dict]:
    """One valid frame of each kind (as msgpack maps), for session ``sid`` at version ``v``
    (the v2 kinds always at v=2), Hello first."""
    def item(mm: str) -> dict:
        return {"mm_hash": mm, "dest": b""}

    return [
        {"k": "hello", "v": v, "session_id": sid, "node_id": "c", "versions": list(range(1, v + 1)),
         "planes": ["nixl"], "compat_hash": COMPAT, "mem_kinds": ["DRAM"]},
        {"k": "req", "v": v, "session_id": sid, "mm_hash": "a", "compat_hash": COMPAT, "dest": b""},
        {"k": "req", "v": v, "session_id": sid, "mm_hash": "b", "compat_hash": COMPAT, "dest": b""},
        {"k": "req", "v": v, "session_id": sid, "mm_hash": "nope", "compat_hash": COMPAT,
         "dest": b""},
        {"k": "done", "v": v, "session_id": sid, "mm_hash": "a", "grant_id": 12345, "ok": True},
        {"k": "renew", "v": v, "session_id": sid, "grant_ids": [1, 2, 3], "extend_s": 3.0},
        {"k": "welcome", "v": v, "session_id": sid, "node_id": "p", "status": 0, "version": v,
         "plane": "nixl", "versions": [1], "planes": ["nixl"], "compat_hash": COMPAT, "detail": ""},
        {"k": "ack", "v": v, "session_id": sid, "mm_hash": "a", "status": 0, "grant": None,
         "detail": ""},
        {"k": "nack", "v": v, "status": 7, "detail": "x"},
        {"k": "reqs", "v": 2, "session_id": sid, "batch_id": 1, "compat_hash": COMPAT,
         "wait_s": 0.0, "inline_max": 0, "items": [item("a"), item("b"), item("nope")]},
        {"k": "reqs", "v": 2, "session_id": sid, "batch_id": 2, "compat_hash": COMPAT,
         "wait_s": 3.0, "inline_max": 64, "items": [item("a"), *map(item, RESERVED)]},
        {"k": "reqs", "v": 2, "session_id": sid, "batch_id": 3, "compat_hash": COMPAT,
         "wait_s": 60.0, "inline_max": 1 << 20, "items": [item("b"), item("w1")]},
        {"k": "acks", "v": 2, "session_id": sid, "batch_id": 1, "items": [
            {"mm_hash": "a", "status": 0, "grant": None, "data": b"xy", "detail": ""}]},
        {"k": "park", "v": 2, "session_id": sid, "batch_id": 2, "items": ["a", "w1"],
         "wait_s": 3.0},
        {"k": "dones", "v": 2, "session_id": sid, "items": [
            {"mm_hash": "a", "grant_id": 1, "ok": True}, {"mm_hash": "b", "grant_id": 2,
                                                         "ok": False}]},
        {"k": "sync", "v": 2, "session_id": sid, "t": 12.5},
        {"k": "offer", "v": 2, "session_id": sid, "anchor": 12.5, "items": [
            {"mm_hash": "a", "grant": None, "valid_s": 1.0}]},
    ]


HUGE = [
    list(range(70_000)), "s" * 300_000, b"\x00" * 300_000, {str(i): i for i in range(5000)},
    [[1, 2]] * 5000, 2**64 - 1, -(2**63), float("nan"), float("inf"), -1.5e308,
]


def random_key(rng: random.Random):
    """A random *hashable* msgpack map key: any scalar (a list or map cannot be a dict key)."""
    r = rng.randrange(8)
    if r == 0:
        return rng.randrange(-(2**63), 2**64)
    if r == 1:
        return rng.choice((0, -1, 2**64 - 1, float("nan"), float("inf"), -0.0, 1.5))
    if r == 2:
        return rng.randbytes(rng.randrange(0, 8))
    if r == 3:
        return rng.choice((None, True, False))
    if r == 4:
        return "".join(chr(rng.randrange(0x20, 0x2FF)) for _ in range(rng.randrange(0, 12)))
    return rng.choice(("k", "v", "session_id", "mm_hash", "grant", "status", "", "s" * 300))


def random_value(rng: random.Random, depth: int = 0):
    r = rng.randrange(14 if depth < 3 else 9)
    if r == 0:
        return rng.randrange(-(2**63), 2**64)
    if r == 1:
        return rng.choice((0, 1, -1, 2**63 - 1, 2**63, 1 << 16, 4096))
    if r == 2:
        return rng.random() * rng.choice((1, 1e9, -1e9))
    if r == 3:
        return "".join(chr(rng.randrange(0x20, 0x2FF)) for _ in range(rng.randrange(0, 20)))
    if r == 4:
        return rng.randbytes(rng.randrange(0, 20))
    if r == 5:
        return None
    if r == 6:
        return rng.random() < 0.5
    if r == 7:
        return rng.choice(("a", "", ":", "hello0", "hello1", COMPAT, "nixl", "1:hello0:a"))
    if r == 8:
        return rng.choice(HUGE) if rng.random() < 0.02 else ""
    if r in (9, 10):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if r == 11:
        return {(random_key(rng) if rng.random() < 0.2 else f"f{i}"):
                random_value(rng, depth + 1) for i in range(rng.randrange(0, 4))}
    return rng.choice(base_frames("hello0", rng.choice(VERSIONS)))  # a whole frame as a value


def mutate(rng: random.Random, frames: list[dict], encoded: list[bytes]) -> bytes:
    """One fuzz frame: a mutation of a valid frame, a structured map, or random bytes."""
    op = rng.randrange(8)
    if op == 0:  # bit flips
        b = bytearray(rng.choice(encoded))
        for _ in range(rng.randrange(1, 9)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if op == 1:  # truncation
        b = rng.choice(encoded)
        return b[:rng.randrange(len(b))]
    if op == 2:  # splice two frames
        a, b = rng.choice(encoded), rng.choice(encoded)
        return a[:rng.randrange(len(a) + 1)] + b[rng.randrange(len(b) + 1):]
    if op in (3, 4):  # right keys, wrong types (or right types and hostile values)
        m = dict(rng.choice(frames))
        for _ in range(rng.randrange(1, 4)):
            m[rng.choice(list(m))] = random_value(rng)
        if rng.random() < 0.1:
            del m[rng.choice(list(m))]
        if rng.random() < 0.1:
            m["extra"] = random_value(rng)
        try:
            return ENC(m)
        except (TypeError, OverflowError, msgspec.EncodeError):
            return b"\x80"
    if op == 5:  # field-swapped frames: keys of one kind with the tag of another
        m = dict(rng.choice(frames))
        m["k"] = rng.choice(("hello", "req", "done", "renew", "welcome", "ack", "nack", "reqs",
                             "acks", "park", "dones", "sync", "offer", "zzz", 7))
        return ENC(m)
    if op == 6:  # byte-level: a valid frame with random bytes inserted
        b = bytearray(rng.choice(encoded))
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randrange(1, 6))
        return bytes(b)
    return rng.randbytes(rng.randrange(0, 64))  # pure random bytes


def check(p: ProducerSession, helloed: set) -> None:
    """Store and session invariants; every pin belongs to a live grant or to a grace period (a
    grant that ended unconfirmed keeps its pin for ``grace_s``), never to a peer without Hello."""
    p.store.check_invariants()
    p.check_invariants()  # each grant and grace pin holds a pin of its live entry
    for g in p.grants():
        assert g.peer in helloed, f"pin taken for {g.peer!r}, which never completed a Hello"
    # with check_invariants' "at least one pin per grant", exactly one pin per grant or grace pin
    # (inline answers and waiting batch items hold none)
    assert sum(e.pins for e in p.store.entries()) == p.active_grants + p.grace_pins
    assert all(v <= p.budget_bytes for v in p.pinned_by_identity().values())


def feed(p: ProducerSession, peer, data: bytes, now: float, user: str, helloed: set) -> None:
    out = p.on_frame(peer, data, now, user=user)
    for c in out:
        assert isinstance(c, (Send, Revoke)), c
        if isinstance(c, Send):
            assert c.peer == peer
            msg = decode(c.data, versions=VERSIONS)  # every answer is itself a valid frame
            if isinstance(msg, Welcome) and msg.status is Status.OK:
                helloed.add(peer)
            if isinstance(msg, Parked):  # names what waits now, with the wait it will honour
                assert peer in helloed and all(p.waits_for(m) for m in msg.items), msg
                assert 0 < msg.wait_s <= p.settings.max_wait_s, msg


def step_store(p: ProducerSession, rng: random.Random, now: float, helloed: set) -> None:
    """Now and then a reserved entry is committed or aborted (and reported), or reserved again:
    batch items waiting for it are answered, to peers that said Hello only."""
    mm = rng.choice(RESERVED)
    e = p.store.get(mm)
    if e is None:
        p.store.alloc(mm, BLOCK)
        return
    if e.ready:
        if e.pins == 0:
            p.store.discard(mm)  # evicted: reserved again later
        return
    if rng.random() < 0.5:
        p.store.mark_ready(mm)
    else:
        p.store.discard(mm)
    for c in p.on_entries_changed([mm], now):
        if isinstance(c, Send):
            assert c.peer in helloed, f"answer to {c.peer!r}, which never completed a Hello"
            assert isinstance(decode(c.data, versions=VERSIONS), AckBatch)


def is_valid_hello(data: bytes) -> bool:
    try:
        return isinstance(decode(data, versions=VERSIONS), Hello)
    except FrameError:
        return False


def fresh_peer_gets_a_grant(p: ProducerSession, now: float) -> None:
    """A well-formed Hello + XferReq from a peer the fuzzer never used still gets an OK grant."""
    frames = base_frames("freshsession")
    (w,) = p.on_frame("fresh", ENC(frames[0]), now, user="fresh-key")
    assert decode(w.data, versions=(1,)).status is Status.OK
    (a,) = p.on_frame("fresh", ENC(frames[1]), now, user="fresh-key")
    ack = decode(a.data, versions=(1,))
    assert isinstance(ack, XferAck) and ack.status is Status.OK and ack.grant is not None, ack
    assert p.store.get("a").pins >= 1
    # and a fresh v2 peer gets its batch answered: "a" granted (or inline), "b" as well
    frames = base_frames("freshv2", 2)
    (w,) = p.on_frame("fresh2", ENC(frames[0]), now, user="fresh2-key")
    assert decode(w.data, versions=VERSIONS).version == 2
    (a,) = p.on_frame("fresh2", ENC(frames[9]), now, user="fresh2-key")
    acks = decode(a.data, versions=VERSIONS)
    assert isinstance(acks, AckBatch) and acks.batch_id == 1, acks
    st = {it.mm_hash: it.status for it in acks.items}
    assert st == {"a": Status.OK, "b": Status.OK, "nope": Status.NACK_MISSING}, acks


def make_fuzz_producer():
    store = BlockStore(64, BLOCK)
    cfg = producer_config(lease_s=5.0, budget_bytes=8 * BLOCK, versions=VERSIONS,
                          inline_max_bytes=2 * BLOCK, max_wait_s=4.0)
    p = ProducerSession(cfg, store, {"nixl": PlaneFacts(describe)}, rng=random.Random(7),
                        read=lambda runs, nbytes: bytes(nbytes))
    put(store, "a", 2)
    put(store, "b", 5)
    put(store, "nr", 1, ready=False)
    return p


def test_random_and_mutated_frames():
    n_frames, seed = fuzz_frames(), fuzz_seed()
    rng = random.Random(seed)
    p = make_fuzz_producer()
    helloed: set = set()
    frames = [f for sid in (*HELLO_SIDS.values(), "s0sess") for f in base_frames(sid)]
    frames += [f for sid in V2_SIDS.values() for f in base_frames(sid, 2)]
    encoded = [ENC(f) for f in frames]
    now = 0.0
    for peer, sid in HELLO_SIDS.items():
        feed(p, peer, ENC(base_frames(sid)[0]), now, f"key-{peer}", helloed)
    for peer, sid in V2_SIDS.items():
        feed(p, peer, ENC(base_frames(sid, 2)[0]), now, f"key-{peer}", helloed)
    assert helloed == set(HELLO_SIDS) | set(V2_SIDS)
    peers = [*HELLO_SIDS, *V2_SIDS, *STRANGERS, *NEVER]
    t0 = time.perf_counter()
    i, event = 0, "start"
    try:
        for i in range(n_frames):
            peer = peers[i % len(peers)] if rng.random() < 0.7 else rng.choice(peers)
            # mostly mutations; now and then a valid frame, so that grants, batches, waits and
            # inline answers happen among the garbage
            data = rng.choice(encoded) if rng.random() < 0.05 else mutate(rng, frames, encoded)
            if peer in NEVER and is_valid_hello(data):
                continue
            event = f"on_frame({peer!r}, {data[:512]!r}, now={now!r})"
            feed(p, peer, data, now, f"key-{peer}", helloed)
            if i % 997 == 0:
                event = f"check / poll after frame {i}"
                check(p, helloed)
                now += rng.random() * 2.0
                assert isinstance(p.poll(now), list)
                for _ in range(3):
                    event = f"store change at now={now!r}"
                    step_store(p, rng, now, helloed)
                if rng.random() < 0.05:  # a connection drops now and then
                    down = rng.choice(peers)
                    event = f"on_peer_down({down!r}, now={now!r})"
                    assert isinstance(p.on_peer_down(down, now), list)
    except Exception as e:
        pytest.fail(f"ECT_FUZZ_SEED={seed}, frame {i}, at {event}: {type(e).__name__}: {e}",
                    pytrace=False)
    elapsed = time.perf_counter() - t0
    check(p, helloed)
    assert not helloed & set(NEVER)
    if n_frames >= 1000:  # the fuzz mostly hit the decoder's error paths
        assert p.stats["bad_frames"] > n_frames // 2
    fresh_peer_gets_a_grant(p, now)
    check(p, helloed | {"fresh", "fresh2"})
    print(f"seed {seed}: {n_frames} frames in {elapsed:.1f} s; grants {p.stats['grants']}, "
          f"helloed {sorted(map(str, helloed))}, nacks { {s.name: n for s, n in p.nacks.items()} }, "
          f"batches {p.stats['batches']}, inline {p.stats['inline']}, waited {p.stats['waited']}")


_keys = st.sampled_from(("k", "v", "session_id", "mm_hash", "compat_hash", "dest", "grant_id",
                         "ok", "grant_ids", "extend_s", "versions", "planes", "node_id",
                         "mem_kinds", "status", "detail", "batch_id", "wait_s", "inline_max",
                         "items", "data"))
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                     st.text(max_size=40), st.binary(max_size=40),
                     st.sampled_from(("hello", "req", "done", "renew", "reqs", "acks", "park",
                                      "dones", "sync", "offer",
                                      "hello0", "hello2", COMPAT, "a", "nr", 2)))
_items = st.lists(st.fixed_dictionaries({"mm_hash": st.sampled_from(("a", "b", "nr", "w1", "x")),
                                         "dest": st.just(b"")}), max_size=4)
_values = st.one_of(_scalars, st.lists(_scalars, max_size=4), _items)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(frames=st.lists(st.one_of(st.binary(max_size=80),
                                 st.dictionaries(_keys, _values, max_size=12).map(ENC)),
                       min_size=1, max_size=6),
       peer=st.sampled_from(("h0", "h2", "s0")))
def test_structured_maps(frames, peer):
    p = make_fuzz_producer()
    helloed: set = set()
    feed(p, "h0", ENC(base_frames("hello0")[0]), 0.0, "key-h0", helloed)
    feed(p, "h2", ENC(base_frames("hello2", 2)[0]), 0.0, "key-h2", helloed)
    for i, data in enumerate(frames):
        feed(p, peer, data, float(i), f"key-{peer}", helloed)
        check(p, helloed)
        assert isinstance(p.poll(float(i) + 0.5), list)
    fresh_peer_gets_a_grant(p, 10.0)


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_deeply_nested_frame_is_a_bad_request(side):
    data = b"\x81" + ENC("x") + b"\x91" * 1000 + b"\x00"  # {"x": [[[...[0]...]]]}, 1004 bytes
    if side == "producer":
        p = make_fuzz_producer()
        (nack,) = p.on_frame("s0", data, 0.0)
        assert decode(nack.data, versions=(1,)).status is Status.NACK_BAD_REQUEST
    else:
        c = make_consumer()
        assert c.on_frame(data, 0.0) == []
