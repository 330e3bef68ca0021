"""The fleet's instance processes in separate network namespaces: each instance and the
redis-server on its own host slot of the interop harness's topology (``interop/netns.py``: a
bridge in a hub namespace, one veth and one address per slot, nothing in the root namespace),
so the directory, the control plane and the tcp data plane cross a real (virtual) network
between hosts instead of loopback:

- an item encoded once is fetched by every other instance, with no further encode;
- a SIGKILLed holder's entries are not used after its liveness TTL; the next holder serves.

Namespaces need root and ``ip``; elsewhere these tests are skipped, saying why (the same
scenarios run on loopback in ``test_fleet_processes.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from interop.netns import Topology, netns_available
from tests.conftest import DEADLINE_S, new_keypair, wait_for
from tests.fleet.conftest import INSTANCE_TTL_S, Instance
from tests.fleet.redis_server import RedisServer

SLOTS = ["redis", "i0", "i1", "i2", "i3"]


@pytest.fixture
def topology() -> Iterator[Topology]:
    ok, why = netns_available()
    if not ok:
        pytest.skip(
            f"network namespaces unavailable ({why}): the loopback versions of these "
            "tests are in test_fleet_processes.py"
        )
    topo = Topology(SLOTS, mode="netns")
    try:
        yield topo
    finally:
        topo.close()


@pytest.fixture
def spread(topology: Topology, tmp_path: Path) -> Iterator:
    """``spread(n)``: a redis-server on slot ``redis`` and n instances, one per slot, trusting
    each other's keys; the URL every instance uses names the Redis host's address."""
    redis = RedisServer(
        tmp_path, host=topology.address("redis"), wrap=topology.wrap("redis", [])
    ).start()
    made: list[Instance] = []

    def start(n: int) -> list[Instance]:
        kps = [new_keypair() for _ in range(n)]
        keys = [k.public for k in kps]
        for i, kp in enumerate(kps):
            slot = f"i{i}"
            made.append(
                Instance(
                    f"pd-{i}",
                    redis.url,
                    keys,
                    kp,
                    host=topology.address(slot),
                    wrap=topology.wrap(slot, []),
                )
            )
        return made

    try:
        yield start
    finally:
        for inst in made:
            inst.close()
        redis.stop()


def test_an_item_encoded_once_is_fetched_across_namespaces(spread, topology):
    insts = spread(4)
    assert len({topology.address(f"i{i}") for i in range(4)}) == 4  # four hosts
    first = insts[0].ask(need="img-0")
    assert first["how"] == "encoded", first
    for inst in insts[1:]:
        got = inst.ask(need="img-0")
        assert got["how"] == "fetched" and got["from"] == "pd-0" and got["ok"], got
    for i in range(1, 6):  # each first needed by another instance, then by all of them
        for inst in insts[i % 4 :] + insts[: i % 4]:
            got = inst.ask(need=f"img-{i}")
            assert got["ok"] and got["how"] in ("encoded", "fetched"), got
    assert sum(inst.encodes() for inst in insts) == 6  # one encode per distinct image


def test_a_killed_holder_is_not_used_after_its_ttl_across_namespaces(spread):
    a, b, c = spread(3)
    assert a.ask(need="x")["how"] == "encoded"
    assert b.ask(encode="x")["how"] == "encoded"  # a second holder
    assert wait_for(lambda: sorted(c.ask(lookup="x")["holders"]) == ["pd-0", "pd-1"])
    a.kill()
    assert wait_for(lambda: c.ask(lookup="x")["holders"] == ["pd-1"], INSTANCE_TTL_S + DEADLINE_S)
    got = c.ask(need="x")
    assert got["how"] == "fetched" and got["from"] == "pd-1" and got["tried"] == ["pd-1"], got
    assert got["ok"]
