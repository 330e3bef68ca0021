"""Two vLLM instances: the producer in a child process, the consumer here, over real ZMQ + CURVE +
NIXL, each driven through vLLM's call order (see ``_engine.py``). The consumer must end with the
producer's exact bytes in ``encoder_cache``, or, when anything goes wrong, with the feature
computed locally: never stuck, and healthy for the next request.

The tests share one producer process and one consumer (vLLM imports once per process); they run
in file order, the producer is killed in the last one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time

import pytest
import torch
from _engine import HIDDEN, Engine, digest, encoder_output, make_request
from conftest import child_producer, model_extra, region_files, stalled_until_first_retry, wait_for

from ectransport.node.common import Layout, Security
from ectransport.node.producer import ProducerNode
from ectransport.settings_schema import ProducerSettings

pytestmark = pytest.mark.slow
_ids = itertools.count()


def uid(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{next(_ids)}-{time.monotonic_ns()}"


def produce(producer, features, hold_reports=False) -> tuple[dict, dict]:
    """Run one request through the producer instance: (its ec_transfer_params, digests)."""
    rid = uid("p")
    r = producer.call("encode", requests=[{"id": rid, "features": features}],
                      hold_reports=hold_reports)
    return r["params"][rid], r["digests"]


def consume(consumer: Engine, features, params, timeout_s: float = 20.0):
    rid = uid("c")
    consumer.add(make_request(rid, features, params))
    consumer.run(timeout_s=timeout_s)
    return consumer.finished[rid]


def assert_local(fin, mm_hash: str, rows: int) -> None:
    assert fin.source[mm_hash] == "computed"
    assert torch.equal(fin.embeds[mm_hash].view(torch.int16),
                       encoder_output(mm_hash, rows, salt="consumer").view(torch.int16))


def assert_healthy(consumer: Engine, producer) -> None:
    """The next request still fetches from the live producer, and nothing is left held."""
    h = uid("health")
    params, digests = produce(producer, [[h, 2, 16]])
    fin = consume(consumer, [(h, 2, 16)], params)
    assert fin.source[h] == "loaded" and digest(fin.embeds[h]) == digests[h]
    side = consumer.sched._scheduler.consumer
    assert wait_for(lambda: not side.busy and side.node.store.pinned_blocks == 0, 5.0)


def announce(node: ProducerNode, mm_hash: str, rows: int) -> dict:
    """ec_transfer_params as the connector announces them, for a plain ProducerNode."""
    return {mm_hash: {"peer_host": "127.0.0.1", "peer_port": node.port,
                      "size_bytes": rows * node.layout.block_bytes, "shape": [rows, HIDDEN],
                      "dtype": "bfloat16", "public_key": node.public_key}}


@pytest.fixture
def side_node(keys):
    """A plain ectransport ProducerNode (same keys as the producer instance) for failure paths."""
    nodes = []

    def make(layout: Layout = Layout("test/vision-model", "bfloat16", HIDDEN), start=True,
             **kw) -> ProducerNode:
        n = ProducerNode(layout=layout, settings=ProducerSettings(region_bytes=1 << 20, **kw),
                         security=Security.from_files(keys.producer_secret, keys.allow_dir))
        nodes.append(n)
        return n.start() if start else n

    yield make
    for n in nodes:
        n.close()


# -- the happy path ----------------------------------------------------------------------------
def test_consumer_gets_the_producers_bytes(producer, consumer):
    a, b, c = uid("a"), uid("b"), uid("c")
    features = [[a, 3, 24], [b, 30, 7], [c, 40, 200]]
    params, digests = produce(producer, features)
    assert set(params) == {a, b, c}
    for h, _, n in features:
        info = params[h]
        assert info["peer_port"] == producer.info["port"]
        assert info["size_bytes"] == n * HIDDEN * 2 and info["shape"] == [n, HIDDEN]
        assert info["public_key"] == producer.info["public_key"]
        assert info["planes"] == ["nixl"] and info["versions"]
        # vLLM's own per-item entries ride along (its EPD proxy sizes rewritten items from them)
        assert info["item_indices"] == [features.index([h, _, n])] and "metadata" in info

    fin = consume(consumer, [tuple(f) for f in features], params)
    for h, _, n in features:
        assert fin.source[h] == "loaded"
        t = fin.embeds[h]
        assert t.shape == (n, HIDDEN) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
        assert digest(t) == digests[h], "not bit-identical to the producer's encoder output"
    side = consumer.sched._scheduler.consumer
    assert side.outcomes["landed"] >= 3
    assert wait_for(lambda: side.node.store.pinned_blocks == 0, 5.0), "load pins not released"
    assert not consumer.sched.has_pending_push_work()


def test_two_requests_share_one_fetch(producer, consumer):
    h = uid("shared")
    params, digests = produce(producer, [[h, 0, 32]])
    r1, r2 = uid("c"), uid("c")
    consumer.add(make_request(r1, [(h, 0, 32)], params))
    consumer.add(make_request(r2, [(h, 5, 32)], params))
    consumer.run(timeout_s=20)
    assert digest(consumer.finished[r1].embeds[h]) == digests[h]
    assert digest(consumer.finished[r2].embeds[h]) == digests[h]
    # after both finished, the landed entry is given back: a later request fetches again
    fin = consume(consumer, [(h, 0, 32)], params)
    assert fin.source[h] == "loaded" and digest(fin.embeds[h]) == digests[h]


def test_announced_items_are_read_on_their_ticket_in_the_same_step(producer, consumer):
    """ECTP v2 §10 (issue 16 items 1 and 5): the producer's ``request_finished`` announces each
    item with a hold (``ect_hold``) offered to the consumer's session; the consumer reads it on
    that ticket with no request at the producer, and the request is admitted in the scheduler
    step that first saw it (no step deferred). Without an offer (first contact) the same params
    are fetched with a request, as before."""
    h0 = uid("first")
    params0, digests0 = produce(producer, [[h0, 0, 32]])
    assert isinstance(params0[h0].get("ect_hold"), int) and params0[h0]["ect_hold"] > 0
    fin0 = consume(consumer, [(h0, 0, 32)], params0)  # connects: no offer yet
    assert fin0.source[h0] == "loaded" and digest(fin0.embeds[h0]) == digests0[h0]
    side = consumer.sched._scheduler.consumer
    # the longest admission wait: the test proves the mechanism, not this host's speed
    saved, side.settings = side.settings, dataclasses.replace(side.settings, admit_wait_s=0.1)
    h = uid("ticket")
    params, digests = produce(producer, [[h, 0, 32]])
    # h0's hold (offered when the session began) and h's
    assert wait_for(lambda: side.node.stats()["offers_held"] >= 2, 5.0), "no offer arrived"
    before = producer.call("stats")
    try:
        fin = consume(consumer, [(h, 0, 32)], params)
    finally:
        side.settings = saved
    assert fin.source[h] == "loaded" and digest(fin.embeds[h]) == digests[h]
    assert side.node.stats()["offer_reads"] >= 1
    assert fin.steps_deferred == 0, "the request waited a scheduler step for its fetch"
    after = producer.call("stats")
    assert after["batches"] == before["batches"] and after["grants"] == before["grants"], \
        "the consumer asked instead of reading on its ticket"
    assert wait_for(lambda: producer.call("stats")["hold_reads"] >= 1, 5.0)


def test_not_ready_then_ready(producer, consumer):
    """The producer announces while its save is still in flight; the consumer's request waits
    at the producer (ECTP v2: parked, no NACK_NOT_READY polling) and gets the bytes once the save
    has landed."""
    h = uid("late")
    params, digests = produce(producer, [[h, 1, 40]], hold_reports=True)
    assert h in params  # announced although not READY yet
    rid = uid("c")
    consumer.add(make_request(rid, [(h, 1, 40)], params))
    for _ in range(40):  # deferred while the request waits at the producer
        consumer.step()
        time.sleep(0.01)
    assert rid not in consumer.finished
    st = producer.call("stats")
    assert st["parked_frames"] >= 1 and st["waiting_items"] == 1, st
    assert st["nacks"].get("NACK_NOT_READY", 0) == 0, "the consumer polled instead of waiting"
    producer.call("release_reports")
    consumer.run(timeout_s=20)
    fin = consumer.finished[rid]
    assert fin.source[h] == "loaded" and digest(fin.embeds[h]) == digests[h]
    assert fin.steps_deferred >= 40


# -- failure paths: every one ends computed locally, bounded, and leaves the consumer healthy --
def test_producer_missing_nobody_listens(producer, consumer, side_node):
    n = side_node()
    params = announce(n, h := uid("gone"), 16)
    n.close()  # nobody listens on that port any more
    t0 = time.monotonic()
    fin = consume(consumer, [(h, 0, 16)], params)
    assert time.monotonic() - t0 < 10
    assert_local(fin, h, 16)
    assert_healthy(consumer, producer)


def test_producer_does_not_hold_it(producer, consumer):
    h = uid("unknown")
    params, _ = produce(producer, [[uid("other"), 0, 8]])
    info = dict(next(iter(params.values())), size_bytes=16 * HIDDEN * 2, shape=[16, HIDDEN])
    fin = consume(consumer, [(h, 0, 16)], {h: info})
    assert_local(fin, h, 16)
    assert consumer.sched._scheduler.consumer.outcomes["miss:missing"] >= 1
    assert_healthy(consumer, producer)


def test_producer_incompatible(producer, consumer, side_node):
    n = side_node(Layout("another/model", "bfloat16", HIDDEN))
    h = uid("incompat")
    n.put(h, encoder_output(h, 16, salt="other"))
    fin = consume(consumer, [(h, 0, 16)], announce(n, h, 16))
    assert_local(fin, h, 16)
    assert consumer.sched._scheduler.consumer.outcomes["miss:incompatible"] >= 1
    assert_healthy(consumer, producer)


def test_busy_then_granted(producer, consumer, side_node):
    """The producer's pin budget admits one entry at a time: the second fetch is answered
    NACK_BUSY, retried, and granted once the first read completed."""
    rows = 64
    n = side_node(budget_bytes=rows * HIDDEN * 2, inline_max_bytes=0)  # inline pins nothing
    a, b = uid("busy-a"), uid("busy-b")
    ta, tb = encoder_output(a, rows, salt="side"), encoder_output(b, rows, salt="side")
    n.put(a, ta)
    n.put(b, tb)
    params = {**announce(n, a, rows), **announce(n, b, rows)}
    fin = consume(consumer, [(a, 0, rows), (b, rows + 1, rows)], params)
    assert fin.source == {a: "loaded", b: "loaded"}
    assert digest(fin.embeds[a]) == digest(ta) and digest(fin.embeds[b]) == digest(tb)
    from ectransport.protocol import Status

    assert n.session.nacks.get(Status.NACK_BUSY, 0) >= 1
    assert_healthy(consumer, producer)


def test_entry_over_the_budget_computes_locally(producer, consumer, side_node):
    """An entry larger than the consumer's whole pin budget is refused for good (terminal, not
    NACK_BUSY since the grants of issue 13): a miss, computed locally, well before the deadline."""
    n = side_node(budget_bytes=HIDDEN * 2, inline_max_bytes=0)  # less than one entry; an
    # inline answer pins nothing, so no budget applies to it
    h = uid("always-busy")
    n.put(h, encoder_output(h, 8, salt="side"))
    t0 = time.monotonic()
    fin = consume(consumer, [(h, 0, 8)], announce(n, h, 8))
    assert time.monotonic() - t0 < 10
    assert_local(fin, h, 8)
    outcomes = consumer.sched._scheduler.consumer.outcomes
    assert outcomes["miss:internal"] + outcomes["miss:busy"] >= 1, outcomes
    assert_healthy(consumer, producer)


def test_producer_never_answers_times_out(producer, consumer, side_node):
    n = side_node(start=False)  # bound and handshaking, but its loop never runs: no Welcome
    h = uid("silent")
    t0 = time.monotonic()
    fin = consume(consumer, [(h, 0, 8)], announce(n, h, 8))
    assert 2.5 < time.monotonic() - t0 < 10  # fetch_timeout_s = 3
    assert_local(fin, h, 8)
    assert consumer.sched._scheduler.consumer.outcomes["miss:timeout"] >= 1
    assert_healthy(consumer, producer)


def test_size_mismatch_computes_locally_without_fetching(producer, consumer):
    h = uid("size")
    params, _ = produce(producer, [[h, 0, 10]])
    side = consumer.sched._scheduler.consumer
    before = sum(v for k, v in side.outcomes.items() if not k.startswith("local"))
    fin = consume(consumer, [(h, 0, 12)], params)  # the consumer's placeholder has 12 rows
    assert_local(fin, h, 12)
    assert fin.steps_deferred == 0, "a size mismatch must not wait for a fetch"
    assert sum(v for k, v in side.outcomes.items() if not k.startswith("local")) == before
    assert side.outcomes["local:size mismatch"] >= 1
    assert_healthy(consumer, producer)


def test_untrusted_producer_key_is_not_contacted(producer, consumer, tmp_path):
    from ectransport.control.keys import generate_keypair, load_public

    pub, _ = generate_keypair(tmp_path, "stranger")
    h = uid("stranger")
    params, _ = produce(producer, [[h, 0, 8]])
    params[h] = dict(params[h], public_key=load_public(pub))
    fin = consume(consumer, [(h, 0, 8)], params)
    assert_local(fin, h, 8)
    assert fin.steps_deferred == 0
    assert_healthy(consumer, producer)


#: Each a malformed ``ec_transfer_params`` entry made from a real one, and the field it breaks.
MALFORMED = {
    "port-as-string": (lambda e: {**e, "peer_port": str(e["peer_port"])}, "peer_port"),
    "size-missing": (lambda e: {k: v for k, v in e.items() if k != "size_bytes"}, "size_bytes"),
    "host-oversized": (lambda e: {**e, "peer_host": "h" * 100_000}, "peer_host"),
    "hold-not-an-int": (lambda e: {**e, "ect_hold": "7"}, "ect_hold"),
    "key-wrong-type": (lambda e: {**e, "public_key": 12345}, "public_key"),
    "shape-garbage": (lambda e: {**e, "shape": {"rows": 8}}, "shape"),
    "entry-garbage": (lambda e: [e], ""),
}


def test_malformed_announcements_compute_locally_and_the_good_item_still_lands(
        producer, consumer, caplog):
    """A malformed entry (wrong types, a missing field, an oversized string, garbage) makes that
    item encode locally — logged with the field it breaks, counted, nothing fetched for it —
    while the well-formed item of the same request lands; the consumer stays healthy."""
    good = uid("good")
    bad = {name: uid(name) for name in MALFORMED}
    features = [[good, 0, 16], *([h, 20 + 10 * i, 8] for i, h in enumerate(bad.values()))]
    params, digests = produce(producer, features)
    assert set(params) == {good, *bad.values()}
    for name, h in bad.items():
        params[h] = MALFORMED[name][0](params[h])
    side = consumer.sched._scheduler.consumer
    before = side.outcomes["local:announcement"]
    with caplog.at_level(logging.WARNING, logger="ectransport.vllm.consumer"):
        fin = consume(consumer, [tuple(f) for f in features], params)
    assert fin.source[good] == "loaded" and digest(fin.embeds[good]) == digests[good]
    for h in bad.values():
        assert_local(fin, h, 8)
    assert side.outcomes["local:announcement"] - before == len(bad)
    for name, h in bad.items():
        line = next(m for m in caplog.messages if h in m)
        field = MALFORMED[name][1]
        assert "announcement" in line and (f"`{field}`" if field else "the entry") in line, line
        assert len(line) < 500, "an oversized value must not be logged"
    assert_healthy(consumer, producer)


def test_no_media_to_fall_back_on_fails_the_request_cleanly(producer, consumer, side_node):
    """The orchestrator replaced the media by the reference: when the fetch fails, the request
    is handed to vLLM's take_unavailable_requests instead of reaching the encoder."""
    n = side_node()
    params = announce(n, h := uid("nomedia"), 8)
    n.close()
    rid = uid("c")
    consumer.add(make_request(rid, [(h, 0, 8)], params, media=False))
    consumer.run(timeout_s=20)
    assert consumer.finished[rid].error
    assert_healthy(consumer, producer)


