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
- a holder record of an untrusted key is never fetched from;
- a holder that misses (its entry gone) hands the fetch to the next one; holders that do not
  answer (stopped processes) cost one ``fetch_timeout_s`` in all, then the item is computed;
  the only holder, stalled (SIGSTOP) once the session is up, is asked again within that deadline;
- an ``ec_producer`` stops naming a holder that was SIGKILLed once its liveness lapsed;
- the fleet counters reach vLLM's EC connector stats path (its stats log and ``/metrics``);
- ``ect_offer_to``: a producer that does not broadcast offers an announcement to the consumer
  the request names, and to no other.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import time

import pytest
from _engine import HIDDEN, Engine, digest, encoder_output, make_request
from conftest import (
    ProducerProcess,
    child_producer,
    model_extra,
    process_stopped,
    stalled_until_first_retry,
    wait_for,
)

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


# -- holders that fail --------------------------------------------------------------------------


def _records(d):
    from ectransport.fleet.records import InstanceRecord, decode

    inst = decode(d.redis.hget(d.keys.instances, d.instance), InstanceRecord)
    assert isinstance(inst, InstanceRecord)
    return inst


@contextlib.contextmanager
def holders_of(d, mm_hash: str, nbytes: int, holders: list[tuple[int, float]]):
    """Holder records of ``mm_hash`` for made-up live instances, one per ``(port, load)``: the
    producer on ``port`` (loopback, the test's producer key) — whether it holds the item or not —
    ranked by ``load`` (lower first). Removed on exit."""
    import msgspec

    from ectransport.fleet.records import HolderRecord, encode

    inst = _records(d)
    names = [f"fake-{port}-{uid('h')}" for port, _ in holders]
    for name, (port, load) in zip(names, holders):
        me = msgspec.structs.replace(inst, instance=name, host="127.0.0.1", port=port, load=load)
        d.redis.hset(d.keys.instances, name, encode(me))
        d.redis.zadd(d.keys.alive, {name: 1e15})
        d.redis.hset(d.keys.holders(mm_hash), name, encode(HolderRecord(
            v=me.v, mm_hash=mm_hash, instance=name, incarnation=me.incarnation, host=me.host,
            port=port, public_key=me.public_key, nbytes=nbytes, compat_hash=me.compat_hash,
            load=load)))
    try:
        yield names
    finally:
        for name in names:
            d.redis.hdel(d.keys.instances, name)
            d.redis.zrem(d.keys.alive, name)
            d.redis.hdel(d.keys.holders(mm_hash), name)


@contextlib.contextmanager
def fleet_fetches(consumer):
    """Record each fleet fetch the consumer side starts: holder port, scheduler time, the
    fetch's timeout and the give-up time of its ``_Fetch`` (yields the list; unwrapped on
    exit)."""
    calls: list[dict] = []
    fleet_fetch, submit = consumer._fleet_fetch, consumer.node.submit_held

    def submitted(addr, mm_hash, **kw):
        calls.append({"port": addr.port, "timeout_s": kw.get("timeout_s")})
        return submit(addr, mm_hash, **kw)

    def started(waiters, mm_hash, nbytes, holders, now, **kw):
        fleet_fetch(waiters, mm_hash, nbytes, holders, now, **kw)
        calls[-1].update(now=now, give_up=consumer._fetches[mm_hash].give_up)

    consumer._fleet_fetch = started
    consumer.node.submit_held = submitted
    try:
        yield calls
    finally:
        del consumer._fleet_fetch, consumer.node.submit_held  # the class's methods again


def assert_one_deadline(calls: list[dict], fetch_timeout_s: float) -> None:
    from ectransport.vllm.sched_consumer import _GRACE_S

    assert len({c["give_up"] for c in calls}) == 1, f"a fresh deadline per holder: {calls}"
    first = calls[0]
    assert first["give_up"] == pytest.approx(first["now"] + fetch_timeout_s + _GRACE_S)
    for c in calls:  # no holder's fetch may end after the first one's deadline
        assert c["now"] + c["timeout_s"] <= first["give_up"] - _GRACE_S + 1e-9, calls


