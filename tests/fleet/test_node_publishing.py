"""A ProducerNode with ``[fleet]`` keeps the directory in step with its store (a real
redis-server): READY entries published with the node's address, CURVE key and compatibility
hash; evicted, discarded and aborted ones withdrawn; a claim won for an encode released when
the entry is published; everything withdrawn at close. A ConsumerNode fetches from the holder
the directory names (``FleetFetcher``), the next holder on a miss."""

from __future__ import annotations

import numpy as np
import pytest

from ectransport.errors import ConfigError
from ectransport.fleet import Directory
from ectransport.node import ConsumerNode, Layout, ProducerNode, Security
from ectransport.node.fleet import FleetFetcher
from ectransport.settings_schema import ConsumerSettings, NodeSettings, ProducerSettings
from tests.conftest import DEADLINE_S, new_keypair, wait_for
from tests.fleet.conftest import settings_for

LAYOUT = Layout(hidden=256, dtype="bfloat16")  # 512-byte rows
ROWS = 16
NBYTES = ROWS * LAYOUT.block_bytes


def rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (ROWS, LAYOUT.block_bytes),
                                                dtype=np.uint8)


def producer(closing, server, name: str, entries: int = 4, **fleet: object) -> ProducerNode:
    kp = new_keypair()
    return closing(ProducerNode(
        layout=LAYOUT, security=Security(public_key=kp.public, secret_key=kp.secret),
        settings=ProducerSettings(region_bytes=entries * NBYTES),
        node=NodeSettings(planes=("tcp",), node_id=name),
        fleet=settings_for(server, **fleet), fleet_trusted=lambda key, cert: True)).start()


def lookup_dir(directories, server, trusted_keys) -> Directory:
    d = Directory(settings_for(server), trusted=lambda key, cert: key in trusted_keys,
                  compat_hash=LAYOUT.compat_hash)
    directories.append(d)
    return d


def holders(d: Directory, mm_hash: str) -> list[str]:
    return [h.instance for h in d.lookup(mm_hash)[mm_hash]]


def test_the_directory_follows_the_store(closing, redis_server, directories):
    p = producer(closing, redis_server, "enc-a")
    d = lookup_dir(directories, redis_server, {p.public_key})
    assert p.fleet is not None and p.fleet.directory.wait_live(DEADLINE_S)
    assert p.put("a", rows(1))
    assert wait_for(lambda: holders(d, "a") == ["enc-a"])
    (h,) = d.lookup("a")["a"]
    assert (h.host, h.port, h.public_key, h.nbytes) == ("127.0.0.1", p.port, p.public_key,
                                                         NBYTES)
    assert h.compat_hash == LAYOUT.compat_hash
    # a reservation is not published; aborted it never is; committed it is
    e = p.reserve("b", NBYTES)
    assert p.fleet.directory.flush(DEADLINE_S) and holders(d, "b") == []
    assert p.abort("b", e.entry_id)
    e = p.reserve("c", NBYTES)
    p.region.write(e.runs, rows(3).reshape(-1))
    assert p.commit("c", e.entry_id)
    assert wait_for(lambda: holders(d, "c") == ["enc-a"]) and holders(d, "b") == []
    # the region holds 4 entries: 3 more evict "a" (the oldest ready), which leaves the directory
    for i, k in enumerate("def"):
        assert p.put(k, rows(10 + i))
    assert p.lookup("a") is None
    assert wait_for(lambda: holders(d, "a") == []) and holders(d, "f") == ["enc-a"]
    assert p.fleet.directory.stats()["unpublished"] >= 1
    # the close withdraws the instance and its entries
    p.close()
    assert holders(d, "c") == [] and holders(d, "f") == []


