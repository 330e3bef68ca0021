"""``ectransport fleet status|who-has`` against a real redis-server (as a user's shell runs
it), their errors when Redis is unreachable or refuses us, and the Prometheus families."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import DEADLINE_S
from tests.fleet.conftest import REPO, consumer_dir, free_port, holder_dir, identity


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ectransport.cli", "fleet", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def one_error_line(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_status_and_who_has(redis_server, directories):
    a = holder_dir(directories, redis_server, "enc-a", ident=identity("enc-a", cert=b"c"))
    b = holder_dir(directories, redis_server, "enc-b")
    a.publish("img-1", 4096)
    a.publish("img-2", 4096)
    b.publish("img-1", 4096)
    assert a.flush(DEADLINE_S) and b.flush(DEADLINE_S)
    assert b.claim("img-9", ttl_s=60)
    r = run_cli("status", "--redis-url", redis_server.url)
    assert r.returncode == 0, r.stderr
    assert "instances: 2 alive, 0 lapsed" in r.stdout and "claims in flight: 1" in r.stdout
    row_a = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("enc-a"))
    assert " 2 " in row_a and "+cert" in row_a and "alive" in row_a
    r = run_cli("status", "--redis-url", redis_server.url, "--json")
    doc = json.loads(r.stdout)
    assert {i["instance"]: i["entries"] for i in doc["instances"]} == {"enc-a": 2, "enc-b": 1}
    assert [c["instance"] for c in doc["claims"]] == ["enc-b"]
    a.redis.hset(a.keys.holders("img-1"), "ghost", b"\x00garbage")
    r = run_cli("who-has", "img-1", "--redis-url", redis_server.url, "--json")
    assert r.returncode == 0, r.stderr
    verdicts = {h["instance"]: h["verdict"] for h in json.loads(r.stdout)["holders"]}
    assert verdicts == {"enc-a": "usable", "enc-b": "usable", "ghost": "malformed"}
    r = run_cli("who-has", "img-1", "--redis-url", redis_server.url)
    assert "2 usable holder(s) of 3 record(s)" in r.stdout


def test_unreachable_or_unconfigured_redis_is_one_error_line(tmp_path):
    one_error_line(run_cli("status"), "no fleet directory configured")
    one_error_line(run_cli("status", "--redis-url", f"redis://127.0.0.1:{free_port()}"),
                   "cannot use the fleet directory", "down")
    one_error_line(run_cli("who-has", "x", "--redis-url", "redis://u:pw@127.0.0.1:1"),
                   "password_file")


def test_wrong_password_is_named(tmp_path):
    from tests.fleet.conftest import RedisServer

    server = RedisServer(tmp_path, extra=("--requirepass", "right")).start()
    try:
        bad = tmp_path / "pw"
        bad.write_text("wrong")
        one_error_line(run_cli("status", "--redis-url", server.url, "--redis-password-file",
                               str(bad)), "refused our credentials")
    finally:
        server.stop()


def test_prometheus_families(redis_server, directories):
    prometheus_client = pytest.importorskip("prometheus_client")
    from ectransport.fleet.prom import FleetCollector

    a = holder_dir(directories, redis_server, "enc")
    a.publish("m", 10)
    assert a.flush(DEADLINE_S)
    c = consumer_dir(directories, redis_server)
    c.lookup_many(["m", "n"])
    c.claim_or_wait("n")
    registry = prometheus_client.CollectorRegistry()
    FleetCollector(registry).attach(c)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'ectransport_fleet_lookup_items_total{outcome="hit"} 1.0' in text
    assert 'ectransport_fleet_lookup_items_total{outcome="miss"} 2.0' in text
    assert 'ectransport_fleet_claims_total{outcome="won"} 1.0' in text
    assert "ectransport_fleet_lookup_seconds_count 2.0" in text
