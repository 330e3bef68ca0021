"""Issue 14 at class level (vLLM's connector classes and call order, see ``_engine.py``): an
encoder-only producer whose worker reports vLLM drops still makes its entries READY (save marks
in the region); an idle engine is not kept stepping; shutdown removes the region file first; a
request whose ec_transfer_params match none of its items is logged; the local CPU tier."""

from __future__ import annotations

import itertools
import logging
import os
import time

import pytest
import torch
from _children import child_env
from _engine import HIDDEN, Engine, encoder_output, make_request
from conftest import wait_for

_ids = itertools.count()


def uid(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{next(_ids)}-{time.monotonic_ns()}"


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(role: str, extra: dict, salt: str = "x") -> Engine:
        e = Engine(role, extra, salt=salt)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


def test_encoder_only_producer_ready_without_worker_reports(engines, producer_extra):
    """vLLM's V1 runner drops the ECConnectorOutput of an ec_producer: the entry must become
    READY from the worker's mark alone, and the engine must then idle."""
    p = engines("ec_producer", producer_extra)
    p.drop_worker_meta = True
    h = uid("enc-only")
    p.add(make_request(h + "-r", [(h, 2, 24)]))
    p.run(timeout_s=10)
    entry = p.sched._scheduler.producer.node.lookup(h)
    assert entry is not None and entry.ready, "save never became READY without worker reports"
    assert not p.sched.has_pending_push_work(), "an idle producer must not keep stepping"
    assert p.finished[h + "-r"].params[h]["size_bytes"] == 24 * HIDDEN * 2


def test_unfinished_save_keeps_stepping_until_marked(engines, producer_extra):
    p = engines("ec_producer", producer_extra)
    p.drop_worker_meta = True
    p.hold_reports = True  # the copy is still "in flight": no report, no mark
    h = uid("inflight")
    p.add(make_request(h + "-r", [(h, 0, 8)]))
    p.step()
    assert p.sched.has_pending_push_work()
    assert not p.sched._scheduler.producer.node.lookup(h).ready
    p.hold_reports = False
    p.release_reports()  # the copy completes: the worker marks it
    assert not p.sched.has_pending_push_work()
    assert p.sched._scheduler.producer.node.lookup(h).ready


def test_failed_save_is_marked_and_dropped(engines, producer_extra):
    p = engines("ec_producer", producer_extra)
    p.drop_worker_meta = True
    wd = p.worker._worker
    wd._copy_in = lambda o, t: (_ for _ in ()).throw(RuntimeError("copy failed"))
    h = uid("fail")
    p.add(make_request(h + "-r", [(h, 0, 8)]))
    p.run(timeout_s=10)
    assert p.sched._scheduler.producer.node.lookup(h) is None
    assert not p.sched.has_pending_push_work()


def test_shutdown_unlinks_the_region_first(engines, producer_extra):
    p = engines("ec_producer", producer_extra)
    delegate = p.sched._scheduler
    path = delegate.region.path
    seen = []
    close = delegate.producer.close
    delegate.producer.close = lambda: (seen.append(os.path.exists(path)), close())
    delegate.shutdown()
    assert seen == [False], "the region file must be gone before the nodes close"
    assert not os.path.exists(path)


def test_params_matching_no_item_are_logged(engines, consumer_extra, caplog):
    c = engines("ec_consumer", consumer_extra, salt="consumer")
    h = uid("mine")
    params = {uid("other-model-hash"): {"peer_host": "127.0.0.1", "peer_port": 9,
                                        "size_bytes": 16 * HIDDEN * 2}}
    with caplog.at_level(logging.WARNING, logger="ectransport.vllm.consumer"):
        c.add(make_request(h + "-r", [(h, 0, 16)], params))
        c.run(timeout_s=5)
    assert c.finished[h + "-r"].source[h] == "computed"
    msgs = [r.getMessage() for r in caplog.records if "none is one of its" in r.getMessage()]
    assert len(msgs) == 1 and "identical --model" in msgs[0]


def test_local_tier_ec_both_reloads_its_own_output(engines, producer_extra):
    """A repeated item on one ec_both instance (vLLM's encoder cache has dropped it) is loaded
    from the host region, bit-identical, with no peer; the pin goes once the load reported."""
    extra = {**producer_extra, "producer_keys": "announced"}
    b = engines("ec_both", extra, salt="both")
    h = uid("repeat")
    b.add(make_request(h + "-1", [(h, 0, 32)]))
    b.run(timeout_s=10)
    assert b.finished[h + "-1"].source[h] == "computed"
    b.encoder_cache.clear()  # vLLM evicted it from its own encoder cache
    b.add(make_request(h + "-2", [(h, 3, 32)]))
    b.run(timeout_s=10)
    fin = b.finished[h + "-2"]
    assert fin.source[h] == "loaded", "the repeated item ran the encoder again"
    assert torch.equal(fin.embeds[h].view(torch.int16),
                       encoder_output(h, 32, salt="both").view(torch.int16))
    delegate = b.sched._scheduler
    assert delegate.local.hits == 1 and delegate.local.pinned == 0
    node = delegate.producer.node  # the only pins left: the announcements' holds (ECTP v2 §10)
    assert node.store.pinned_blocks * node.store.block_bytes == node.stats()["held_bytes"]
    assert not b.sched.has_pending_push_work()


def test_local_tier_fifo_eviction_and_disabled(engines, producer_extra):
    """Ready, unpinned entries are evicted oldest first when the region is full; a evicted item
    is encoded again. ``local_cache: false`` turns the tier off."""
    extra = {**producer_extra, "producer_keys": "announced",
             "region_bytes": 2 * 64 * HIDDEN * 2}  # two halves of 64 rows
    b = engines("ec_both", extra, salt="both")
    a, c = uid("a"), uid("c")
    for h in (a, c):  # 40 rows each: the second evicts the first
        b.add(make_request(h, [(h, 0, 40)]))
        b.run(timeout_s=10)
    b.encoder_cache.clear()
    assert not b.sched.has_cache_item(a) and b.sched.has_cache_item(c)
    off = engines("ec_both", {**extra, "local_cache": False}, salt="both")
    off.add(make_request("r", [(a, 0, 8)]))
    off.run(timeout_s=10)
    off.encoder_cache.clear()
    assert not off.sched.has_cache_item(a)


def test_local_tier_encoder_only_skips_the_encoder(engines, producer_extra):
    p = engines("ec_producer", producer_extra)
    p.drop_worker_meta = True
    h = uid("again")
    for n in (1, 2):
        p.add(make_request(f"{h}-{n}", [(h, 0, 16)]))
        p.run(timeout_s=10)
        p.encoder_cache.clear()
    assert p.finished[f"{h}-1"].source[h] == "computed"
    assert p.finished[f"{h}-2"].source[h] == "loaded"  # not encoded: taken from the region
    assert h in p.finished[f"{h}-2"].params  # and announced again
    assert wait_for(lambda: not p.sched.has_pending_push_work(), 2.0)


def test_sigterm_removes_the_region_file_at_once(producer_extra, tmp_path):
    """vLLM's process manager kills an engine core 5 s after SIGTERM, possibly before the
    connector's shutdown ran: the region file's name must go when the signal arrives."""
    import json
    import subprocess
    import sys
    import textwrap

    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(f"""
        import json, os, signal, sys, time
        sys.path.insert(0, {here!r})
        from _engine import Engine
        e = Engine("ec_producer", json.loads({json.dumps(json.dumps(producer_extra))}), "x")
        print(e.sched._scheduler.region.path, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)   # default disposition after ours: the process dies
        time.sleep(30)  # never reached: the SIGTERM above ends the process (the test's subject)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=child_env())
    path = r.stdout.strip().splitlines()[-1]
    assert r.returncode == -15, r.stderr[-2000:]
    assert path.endswith(".region") and not os.path.exists(path), "region file left behind"
