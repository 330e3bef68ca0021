"""The directory against a real redis-server: publish/lookup/unpublish, one round trip per
lookup, liveness of a SIGKILLed holder process, trust filtering, ordering, the async forms, GC."""

from __future__ import annotations

import concurrent.futures as cf
import statistics

import msgspec
import pytest
import redis

from ectransport.errors import ConfigError
from ectransport.fleet import Directory, LookupBatcher, trust_any
from ectransport.fleet.records import HolderRecord, decode, encode
from tests.conftest import DEADLINE_S, new_keypair, wait_for
from tests.fleet.conftest import (
    Proc,
    consumer_dir,
    holder_dir,
    identity,
    server_ms,
    settings_for,
)


def test_publish_lookup_unpublish(redis_server, directories):
    p = holder_dir(directories, redis_server, "enc-0")
    c = consumer_dir(directories, redis_server)
    assert c.lookup_many(["a", "b"]) == {"a": [], "b": []}
    p.publish("a", 4096)
    p.publish("b", 8192)
    assert p.flush(DEADLINE_S)
    got = c.lookup_many(["a", "b", "c", "a"])
    assert got.ok and set(got) == {"a", "b", "c"}
    assert [(h.instance, h.nbytes, h.address) for h in got["a"]] == [("enc-0", 4096,
                                                                      "10.0.0.1:5601")]
    assert got["b"][0].public_key == p.identity.public_key and got["c"] == []
    p.unpublish("a")
    assert p.flush(DEADLINE_S)
    got = c.lookup_many(["a", "b"])
    assert got["a"] == [] and len(got["b"]) == 1
    s = c.stats()
    assert s["hits"] == 3 and s["lookups"] == 3 and s["lookup_seconds_count"] == 3
    assert p.stats()["published"] == 2 and p.stats()["unpublished"] == 1


