"""Subcommands that manage rather than move: ``keys``, ``planes``, ``config show``, ``doctor``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ectransport.cli.app import cli, friendly
from ectransport.cli.options import cli_settings, config_option

# -- keys ----------------------------------------------------------------------------------------


@cli.group()
def keys():
    """Manage CurveZMQ key pairs and allow-lists (zcert format, usable by other ZeroMQ tools),
    and fleet trust: a deployment CA, node certificates, revocation lists."""


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
@click.option("--ca", "ca_files", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="For a certificate or revocation list: check it against this CA public key "
                   "file (repeat the option for several CAs); exit 1 if it does not verify.")
@click.option("--revocations", "revocation_files", multiple=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="For a certificate: also check it against these revocation list files.")
@friendly
def keys_show(key_file, ca_files, revocation_files):
    """Print the public key of a key file (public or secret); for a node certificate its
    name, role, key, serial and validity (and, with --ca, whether it verifies); for a
    revocation list or a CA public key file what it holds."""
    from ectransport.cli.trust_show import show_trust_file
    from ectransport.control.keys import load_public

    shown = show_trust_file(key_file, ca_files, revocation_files)
    if shown is None:
        click.echo(load_public(key_file))
    elif not shown:
        raise SystemExit(1)


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
    """Allow a consumer: PUBKEY is a Z85 public key or a public key file.

    A Z85 key may begin with '-' (and contains shell metacharacters): pass a key file, or put
    `--` before the key (`ectransport keys allow --dir DIR -- KEY`)."""
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

    from ectransport.data.base import plane_halves
    from ectransport.data.registry import declared_api_version, discover, try_load

    table = Table(title="data planes")
    for col in ("name", "from", "api", "model", "memory", "notifications", "usable here"):
        table.add_column(col)
    for name, info in sorted(discover().items()):
        cls = try_load(name)
        if cls is None:
            table.add_row(name, info.dist, "?", "?", "?", "?", "[red]no: failed to load[/red]")
            continue
        # the plugin API the plane declares (2: through the registry's adapter) and its halves
        halves = plane_halves(cls)
        ok, why = cls.probe()
        caps = cls.capabilities
        table.add_row(
            name,
            info.dist + (f" (shadows {', '.join(info.shadowed)})" if info.shadowed else ""),
            f"{declared_api_version(cls)} {'both' if len(halves) == 2 else halves[0]}",
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

    click.echo(render(cli_settings(ctx, config_file)), nl=False)


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

    settings = cli_settings(ctx, config_file).settings
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
