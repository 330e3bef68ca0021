"""The directory on a real 3-master Redis Cluster when a master fails: a stopped (SIGSTOP) or
killed (SIGKILL) master costs bounded calls and misses — never a hang, never a wrong holder —
and once it is back, publishing resumes and every holder is found again. Every call runs on a
future with a deadline, so a call that hung would fail the test instead of stalling it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ectransport.errors import ConfigError
from ectransport.fleet import Acquired, Directory, UnavailableReason
from ectransport.fleet.client import connection_kwargs
from ectransport.settings_schema import FleetSettings
from tests.conftest import DEADLINE_S, wait_for
from tests.fleet.conftest import FLEET_ACL_USER, consumer_dir, holder_dir
from tests.fleet.redis_server import RedisCluster

ITEMS = [f"img-{i}" for i in range(30)]


def _cluster(tmp_path: Path, node_timeout_ms: int):
    return RedisCluster(tmp_path, node_timeout_ms=node_timeout_ms).start()


def _lookup(d: Directory, items: list[str]):
    """A lookup that must end: on the lookup thread, with a deadline."""
    return d.submit_lookup(items).result(timeout=DEADLINE_S)


def _fleet(directories, cl: RedisCluster) -> tuple[Directory, Directory]:
    a = holder_dir(
        directories,
        cl,
        "enc-a",
        cluster=True,
        lookup_timeout_s=0.3,
        op_timeout_s=0.3,
        connect_timeout_s=0.3,
    )
    c = consumer_dir(
        directories, cl, cluster=True, lookup_timeout_s=0.3, op_timeout_s=0.3, connect_timeout_s=0.3
    )
    for m in ITEMS:
        a.publish(m, 4096)
    assert a.flush(DEADLINE_S)
    assert all(v for v in _lookup(c, ITEMS).values())
    return a, c


def test_a_stopped_master_costs_misses_of_its_slots_only_then_recovers(tmp_path, directories):
    """The cluster does not mark the master failed (60 s node timeout): the items of its slots
    miss (one deadline for the whole lookup), the others are still found; a claim on one of its
    items ends in ENCODE_LOCALLY; once resumed, everything is found again. Then the master of
    ``{fleet}`` stopped: every lookup is unavailable (TIMEOUT), bounded, and recovers."""
    cl = _cluster(tmp_path, node_timeout_ms=60_000)
    try:
        a, c = _fleet(directories, cl)
        fleet_master = cl.node_of(c.keys.alive)
        victim = next(n for n in cl.nodes if n is not fleet_master)
        on_victim = [m for m in ITEMS if cl.node_of(c.keys.holders(m)) is victim]
        elsewhere = [m for m in ITEMS if m not in on_victim]
        assert on_victim and elsewhere
        victim.pause()
        try:
            got = _lookup(c, ITEMS)
            assert got.ok
            assert all(got[m] == [] for m in on_victim), got
            assert all([h.instance for h in got[m]] == ["enc-a"] for m in elsewhere), got
            a.publish("during-stop", 4096)  # queued: never blocks its caller
            acq = c.submit_claim_or_wait(on_victim[0] + "-cold").result(timeout=DEADLINE_S)
            assert acq.outcome is Acquired.ENCODE_LOCALLY, acq
        finally:
            victim.resume()
        assert wait_for(lambda: all(v for v in _lookup(c, [*ITEMS, "during-stop"]).values()))

        fleet_master.pause()
        try:
            got = _lookup(c, ITEMS)
            assert got.unavailable is not None and all(v == [] for v in got.values())
            assert got.unavailable.reason in (
                UnavailableReason.TIMEOUT,
                UnavailableReason.BACKOFF,
            ), got.unavailable
        finally:
            fleet_master.resume()
        assert wait_for(lambda: all(v for v in _lookup(c, ITEMS).values()))
    finally:
        cl.stop()


def test_a_killed_master_the_cluster_goes_down_then_comes_back_and_holders_return(
    tmp_path, directories
):
    """SIGKILL of a master (1 s node timeout): the others mark it failed and answer
    CLUSTERDOWN; every lookup is a bounded miss (DOWN), publishing queues. The master restarts
    on its port with its slots but no keys: the holder's renewals find the directory back and
    re-publish what it holds, including what it published meanwhile."""
    cl = _cluster(tmp_path, node_timeout_ms=1000)
    try:
        a, c = _fleet(directories, cl)
        victim = cl.nodes[1]
        victim.kill()
        assert wait_for(cl.down, DEADLINE_S * 2)
        got = _lookup(c, ITEMS)
        assert got.unavailable is not None and all(v == [] for v in got.values())
        assert got.unavailable.reason in (UnavailableReason.DOWN, UnavailableReason.BACKOFF)
        a.publish("during-outage", 4096)
        assert a.stats()["publish_queue"] >= 1
        victim.start()  # same port (nodes.conf: same id and slots), every key of it lost
        assert wait_for(cl.healthy, DEADLINE_S * 2)
        assert wait_for(
            lambda: all(v for v in _lookup(c, [*ITEMS, "during-outage"]).values()), DEADLINE_S * 2
        )
        assert a.stats()["resyncs"] >= 1
    finally:
        cl.stop()


def test_cluster_settings_are_checked(tmp_path):
    kw = connection_kwargs(FleetSettings(url="redis://h1:7000,h2:7001", cluster=True))
    assert kw["startup_nodes"] == [("h1", 7000), ("h2", 7001)] and "db" not in kw
    with pytest.raises(ConfigError, match="several hosts"):
        connection_kwargs(FleetSettings(url="redis://h1:7000,h2:7001"))
    with pytest.raises(ConfigError, match="database"):
        connection_kwargs(FleetSettings(url="redis://h1:7000/2", cluster=True))


def test_a_cluster_node_without_the_cluster_setting_is_named(tmp_path, directories):
    from ectransport.fleet import DirectoryError

    cl = _cluster(tmp_path, node_timeout_ms=5000)
    try:
        d = consumer_dir(directories, cl)  # cluster = false
        with pytest.raises(DirectoryError, match="fleet.cluster"):
            d.check()
    finally:
        cl.stop()


def test_the_documented_acl_is_enough_on_a_cluster(tmp_path, directories):
    """docs/fleet.md's least-privilege user plus ``+cluster|slots +command`` (the cluster client
    reads the slot table and the command table) does everything on a cluster: publish, lookups,
    claims, status."""
    from ectransport.fleet import status

    cl = RedisCluster(
        tmp_path,
        node_timeout_ms=5000,
        extra=("--user", *FLEET_ACL_USER, "+cluster|slots", "+command"),
    ).start()
    try:
        pw = tmp_path / "pw"
        pw.write_text("s3cret\n")
        kw = {"cluster": True, "username": "fleet", "password_file": str(pw)}
        a = holder_dir(directories, cl, "enc-a", **kw)
        for m in ITEMS:
            a.publish(m, 4096)
        assert a.flush(DEADLINE_S)
        c = consumer_dir(directories, cl, **kw)
        assert c.check()["cluster"] is True
        assert all(v for v in c.lookup_many(ITEMS).values())
        assert c.claim_or_wait("cold").outcome is Acquired.ENCODE
        assert [r.instance for r in status.claims(c)] == [c.instance]
        assert [r.instance for r in status.instances(c)] == ["enc-a"]
        assert a.stats()["heartbeat_failures"] == 0
    finally:
        cl.stop()
