"""Subcommands of the ``ectransport`` CLI (see ``ectransport --help``)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import click

from ectransport.cli.main import cli, friendly
from ectransport.errors import ConfigError

# -- shared options ------------------------------------------------------------------------------


def layout_options(fn):
    fn = click.option("--hidden", default=3584, show_default=True, type=click.IntRange(1),
                      help="Row width of an encoder output (elements): the model's inputs-embeds "
                           "width; 3584 = Qwen2-VL-7B.")(fn)
    fn = click.option("--dtype", default="bfloat16", show_default=True,
                      type=click.Choice(["bfloat16", "float16", "float32"]),
                      help="Element dtype of encoder outputs.")(fn)
    fn = click.option("--seed", default=0, show_default=True, type=click.IntRange(0),
                      help="Weight seed of the reference encoder (part of the model id).")(fn)
    return fn


def demo_layout(hidden: int, dtype: str, seed: int):
    from ectransport.demo.encoder import ReferenceEncoder
    from ectransport.node.common import Layout

    enc = ReferenceEncoder(hidden=hidden, dtype=dtype, seed=seed)
    return enc, Layout(model_id=enc.model_id, dtype=dtype, hidden=hidden)


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def planes_option(fn):
    return click.option("--plane", "planes", multiple=True, default=("nixl",), show_default=True,
                        help="Data plane(s) to offer/use, best first (repeat the option). "
                             "See `ectransport planes`.")(fn)


# -- demo ----------------------------------------------------------------------------------------


@cli.command()
@click.option("--images", type=click.Path(path_type=Path), default=None,
              help="Folder (or single file) of images to encode. Default: the six public-domain "
                   "photographs shipped with ectransport.")
@layout_options
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 1000),
              help="Fetches per item (the table shows the median).")
@planes_option
@click.option("--insecure", is_flag=True,
              help="Plain ZMQ without CURVE (not recommended; for comparison only).")
@click.option("--json-out", type=click.Path(path_type=Path), default=None,
              help="Also write the results as JSON to this file.")
@friendly
def demo(images, hidden, dtype, seed, repeats, planes, insecure, json_out):
    """Run the main job end to end on this machine.

    A producer process encodes real images with a deterministic reference vision encoder
    (Qwen2-VL geometry: 14 px patches, 2x2 merge) and serves the outputs; this process is the
    consumer: it fetches every item over the CURVE-authenticated control plane and the data plane,
    recomputes it locally, checks the bytes are identical, and prints fetch vs recompute time.
    """
    from ectransport.cli.demo import run_demo

    ok = run_demo(images=images, hidden=hidden, dtype=dtype, seed=seed, repeats=repeats,
                  planes=tuple(planes), insecure=insecure, json_out=json_out)
    raise SystemExit(0 if ok else 1)


# -- serve ---------------------------------------------------------------------------------------


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Control-plane bind address.")
@click.option("--port", default=5601, show_default=True, type=click.IntRange(0, 65535),
              help="Control-plane port (0 = any free port).")
@click.option("--key", "key_file", type=click.Path(path_type=Path), default=None,
              help="This producer's secret key file (from `ectransport keys generate`).")
@click.option("--allow-dir", type=click.Path(path_type=Path), default=None,
              help="Directory of consumer public keys allowed to connect (reloaded on change "
                   "and on SIGHUP). Required for a non-loopback --host.")
@click.option("--insecure", is_flag=True,
              help="Plain ZMQ: no authentication, no encryption. Anyone who reaches the port can "
                   "pin and read cache entries.")
@click.option("--images", type=click.Path(path_type=Path), default=None,
              help="Encode these images at start-up and serve them (default: the bundled ones).")
@layout_options
@click.option("--region-bytes", default=1 << 30, show_default=True, type=click.IntRange(1),
              help="Host region for cached entries, bytes.")
@click.option("--lease-s", default=30.0, show_default=True, type=click.FloatRange(0.1),
              help="Pin lease of a grant, seconds.")
@planes_option
@click.option("--ready-file", type=click.Path(path_type=Path), default=None,
              help="Write a JSON description (endpoint, public key, items) here once serving.")
@click.option("--progress-json", is_flag=True, hidden=True,
              help="Print one JSON line per encoded item (used by `demo`).")
@friendly
def serve(host, port, key_file, allow_dir, insecure, images, hidden, dtype, seed, region_bytes,
          lease_s, planes, ready_file, progress_json):
    """Run a producer: encode images, hold the outputs, serve them until interrupted."""
    from ectransport.demo.images import load_images
    from ectransport.node.common import Security
    from ectransport.node.producer import ProducerNode

    items = load_images(images)
    encoder, layout = demo_layout(hidden, dtype, seed)
    if insecure:
        security = Security(insecure=True)
    elif key_file is None:
        raise ConfigError("--key is required (or --insecure); create one with "
                          "`ectransport keys generate --out DIR --name producer`")
    else:
        if allow_dir is not None and not allow_dir.is_dir():
            raise ConfigError(f"--allow-dir {allow_dir} is not a directory")
        security = Security.from_files(str(key_file), str(allow_dir) if allow_dir else None)
    node = ProducerNode(layout=layout, region_bytes=region_bytes, host=host, port=port,
                        security=security, planes=tuple(planes), lease_s=lease_s)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: node.reload_allow_list())
    try:
        node.start()
        described = []
        for i, item in enumerate(items):
            t0 = time.perf_counter()
            tensor = encoder.encode(item.data)
            enc_s = time.perf_counter() - t0
            if not node.put(item.mm_hash, tensor):
                raise ConfigError(f"--region-bytes {region_bytes} is too small for {item.name}")
            d = {"name": item.name, "mm_hash": item.mm_hash, "tokens": int(tensor.shape[0]),
                 "nbytes": int(tensor.numel() * tensor.element_size()), "encode_s": enc_s}
            described.append(d)
            if progress_json:
                click.echo(json.dumps({"encoded": i + 1, "of": len(items), **d}), nl=True)
            else:
                click.echo(f"encoded {item.name}: {d['tokens']} tokens, {d['nbytes']} bytes, "
                           f"mm_hash {item.mm_hash[:16]}")
        info = {"host": node.host, "port": node.port, "public_key": node.public_key,
                "planes": list(planes), "transports": node.plane_transports(), "items": described,
                "pid": os.getpid()}
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(ready_file)
        if progress_json:
            click.echo(json.dumps({"ready": info}))
        else:
            click.echo(f"serving {len(items)} items on {node.host}:{node.port} "
                       f"(planes: {', '.join(planes)}; CURVE {'off' if insecure else 'on'})")
            if node.public_key:
                click.echo(f"producer public key: {node.public_key}")
            click.echo("press Ctrl-C to stop")
        while not stop.wait(0.5):
            pass
    finally:
        node.close()


# -- fetch ---------------------------------------------------------------------------------------


@cli.command()
@click.argument("address")
@click.argument("mm_hashes", nargs=-1, required=True)
@click.option("--server-key", default=None,
              help="The producer's public key (Z85 text or a public key file).")
@click.option("--key", "key_file", type=click.Path(path_type=Path), default=None,
              help="This consumer's secret key file.")
@click.option("--insecure", is_flag=True, help="Plain ZMQ (the producer must be --insecure too).")
@layout_options
@planes_option
@click.option("--timeout-s", default=30.0, show_default=True, type=click.FloatRange(0.1),
              help="Deadline of each fetch, seconds.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Write each fetched entry to OUT/<mm_hash>.bin.")
@friendly
def fetch(address, mm_hashes, server_key, key_file, insecure, hidden, dtype, seed, planes,
          timeout_s, out):
    """Fetch entries by mm_hash from a producer at ADDRESS (HOST:PORT)."""
    from ectransport.control.keys import load_public
    from ectransport.node.common import Layout, Security
    from ectransport.node.consumer import ConsumerNode, ProducerAddress

    host, port = parse_address(address)
    _, layout = demo_layout(hidden, dtype, seed)
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
    with ConsumerNode(layout=layout, security=security, planes=tuple(planes),
                      fetch_timeout_s=timeout_s) as node:
        peer = ProducerAddress(host, port, pub)
        plane = node.connect(peer, timeout_s=min(timeout_s, 10.0))  # typed, one-line errors
        click.echo(f"connected to {host}:{port} (CURVE {'off' if insecure else 'on'}, plane {plane}: "
                   f"{node.plane_transports().get(plane, plane)})")
        for mm in mm_hashes:
            r = node.fetch(peer, mm)
            if r.ok:
                click.echo(f"{mm[:16]}  {r.nbytes} bytes in {r.timings.get('total', 0) * 1e3:.2f} ms "
                           f"via {r.plane}")
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
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Directory to write NAME.key (public) and NAME.key_secret (mode 0600).")
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
@click.option("--dir", "allow_dir", required=True, type=click.Path(path_type=Path),
              help="The producer's allow-list directory (see `serve --allow-dir`).")
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
        table.add_row(name, info.dist + (f" (shadows {', '.join(info.shadowed)})" if info.shadowed else ""),
                      caps.transfer_model.value, ",".join(sorted(caps.mem_kinds)),
                      "yes" if caps.notifications else "no",
                      f"[green]yes[/green]: {why}" if ok else f"[red]no[/red]: {why}")
    Console().print(table)
