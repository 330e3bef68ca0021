"""``ectransport demo``: producer and consumer as two OS processes on loopback, end to end.

The producer is ``ectransport serve`` in a child process (it encodes the images and serves them);
this process is the consumer. CURVE is on: the demo creates a key pair for each node in a temporary
directory and allow-lists only the consumer's public key on the producer.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console, JustifyMethod
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ectransport.errors import ConfigError, PlaneUnavailable
from ectransport.settings_schema import CLI, Settings, TrustSettings

PRODUCER_START_TIMEOUT_S = CLI.demo.producer_start_timeout_s


def _check_planes(planes: tuple[str, ...]) -> None:
    from ectransport.data.registry import load_plane

    for name in planes:
        ok, why = load_plane(name).probe()
        if not ok:
            raise PlaneUnavailable(f"data plane {name!r} cannot run here: {why}")


def _reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def run_demo(*, images: Path | None, hidden: int, dtype: str, seed: int, repeats: int,
             planes: tuple[str, ...], insecure: bool, json_out: Path | None,
             config_file: Path | None = None, settings: Settings | None = None,
             start_timeout_s: float = PRODUCER_START_TIMEOUT_S,
             stop_timeout_s: float = CLI.demo.producer_stop_timeout_s,
             certificates: bool = False) -> bool:
    """Run the demo; returns True when every item was fetched and verified bit for bit.

    ``config_file`` is passed on to the producer (``serve --config``); ``settings`` are the
    consumer's (timeouts, plane and control options; default: the CLI's defaults).
    ``certificates``: admit by certificates of a throwaway deployment CA (fleet trust) instead
    of an allow-list; the producer binds as configured, with no allow-list at all."""
    from ectransport.cli.reference import demo_layout
    from ectransport.control.keys import allow_key, generate_keypair
    from ectransport.demo.images import bundled_images_dir, load_images
    from ectransport.node.common import Security
    from ectransport.node.consumer import ConsumerNode, ProducerAddress

    console = Console(width=None if sys.stdout.isatty() else 120)
    items = {it.mm_hash: it for it in load_images(images)}  # fails fast with a one-line error
    _check_planes(planes)
    encoder, layout = demo_layout(hidden, dtype, seed)
    image_arg = str((images or bundled_images_dir()).resolve())

    with tempfile.TemporaryDirectory(prefix="ectransport-demo-") as tmp:
        tmpd = Path(tmp)
        cmd = [sys.executable, "-m", "ectransport.cli", "serve", "--port", "0", "--progress-json",
               "--images", image_arg, "--hidden", str(hidden), "--dtype", dtype,
               "--seed", str(seed)]  # the region: serve's own ([producer] region_bytes, 1 GiB)
        for p in planes:
            cmd += ["--plane", p]
        if config_file is not None:
            cmd += ["--config", str(Path(config_file).resolve())]
        if insecure:
            cmd.append("--insecure")
            security = Security(insecure=True)
        else:
            generate_keypair(tmpd / "keys", "producer")
            generate_keypair(tmpd / "keys", "consumer")
            cmd += ["--key", str(tmpd / "keys" / "producer.key_secret")]
            if certificates:
                trust = _demo_ca(tmpd)
                cmd += _trust_flags(trust, tmpd / "keys" / "producer.cert")
                settings = msgspec.structs.replace(settings or CLI, trust=msgspec.structs.replace(
                    trust, cert_file=str(tmpd / "keys" / "consumer.cert")))
            else:
                allow_key(tmpd / "allow", tmpd / "keys" / "consumer.key")
                cmd += ["--allow-dir", str(tmpd / "allow")]
            security = Security.from_files(str(tmpd / "keys" / "consumer.key_secret"))
        errlog = open(tmpd / "producer.stderr", "w+")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errlog, text=True)
        try:
            info = _wait_ready(proc, errlog, len(items), console, start_timeout_s)
            return _consume(console, info, items, encoder, layout, security, planes, repeats,
                            "OFF (--insecure)" if insecure else "on, consumer admitted by its "
                            "certificate" if certificates else "on, consumer key allow-listed",
                            proc.pid, json_out, ConsumerNode, ProducerAddress, settings)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            errlog.close()


def _demo_ca(tmpd: Path) -> TrustSettings:
    """A throwaway CA in ``tmpd/ca`` and certificates for ``tmpd/keys/{producer,consumer}``;
    the ``[trust]`` both nodes use (without ``cert_file``)."""
    from ectransport.control.keys import load_public
    from ectransport.trust.files import init_ca, write_cert

    now = int(time.time())
    ca, paths = init_ca(tmpd / "ca", None, now=now)
    for name in ("producer", "consumer"):
        write_cert(tmpd / "keys" / f"{name}.cert", ca.issue(
            curve_key=load_public(tmpd / "keys" / f"{name}.key"), role=name, name=f"demo-{name}",
            not_before=now - 60, not_after=now + 86400))
    return TrustSettings(trust_ca=(str(paths.public),), revocation_file=(str(paths.revocations),),
                         admission="certificate")


def _trust_flags(trust: TrustSettings, cert: Path) -> list[str]:
    return ["--trust-ca", trust.trust_ca[0], "--revocation-file", trust.revocation_file[0],
            "--cert", str(cert), "--admission", trust.admission]


def _wait_ready(proc: subprocess.Popen, errlog, n: int, console: Console,
                timeout_s: float = PRODUCER_START_TIMEOUT_S) -> dict:
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task(f"producer (pid {proc.pid}) encoding images", total=n)
        while time.monotonic() < deadline:
            try:
                line = q.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                errlog.seek(0)
                last = [ln for ln in errlog.read().splitlines() if ln.strip()]
                raise ConfigError("producer exited before serving: "
                                  + (last[-1] if last else f"exit code {proc.wait()}"))
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "encoded" in msg:
                progress.update(task, completed=msg["encoded"])
            elif "ready" in msg:
                return msg["ready"]
    raise ConfigError(f"producer not ready within {timeout_s:.0f} s")


def _consume(console, info, items, encoder, layout, security, planes, repeats, auth, pid,
             json_out, ConsumerNode, ProducerAddress, settings=None) -> bool:
    addr = ProducerAddress(info["host"], info["port"], info.get("public_key"))
    console.print(f"producer: pid {pid} on {addr.host}:{addr.port}, CURVE {auth}, "
                  f"planes {', '.join(info['planes'])} "
                  f"({'; '.join(f'{k}: {v}' for k, v in info.get('transports', {}).items())})")
    n = len(info["items"])
    console.print(f"consumer: pid {os.getpid()}, {n} item{'s' * (n != 1)} x {repeats} "
                  f"fetch{'es' * (repeats != 1)}; recomputing each item locally to verify")
    rows, all_ok = [], True
    s = settings if settings is not None else CLI
    s = msgspec.structs.replace(s, node=msgspec.structs.replace(s.node, planes=tuple(planes)))
    with ConsumerNode.from_settings(s, layout=layout, security=security) as node, Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console, transient=True,
            disable=not console.is_terminal) as progress:
        task = progress.add_task("fetching and verifying", total=len(info["items"]) * repeats)
        for d in info["items"]:
            item = items[d["mm_hash"]]
            t0 = time.perf_counter()
            ref = encoder.encode(item.data)
            recompute_s = time.perf_counter() - t0
            ref_bytes = ref.contiguous().reshape(-1).view(__import__("torch").uint8).numpy()
            times, verified, miss = [], True, None
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = node.fetch(addr, d["mm_hash"])
                dt = time.perf_counter() - t0
                progress.advance(task)
                if not r.ok:
                    miss, verified = r, False
                    break
                times.append(dt)
                verified &= bool(np.array_equal(r.data, ref_bytes))
                plane = r.plane
                del r  # return the landing blocks to the consumer's region
            all_ok &= verified
            rows.append({
                "item": item.name, "mm_hash": d["mm_hash"], "tokens": d["tokens"],
                "bytes": d["nbytes"], "first_ms": times[0] * 1e3 if times else None,
                "fetch_p50_ms": statistics.median(times[1:] or times) * 1e3 if times else None,
                "recompute_ms": recompute_s * 1e3, "verified": verified,
                "plane": plane if times else None,
                "miss": f"{miss.reason.value}: {miss.detail}" if miss else None,
            })
    _print_table(console, rows, repeats)
    if json_out is not None:
        json_out.write_text(json.dumps({"rows": rows, "producer": info}, indent=2))
    return all_ok


def _print_table(console: Console, rows: list[dict], repeats: int) -> None:
    t = Table(title=f"ectransport demo: fetch vs local recompute ({repeats} fetches per item)")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("item", "left"), ("tokens", "right"), ("bytes", "right"), ("first fetch ms", "right"),
        ("fetch p50 ms", "right"), ("GB/s", "right"), ("recompute ms", "right"),
        ("speed-up", "right"), ("verified", "center"))
    for col, just in columns:
        t.add_column(col, justify=just)
    for r in rows:
        if r["fetch_p50_ms"] is None:
            t.add_row(r["item"], str(r["tokens"]), f"{r['bytes']:,}", "-", "-", "-",
                      f"{r['recompute_ms']:.1f}", "-", f"[red]MISS[/red] {r['miss']}")
            continue
        gbs = r["bytes"] / (r["fetch_p50_ms"] / 1e3) / 1e9
        t.add_row(r["item"], str(r["tokens"]), f"{r['bytes']:,}", f"{r['first_ms']:.2f}",
                  f"{r['fetch_p50_ms']:.2f}", f"{gbs:.2f}", f"{r['recompute_ms']:.1f}",
                  f"{r['recompute_ms'] / r['fetch_p50_ms']:.0f}x",
                  "[green]yes[/green]" if r["verified"] else "[red]NO[/red]")
    console.print(t)
    ok = sum(r["verified"] for r in rows)
    note = (" fetch p50 excludes the first fetch (connection and data-plane set-up)."
            if repeats > 1 else " one fetch per item: p50 is that first fetch (with set-up costs).")
    console.print(f"{ok}/{len(rows)} items fetched and verified bit-identical to a local recompute."
                  + note)
