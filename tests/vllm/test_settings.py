"""ec_connector_extra_config validation (keys, types, ranges and defaults from the one settings
schema), the producer node taking every producer setting, the layout rule, and producer-key
trust."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
from msgspec import inspect as mi

from ectransport import settings_schema as schema
from ectransport.control.keys import generate_keypair, load_public
from ectransport.errors import ConfigError
from ectransport.vllm.layout import layout_for, model_hidden
from ectransport.vllm.settings import KEYS, Settings, parse_settings, settings_table
from ectransport.vllm.trust import ProducerKeys

ROOT = Path(__file__).resolve().parents[2]

SECURE = {"secret_key_file": "/k/node.key_secret"}


def parse(extra, producer=True, consumer=False):
    return parse_settings(extra, producer=producer, consumer=consumer)


def test_defaults_and_values():
    s = parse({**SECURE, "region_bytes": 1 << 20, "port": 5601, "planes": "nixl",
               "fetch_timeout_s": 2, "dtype": "torch.float16"})
    assert (s.region_bytes, s.port, s.planes, s.fetch_timeout_s, s.dtype) == \
        (1 << 20, 5601, ("nixl",), 2.0, "float16")
    assert s.host == "127.0.0.1" and s.announced_host == "127.0.0.1" and not s.insecure


@pytest.mark.parametrize("extra, message", [
    ({"regoin_bytes": 1}, r"unknown .*'regoin_bytes' \(did you mean 'region_bytes'\?\)"),
    ({"ec_cpu_bytes": 1}, r"unknown .*'ec_cpu_bytes'.*known keys: region_bytes"),
    ({"region_bytes": "1GiB"}, r"\['region_bytes'\] must be an integer, got str '1GiB'"),
    ({"region_bytes": True}, r"\['region_bytes'\] must be an integer, got bool True"),
    ({"port": 70000}, r"\['port'\] must be in \[0, 65535\], got 70000"),
    ({"ack_timeout_s": 0}, r"\['ack_timeout_s'\] must be a positive number of seconds, got 0"),
    ({"insecure": "yes"}, r"\['insecure'\] must be true or false, got str 'yes'"),
    ({"planes": []}, r"\['planes'\] must be a non-empty list of strings"),
    ({"versions": [99]}, r"unsupported version\(s\) \[99\]"),
    ({"dtype": "float64"}, r"\['dtype'\]: unknown dtype 'float64'"),
    ({"host": "0.0.0.0"}, r"wildcard bind: set 'advertise_host'"),
    # ranges come from the schema, the same as for the CLI and the TOML file
    ({"lease_s": 0.05}, r"\['lease_s'\] must be a number of seconds >= 0.1, got 0.05"),
    ({"fetch_timeout_s": float("inf")}, r"\['fetch_timeout_s'\] must be a number of seconds"),
    ({"hidden": 0}, r"\['hidden'\] must be >= 1, got 0"),
    ({"budget_bytes": "1"}, r"\['budget_bytes'\] must be an integer, got str '1'"),
    ({"shm_dir": ""}, r"\['shm_dir'\] must be a non-empty string"),
    ({"versions": [True]}, r"\['versions'\] must be a non-empty list of integers"),
])
def test_bad_values_are_named(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse({**SECURE, **extra})


_PY = {mi.IntType: int, mi.FloatType: float, mi.BoolType: bool, mi.StrType: str,
       mi.VarTupleType: tuple, mi.LiteralType: str}


def test_keys_types_and_defaults_are_the_schemas():
    """Each public key is a schema setting; its default is the schema's, except where the schema
    declares the connector's own (fetch_timeout_s, with the reason); the attribute types the
    type checker sees agree with the schema's."""
    defaults = Settings()
    hints = typing.get_type_hints(Settings)
    for name, k in KEYS.items():
        leaf = k.leaf
        assert getattr(defaults, name) == leaf.default_for("vllm"), name
        args = typing.get_args(hints[name]) or (hints[name],)
        want = _PY[type(leaf.base)]
        assert want in args or typing.get_origin(hints[name]) is want, \
            f"{name}: annotated {hints[name]}, the schema says {leaf.base}"
        assert leaf.optional == (type(None) in args), name
    assert defaults.fetch_timeout_s == 10.0 == schema.VLLM.consumer.fetch_timeout_s
    assert schema.API.consumer.fetch_timeout_s == 30.0
    assert [(fe, n) for fe, n, _, _ in schema.DIFFERENCES if fe == "vllm"] == \
        [("vllm", "consumer.fetch_timeout_s")]
    assert (defaults.lease_s, defaults.ack_timeout_s, defaults.planes, defaults.versions) == \
        (schema.API.producer.lease_s, schema.API.consumer.ack_timeout_s, schema.API.node.planes,
         schema.API.node.versions)
    s = parse(SECURE)
    assert s.common.security.key_file == s.secret_key_file == SECURE["secret_key_file"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.lease_s = 3.0  # type: ignore[misc]


def test_keyword_construction_and_replace_are_checked_by_the_schema():
    """``Settings`` stays the frozen dataclass of the public API: keywords and
    ``dataclasses.replace`` work, and every value goes through the same schema checks as
    ec_connector_extra_config."""
    s = Settings(insecure=True, planes="tcp", dtype="torch.float16")
    assert (s.insecure, s.planes, s.dtype, s.common.security.insecure) == \
        (True, ("tcp",), "float16", True)
    r = dataclasses.replace(s, lease_s=3)
    assert r.lease_s == 3.0 and r.common.producer.lease_s == 3.0 and r.planes == ("tcp",)
    assert r != s and dataclasses.replace(r, lease_s=s.lease_s) == s
    with pytest.raises(ConfigError, match=r"\['lease_s'\] must be a number of seconds >= 0.1"):
        dataclasses.replace(s, lease_s=0.01)
    with pytest.raises(ConfigError, match=r"unsupported version\(s\) \[99\]"):
        Settings(versions=(99,))
    with pytest.raises(TypeError):
        Settings(no_such_key=1)  # type: ignore[call-arg]


def test_node_arguments_come_from_the_shared_mapping():
    s = parse({**SECURE, "host": "0.0.0.0", "advertise_host": "10.0.0.5", "lease_s": 12,
               "budget_bytes": 4096, "producer_keys": "announced"}, consumer=True)
    p = s.common.producer  # what ProducerNode(settings=...) takes, as `ectransport serve`
    assert (p.host, p.advertise_host, p.lease_s, p.budget_bytes) == \
        ("0.0.0.0", "10.0.0.5", 12.0, 4096)
    assert p.grace_s == schema.API.producer.grace_s
    c = s.common.consumer
    assert c.fetch_timeout_s == 10.0
    n = s.node_section("ec-1")
    assert n.planes == ("nixl",) and n.node_id == "ec-1"


def test_a_wildcard_producer_announces_and_serves_on_advertise_host(tmp_path):
    """advertise_host reaches the ProducerNode: a wildcard bind serves the tcp plane at the
    advertised address (it used to be required here, then dropped on the way to the node)."""
    pytest.importorskip("vllm")  # ProducerSide's metadata types are vLLM's
    from ectransport.node.common import Layout, Security
    from ectransport.vllm.region import SharedRegion
    from ectransport.vllm.sched_producer import ProducerSide

    s = parse({"insecure": True, "host": "0.0.0.0", "advertise_host": "127.0.0.1",
               "planes": ["tcp"]})
    layout = Layout(hidden=64)
    region = SharedRegion(str(tmp_path / "r.region"), 16, layout.block_bytes)
    side = ProducerSide(s, layout, region.part(0, 16), Security(insecure=True), "ect-p-test")
    try:
        assert side.node.plane("tcp").host == "127.0.0.1"  # type: ignore[attr-defined]
        assert s.announced_host == "127.0.0.1"
    finally:
        side.close()
        region.close()


def test_docs_table_is_the_generated_one():
    doc = (ROOT / "docs" / "vllm.md").read_text()
    assert settings_table() in doc, "docs/vllm.md is stale: paste " \
        "ectransport.vllm.settings.settings_table() between its generated markers"


def test_keys_are_required_unless_insecure():
    with pytest.raises(ConfigError, match="needs 'secret_key_file'"):
        parse({})
    with pytest.raises(ConfigError, match="a consumer needs 'producer_keys'"):
        parse(SECURE, producer=False, consumer=True)
    with pytest.raises(ConfigError, match="cannot use 'secret_key_file'"):
        parse({"insecure": True, **SECURE})
    with pytest.raises(ConfigError, match="cannot be combined"):
        parse({**SECURE, "producer_keys": ["announced", "x"]}, consumer=True)
    assert parse({"insecure": True}, consumer=True).insecure


def _model(hidden=3584, dtype="torch.bfloat16", vision=None):
    return SimpleNamespace(model="org/model", dtype=dtype, hf_config=SimpleNamespace(
        vision_config=vision), get_inputs_embeds_size=lambda: hidden)


def test_hidden_is_inputs_embeds_width_or_the_deepstack_rule():
    assert model_hidden(_model(3584)) == 3584
    assert model_hidden(_model(3584, vision=SimpleNamespace(out_hidden_size=2048))) == 3584
    qwen3_vl = SimpleNamespace(out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24])
    assert model_hidden(_model(2048, vision=qwen3_vl)) == 2048 * 4