def test_a_consumer_fetches_from_the_holder_the_directory_names(closing, redis_server,
                                                                directories):
    p1 = producer(closing, redis_server, "enc-1")
    p2 = producer(closing, redis_server, "enc-2")
    data = rows(7)
    for p in (p1, p2):
        assert p.put("img", data)
    d = lookup_dir(directories, redis_server, {p1.public_key, p2.public_key})
    assert wait_for(lambda: sorted(holders(d, "img")) == ["enc-1", "enc-2"])
    kp = new_keypair()
    c = closing(ConsumerNode(layout=LAYOUT, security=Security(public_key=kp.public,
                                                              secret_key=kp.secret),
                             settings=ConsumerSettings(region_bytes=4 * NBYTES),
                             node=NodeSettings(planes=("tcp",))))
    f = FleetFetcher(c, d)
    out, h = f.fetch("img", nbytes=NBYTES, timeout_s=DEADLINE_S)
    assert out.ok and h is not None and np.array_equal(out.data, data.reshape(-1))
    # the first holder misses (its entry discarded behind the directory's back): the next serves
    found = d.lookup("img")["img"]
    first = p1 if found[0].instance == "enc-1" else p2
    with first._lock:
        first.store.discard("img")  # not through the node: its record still says it holds it
    out, h2 = f.fetch_from("img", found, t_end=__import__("time").monotonic() + DEADLINE_S)
    assert out.ok and h2 is not None and h2.instance != found[0].instance
    # an untrusted holder is never returned, whatever the directory says
    only = lookup_dir(directories, redis_server, {p2.public_key})
    assert holders(only, "img") == ["enc-2"]


def test_a_claim_won_for_an_encode_is_released_when_the_entry_is_published(closing, redis_server,
                                                                           directories):
    p = producer(closing, redis_server, "enc-c")
    d = lookup_dir(directories, redis_server, {p.public_key})
    mine = Directory(settings_for(redis_server), identity=None, trusted=lambda k, c: True)
    directories.append(mine)
    claim = p.fleet.directory.claim("cold")
    assert claim
    p.fleet.encoding(claim)
    assert not mine.claim("cold")  # another instance sees it claimed
    assert p.put("cold", rows(5))
    assert wait_for(lambda: holders(d, "cold") == ["enc-c"])
    assert wait_for(lambda: p.fleet.directory.redis.get(p.fleet.directory.keys.claim("cold"))
                    is None)


def test_a_holder_needs_a_curve_key_and_a_reachable_address(closing, redis_server):
    with pytest.raises(ConfigError, match="CURVE key"):
        ProducerNode(layout=LAYOUT, security=Security(insecure=True),
                     node=NodeSettings(planes=("tcp",)), fleet=settings_for(redis_server))
    kp = new_keypair()
    with pytest.raises(ConfigError, match="advertise|wildcard"):
        ProducerNode(layout=LAYOUT, security=Security(public_key=kp.public, secret_key=kp.secret,
                                                      allow=lambda k: True),
                     settings=ProducerSettings(host="0.0.0.0", advertise_host=None),
                     node=NodeSettings(planes=("nixl",)), fleet=settings_for(redis_server))


def test_the_node_metrics_export_the_fleet_families(closing, redis_server, directories):
    prom = pytest.importorskip("prometheus_client")
    from ectransport.metrics import Metrics

    p = producer(closing, redis_server, "enc-m")
    registry = prom.CollectorRegistry()
    Metrics(registry=registry).attach(p)
    assert p.put("m", rows(9))
    assert p.fleet.directory.flush(DEADLINE_S)
    assert p.fleet.directory.claim("cold-m")  # a claim won
    p.fleet.directory.lookup("m")  # a lookup (its own record: skipped, a miss)
    assert registry.get_sample_value("ectransport_fleet_published_total") == 1
    assert registry.get_sample_value("ectransport_fleet_claims_total", {"outcome": "won"}) == 1
    assert registry.get_sample_value("ectransport_fleet_lookup_items_total",
                                     {"outcome": "miss"}) == 1
    assert registry.get_sample_value("ectransport_fleet_lookup_seconds_count") == 1