def test_a_holder_that_misses_hands_the_fetch_to_the_next_one(instances):
    a, b, c = instances["A"], instances["B"], instances["C"]
    x = uid("x")
    assert run(a, x, 8).source[x] == "computed"
    d = sched(a).producer.node.fleet.directory
    assert wait_for(lambda: d.redis.hget(d.keys.holders(x), d.instance) is not None, 10.0)
    d.redis.hdel(d.keys.holders(x), d.instance)  # A's own record: the order below is fixed
    nbytes = 8 * sched(c).layout.block_bytes
    a_port, b_port = sched(a).producer.node.port, sched(b).producer.node.port
    # first B, which never held x (an entry evicted since it was published), then A
    with fleet_fetches(sched(c).consumer) as calls, \
            holders_of(d, x, nbytes, [(b_port, 0.0), (a_port, 0.5)]):
        fin = run(c, x, 8)
    assert fin.source[x] == "loaded", sched(c).consumer.outcomes
    assert digest(fin.embeds[x]) == digest(encoder_output(x, 8, salt="a"))
    assert [k["port"] for k in calls] == [b_port, a_port]
    assert_one_deadline(calls, 3.0)


@contextlib.contextmanager
def stopped_producers(keys, n: int):
    """``n`` real ProducerNodes (tests/node/_producer_proc.py, the test's producer key), each in
    its own process, stopped (SIGSTOP) once serving: a connection to one is accepted by the
    kernel and never answered. Yields their ports."""
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(child_producer(keys, [])) for _ in range(n)]
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
            assert wait_for(lambda pid=p.pid: process_stopped(pid), 10.0)
        yield [p.port for p in procs]


def test_holders_that_never_answer_cost_one_deadline_then_it_is_computed(instances, keys):
    a, c = instances["A"], instances["C"]
    y = uid("y")
    d = sched(a).producer.node.fleet.directory
    nbytes = 8 * sched(c).layout.block_bytes
    with fleet_fetches(sched(c).consumer) as calls, stopped_producers(keys, 2) as ports, \
            holders_of(d, y, nbytes, [(ports[0], 0.0), (ports[1], 0.5)]):
        fin = run(c, y, 8)
    assert fin.source[y] == "computed"
    assert [k["port"] for k in calls] == ports[:len(calls)] and calls, calls
    assert_one_deadline(calls, 3.0)
    assert any(k.startswith("miss:") for k in sched(c).consumer.outcomes)


def test_a_holder_that_stalls_once_the_session_is_up_is_asked_again(instances, keys):
    """The only holder of an item stops answering (SIGSTOP) after the consumer's session with it
    is up: the fetch misses (no ack in ack_timeout_s = 1 s) and, with no other holder, the same
    holder is asked again within fetch_timeout_s (3 s) once its quarantine is over; it runs
    again from the first retry on, and the item lands (bit for bit) instead of being encoded."""
    from tests.node._producer_proc import make_tensor

    a, c = instances["A"], instances["C"]
    w, z = uid("w"), uid("z")
    d = sched(a).producer.node.fleet.directory
    side = sched(c).consumer
    nbytes = 8 * sched(c).layout.block_bytes
    with child_producer(keys, [(w, 8, 1), (z, 8, 2)]) as p, \
            holders_of(d, w, nbytes, [(p.port, 0.0)]), holders_of(d, z, nbytes, [(p.port, 0.0)]):
        assert run(c, w, 8).source[w] == "loaded"  # the session with the holder is up
        with stalled_until_first_retry(side, p.pid) as asks:
            fin = run(c, z, 8)
    assert fin.source[z] == "loaded", (asks, side.outcomes)
    assert digest(fin.embeds[z]) == digest(make_tensor(8, HIDDEN, 2)), "not the holder's bytes"
    assert len(asks) >= 2 and set(asks) == {(p.port, z)}, asks


def test_an_encoder_only_instance_stops_naming_a_killed_holder(keys, redis):
    extra = model_extra(secret_key_file=keys.producer_secret, allow_dir=keys.allow_dir,
                        **fleet_extra(redis.url))
    h = ProducerProcess(extra, salt="h")
    p = None
    try:
        z = uid("z")
        h.call("encode", requests=[{"id": uid("r"), "features": [[z, 0, 8]]}])
        p = Engine("ec_producer", extra, salt="p", engine_id=uid("fleet-p"))
        p.drop_worker_meta = True
        d = sched(p).producer.node.fleet.directory

        def holder_ports() -> set[int]:
            return {x.port for x in d.lookup(z).get(z, [])}

        assert wait_for(lambda: h.info["port"] in holder_ports(), 20.0)
        first = run(p, z, 8)
        assert first.params[z]["peer_port"] == h.info["port"] and z not in first.embeds
        h.kill()  # SIGKILL: no withdrawal, its records lapse with its liveness
        assert wait_for(lambda: h.info["port"] not in holder_ports(), 20.0)
        again = run(p, z, 8)
        assert again.params[z]["peer_port"] != h.info["port"], "named a dead holder"
        assert again.params[z]["peer_port"] == sched(p).producer.node.port
        assert z in again.embeds  # encoded here
    finally:
        if p is not None:
            p.shutdown()
        h.close()


