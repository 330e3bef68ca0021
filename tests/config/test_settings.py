"""Settings: defaults < TOML file < ECTRANSPORT_… environment < CLI flags; unknown keys are
errors with a hint; ``config show`` redacts secrets and names where each value came from."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import tomllib
from click.testing import CliRunner

from ectransport.cli.main import cli
from ectransport.cli.options import cli_settings, setting_options
from ectransport.config import LEAVES, Settings, load_settings, render
from ectransport.errors import ConfigError
from ectransport.settings_schema import CLI, defaults


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "ectransport.toml"
    p.write_text(text)
    return p


def test_defaults_match_the_nodes_and_operations_doc():
    s = load_settings(env={}).settings
    assert s == CLI == defaults("cli")
    assert load_settings(env={}, front_end="api").settings == Settings()
    c = s.consumer
    assert (c.ack_timeout_s, c.read_timeout_s, c.quarantine_s, c.fetch_timeout_s) == \
        (2.0, 20.0, 60.0, 30.0)
    assert (c.hello_timeout_s, c.retry_backoff_s, c.retry_backoff_max_s, c.peer_backoff_s,
            c.peer_backoff_max_s) == (5.0, 0.02, 0.5, 1.0, 60.0)
    assert s.control.client.options()["handshake_timeout_s"] == 1.5
    p = s.producer
    assert (p.lease_s, p.grace_s, p.port, p.region_bytes) == (5.0, 2.0, 5601, 1 << 30)
    assert s.control.server.options()["handshake_timeout_s"] == 10.0
    assert s.control.server.options()["peer_rate_per_s"] == 2000.0
    assert "host" not in s.planes.options()["tcp"]  # the node defaults it to the control host


def test_every_setting_has_a_description_with_a_unit_where_it_has_one():
    for leaf in LEAVES.values():
        assert leaf.description, leaf.name
        if leaf.path[-1].endswith("_s"):
            assert leaf.description.rstrip().endswith(("s", "s)")) or ", s" in leaf.description, \
                leaf.name
        if leaf.path[-1].endswith("_bytes"):
            assert "bytes" in leaf.description, leaf.name


def test_precedence_file_then_env_then_flags(tmp_path):
    f = write(tmp_path, """
[producer]
lease_s = 45
port = 7000
region_bytes = 1048576
[consumer]
ack_timeout_s = 3.5
""")
    env = {"ECTRANSPORT_PRODUCER__PORT": "7100", "ECTRANSPORT_CONSUMER__ACK_TIMEOUT_S": "4",
           "ECTRANSPORT_NODE__PLANES": "tcp,nixl"}
    loaded = load_settings(f, env=env, flags={"producer.port": 7200},
                           flag_names={"producer.port": "--port"})
    s = loaded.settings
    assert s.producer.lease_s == 45.0  # file
    assert s.producer.region_bytes == 1 << 20  # file
    assert s.consumer.ack_timeout_s == 4.0  # env over file
    assert s.producer.port == 7200  # flag over env over file
    assert s.node.planes == ("tcp", "nixl")  # env, comma-separated list
    assert s.consumer.read_timeout_s == 20.0  # default
    src = loaded.sources
    assert src[("producer", "lease_s")] == f"file {f}"
    assert src[("consumer", "ack_timeout_s")] == "env ECTRANSPORT_CONSUMER__ACK_TIMEOUT_S"
    assert src[("producer", "port")] == "flag --port"
    assert src[("consumer", "read_timeout_s")] == "default"


def test_config_file_from_environment_and_nested_env_keys(tmp_path):
    f = write(tmp_path, '[planes.plugins.shm]\npath = "/dev/shm/a"\n')
    env = {"ECTRANSPORT_CONFIG": str(f), "ECTRANSPORT_PLANES__PLUGINS__SHM__SIZE_BYTES": "4096",
           "ECTRANSPORT_PLANES__UCX__UCX_OPTIONS": '{TLS = "tcp,self"}',
           "ECTRANSPORT_CONTROL__SERVER__PEER_BURST": "100",
           "ECTRANSPORT_PLANES": "tcp", "ECTRANSPORT_BENCHMARKS_DIR": "/x"}  # not settings
    s = load_settings(env=env).settings
    assert s.planes.plugins == {"shm": {"path": "/dev/shm/a", "size_bytes": 4096}}
    assert s.planes.ucx.ucx_options == {"TLS": "tcp,self"}
    assert s.control.server.peer_burst == 100
    assert s.planes.options()["shm"]["size_bytes"] == 4096


@pytest.mark.parametrize("text, needle", [
    ("[producer]\nlease = 3\n", "unknown key 'producer.lease' (did you mean 'producer.lease_s'?)"),
    ("[prodcer]\nport = 1\n", "unknown key 'prodcer'"),
    ("lease_s = 3\n", "(did you mean 'producer.lease_s'?)"),
    ("[control.sever]\npeer_burst = 3\n", "did you mean 'control.server"),
    ("producer = 3\n", "'producer' is a section"),
    ("[producer]\nport = \"x\"\n", "file"),
    ("[producer]\nport = 70000\n", "producer.port"),
    ("[log]\nformat = \"xml\"\n", "log.format"),
    ("[producer\n", "not valid TOML"),
])
def test_bad_files_are_config_errors_with_a_hint(tmp_path, text, needle):
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, text), env={})
    assert needle in str(e.value)


def test_unknown_env_keys_are_errors_but_plain_ectransport_vars_are_not():
    with pytest.raises(ConfigError, match=r"ECTRANSPORT_PRODUCER__LEASE: unknown setting "
                       r"'producer.lease' \(did you mean 'producer.lease_s'\?\)"):
        load_settings(env={"ECTRANSPORT_PRODUCER__LEASE": "1"})
    with pytest.raises(ConfigError, match=r"from env ECTRANSPORT_PRODUCER__PORT"):
        load_settings(env={"ECTRANSPORT_PRODUCER__PORT": "many"})
    load_settings(env={"ECTRANSPORT_PLANES": "tcp"})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(env={"ECTRANSPORT_CONFIG": "/nonexistent/ect.toml"})


def test_show_redacts_secrets_names_sources_and_round_trips(tmp_path):
    f = write(tmp_path, """
