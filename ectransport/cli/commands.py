"""Subcommands of the ``ectransport`` CLI (see ``ectransport --help``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import click
from click.core import ParameterSource

from ectransport.cli.main import cli, friendly, setup_logging
from ectransport.errors import ConfigError

# -- shared options ------------------------------------------------------------------------------


def layout_options(fn):
    fn = click.option(
        "--hidden",
        default=3584,
        show_default=True,
        type=click.IntRange(1),
        help="Row width of an encoder output (elements): the model's inputs-embeds "
        "width; 3584 = Qwen2-VL-7B.",
    )(fn)
    fn = click.option(
        "--dtype",
        default="bfloat16",
        show_default=True,
        type=click.Choice(["bfloat16", "float16", "float32"]),
        help="Element dtype of encoder outputs.",
    )(fn)
    fn = click.option(
        "--seed",
        default=0,
        show_default=True,
        type=click.IntRange(0),
        help="Weight seed of the reference encoder (part of the model id).",
    )(fn)
    return fn


def demo_layout(hidden: int, dtype: str, seed: int):
    """The reference encoder (imports torch) and the layout of its outputs."""
    from ectransport.demo.encoder import ReferenceEncoder

    enc = ReferenceEncoder(hidden=hidden, dtype=dtype, seed=seed)
    return enc, reference_layout(hidden, dtype, seed)


def reference_layout(hidden: int, dtype: str, seed: int):
    """The layout of the reference encoder's outputs, without building the encoder (fast)."""
    from ectransport.demo.encoder import reference_model_id
    from ectransport.node.common import Layout

    return Layout(model_id=reference_model_id(hidden, seed), dtype=dtype, hidden=hidden)


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def config_option(fn):
    return click.option(
        "--config",
        "config_file",
        default=None,
        type=click.Path(path_type=Path),
        help="TOML settings file (overrides the group's --config; default "
        "$ECTRANSPORT_CONFIG). Flags typed here win over it and over "
        "ECTRANSPORT_SECTION__KEY variables.",
    )(fn)


#: flag parameter name → (setting, flag as typed); only flags given on the command line override.
LAYOUT_FLAGS = {
    "hidden": ("layout.hidden", "--hidden"),
    "dtype": ("layout.dtype", "--dtype"),
    "seed": ("layout.seed", "--seed"),
    "planes": ("node.planes", "--plane"),
    "insecure": ("security.insecure", "--insecure"),
}


def cli_settings(ctx: click.Context, config_file: Path | None, flag_map: dict, params: dict):
    """The effective settings of a subcommand: defaults < file < environment < typed flags.

    Also re-applies the logging settings (the file named here may set ``[log]``)."""
    from ectransport.config import load_settings

    root = ctx.find_root().obj or {}
    if config_file is None:
        config_file = root.get("config")
    flags, names = {}, {}
    for param, (setting, flag) in flag_map.items():
        if ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE:
            v = params[param]
            flags[setting] = (
                str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
            )
            names[setting] = flag
    loaded = load_settings(config_file, flags=flags, flag_names=names)
    log = loaded.settings.log
    setup_logging(root.get("log_level") or log.level, root.get("log_format") or log.format)
    return loaded


def planes_option(fn):
    return click.option(
        "--plane",
        "planes",
        multiple=True,
        default=("nixl",),
        show_default=True,
        help="Data plane(s) to offer/use, best first (repeat the option). "
        "See `ectransport planes`.",
    )(fn)


# -- demo ----------------------------------------------------------------------------------------