# -- metrics --------------------------------------------------------------------------------------


def test_the_fleet_counters_reach_vllms_ec_connector_stats(instances):
    import msgspec
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    a, c = instances["A"], instances["C"]
    connector = type(c.sched)
    got = connector.build_ec_connector_stats()
    assert got is not None and got.is_empty()

    def take() -> bool:  # what vLLM's scheduler does each step, aggregated as its loggers do
        nonlocal got
        s = c.sched.get_ec_connector_stats()
        if s is not None:
            wire = msgspec.msgpack.decode(msgspec.msgpack.encode(s.data))  # to the front end
            got = got.aggregate(connector.build_ec_connector_stats(wire))
        return got.data.get("counts", {}).get("hits", 0) >= 1

    take()  # everything so far
    got = connector.build_ec_connector_stats()
    x = uid("x")
    assert run(a, x, 8).source[x] == "computed"
    assert wait_for(lambda: sched(a).producer.node.lookup(x) is not None and
                    sched(a).producer.node.lookup(x).ready, 10.0)
    assert wait_for(lambda: run(c, x, 8).source[x] == "loaded", 20.0)
    assert wait_for(take, 10.0), got.data
    summary = got.reduce()
    assert summary["fleet_hits"] >= 1 and summary["lookups"] >= 1
    assert got.data["counts"].get("decision:fetched", 0) >= 1
    registry = CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    prom = connector.build_prom_metrics(c.config, types, ["engine"], {0: ["0"]})
    prom.observe(got.data, 0)
    hits = registry.get_sample_value("vllm:ec_fleet_lookup_items_total",
                                     {"engine": "0", "outcome": "hit"})
    assert hits is not None and hits >= 1
    assert registry.get_sample_value("vllm:ec_fleet_lookup_seconds_count",
                                     {"engine": "0"}) == summary["lookups"]
    assert registry.get_sample_value("vllm:ec_fleet_decisions_total",
                                     {"engine": "0", "outcome": "fetched"}) >= 1
    # an ec_both instance counts its claims the same way
    won = sched(a).fleet.directory.stats()["claims_won"]
    assert won >= 1


# -- targeted offers ------------------------------------------------------------------------------


def test_a_request_naming_its_consumer_has_it_offered_to_that_consumer_alone(keys):
    from ectransport.vllm.fleet import OFFER_TO

    p = Engine("ec_producer", model_extra(secret_key_file=keys.producer_secret,
                                          allow_dir=keys.allow_dir, broadcast_offers=False),
               salt="p", engine_id=uid("offer-p"))
    consumers = []
    try:
        for tag in ("c1", "c2"):
            consumers.append(Engine("ec_consumer", model_extra(
                secret_key_file=keys.consumer_secret, producer_keys=[keys.producer_public],
                fetch_timeout_s=5.0), salt=tag, engine_id=uid("offer-" + tag)))
        c1, c2 = consumers
        # both connect to the producer (nothing is offered: it does not broadcast)
        w = uid("w")
        rid = uid("r")
        p.add(make_request(rid, [(w, 0, 8)]))
        p.run()
        for c in consumers:
            rc = uid("rc")
            c.add(make_request(rc, [(w, 0, 8)], ec_transfer_params=p.finished[rid].params))
            c.run()
            assert c.finished[rc].source[w] == "loaded"
        nodes = [sched(c).consumer.node for c in consumers]
        assert [n.stats()["offers_held"] for n in nodes] == [0, 0]
        # a request naming c1's consumer node
        t = uid("t")
        rid = uid("r")
        p.add(make_request(rid, [(t, 0, 8)], ec_transfer_params={OFFER_TO: nodes[0].node_id}))
        p.run()
        params = p.finished[rid].params
        assert params[t].get("ect_hold"), params
        assert wait_for(lambda: nodes[0].stats()["offers_held"] >= 1, 10.0)
        want = digest(encoder_output(t, 8, salt="p"))
        for c in (c2, c1):  # c2 first: an offer sent to it too would be there by its answer
            rc = uid("rc")
            c.add(make_request(rc, [(t, 0, 8)], ec_transfer_params=params))
            c.run()
            assert c.finished[rc].source[t] == "loaded"
            assert digest(c.finished[rc].embeds[t]) == want
        assert nodes[1].stats()["offers_held"] == 0 and nodes[1].stats()["offer_reads"] == 0
        assert nodes[0].stats()["offer_reads"] == 1  # read on its offer, with no request
        assert sched(p).producer.node.stats()["offers_targeted"] >= 1
    finally:
        for e in (*consumers, p):
            e.shutdown()


