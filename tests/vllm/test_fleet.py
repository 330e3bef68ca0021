"""vLLM instances sharing encodings through the fleet directory, with no ec_transfer_params
from an orchestrator: vLLM's own connector objects, driven in vLLM's call order (``_engine.py``),
a real redis-server, real ZMQ + CURVE + NIXL between the instances.

- two ``ec_both`` instances and an ``ec_consumer``: an image encoded by one is fetched (bit for
  bit its encoder output) by the others, with no further encode;
- the same cold image on both ``ec_both`` instances at once: encoded once (a claim), the other
  waits for the claimant's entry and fetches it;
- an ``ec_producer`` skips its encoder for an image the fleet holds and names that holder in
  the request's ec_transfer_params;
- Redis stopped (SIGSTOP) mid-run: every request still ends (computed locally), none stuck;
- a holder record of an untrusted key is never fetched from.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
from _engine import Engine, digest, encoder_output, make_request
from conftest import model_extra, wait_for

pytest.importorskip("redis")
from tests.fleet.redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.slow
_ids = itertools.count()


def uid(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{next(_ids)}-{time.monotonic_ns()}"


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def fleet_extra(url: str, **kw: object) -> dict:
    return {"fleet_url": url, "fleet_liveness_ttl_s": 1.5, "fleet_lookup_timeout_s": 0.3,
            "fleet_claim_wait_s": 8.0, "fetch_timeout_s": 3.0, "ack_timeout_s": 1.0, **kw}


@pytest.fixture(scope="module")
def instances(keys, redis):
    """A and B: ec_both (the producer's key pair, allowed by each other); C: ec_consumer."""
    both = model_extra(secret_key_file=keys.producer_secret, allow_dir=keys.allow_dir,
                       producer_keys=[keys.producer_public], **fleet_extra(redis.url))
    made: dict[str, Engine] = {}
    try:
        made["A"] = Engine("ec_both", both, salt="a", engine_id=uid("fleet-a"))
        made["B"] = Engine("ec_both", both, salt="b", engine_id=uid("fleet-b"))
        made["C"] = Engine("ec_consumer", model_extra(
            secret_key_file=keys.consumer_secret, producer_keys=[keys.producer_public],
            **fleet_extra(redis.url)), salt="c", engine_id=uid("fleet-c"))
        for name in ("A", "B"):
            d = made[name].sched._scheduler.producer.node.fleet.directory
            assert d.wait_live(20.0), name
        yield made
    finally:
        for e in made.values():
            e.shutdown()


def run(engine: Engine, mm_hash: str, rows: int, timeout_s: float = 30.0):
    rid = uid("r")
    engine.add(make_request(rid, [(mm_hash, 2, rows)]))
    engine.run(timeout_s=timeout_s)
    return engine.finished[rid]


def sched(engine: Engine):
    return engine.sched._scheduler


def test_an_image_encoded_once_is_fetched_by_the_other_instances(instances):
    a, b, c = instances["A"], instances["B"], instances["C"]
    x = uid("x")
    fa = run(a, x, 24)
    assert fa.source[x] == "computed"
    want = digest(encoder_output(x, 24, salt="a"))
    assert digest(fa.embeds[x]) == want
    assert wait_for(lambda: sched(a).producer.node.lookup(x) is not None and
                    sched(a).producer.node.lookup(x).ready, 10.0)  # saved, published
    for e in (b, c):
        fin = run(e, x, 24)
        assert fin.source[x] == "loaded", sched(e).fleet.stats()
        assert digest(fin.embeds[x]) == want, "not the bytes A's encoder made"
    for e in (b, c):
        assert sched(e).fleet.outcomes.get("found", 0) >= 1
        assert sched(e).consumer.outcomes["landed"] >= 1


def test_the_same_cold_image_on_two_instances_is_encoded_once(instances):
    a, b = instances["A"], instances["B"]
    y = uid("y")
    ra, rb = uid("ra"), uid("rb")
    a.add(make_request(ra, [(y, 0, 16)]))
    b.add(make_request(rb, [(y, 0, 16)]))
    deadline = time.monotonic() + 30.0
    while (a.waiting or b.waiting) and time.monotonic() < deadline:
        progressed = [a.step(), b.step()]  # both schedulers, interleaved
        if not any(progressed):
            time.sleep(0.005)
    a.run(timeout_s=30.0)
    b.run(timeout_s=30.0)
    assert not a.waiting and not b.waiting, "a request is stuck"
    srcs = sorted([a.finished[ra].source[y], b.finished[rb].source[y]])
    assert srcs == ["computed", "loaded"], srcs
    winner, loser = (a, b) if a.finished[ra].source[y] == "computed" else (b, a)
    salt = "a" if winner is a else "b"
    got = (a.finished[ra] if loser is a else b.finished[rb]).embeds[y]
    assert digest(got) == digest(encoder_output(y, 16, salt=salt))
    assert sched(winner).fleet.outcomes.get("claimed", 0) >= 1
    assert sched(loser).fleet.directory.stats()["claims_lost"] >= 1


def test_an_encoder_only_instance_names_the_fleets_holder(instances, keys, redis):
    a = instances["A"]
    z = uid("z")
    assert run(a, z, 8).source[z] == "computed"
    assert wait_for(lambda: sched(a).producer.node.lookup(z) is not None, 10.0)
    p = Engine("ec_producer", model_extra(secret_key_file=keys.producer_secret,
                                          allow_dir=keys.allow_dir, **fleet_extra(redis.url)),
               salt="p", engine_id=uid("fleet-p"))
    try:
        p.drop_worker_meta = True  # as vLLM's V1 runner does for an ec_producer
        fin = run(p, z, 8)
        assert z not in fin.embeds  # its encoder did not run
        info = fin.params[z]
        assert info["peer_port"] == sched(a).producer.node.port
        assert info["public_key"] == sched(a).producer.node.public_key
        assert "ect_hold" not in info
        assert sched(p).producer.node.lookup(z) is None  # nothing saved here
    finally:
        p.shutdown()


def test_a_stopped_directory_never_blocks_a_request(instances, redis):
    a, c = instances["A"], instances["C"]
    redis.pause()
    try:
        for e in (a, c):
            w = uid("w")
            fin = run(e, w, 8, timeout_s=30.0)  # run() fails if a request is stuck
            assert fin.source[w] == "computed"
        assert sched(c).fleet.directory.stats()["unavailable"] >= 1
    finally:
        redis.resume()
    v = uid("v")
    assert run(a, v, 8).source[v] == "computed"  # claimed again once Redis answers
    assert wait_for(lambda: sched(a).producer.node.lookup(v) is not None, 10.0)
    assert wait_for(lambda: run(c, v, 8).source[v] == "loaded", 20.0)


def test_an_untrusted_holder_is_never_fetched_from(instances, redis):
    import msgspec

    from ectransport.fleet.records import HolderRecord, InstanceRecord, decode, encode
    from tests.conftest import new_keypair

    a, c = instances["A"], instances["C"]
    u = uid("u")
    assert run(a, u, 8).source[u] == "computed"
    d = sched(a).producer.node.fleet.directory
    assert wait_for(lambda: d.redis.hget(d.keys.holders(u), d.instance) is not None, 10.0)
    rec = decode(d.redis.hget(d.keys.holders(u), d.instance), HolderRecord)
    inst = decode(d.redis.hget(d.keys.instances, d.instance), InstanceRecord)
    assert isinstance(rec, HolderRecord) and isinstance(inst, InstanceRecord)
    rogue = new_keypair().public  # A's address, a key C does not trust
    d.redis.hset(d.keys.instances, "rogue", encode(msgspec.structs.replace(
        inst, instance="rogue", public_key=rogue)))
    d.redis.zadd(d.keys.alive, {"rogue": 1e15})
    w = uid("w")
    d.redis.hset(d.keys.holders(w), "rogue", encode(msgspec.structs.replace(
        rec, mm_hash=w, instance="rogue", public_key=rogue)))
    before = sched(c).fleet.directory.stats().get("dropped_untrusted", 0)
    fin = run(c, w, 8)
    assert fin.source[w] == "computed"
    assert sched(c).fleet.directory.stats()["dropped_untrusted"] > before