@cli.command()
@click.option(
    "--images",
    type=click.Path(path_type=Path),
    default=None,
    help="Folder (or single file) of images to encode. Default: the six public-domain "
    "photographs shipped with ectransport.",
)
@layout_options
@click.option(
    "--repeats",
    default=5,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Fetches per item (the table shows the median).",
)
@planes_option
@click.option(
    "--insecure",
    is_flag=True,
    help="Plain ZMQ without CURVE (not recommended; for comparison only).",
)
@click.option(
    "--json-out",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write the results as JSON to this file.",
)
@config_option
@click.pass_context
@friendly
def demo(ctx, images, hidden, dtype, seed, repeats, planes, insecure, json_out, config_file):
    """Run the main job end to end on this machine.

    A producer process encodes real images with a deterministic reference vision encoder
    (Qwen2-VL geometry: 14 px patches, 2x2 merge) and serves the outputs; this process is the
    consumer: it fetches every item over the CURVE-authenticated control plane and the data plane,
    recomputes it locally, checks the bytes are identical, and prints fetch vs recompute time.
    """
    from ectransport.cli.demo import run_demo

    loaded = cli_settings(
        ctx,
        config_file,
        {
            **LAYOUT_FLAGS,
            "images": ("producer.images", "--images"),
            "repeats": ("demo.repeats", "--repeats"),
        },
        locals(),
    )
    s = loaded.settings
    kwargs = s.consumer_node_kwargs()
    kwargs.pop("planes")
    ok = run_demo(
        images=Path(s.producer.images) if s.producer.images else None,
        hidden=s.layout.hidden,
        dtype=s.layout.dtype,
        seed=s.layout.seed,
        repeats=s.demo.repeats,
        planes=tuple(s.node.planes),
        insecure=s.security.insecure,
        json_out=json_out,
        config_file=loaded.file,
        node_kwargs=kwargs,
        start_timeout_s=s.demo.producer_start_timeout_s,
        stop_timeout_s=s.demo.producer_stop_timeout_s,
    )
    raise SystemExit(0 if ok else 1)


# -- serve ---------------------------------------------------------------------------------------


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Control-plane bind address.")
@click.option("--advertise-host", default=None,
              help="Address consumers reach this host at; required with a wildcard --host "
                   "(0.0.0.0) for the tcp and ucx planes, which put it in their grants.")