[security]
key_file = "/etc/ectransport/producer.key_secret"
[planes.plugins.vault]
secret = "hunter2"
api_token = "tok-123"
endpoint = "https://vault"
[planes.ucx.ucx_options]
TLS = "tcp"
""")
    loaded = load_settings(f, env={"ECTRANSPORT_PRODUCER__LEASE_S": "12"},
                           flags={"consumer.fetch_timeout_s": 9.0},
                           flag_names={"consumer.fetch_timeout_s": "--timeout-s"})
    out = render(loaded)
    assert "hunter2" not in out and "tok-123" not in out
    assert out.count("<redacted>") == 2
    assert 'key_file = "/etc/ectransport/producer.key_secret"' in out  # paths are shown
    assert '"https://vault"' in out
    assert "lease_s = 12.0  # env ECTRANSPORT_PRODUCER__LEASE_S" in out
    assert "fetch_timeout_s = 9.0  # flag --timeout-s" in out
    assert f"# file {f}" in out
    assert "ack_timeout_s = 2.0  # default | XferReq -> XferAck deadline, s" in out
    # the output is itself a config file giving the same settings (redacted values aside)
    again = load_settings(write(tmp_path, out.replace('"<redacted>"', '"x"')), env={}).settings
    assert again.producer.lease_s == 12.0 and again.consumer.fetch_timeout_s == 9.0
    assert again.planes.ucx.ucx_options == {"TLS": "tcp"}
    tomllib.loads(out)


def test_config_show_command(tmp_path, monkeypatch):
    f = write(tmp_path, '[producer]\nlease_s = 7\n[planes.plugins.x]\nsecret_key = "abc"\n')
    monkeypatch.setenv("ECTRANSPORT_CONSUMER__QUARANTINE_S", "5")
    r = CliRunner().invoke(cli, ["config", "show", "--config", str(f)])
    assert r.exit_code == 0, r.output
    assert "lease_s = 7.0  # file" in r.output
    assert "quarantine_s = 5.0  # env ECTRANSPORT_CONSUMER__QUARANTINE_S" in r.output
    assert "abc" not in r.output and "<redacted>" in r.output
    r = CliRunner().invoke(cli, ["--config", str(f), "config", "show"])  # group-level option
    assert r.exit_code == 0 and "lease_s = 7.0" in r.output
    bad = write(tmp_path, "[producer]\nlease = 7\n")
    r = CliRunner().invoke(cli, ["config", "show", "--config", str(bad)])
    assert r.exit_code == 2 and "did you mean 'producer.lease_s'" in r.output


def test_cli_flags_override_only_when_typed(tmp_path, monkeypatch):
    """A flag's default never hides the file; a typed flag beats the file and the env."""
    seen = {}

    @click.command()
    @setting_options("producer.port", "producer.lease_s", "node.planes")
    @click.pass_context
    def probe(ctx):
        seen["s"] = cli_settings(ctx, f)

    f = write(tmp_path, "[producer]\nport = 7000\nlease_s = 40\n[node]\nplanes = [\"tcp\"]\n")
    monkeypatch.setenv("ECTRANSPORT_PRODUCER__LEASE_S", "50")
    assert CliRunner().invoke(probe, []).exit_code == 0
    s = seen["s"].settings
    assert (s.producer.port, s.producer.lease_s, s.node.planes) == (7000, 50.0, ("tcp",))
    assert CliRunner().invoke(probe, ["--port", "7300", "--lease-s", "60", "--plane", "ucx",
                                      "--plane", "tcp"]).exit_code == 0
    s = seen["s"].settings
    assert (s.producer.port, s.producer.lease_s, s.node.planes) == (7300, 60.0, ("ucx", "tcp"))
    assert seen["s"].sources[("producer", "lease_s")] == "flag --lease-s"


def test_a_single_env_value_is_a_list_of_one_and_section_rules_name_the_source():
    s = load_settings(env={"ECTRANSPORT_NODE__VERSIONS": "1"}).settings
    assert s.node.versions == (1,)
    assert load_settings(env={"ECTRANSPORT_NODE__PLANES": "tcp"}).settings.node.planes == ("tcp",)
    with pytest.raises(ConfigError, match=r"from env ECTRANSPORT_NODE__VERSIONS.*unsupported"):
        load_settings(env={"ECTRANSPORT_NODE__VERSIONS": "7"})


def test_an_empty_env_value_unsets_an_optional_setting_only():
    loaded = load_settings(env={"ECTRANSPORT_SECURITY__KEY_FILE": "",
                                "ECTRANSPORT_PRODUCER__BUDGET_BYTES": ""})
    assert loaded.settings.security.key_file is None
    assert loaded.settings.producer.budget_bytes is None
    with pytest.raises(ConfigError, match="from env ECTRANSPORT_PRODUCER__HOST"):
        load_settings(env={"ECTRANSPORT_PRODUCER__HOST": ""})
