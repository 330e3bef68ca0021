"""One settings schema: the Python API's defaults, the CLI flags, the TOML/env keys, ``config
show`` and the docs are all generated from (or checked against) ``ectransport.settings_schema``;
front ends differ only where a field says so, with the reason."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ectransport.cli.main import cli
from ectransport.cli.options import select, setting_options
from ectransport.config import load_settings, render
from ectransport.config.show import docs_tables
from ectransport.settings_schema import (
    API,
    CLI,
    DIFFERENCES,
    LEAVES,
    VLLM,
    Settings,
    defaults,
)

ROOT = Path(__file__).resolve().parents[2]


def _defaults(fn) -> dict[str, object]:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("node", ["producer", "consumer"])
def test_node_constructors_take_the_schemas_sections_as_defaults(node):
    """ProducerNode/ConsumerNode take the typed sections of the schema, defaulting to its Python
    API defaults (``API.producer``, ...): one source for both, no field list kept by hand."""
    if node == "producer":
        from ectransport.node.producer import ProducerNode as cls
        want = {"settings": API.producer, "control_settings": API.control.server}
    else:
        from ectransport.node.consumer import ConsumerNode as cls
        want = {"settings": API.consumer, "control_settings": API.control.client}
    want |= {"node": API.node, "plane_settings": API.planes}
    got = _defaults(cls.__init__)
    for name, section in want.items():
        assert got[name] == section, f"{cls.__name__}({name}=) defaults to {got[name]!r}"
    built = inspect.signature(cls.from_settings)
    assert list(built.parameters)[:2] == ["s", "layout"], built


def test_session_and_control_defaults_are_the_schemas():
    from ectransport.control.zmqctl import ZmqControlClient, ZmqControlServer
    from ectransport.data.options import SERVING_DEFAULTS
    from ectransport.session import ConsumerConfig, ProducerConfig

    def fields(dc) -> dict[str, object]:
        return {f.name: f.default for f in dataclasses.fields(dc)
                if f.default is not dataclasses.MISSING}

    for cfg, section in ((ConsumerConfig, API.consumer), (ProducerConfig, API.producer)):
        got = fields(cfg)
        assert got["settings"] == section and got["planes"] == API.node.planes, cfg
        assert got["versions"] == API.node.versions, cfg
    for cls, section in ((ZmqControlServer, API.control.server),
                         (ZmqControlClient, API.control.client)):
        got = _defaults(cls.__init__)
        for k in type(section).__struct_fields__:
            assert got[k] == getattr(section, k), f"{cls.__name__}({k}=)"
        assert set(section.options()) <= set(got), "every option is a constructor argument"
    for k, v in SERVING_DEFAULTS.items():
        assert getattr(API.planes.tcp, k) == v, f"planes.tcp.{k}"


def test_plane_and_demo_defaults_are_the_schemas():
    """The nixl/ucx planes and ``demo`` read their defaults from the schema: their sources name
    ``API.planes.*`` / ``CLI.demo.*`` and no literal of their own."""
    from ectransport.cli import demo

    src = {name: (ROOT / "ectransport" / name).read_text()
           for name in ("data/nixl.py", "data/ucx.py")}
    for k in ("prog_thread", "num_threads", "grant_scope"):
        assert f'options.get("{k}", API.planes.nixl.{k})' in src["data/nixl.py"], k
    for k in ("transfer_timeout_s", "peer_error_handling", "port"):
        assert f'options.get("{k}", d.{k})' in src["data/ucx.py"], k
    assert "d = API.planes.ucx" in src["data/ucx.py"]
    assert CLI.demo.producer_start_timeout_s == demo.PRODUCER_START_TIMEOUT_S
    assert _defaults(demo.run_demo)["stop_timeout_s"] == CLI.demo.producer_stop_timeout_s
    assert "--region-bytes" not in inspect.getsource(demo)  # serve's own region_bytes setting


def test_front_ends_differ_only_where_the_schema_says_why():
    assert DIFFERENCES, "the known differences are declared"
    for front_end, name, value, reason in DIFFERENCES:
        assert len(reason) > 20, (front_end, name)
        assert LEAVES[tuple(name.split("."))].default != value
    assert Settings() == API == defaults("api")
    assert (CLI.producer.region_bytes, CLI.producer.port) == (1 << 30, 5601)
    assert (API.producer.region_bytes, API.producer.port) == (256 << 20, 0)
    assert (VLLM.consumer.fetch_timeout_s, API.consumer.fetch_timeout_s) == (10.0, 30.0)
    changed = {(fe, n) for fe, n, _, _ in DIFFERENCES}
    for path, leaf in LEAVES.items():
        for fe, s in (("cli", CLI), ("vllm", VLLM)):
            value = s
            for k in path:
                value = getattr(value, k)
            assert (value != leaf.default) == ((fe, leaf.name) in changed), (fe, leaf.name)


def _flags(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in p.opts}


@pytest.mark.parametrize("command, sections", [
    ("serve", ["producer", "layout", "node.planes", "security.key_file", "metrics.port"]),
    ("fetch", ["consumer", "layout", "node.planes", "security.server_key"]),
    ("demo", ["demo", "layout", "producer.images"]),
])
def test_every_setting_of_an_exposed_section_is_a_flag(command, sections):
    cmd = cli.commands[command]
    for leaf in select(*sections):
        assert leaf.flag in _flags(cmd), f"{command}: no {leaf.flag} for {leaf.name}"


def test_generated_flags_take_type_range_default_and_help_from_the_schema():
    seen = {}

    @click.command()
    @setting_options("producer", "consumer.fetch_timeout_s", "security.insecure", "planes.nixl")
    @click.pass_context
    def probe(ctx):
        from ectransport.cli.options import cli_settings

        seen["s"] = cli_settings(ctx).settings

    r = CliRunner().invoke(probe, ["--help"], terminal_width=200)
    assert "while a read is in flight (ECTP v2 RenewAck), so a dead consumer's pins return " \
        "within lease + grace [default: 5.0; x>=0.1]" in " ".join(r.output.split())
    assert "--port INTEGER RANGE" in r.output and "[default: 5601; 0<=x<=65535]" in r.output
    # the CLI's default, not the API's; no "(...)" around it, no role prefix in the help
    assert "blocks); default 1 GiB  [default: 1073741824; x>=1]" in r.output
    assert "Path:" not in r.output and "Consumer:" not in r.output and "(1073741824" not in r.output
    assert "--prog-thread / --no-prog-thread" in r.output
    assert "--grant-scope [grant|region]" in r.output
    r = CliRunner().invoke(probe, ["--lease-s", "0.01"])
    assert r.exit_code == 2 and "0.01 is not in the range x>=0.1" in r.output
    r = CliRunner().invoke(probe, ["--lease-s", "12", "--timeout-s", "3", "--insecure",
                                   "--no-prog-thread", "--grant-scope", "region"],
                           env={"ECTRANSPORT_CONFIG": ""})
    assert r.exit_code == 0, r.output
    s = seen["s"]
    assert (s.producer.lease_s, s.consumer.fetch_timeout_s, s.security.insecure) == \
        (12.0, 3.0, True)
    assert (s.planes.nixl.prog_thread, s.planes.nixl.grant_scope) == (False, "region")
    assert s.producer.port == 5601  # not typed: the CLI default


def test_duplicate_flags_and_unknown_selectors_fail_at_declaration():
    with pytest.raises(ValueError, match="duplicate flags"):
        setting_options("producer.port", "planes.tcp.port")
    with pytest.raises(KeyError, match="no setting or section 'producer.lease'"):
        select("producer.lease")


def test_every_setting_is_an_env_var_a_toml_key_and_a_config_show_line():
    loaded = load_settings(env={})
    shown = render(loaded)
    for path, leaf in LEAVES.items():
        assert f"{path[-1]} = " in shown, leaf.name
        if leaf.is_dict:
            continue
        env = "ECTRANSPORT_" + "__".join(p.upper() for p in path)
        default = leaf.default_for("cli")
        # a float setting takes its default's text (every one in its own range: e.g. a share)
        raw = {bool: "true", int: "1", float: repr(default), str: "x"}.get(type(default))
        if raw is None:
            continue  # None/list defaults: covered by test_settings
        if leaf.is_str and not isinstance(default, str):
            continue
        got = load_settings(env={env: raw if not leaf.is_str else str(default)})
        assert got.sources[path] == f"env {env}", leaf.name


def test_configuration_doc_tables_are_the_generated_ones():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert docs_tables() in doc, "docs/configuration.md is stale: paste " \
        "ectransport.config.show.docs_tables() between its generated markers"