def test_ec_both_serves_and_fetches(producer, consumer, keys):
    extra = model_extra(secret_key_file=keys.producer_secret, allow_dir=keys.allow_dir,
                        producer_keys=[keys.producer_public], fetch_timeout_s=3.0)
    both = Engine("ec_both", extra, salt="both")
    region = both.sched._scheduler.region.path
    try:
        # it fetches from the producer instance...
        x = uid("x")
        params, digests = produce(producer, [[x, 0, 20]])
        # ...and computes + serves what nobody announced
        y = uid("y")
        rid = uid("both")
        both.add(make_request(rid, [(x, 0, 20), (y, 30, 9)], params))
        both.run(timeout_s=20)
        fin = both.finished[rid]
        assert fin.source == {x: "loaded", y: "computed"}
        assert digest(fin.embeds[x]) == digests[x]
        assert set(fin.params) == {y}  # only what it saved itself is announced
        got = consume(consumer, [(y, 0, 9)], fin.params)
        assert got.source[y] == "loaded"
        assert digest(got.embeds[y]) == digest(encoder_output(y, 9, salt="both"))
    finally:
        both.shutdown()
    assert not os.path.exists(region)


def test_a_producer_that_stalls_once_the_session_is_up_is_asked_again(producer, consumer, keys):
    """A producer that stops answering for a while after the consumer's session with it is up
    (SIGSTOP: a stalled, overloaded host): the fetch misses (no ack within ack_timeout_s = 1 s),
    the producer is quarantined (1 s), and the same producer is asked again while
    fetch_timeout_s (3 s) lasts. The producer runs again from the consumer's first retry on:
    the item lands with the producer's bytes, nothing is computed locally."""
    from tests.node._producer_proc import make_tensor

    a, b = uid("stall-a"), uid("stall-b")
    side = consumer.sched._scheduler.consumer
    with child_producer(keys, [(a, 8, 1), (b, 8, 2)]) as p:
        ann = {"peer_host": "127.0.0.1", "peer_port": p.port, "size_bytes": 8 * 2 * HIDDEN,
               "shape": [8, HIDDEN], "dtype": "bfloat16", "public_key": p.public_key}
        assert consume(consumer, [(a, 0, 8)], {a: ann}).source[a] == "loaded"  # session up
        before = dict(side.outcomes)
        with stalled_until_first_retry(side, p.pid) as asks:
            fin = consume(consumer, [(b, 0, 8)], {b: ann})
        assert fin.source[b] == "loaded", (asks, side.outcomes)
        assert torch.equal(fin.embeds[b].view(torch.int16), make_tensor(8, HIDDEN, 2)
                           .view(torch.int16)), "not the producer's bytes"
        assert len(asks) >= 2 and set(asks) == {(p.port, b)}, asks
        assert {k: n - before.get(k, 0) for k, n in side.outcomes.items()
                if n != before.get(k, 0)} == {"landed": 1}
    assert_healthy(consumer, producer)


