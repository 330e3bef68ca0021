"""The main subcommands of the ``ectransport`` CLI: ``demo``, ``serve``, ``fetch`` (see
``ectransport --help``; ``keys``, ``planes``, ``config``, ``doctor`` are in ``admin``).

Their settings flags are generated from the settings schema (:mod:`ectransport.cli.options`):
each command names the settings it exposes; the flags typed win over the file and environment.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import click

from ectransport.cli.app import cli, friendly
from ectransport.cli.options import cli_settings, config_option, setting_options
from ectransport.cli.reference import demo_layout, reference_layout
from ectransport.errors import ConfigError

# -- shared helpers ------------------------------------------------------------------------------


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


# -- demo ----------------------------------------------------------------------------------------


@cli.command()
@setting_options("producer.images", "layout", "demo", "node.planes", "security.insecure")
@click.option(
    "--certificates",
    is_flag=True,
    help="Admit the consumer by a certificate of a throwaway deployment CA (fleet trust: "
    "[trust] admission = certificate) instead of an allow-list.",
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
def demo(ctx, certificates, json_out, config_file):
    """Run the main job end to end on this machine.

    A producer process encodes real images with a deterministic reference vision encoder
    (Qwen2-VL geometry: 14 px patches, 2x2 merge) and serves the outputs; this process is the
    consumer: it fetches every item over the CURVE-authenticated control plane and the data plane,
    recomputes it locally, checks the bytes are identical, and prints fetch vs recompute time.
    """
    from ectransport.cli.demo import run_demo

    loaded = cli_settings(ctx, config_file)
    s = loaded.settings
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
        settings=s,
        start_timeout_s=s.demo.producer_start_timeout_s,
        stop_timeout_s=s.demo.producer_stop_timeout_s,
        certificates=certificates,
    )
    raise SystemExit(0 if ok else 1)


# -- serve ---------------------------------------------------------------------------------------


@cli.command()
@setting_options("producer", "layout", "node.planes", "security.key_file", "security.allow_dir",
                 "security.insecure", "trust", "fleet", "metrics.port")
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
@config_option
@click.pass_context
@friendly
def serve(ctx, ready_file, progress_json, config_file):
    """Run a producer: encode images, hold the outputs, serve them until interrupted."""
    from ectransport.demo.images import load_images
    from ectransport.node.common import Security
    from ectransport.node.producer import ProducerNode

    loaded = cli_settings(ctx, config_file)
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
    node = ProducerNode.from_settings(s, layout=layout, security=security)
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
                f"(planes: {', '.join(planes)}; CURVE {'off' if insecure else 'on'}; "
                f"admission: {s.trust.admission})"
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
@setting_options("security.server_key", "security.key_file", "security.insecure", "trust",
                 "layout", "node.planes", "consumer")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Write each fetched entry to OUT/<mm_hash>.bin.",
)
@config_option
@click.pass_context
@friendly
def fetch(ctx, address, mm_hashes, out, config_file):
    """Fetch entries by mm_hash from a producer at ADDRESS (HOST:PORT)."""
    from ectransport.control.keys import load_public
    from ectransport.node.common import Layout, Security
    from ectransport.node.consumer import ConsumerNode, ProducerAddress

    loaded = cli_settings(ctx, config_file)
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
    with ConsumerNode.from_settings(s, layout=layout, security=security) as node:
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

