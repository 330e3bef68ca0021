"""A fleet of instance processes (``tests/fleet/_instance.py``: a ProducerNode with ``[fleet]``,
a ConsumerNode and claims; CURVE on, the tcp plane, loopback) sharing one real redis-server:

- an item encoded once is fetched by every other instance, with no further encode;
- concurrent cold requests for one item on 4 instances encode it exactly once;
- an evicted entry is withdrawn, so nobody is sent to fetch it;
- a SIGKILLed holder's entries are not used after its liveness TTL; the next holder serves;
- Redis SIGSTOPped, killed and restarted mid-run: every request still ends (local encodes while
  it is away), and the holders are back once it is;
- a hostile directory (records of an untrusted instance serving other bytes, wrong sizes,
  another instance's mm_hashes, a trusted instance named for an item it does not hold) causes
  only misses: never a fetch from an untrusted peer, never wrong bytes.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from ectransport.fleet import Directory
from ectransport.fleet.records import HolderRecord, decode, encode
from tests.conftest import DEADLINE_S, new_keypair, wait_for
from tests.fleet._instance import LAYOUT, NBYTES
from tests.fleet.conftest import INSTANCE_TTL_S, Instance, settings_for

TTL_S = INSTANCE_TTL_S


@pytest.fixture
def fleet(redis_server):
    """``fleet(n, **spec)`` starts n instances trusting each other's keys."""
    made: list[Instance] = []

    def start(
        n: int, prefix: str = "pd", trusted: list[str] | None = None, **spec: object
    ) -> list[Instance]:
        kps = [new_keypair() for _ in range(n)]
        keys = [k.public for k in kps] + list(trusted or [])
        out = [
            Instance(f"{prefix}-{i}", redis_server.url, keys, kp, **spec)
            for i, kp in enumerate(kps)
        ]
        made.extend(out)
        return out

    yield start
    for inst in made:
        inst.close()


def test_an_item_encoded_once_is_fetched_by_every_other_instance(fleet):
    insts = fleet(4)
    first = insts[0].ask(need="img-0")
    assert first["how"] == "encoded", first
    for inst in insts[1:]:
        got = inst.ask(need="img-0")
        assert got["how"] == "fetched" and got["from"] == "pd-0" and got["ok"], got
    # ten images, each first needed by a different instance, then by all of them
    for i in range(1, 11):
        order = insts[i % 4 :] + insts[: i % 4]
        for inst in order:
            got = inst.ask(need=f"img-{i}")
            assert got["ok"] and got["how"] in ("encoded", "fetched"), got
    assert sum(inst.encodes() for inst in insts) == 11  # one encode per distinct image


def test_concurrent_cold_requests_on_four_instances_encode_once(fleet):
    insts = fleet(4)
    for inst in insts:
        inst.send(need="cold")
    answers = [inst._next() for inst in insts]
    hows = sorted(a["how"] for a in answers)
    assert hows == ["encoded", "fetched", "fetched", "fetched"], answers
    winner = next(a for a in answers if a["how"] == "encoded")
    assert all(a["ok"] for a in answers)
    assert sum(inst.encodes() for inst in insts) == 1
    assert {a["from"] for a in answers if a["how"] == "fetched"} == {
        insts[answers.index(winner)].name
    }


def test_an_evicted_entry_is_withdrawn_and_nobody_is_sent_for_it(fleet, redis_server, directories):
    (small, other) = fleet(2, entries=2)  # each producer region holds two entries
    assert small.ask(encode="e-0")["how"] == "encoded"
    d = Directory(
        settings_for(redis_server), trusted=lambda k, c: True, compat_hash=LAYOUT.compat_hash
    )
    directories.append(d)
    assert wait_for(lambda: [h.instance for h in d.lookup("e-0")["e-0"]] == ["pd-0"])
    small.ask(encode="e-1")
    small.ask(encode="e-2")  # evicts e-0 (the oldest ready entry)
    assert wait_for(lambda: d.lookup("e-0")["e-0"] == [])
    got = other.ask(need="e-0")
    assert got["how"] == "encoded" and got["tried"] == [], got  # not sent to the old holder