@click.option(
    "--port",
    default=5601,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Control-plane port (0 = any free port).",
)
@click.option(
    "--key",
    "key_file",
    type=click.Path(path_type=Path),
    default=None,
    help="This producer's secret key file (from `ectransport keys generate`).",
)
@click.option(
    "--allow-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory of consumer public keys allowed to connect (reloaded on change "
    "and on SIGHUP). Required for a non-loopback --host.",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Plain ZMQ: no authentication, no encryption. Anyone who reaches the port can "
    "pin and read cache entries.",
)
@click.option(
    "--images",
    type=click.Path(path_type=Path),
    default=None,
    help="Encode these images at start-up and serve them (default: the bundled ones).",
)
@layout_options
@click.option(
    "--region-bytes",
    default=1 << 30,
    show_default=True,
    type=click.IntRange(1),
    help="Host region for cached entries, bytes.",
)
@click.option(
    "--lease-s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0.1),
    help="Pin lease of a grant, seconds.",
)
@planes_option
@click.option(
    "--ready-file",
    type=click.Path(path_type=Path),
    default=None,
    help="Write a JSON description (endpoint, public key, items) here once serving.",
)
@click.option(
    "--progress-json",
    is_flag=True,
    hidden=True,
    help="Print one JSON line per encoded item (used by `demo`).",
)
@click.option(
    "--metrics-port",
    default=None,
    type=click.IntRange(0, 65535),
    help="Expose Prometheus metrics at http://[metrics.host]:PORT/metrics (needs the "
    "`metrics` extra; 0 = any free port) [default: off, or [metrics] port].",
)
@config_option
@click.pass_context
@friendly
def serve(
    ctx,
    host,
    advertise_host,
    port,
    key_file,
    allow_dir,
    insecure,
    images,
    hidden,
    dtype,
    seed,
    region_bytes,
    lease_s,
    planes,
    ready_file,
    progress_json,
    metrics_port,
    config_file,
):
    """Run a producer: encode images, hold the outputs, serve them until interrupted."""
    from ectransport.demo.images import load_images
    from ectransport.node.common import Security
    from ectransport.node.producer import ProducerNode

    loaded = cli_settings(
        ctx,
        config_file,
        {
            **LAYOUT_FLAGS,
            "host": ("producer.host", "--host"),
            "advertise_host": ("producer.advertise_host", "--advertise-host"),
            "port": ("producer.port", "--port"),
            "key_file": ("security.key_file", "--key"),
            "allow_dir": ("security.allow_dir", "--allow-dir"),
            "images": ("producer.images", "--images"),
            "region_bytes": ("producer.region_bytes", "--region-bytes"),
            "lease_s": ("producer.lease_s", "--lease-s"),
            "metrics_port": ("metrics.port", "--metrics-port"),
        },
        locals(),
    )
    s = loaded.settings
    insecure, planes, region_bytes = (
        s.security.insecure,
        tuple(s.node.planes),
        s.producer.region_bytes,
    )
    key_file = Path(s.security.key_file) if s.security.key_file else None
    allow_dir = Path(s.security.allow_dir) if s.security.allow_dir else None
    items = load_images(Path(s.producer.images) if s.producer.images else None)
    encoder, layout = demo_layout(s.layout.hidden, s.layout.dtype, s.layout.seed)
    if insecure:
        security = Security(insecure=True)
    elif key_file is None:
        raise ConfigError(
            "--key is required (or --insecure); create one with "
            "`ectransport keys generate --out DIR --name producer`"
        )
    else:
        if allow_dir is not None and not allow_dir.is_dir():
            raise ConfigError(f"--allow-dir {allow_dir} is not a directory")
        security = Security.from_files(str(key_file), str(allow_dir) if allow_dir else None)
    node = ProducerNode(layout=layout, security=security, **s.producer_node_kwargs())
    metrics = None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: node.reload_allow_list())
    try:
        if s.metrics.port is not None:
            from ectransport.metrics import Metrics

            metrics = Metrics()
            metrics.attach(node)
            metrics_port = metrics.serve(s.metrics.port, s.metrics.host)
        node.start()
        described = []
        for i, item in enumerate(items):
            t0 = time.perf_counter()
            tensor = encoder.encode(item.data)
            enc_s = time.perf_counter() - t0
            if not node.put(item.mm_hash, tensor):
                raise ConfigError(f"--region-bytes {region_bytes} is too small for {item.name}")
            d = {
                "name": item.name,
                "mm_hash": item.mm_hash,
                "tokens": int(tensor.shape[0]),
                "nbytes": int(tensor.numel() * tensor.element_size()),
                "encode_s": enc_s,
            }
            described.append(d)
            if progress_json:
                click.echo(json.dumps({"encoded": i + 1, "of": len(items), **d}), nl=True)
            else:
                click.echo(
                    f"encoded {item.name}: {d['tokens']} tokens, {d['nbytes']} bytes, "
                    f"mm_hash {item.mm_hash}"
                )
        info = {
            "host": s.producer.advertise_host or node.host,
            "port": node.port,
            "public_key": node.public_key,
            "planes": list(planes),
            "transports": node.plane_transports(),
            "items": described,
            "pid": os.getpid(),
        }
        if metrics is not None:
            info["metrics_port"] = metrics_port
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(ready_file)
        if progress_json:
            click.echo(json.dumps({"ready": info}))
        else:
            click.echo(
                f"serving {len(items)} items on {node.host}:{node.port} "
                f"(planes: {', '.join(planes)}; CURVE {'off' if insecure else 'on'})"
            )
            if node.public_key:
                click.echo(f"producer public key: {node.public_key}")
            if metrics is not None:
                click.echo(f"metrics: http://{s.metrics.host}:{metrics_port}/metrics")
            click.echo("press Ctrl-C to stop")
        while not stop.wait(0.5):
            pass
    finally:
        if metrics is not None:
            metrics.close()
        node.close()


# -- fetch ---------------------------------------------------------------------------------------