@pytest.fixture
def quiet_pair(keys, redis):
    """Two ec_both instances that offer announcements only to the consumers named
    (``broadcast_offers`` false)."""
    both = model_extra(secret_key_file=keys.producer_secret, allow_dir=keys.allow_dir,
                       producer_keys=[keys.producer_public], broadcast_offers=False,
                       **fleet_extra(redis.url))
    made: list[Engine] = []
    try:
        for tag in ("qa", "qb"):
            made.append(Engine("ec_both", both, salt=tag, engine_id=uid("fleet-" + tag)))
            assert sched(made[-1]).producer.node.fleet.directory.wait_live(20.0)
        yield made
    finally:
        for e in made:
            e.shutdown()


def test_a_waiter_the_directory_names_reads_the_claimants_entry_on_its_offer(quiet_pair):
    """Targeted offers named by the directory: B loses the claim of a cold item to A and records
    its consumer as waiting (the item's wants set); A, once its entry is READY, offers it to
    exactly that consumer (A broadcasts nothing), and B reads it on the offer, with no
    request."""
    from ectransport.fleet.wants import wants_key

    a, b = quiet_pair
    for src, dst in ((a, b), (b, a)):  # a consumer is offered only on a session it has
        w = uid("w")
        assert run(src, w, 8).source[w] == "computed"
        port = sched(src).producer.node.port
        dd = sched(dst).fleet.directory
        assert wait_for(lambda w=w, dd=dd, port=port:
                        port in {h.port for h in dd.lookup(w).get(w, [])}, 10.0)
        assert run(dst, w, 8).source[w] == "loaded"
    y = uid("y")
    a.hold_reports = True  # A's save of y stays in flight until released: B waits for it
    ra, rb = uid("ra"), uid("rb")
    a.add(make_request(ra, [(y, 0, 8)]))
    assert wait_for(lambda: (a.step(), not a.waiting)[1], 30.0)
    assert sched(a).fleet.outcomes.get("claimed", 0) >= 1 and y in sched(a).fleet._encoding
    d = sched(b).fleet.directory
    me = sched(b).consumer.node.node_id
    b.add(make_request(rb, [(y, 0, 8)]))
    assert wait_for(lambda: (b.step(), me.encode() in d.redis.smembers(wants_key(d.keys, y)))[1],
                    20.0), "B recorded no want"
    assert b.waiting  # waiting for A's entry
    offers_before = sched(b).consumer.node.stats()["offer_reads"]
    a.hold_reports = False
    a.release_reports()
    a.run()
    # B's scheduler is not stepped meanwhile: the offer is there before its fetch starts
    assert wait_for(lambda: sched(b).consumer.node.stats()["offers_held"] >= 1, 10.0)
    b.run(timeout_s=30.0)
    fin = b.finished[rb]
    assert fin.source[y] == "loaded"
    assert digest(fin.embeds[y]) == digest(encoder_output(y, 8, salt="qa"))
    assert sched(b).consumer.node.stats()["offer_reads"] == offers_before + 1
    assert sched(a).fleet.outcomes.get("offered_waiters", 0) >= 1


def test_an_item_in_vllms_encoder_cache_is_not_looked_up_until_vllm_frees_it(instances):
    """vLLM asks ``ensure_cache_available`` before it consults its own encoder cache: an item
    allocated there (computed or loaded) and not reported freed since
    (``free_encoder_mm_hashes``) is admitted at once, with no lookup and no fetch."""
    a, c = instances["A"], instances["C"]
    x = uid("x")
    assert run(a, x, 8).source[x] == "computed"
    d = sched(c).fleet.directory
    port = sched(a).producer.node.port
    assert wait_for(lambda: port in {h.port for h in d.lookup(x).get(x, [])}, 10.0)
    assert run(c, x, 8).source[x] == "loaded"  # fetched; vLLM holds it until it frees it
    found = sched(c).fleet.outcomes.get("found", 0)
    again = make_request(uid("r"), [(x, 2, 8)])
    assert c.sched.ensure_cache_available(again, 0)  # vLLM's cache has it: nothing asked
    assert not sched(c).fleet.batcher.pending(x) and x not in sched(c).consumer._fetches
    c.step()  # a step whose SchedulerOutput reports x freed (evicted)
    assert not c.sched.ensure_cache_available(again, 0)  # now the fleet is asked again
    c.add(again)
    c.run()
    assert c.finished[again.request_id].source[x] == "loaded"
    assert sched(c).fleet.outcomes.get("found", 0) == found + 1
