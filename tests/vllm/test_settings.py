"""ec_connector_extra_config validation, the layout rule, and producer-key trust."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq

from ectransport.control.keys import generate_keypair, load_public
from ectransport.errors import ConfigError
from ectransport.vllm.layout import layout_for, model_hidden
from ectransport.vllm.settings import parse_settings
from ectransport.vllm.trust import ProducerKeys

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
])
def test_bad_values_are_named(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse({**SECURE, **extra})


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
