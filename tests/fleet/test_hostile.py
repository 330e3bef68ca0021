"""A wrong or hostile directory causes only misses: records written raw into Redis (garbage,
other versions, unknown instances, another item's record, wrong sizes, keys that are not the
instance's, wrong key types) are dropped and counted; lookups never raise."""

from __future__ import annotations

import msgspec

from ectransport.fleet import UnavailableReason
from ectransport.fleet.records import HolderRecord, InstanceRecord, decode, encode
from tests.conftest import DEADLINE_S, new_keypair
from tests.fleet.conftest import consumer_dir, holder_dir


def test_hostile_holder_records_are_dropped_and_counted(redis_server, directories):
    p = holder_dir(directories, redis_server, "honest")
    p.publish("item", 4096)
    p.publish("other", 4096)
    assert p.flush(DEADLINE_S)
    r = p.redis
    k = p.keys
    genuine = decode(r.hget(k.holders("item"), "honest"), HolderRecord)
    assert isinstance(genuine, HolderRecord)

    def forged(**changes) -> bytes:
        return encode(msgspec.structs.replace(genuine, **changes))

    # a second, live instance whose records get forged
    victim = holder_dir(directories, redis_server, "victim")
    r.hset(k.holders("item"), mapping={
        "garbage": b"\x00\xffnot msgpack",
        "array": msgspec.msgpack.encode([1, "x"]),
        "future": msgspec.msgpack.encode({"v": 2, "anything": True}),
        "typed-wrong": msgspec.msgpack.encode({"v": 1, "mm_hash": 5}),
        "ghost": forged(instance="ghost"),                        # no such instance
        "named-wrong": forged(instance="victim"),                 # field is not its instance
        "victim": forged(instance="victim", incarnation=victim.incarnation,
                         public_key=new_keypair().public),        # not the victim's key
        "honest2": forged(instance="honest2"),
    })
    r.hset(k.holders("big"), "honest", forged(mm_hash="big", nbytes=1 << 50))
    r.hset(k.holders("moved"), "honest", r.hget(k.holders("other"), "honest"))  # other item's
    r.set(k.holders("wrongtype"), b"a string where a hash belongs")
    c = consumer_dir(directories, redis_server)
    got = c.lookup_many(["item", "big", "moved", "wrongtype", "nobody"], nbytes={"item": 4096})
    assert got.ok
    assert [h.instance for h in got["item"]] == ["honest"]
    assert got["big"] == got["moved"] == got["wrongtype"] == got["nobody"] == []
    s = c.stats()
    assert s["dropped_malformed"] == 5  # garbage, array, typed-wrong, named-wrong, moved
    assert s["dropped_version"] == 1 and s["dropped_dead"] == 2  # ghost, honest2
    assert s["dropped_mismatch"] == 1 and s["dropped_size"] == 1
    assert s["dropped_bad_reply"] == 1
    wrong_size = c.lookup("item", nbytes=4097)
    assert wrong_size["item"] == []


def test_hostile_instance_records_only_cause_misses(redis_server, directories):
    p = holder_dir(directories, redis_server, "honest")
    p.publish("item", 4096)
    assert p.flush(DEADLINE_S)
    r, k = p.redis, p.keys
    r.hset(k.instances, mapping={"junk": b"\x93\x01\x02", "liar": encode(InstanceRecord(
        v=1, instance="not-liar", incarnation="x", host="h", port=1,
        public_key=new_keypair().public, compat_hash="c"))})
    r.zadd(k.alive, {"junk": 1e15, "liar": 1e15})
    c = consumer_dir(directories, redis_server)
    got = c.lookup("item")
    assert [h.instance for h in got["item"]] == ["honest"]
    # the directory's own structures of the wrong type: an unavailable answer, no exception
    r.delete(k.alive)
    r.set(k.alive, b"oops")
    got = c.lookup("item")
    assert got.unavailable is not None and got.unavailable.reason is UnavailableReason.ERROR
    assert got["item"] == []