def test_layout_from_model_config_and_overrides():
    cfg = SimpleNamespace(model_config=_model(1024, "torch.float16"))
    lay = layout_for(cfg, parse(SECURE))
    assert (lay.model_id, lay.dtype, lay.hidden, lay.block_bytes) == \
        ("org/model", "float16", 1024, 2048)
    lay = layout_for(cfg, parse({**SECURE, "hidden": 512, "model_id": "alias"}))
    assert (lay.model_id, lay.hidden) == ("alias", 512)
    with pytest.raises(ConfigError, match="without a model config.*dtype, hidden"):
        layout_for(SimpleNamespace(model_config=None), parse({**SECURE, "model_id": "m"}))


def test_producer_key_trust(tmp_path):
    pub_a, _ = generate_keypair(tmp_path / "a", "a")
    pub_b, _ = generate_keypair(tmp_path / "dir", "b")
    a, b = load_public(pub_a), load_public(pub_b)
    stranger = zmq.curve_keypair()[0].decode()

    one = ProducerKeys(parse({**SECURE, "producer_keys": [str(pub_a)]}, consumer=True))
    assert one.resolve(a) == (a, "")
    assert one.resolve(None) == (a, "")  # the only trusted key
    assert one.resolve(stranger)[0] is None
    assert "not a Z85" in one.resolve("garbage")[1]

    two = ProducerKeys(parse({**SECURE, "producer_keys": [a, str(tmp_path / "dir")]},
                             consumer=True))
    assert two.resolve(b) == (b, "")
    assert "cannot tell which producer" in two.resolve(None)[1]

    announced = ProducerKeys(parse({**SECURE, "producer_keys": "announced"}, consumer=True))
    assert announced.resolve(stranger) == (stranger, "")
    assert announced.resolve(None)[0] is None

    assert ProducerKeys(parse({"insecure": True}, consumer=True)).resolve(stranger) == (None, "")