def test_the_consumers_nixl_agent_runs_without_a_progress_thread(consumer):
    """The consumer node's planes are the instance's, with NIXL's progress thread off
    (``consumer_planes``: its I/O thread progresses its READs); the other options are kept."""
    from ectransport.vllm.sched_consumer import consumer_planes

    s = consumer.sched._scheduler.settings
    got = consumer_planes(s)
    assert got.nixl.prog_thread is False and s.common.planes.nixl.prog_thread is True
    assert got.nixl.grant_scope == s.common.planes.nixl.grant_scope
    assert got.tcp == s.common.planes.tcp and got.ucx == s.common.planes.ucx


def test_producer_dead_then_region_reclaimed(producer, consumer, producer_extra):
    """Last test: SIGKILL the producer process. The consumer computes locally; the dead
    process's /dev/shm file is reclaimed by the next engine that starts; that engine serves."""
    h = uid("orphan")
    params, _ = produce(producer, [[h, 0, 8]])
    stale = producer.info["region"]
    assert os.path.exists(stale)
    producer.kill()
    t0 = time.monotonic()
    fin = consume(consumer, [(h, 0, 8)], params)
    assert time.monotonic() - t0 < 10
    assert_local(fin, h, 8)
    assert os.path.exists(stale), "SIGKILL leaves the region file behind"

    fresh = Engine("ec_producer", producer_extra, salt="fresh")
    try:
        assert not os.path.exists(stale), "the dead producer's region was not reclaimed"
        g = uid("fresh")
        fresh.add(make_request(g, [(g, 0, 12)]))
        fresh.run(timeout_s=20)
        params = fresh.finished[g].params
        got = consume(consumer, [(g, 0, 12)], params)
        assert got.source[g] == "loaded"
        assert digest(got.embeds[g]) == digest(encoder_output(g, 12, salt="fresh"))
    finally:
        region = fresh.sched._scheduler.region.path
        fresh.shutdown()
    assert not os.path.exists(region)
    assert stale not in region_files()