@cli.command()
@click.argument("address")
@click.argument("mm_hashes", nargs=-1, required=True)
@click.option(
    "--server-key", default=None, help="The producer's public key (Z85 text or a public key file)."
)
@click.option(
    "--key",
    "key_file",
    type=click.Path(path_type=Path),
    default=None,
    help="This consumer's secret key file.",
)
@click.option("--insecure", is_flag=True, help="Plain ZMQ (the producer must be --insecure too).")
@layout_options
@planes_option
@click.option(
    "--timeout-s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0.1),
    help="Deadline of each fetch, seconds.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Write each fetched entry to OUT/<mm_hash>.bin.",
)
@config_option
@click.pass_context
@friendly
def fetch(
    ctx,
    address,
    mm_hashes,
    server_key,
    key_file,
    insecure,
    hidden,
    dtype,
    seed,
    planes,
    timeout_s,
    out,
    config_file,
):
    """Fetch entries by mm_hash from a producer at ADDRESS (HOST:PORT)."""
    from ectransport.control.keys import load_public
    from ectransport.node.common import Layout, Security
    from ectransport.node.consumer import ConsumerNode, ProducerAddress

    loaded = cli_settings(
        ctx,
        config_file,
        {
            **LAYOUT_FLAGS,
            "server_key": ("security.server_key", "--server-key"),
            "key_file": ("security.key_file", "--key"),
            "timeout_s": ("consumer.fetch_timeout_s", "--timeout-s"),
        },
        locals(),
    )
    s = loaded.settings
    insecure, server_key = s.security.insecure, s.security.server_key
    key_file = Path(s.security.key_file) if s.security.key_file else None
    timeout_s = s.consumer.fetch_timeout_s
    host, port = parse_address(address)
    layout = reference_layout(s.layout.hidden, s.layout.dtype, s.layout.seed)
    if insecure:
        security, pub = Security(insecure=True), None
    else:
        if key_file is None or server_key is None:
            raise ConfigError("--key and --server-key are required (or --insecure)")
        security, pub = Security.from_files(str(key_file)), load_public(server_key)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    assert isinstance(layout, Layout)
    misses = 0
    with ConsumerNode(layout=layout, security=security, **s.consumer_node_kwargs()) as node:
        peer = ProducerAddress(host, port, pub)
        plane = node.connect(peer, timeout_s=min(timeout_s, s.consumer.connect_timeout_s))
        click.echo(
            f"connected to {host}:{port} (CURVE {'off' if insecure else 'on'}, plane {plane}: "
            f"{node.plane_transports().get(plane, plane)})"
        )
        for mm in mm_hashes:
            r = node.fetch(peer, mm)
            if r.ok:
                click.echo(
                    f"{mm[:16]}  {r.nbytes} bytes in {r.timings.get('total', 0) * 1e3:.2f} ms "
                    f"via {r.plane}"
                )
                if out is not None:
                    (out / f"{mm}.bin").write_bytes(r.data.tobytes())
            else:
                misses += 1
                click.echo(f"{mm[:16]}  miss: {r.reason.value}: {r.detail}")
    raise SystemExit(0 if misses == 0 else 1)


# -- keys ----------------------------------------------------------------------------------------


@cli.group()
def keys():
    """Manage CurveZMQ key pairs and allow-lists (zcert format, usable by other ZeroMQ tools)."""


@keys.command("generate")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory to write NAME.key (public) and NAME.key_secret (mode 0600).",
)
@click.option("--name", required=True, help="Node name, e.g. producer or consumer-3.")
@click.option("--force", is_flag=True, help="Overwrite an existing key pair.")
@friendly
def keys_generate(out_dir, name, force):
    """Create a key pair for one node."""
    from ectransport.control.keys import generate_keypair, load_public

    public, secret = generate_keypair(out_dir, name, force=force)
    click.echo(f"public key file: {public}")
    click.echo(f"secret key file: {secret} (mode 0600; keep it private)")
    click.echo(f"public key: {load_public(public)}")