def test_a_lookup_of_many_items_is_one_round_trip(redis_server, directories, monkeypatch):
    """The whole batch (holders of every item, live instances, server clock) is sent in one
    write and answered in one read sequence: count the client's sends."""
    p = holder_dir(directories, redis_server, "enc-0")
    for i in range(50):
        p.publish(f"item-{i}", 100 + i)
    assert p.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    c.lookup_many(["warm-up"])  # the connection is made (and counted) before we count
    sends = []
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        sends.append(1)
        return real(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    got = c.lookup_many([f"item-{i}" for i in range(50)] + ["nope"])
    assert len(sends) == 1
    assert sum(1 for v in got.values() if v) == 50


def test_own_records_are_skipped_and_holders_ordered_same_host_then_load(redis_server,
                                                                          directories):
    near = holder_dir(directories, redis_server, "near",
                      ident=identity("near", host="10.9.9.9"))
    busy = holder_dir(directories, redis_server, "busy", ident=identity("busy", port=1))
    idle = holder_dir(directories, redis_server, "idle", ident=identity("idle", port=2))
    near.set_load(50.0)
    busy.set_load(10.0)
    idle.set_load(1.0)
    for d in (near, busy, idle):
        d.publish("x", 10)
    me = Directory(settings_for(redis_server), identity=identity("me", host="10.9.9.9"),
                   trusted=trust_any).start()
    directories.append(me)
    me.publish("x", 10)
    for d in (near, busy, idle, me):
        assert d.flush(DEADLINE_S)

    def loads_written() -> bool:  # the load figure travels with the next liveness renewal
        hs = me.lookup("x")["x"]
        return [h.load for h in hs] == [50.0, 1.0, 10.0]

    assert wait_for(loads_written)
    hs = me.lookup("x")["x"]
    assert [h.instance for h in hs] == ["near", "idle", "busy"]
    assert hs[0].same_host and not hs[1].same_host
    assert me.stats()["skipped_self"] >= 1


def test_trust_predicate_and_compat_hash_filter_holders(redis_server, directories):
    good, bad = new_keypair().public, new_keypair().public
    a = holder_dir(directories, redis_server, "a", ident=identity("a", key=good, cert=b"CERT-A"))
    b = holder_dir(directories, redis_server, "b", ident=identity("b", key=bad))
    a.publish("x", 10)
    b.publish("x", 10)
    assert a.flush(DEADLINE_S) and b.flush(DEADLINE_S)
    seen = []

    def trusted(key, cert):
        seen.append((key, cert))
        if key == bad:
            return False
        raise RuntimeError("a predicate that raises refuses")  # for `good`

    c = consumer_dir(directories, redis_server, trusted=trusted)
    assert c.lookup("x")["x"] == []
    assert (good, b"CERT-A") in seen and c.stats()["dropped_untrusted"] == 2
    c2 = consumer_dir(directories, redis_server, trusted=lambda k, cert: k == good)
    assert [h.instance for h in c2.lookup("x")["x"]] == ["a"]
    assert c2.lookup("x")["x"][0].cert == b"CERT-A"
    other = Directory(settings_for(redis_server), trusted=trust_any, compat_hash="another")
    directories.append(other)
    assert other.lookup("x")["x"] == [] and other.stats()["dropped_incompatible"] == 2
    sized = c2.lookup("x", nbytes=11)
    assert sized["x"] == [] and c2.stats()["dropped_size"] == 2  # size is checked before trust
    with pytest.raises(ConfigError, match="trust predicate"):
        Directory(settings_for(redis_server)).lookup("x")


def test_sigkilled_holder_process_is_not_returned_after_its_ttl(redis_server, directories,
                                                                procs):
    """A holder PROCESS publishes and is SIGKILLed: its liveness deadline (server clock) is at
    most one TTL after the kill, and once the server's clock passes it, lookups return none of
    its entries (and count them dead); a live holder of the same item keeps serving."""
    ttl_s = 1.5
    p = Proc("holder", redis_server.url, "doomed", str(ttl_s), "m1", "m2")
    procs.append(p)
    p.expect("READY")
    live = holder_dir(directories, redis_server, "survivor")
    live.publish("m2", 4096)
    assert live.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    got = c.lookup_many(["m1", "m2"])
    assert [h.instance for h in got["m1"]] == ["doomed"]
    assert {h.instance for h in got["m2"]} == {"doomed", "survivor"}
    p.kill()
    killed_ms = server_ms(redis_server)
    r = live.redis
    deadline_ms = int(r.zscore(live.keys.alive, "doomed"))
    assert deadline_ms <= killed_ms + ttl_s * 1000
    assert wait_for(lambda: server_ms(redis_server) > deadline_ms, DEADLINE_S)
    got = c.lookup_many(["m1", "m2"])
    assert got["m1"] == [] and [h.instance for h in got["m2"]] == ["survivor"]
    assert c.stats()["dropped_dead"] == 2
    assert r.hexists(c.keys.holders("m1"), "doomed")  # lapsed, not collected: cleaned lazily


def test_lapsed_instances_are_collected_with_their_entries(redis_server, directories, procs):
    p = Proc("holder", redis_server.url, "gone", "1.0", "g1", "g2")
    procs.append(p)
    p.expect("READY")
    p.kill()
    gc = holder_dir(directories, redis_server, "janitor", liveness_ttl_s=0.6, gc_after_s=1.0)
    r = gc.redis
    assert wait_for(lambda: not r.hexists(gc.keys.instances, "gone"), DEADLINE_S * 2)
    assert wait_for(lambda: not r.hexists(gc.keys.holders("g1"), "gone"))
    assert not r.hexists(gc.keys.holders("g2"), "gone")
    assert gc.stats()["gc_instances"] == 1 and gc.stats()["cleaned"] == 2


def test_stale_records_of_an_unknown_instance_are_cleaned_by_lookups(redis_server, directories):
    h = holder_dir(directories, redis_server, "h")
    h.publish("s", 10)
    assert h.flush(DEADLINE_S)
    r = h.redis
    raw = r.hget(h.keys.holders("s"), "h")
    rec = decode(raw, HolderRecord)
    assert isinstance(rec, HolderRecord), (rec, raw)
    ghost = encode(msgspec.structs.replace(rec, instance="ghost"))
    r.hset(h.keys.holders("s"), "ghost", ghost)
    assert [x.instance for x in h.lookup_many(["s"]).get("s", [])] == []  # own record skipped
    assert wait_for(lambda: not r.hexists(h.keys.holders("s"), "ghost"))
    assert r.hexists(h.keys.holders("s"), "h") and h.stats()["cleaned"] == 1


def test_async_lookup_and_the_per_step_batcher(redis_server, directories):
    p = holder_dir(directories, redis_server, "enc")
    p.publish("a", 10)
    assert p.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    got = []
    fut = c.submit_lookup(["a", "b"], callback=got.append)
    assert [h.instance for h in fut.result(DEADLINE_S)["a"]] == ["enc"]
    assert wait_for(lambda: len(got) == 1) and got[0]["b"] == []
    batcher = LookupBatcher(c)
    for m in ("a", "b", "a"):
        batcher.want(m)
    assert batcher.result("a") is None and batcher.pending("a")
    assert batcher.flush() == 2 and batcher.flush() == 0
    assert wait_for(lambda: batcher.result("a") is not None and batcher.result("b") is not None)
    assert [h.instance for h in batcher.result("a")] == ["enc"] and batcher.result("b") == []
    assert batcher.round_trips == 1
    batcher.want("a")  # answered and fresh: not asked again
    assert batcher.flush() == 0
    futs = [c.submit_lookup([f"k{i}"]) for i in range(20)]
    assert all(f.result(DEADLINE_S).ok for f in cf.as_completed(futs, DEADLINE_S))


def test_lookup_latency_p50_printed(redis_server, directories):
    p = holder_dir(directories, redis_server, "enc")
    for i in range(8):
        p.publish(f"lat-{i}", 4 << 20)
    assert p.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    items = [f"lat-{i}" for i in range(8)]
    c.lookup_many(items)
    times = [c.lookup_many(items).elapsed_s for _ in range(300)]
    one = [c.lookup("lat-0").elapsed_s for _ in range(300)]
    print(f"\nfleet lookup on loopback: 8 items p50 {statistics.median(times) * 1e3:.3f} ms, "
          f"1 item p50 {statistics.median(one) * 1e3:.3f} ms, stats p99 "
          f"{c.stats()['lookup_p99_s'] * 1e3:.3f} ms")
    assert c.stats()["hits"] == 8 * 301 + 300