def test_a_killed_holders_entries_are_not_used_after_its_ttl(fleet, redis_server, directories):
    a, b, c = fleet(3)
    assert a.ask(need="x")["how"] == "encoded"
    assert b.ask(encode="x")["how"] == "encoded"  # a second holder
    d = Directory(
        settings_for(redis_server), trusted=lambda k, c_: True, compat_hash=LAYOUT.compat_hash
    )
    directories.append(d)
    assert wait_for(lambda: sorted(h.instance for h in d.lookup("x")["x"]) == ["pd-0", "pd-1"])
    a.kill()
    # the dead holder's records lapse with its liveness (TTL, on the Redis server's clock)
    assert wait_for(
        lambda: [h.instance for h in d.lookup("x")["x"]] == ["pd-1"], TTL_S + DEADLINE_S
    )
    got = c.ask(need="x")
    assert got["how"] == "fetched" and got["from"] == "pd-1" and got["tried"] == ["pd-1"], got
    assert got["ok"]


def test_redis_stopped_killed_and_restarted_mid_run(fleet, redis_server, directories):
    a, b = fleet(2)
    assert a.ask(need="r-0")["how"] == "encoded"
    assert b.ask(need="r-0")["how"] == "fetched"  # fetched entries are not re-published
    redis_server.pause()  # SIGSTOP: every directory call runs into its deadline
    try:
        got = b.ask(need="r-1")
        assert got["how"] == "local" and got["ok"], got  # ended, encoded without the directory
        assert a.ask(need="r-1")["how"] == "local"
    finally:
        redis_server.resume()
    # back: the directory answers again once the instances' backoff ends (a cold item: claimed)
    assert wait_for(lambda: b.ask(need=f"r-2-{time.monotonic()}")["how"] == "encoded")
    redis_server.restart()  # SIGKILL, then a new, empty redis-server on the same port
    got = a.ask(need="r-3")
    assert got["how"] in ("local", "encoded") and got["ok"], got
    # the instances publish everything again (their liveness renewal finds their record gone)
    d = Directory(
        settings_for(redis_server), trusted=lambda k, c: True, compat_hash=LAYOUT.compat_hash
    )
    directories.append(d)
    assert wait_for(
        lambda: [h.instance for h in d.lookup("r-0")["r-0"]] == ["pd-0"], TTL_S + DEADLINE_S
    )
    got = b.ask(need="r-0")
    assert got["how"] == "fetched" and got["from"] == "pd-0" and got["ok"], got


def test_a_hostile_directory_causes_only_misses(fleet, redis_server, directories):
    (rogue,) = fleet(1, prefix="rogue", corrupt=True)  # trusted by nobody else
    honest, victim = fleet(2, trusted=[])
    assert rogue.ask(encode="v-0")["how"] == "encoded"  # its v-0 bytes are not the encoder's
    assert honest.ask(encode="h-0")["how"] == "encoded"
    d = Directory(
        settings_for(redis_server), trusted=lambda k, c: True, compat_hash=LAYOUT.compat_hash
    )
    directories.append(d)
    assert wait_for(lambda: d.lookup("h-0")["h-0"] != [] and d.lookup("v-0")["v-0"] != [])
    r, k = d.redis, d.keys
    genuine = decode(r.hget(k.holders("h-0"), "pd-0"), HolderRecord)
    assert isinstance(genuine, HolderRecord)
    # the honest instance named for items it does not hold, with the wrong size, or under
    # another item's key
    r.hset(k.holders("v-1"), "pd-0", encode(msgspec.structs.replace(genuine, mm_hash="v-1")))
    r.hset(
        k.holders("v-2"),
        "pd-0",
        encode(msgspec.structs.replace(genuine, mm_hash="v-2", nbytes=NBYTES + 512)),
    )
    r.hset(k.holders("v-3"), "pd-0", r.hget(k.holders("h-0"), "pd-0"))
    for mm in ("v-0", "v-1", "v-2", "v-3"):
        got = victim.ask(need=mm)
        assert got["ok"], got  # never wrong bytes
        assert got["how"] in ("encoded", "local") and got["from"] is None, got
        assert "rogue-0" not in got["tried"], got  # never tried: untrusted
    assert victim.ask(need="h-0")["how"] == "fetched"  # the honest record still serves
    st = victim.ask(stats=True)["fleet"]
    assert st["dropped_untrusted"] >= 1 and st["dropped_size"] >= 1
    assert st["dropped_malformed"] >= 1