@keys.command("show")
@click.argument("key_file", type=click.Path(path_type=Path))
@friendly
def keys_show(key_file):
    """Print the public key of a key file (public or secret)."""
    from ectransport.control.keys import load_public

    click.echo(load_public(key_file))


@keys.command("allow")
@click.argument("pubkey")
@click.option(
    "--dir",
    "allow_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="The producer's allow-list directory (see `serve --allow-dir`).",
)
@click.option("--name", default=None, help="File name for the entry (default: derived from key).")
@friendly
def keys_allow(pubkey, allow_dir, name):
    """Allow a consumer: PUBKEY is a Z85 public key or a public key file."""
    from ectransport.control.keys import allow_key

    path = allow_key(allow_dir, pubkey, name=name)
    click.echo(f"allowed: {path}")


# -- planes --------------------------------------------------------------------------------------


@cli.command()
@friendly
def planes():
    """List the data planes installed, their capabilities and whether they can run here."""
    from rich.console import Console
    from rich.table import Table

    from ectransport.data.registry import discover, try_load

    table = Table(title="data planes")
    for col in ("name", "from", "model", "memory", "notifications", "usable here"):
        table.add_column(col)
    for name, info in sorted(discover().items()):
        cls = try_load(name)
        if cls is None:
            table.add_row(name, info.dist, "?", "?", "?", "[red]no: failed to load[/red]")
            continue
        ok, why = cls.probe()
        caps = cls.capabilities
        table.add_row(
            name,
            info.dist + (f" (shadows {', '.join(info.shadowed)})" if info.shadowed else ""),
            caps.transfer_model.value,
            ",".join(sorted(caps.mem_kinds)),
            "yes" if caps.notifications else "no",
            f"[green]yes[/green]: {why}" if ok else f"[red]no[/red]: {why}",
        )
    Console().print(table)


# -- config --------------------------------------------------------------------------------------


@cli.group("config")
def config_group():
    """Settings: one TOML file, ECTRANSPORT_SECTION__KEY variables, flags (later wins)."""


@config_group.command("show")
@config_option
@click.pass_context
@friendly
def config_show(ctx, config_file):
    """Print the effective configuration as TOML: every timeout, budget, size and path with its
    value, where it came from (default, file, env, flag) and its unit. Values of settings named
    like secrets are redacted. The output is a valid config file."""
    from ectransport.config import render

    click.echo(render(cli_settings(ctx, config_file, {}, {})), nl=False)


# -- doctor --------------------------------------------------------------------------------------


@cli.command()
@config_option
@click.pass_context
@friendly
def doctor(ctx, config_file):
    """Check this machine: python and package versions, CURVE in libzmq, each data plane (and
    why not), UCX transports, /dev/shm, the memlock limit, the configured ports and key files.

    Exits 1 when something required is missing: msgspec, pyzmq with CURVE, or every data plane.
    """
    from rich.console import Console
    from rich.table import Table

    from ectransport.config.doctor import FAIL, INFO, OK, run_checks

    settings = cli_settings(ctx, config_file, {}, {}).settings
    console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)
    with console.status("checking", spinner="dots") if console.is_terminal else _nothing():
        checks = run_checks(settings)
    table = Table(title="ectransport doctor")
    for col in ("check", "item", "status", "detail"):
        table.add_column(col, overflow="fold")
    colors = {OK: "green", INFO: "blue", FAIL: "red"}
    group = None
    for c in checks:
        color = colors.get(c.status, "yellow")
        req = " (required)" if c.required and c.status == FAIL else ""
        table.add_row(
            c.group if c.group != group else "",
            c.name,
            f"[{color}]{c.status}[/{color}]{req}",
            c.detail,
        )
        group = c.group
    console.print(table)
    failed = [c for c in checks if c.failed]
    if failed:
        console.print(f"[red]missing:[/red] {', '.join(c.name for c in failed)}")
        raise SystemExit(1)
    console.print("everything required is here.")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
