"""``ectransport fleet status`` and ``ectransport fleet who-has MM_HASH``: the fleet directory
(``docs/fleet.md``) as it is, for operators. Read-only.

The connection flags (``--redis-url``, ``--redis-cluster``, ``--redis-username``, ``--redis-password-file``, TLS,
``--fleet-namespace``, timeouts) come from the ``[fleet]`` settings section; an unreachable or
refusing Redis is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json

import click

from ectransport.cli.app import cli, friendly
from ectransport.cli.options import cli_settings, config_option, setting_options

#: the settings a fleet subcommand exposes as flags
CONNECTION = (
    "fleet.url",
    "fleet.cluster",
    "fleet.username",
    "fleet.password_file",
    "fleet.tls",
    "fleet.tls_ca_file",
    "fleet.tls_cert_file",
    "fleet.tls_key_file",
    "fleet.tls_check_hostname",
    "fleet.namespace",
    "fleet.op_timeout_s",
    "fleet.connect_timeout_s",
)


def _directory(ctx: click.Context, config_file):
    """A lookup-only Directory from the effective settings, checked (one PING)."""
    from ectransport.fleet import Directory, trust_any

    settings = cli_settings(ctx, config_file).settings.fleet
    d = Directory(settings, trusted=trust_any)
    try:
        info = d.check()
    except BaseException:
        d.close()
        raise
    return d, info


@cli.group()
def fleet():
    """Inspect the fleet-wide encoder-cache directory (Redis or Valkey; docs/fleet.md)."""


@fleet.command("status")
@setting_options(*CONNECTION)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
@config_option
@click.pass_context
@friendly
def fleet_status(ctx, as_json, config_file):
    """Instances (alive or lapsed, address, load, entries held) and the claims in flight."""
    from ectransport.fleet import status

    d, info = _directory(ctx, config_file)
    try:
        rows = status.instances(d)
        claims = status.claims(d)
    finally:
        d.close()
    if as_json:
        click.echo(
            json.dumps(
                {
                    "directory": {**info, "url": d.settings.url, "namespace": d.settings.namespace},
                    "instances": [dataclasses.asdict(r) for r in rows],
                    "claims": [dataclasses.asdict(c) for c in claims],
                }
            )
        )
        return
    alive = sum(1 for r in rows if r.alive)
    kind = " cluster" if info.get("cluster") else ""
    click.echo(
        f"directory: {info['server']} {info['version']}{kind} at {d.settings.url} "
        f"(namespace {d.settings.namespace}), round trip {info['rtt_s'] * 1e3:.2f} ms"
    )
    click.echo(f"instances: {alive} alive, {len(rows) - alive} lapsed")
    if rows:
        click.echo(
            _table(
                (
                    "instance",
                    "state",
                    "address",
                    "entries",
                    "load",
                    "roles",
                    "public key",
                    "liveness",
                ),
                [
                    (
                        r.instance,
                        "alive" if r.alive else "lapsed",
                        r.address,
                        str(r.entries),
                        f"{r.load:g}",
                        ",".join(r.roles),
                        r.public_key[:12] + ("… +cert" if r.has_cert else "…"),
                        _left(r.expires_in_s),
                    )
                    for r in rows
                ],
            )
        )
    click.echo(f"claims in flight: {len(claims)}")
    if claims:
        click.echo(
            _table(
                ("claim key", "claimed by", "expires in"),
                [(c.mm_hash_key, c.instance, f"{c.ttl_s:.1f} s") for c in claims],
            )
        )


@fleet.command("who-has")
@click.argument("mm_hash")
@setting_options(*CONNECTION)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
@config_option
@click.pass_context
@friendly
def fleet_who_has(ctx, mm_hash, as_json, config_file):
    """Every holder record of MM_HASH and what a lookup makes of it: "usable", or why it is
    dropped (dead, stale, mismatch, malformed, ...). Keys are not judged here: a consumer also
    drops holders its trust rule refuses."""
    from ectransport.fleet import status
    from ectransport.fleet.filter import Policy, trust_any

    d, _info = _directory(ctx, config_file)
    try:
        rows = status.who_has(
            d, mm_hash, Policy(trusted=trust_any, max_entry_bytes=d.settings.max_entry_bytes)
        )
    finally:
        d.close()
    if as_json:
        click.echo(
            json.dumps({"mm_hash": mm_hash, "holders": [dataclasses.asdict(r) for r in rows]})
        )
        return
    usable = sum(1 for r in rows if r.verdict == "usable")
    click.echo(f"{mm_hash}: {usable} usable holder(s) of {len(rows)} record(s)")
    if rows:
        click.echo(
            _table(
                ("instance", "verdict", "address", "bytes", "public key"),
                [
                    (
                        r.instance,
                        r.verdict,
                        r.address,
                        "" if r.nbytes is None else str(r.nbytes),
                        r.public_key[:12] + "…",
                    )
                    for r in rows
                ],
            )
        )


def _left(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s left" if seconds > 0 else f"lapsed {-seconds:.1f} s ago"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join("  " + ln for ln in lines)
