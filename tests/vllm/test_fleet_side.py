"""The vLLM adapter's fleet side (``ectransport.vllm.fleet.FleetSide``) against a real
redis-server, without vLLM (the module imports none): the scheduler's clock is the ``now`` it is
handed, the directory's threads and Redis are real.

- a claim attempt the scheduler stopped waiting for (no answer within ``max_pending_s``) that
  wins later is given back at once, not left to block the fleet until its TTL;
- the fleet metrics an instance exports count its hits, misses, claims and lookup latency.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("redis")

from ectransport.fleet import Acquired, Directory, Identity, trust_any  # noqa: E402
from ectransport.fleet.keys import Keyspace  # noqa: E402
from ectransport.node.common import Layout  # noqa: E402
from ectransport.vllm.fleet import FleetSide, Verdict  # noqa: E402
from ectransport.vllm.settings import Settings  # noqa: E402
from tests.conftest import new_keypair, wait_for  # noqa: E402
from tests.fleet.redis_server import RedisServer  # noqa: E402

LAYOUT = Layout(model_id="fleet-side-test", hidden=64, dtype="bfloat16")
NBYTES = 8 * LAYOUT.block_bytes


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def settings(url: str, **kw: object) -> Settings:
    kw.setdefault("fleet_claim_wait_s", 20.0)
    return Settings(
        insecure=True, fleet_url=url, fleet_liveness_ttl_s=1.5, fleet_lookup_timeout_s=0.5, **kw
    )


def directory(s: Settings, name: str) -> Directory:
    ident = Identity(
        instance=name,
        host="127.0.0.1",
        port=5000 + os.getpid() % 1000,
        public_key=new_keypair().public,
        compat_hash=LAYOUT.compat_hash,
    )
    d = Directory(
        s.common.fleet, identity=ident, trusted=trust_any, compat_hash=LAYOUT.compat_hash
    ).start()
    assert d.wait_live(10.0)
    return d


def test_a_claim_won_after_the_scheduler_gave_up_on_it_is_given_back(redis):
    s = settings(redis.url)
    mine, other = directory(s, "side-a"), directory(s, "side-b")
    side = FleetSide(s, LAYOUT, directory=mine, trusted=trust_any, claims=True)
    try:
        m = "cold-item-" + str(os.getpid())
        theirs = other.claim(m, ttl_s=60.0)  # another instance is encoding it
        assert theirs
        t0 = 1000.0
        # a lookup first (nobody holds it), then the claim attempt, which loses and polls
        assert side.decide(m, NBYTES, t0).verdict is Verdict.PENDING
        side.step(t0)
        assert wait_for(lambda: side.batcher.result(m) == [], 10.0)
        assert side.decide(m, NBYTES, t0).verdict is Verdict.PENDING
        fut = side._claims[m][0]
        assert wait_for(lambda: mine.stats()["claims_lost"] >= 1, 10.0)
        assert not fut.done()
        # the scheduler stops waiting: the item is encoded here without the claim
        late = t0 + side.max_pending_s + 1.0
        d = side.decide(m, NBYTES, late)
        assert d.verdict is Verdict.LOCAL and "in time" in d.detail
        # the other claimant goes away: the attempt nobody waits for now wins the claim
        assert other.release_claim(theirs)
        got = fut.result(timeout=30.0)
        assert got.outcome is Acquired.ENCODE and got.claim is not None
        key = Keyspace(s.common.fleet.namespace).claim(m)
        # given back at once, not held until its TTL (claim_ttl_s, 10 s) keeps others waiting
        assert wait_for(lambda: mine.redis.get(key) is None, 5.0), "the won claim was left"
        assert side.outcomes.get("claims_abandoned") == 1
    finally:
        side.close()
        mine.close()
        other.close()


def _decided(side: FleetSide, m: str, now: float, timeout_s: float = 20.0) -> Verdict:
    """Drive ``side`` for ``m`` as the scheduler does (decide, then the step's flush) until it
    decides something other than PENDING."""
    end = [None]

    def settled() -> bool:
        d = side.decide(m, NBYTES, now)
        side.step(now)
        end[0] = d.verdict
        return d.verdict is not Verdict.PENDING

    assert wait_for(settled, timeout_s), f"{m}: still pending"
    assert end[0] is not None
    return end[0]


def test_the_fleet_metrics_count_hits_misses_claims_and_lookup_latency(redis):
    import urllib.request

    from ectransport.vllm.metrics import AdapterMetrics

    s = settings(redis.url)
    mine, other = directory(s, "metrics-a"), directory(s, "metrics-b")
    side = FleetSide(s, LAYOUT, directory=mine, trusted=trust_any, claims=True)
    m = AdapterMetrics([], side, port=0)
    try:
        tag = str(os.getpid())
        other.publish("held-" + tag, NBYTES)
        assert other.flush(10.0)
        assert _decided(side, "held-" + tag, 1.0) is Verdict.FETCH  # a hit
        assert _decided(side, "cold-" + tag, 2.0) is Verdict.ENCODE  # a miss, claim won
        waited = other.claim("waited-" + tag)
        assert waited

        def claiming() -> bool:  # looked up (a miss), then its claim attempt, which waits
            side.decide("waited-" + tag, NBYTES, 3.0)
            side.step(3.0)
            return "waited-" + tag in side._claims

        assert wait_for(claiming, 10.0)
        assert wait_for(lambda: mine.stats()["claims_lost"] >= 1, 10.0)
        other.publish("waited-" + tag, NBYTES, claim=waited)  # the claimant's entry is ready
        assert _decided(side, "waited-" + tag, 3.0) is Verdict.FETCH
        # a claimant that dies: its claim is renewed for claim_wait_s (0.6 s), then lapses
        dying = directory(settings(redis.url, fleet_claim_wait_s=0.6), "metrics-c")
        assert dying.claim("lapsing-" + tag, ttl_s=0.3)
        assert _decided(side, "lapsing-" + tag, 4.0) is Verdict.ENCODE
        dying.close()

        def sample(name: str, **labels: str) -> float:
            v = m.registry.get_sample_value(name, labels)
            return 0.0 if v is None else v

        assert sample("ectransport_fleet_lookup_items_total", outcome="hit") >= 1
        assert sample("ectransport_fleet_lookup_items_total", outcome="miss") >= 1
        assert sample("ectransport_fleet_claims_total", outcome="won") == 2
        assert sample("ectransport_fleet_claims_total", outcome="waited") == 1
        assert sample("ectransport_fleet_claims_total", outcome="expired") == 1
        assert sample("ectransport_fleet_lookup_seconds_count") >= 2
        assert sample("ectransport_fleet_decisions_total", outcome="found") == 1
        assert sample("ectransport_fleet_decisions_total", outcome="found_after_wait") == 1
        assert sample("ectransport_fleet_decisions_total", outcome="claimed") == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'ectransport_fleet_claims_total{outcome="won"} 2.0' in text
        assert "ectransport_fleet_lookup_seconds_bucket" in text
    finally:
        m.close()
        side.close()
        mine.close()
        other.close()


def test_wants_are_recorded_bounded_taken_once_and_lapse(redis):
    from ectransport.fleet import DirectoryUnavailable
    from ectransport.fleet.wants import MAX_WANTS, take_wants, want, wants_key

    s = settings(redis.url)
    d = directory(s, "wants-a")
    try:
        m = "wanted-" + str(os.getpid())
        assert want(d, m, "ect-c-b-dp0", 5.0) is True
        assert want(d, m, "ect-c-c-dp0", 5.0) is True
        assert want(d, m, "has space", 5.0) is False and want(d, m, "", 5.0) is False
        key = wants_key(d.keys, m)
        assert 0 < d.redis.pttl(key) <= 5000  # lapses with the waiters' longest wait
        assert d.keys.item_tag(m) in key  # the item's slot
        assert take_wants(d, m) == ["ect-c-b-dp0", "ect-c-c-dp0"]
        assert take_wants(d, m) == []  # taken once
        for i in range(MAX_WANTS):
            assert want(d, m, f"c{i}", 5.0) is True
        assert want(d, m, "one-too-many", 5.0) is False
        assert len(take_wants(d, m)) == MAX_WANTS
        d.redis.sadd(key, "bad name", b"\xff\xfe")  # what a hostile directory may hold
        assert take_wants(d, m) == []
    finally:
        d.close()
    redis.stop()
    gone = Directory(s.common.fleet, trusted=trust_any)
    try:
        assert isinstance(want(gone, "x", "c", 1.0), DirectoryUnavailable)
        assert isinstance(take_wants(gone, "x"), DirectoryUnavailable)
    finally:
        gone.close()
