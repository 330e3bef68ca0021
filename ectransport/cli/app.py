"""The ``ectransport`` click group and what every subcommand shares (``friendly``).

A leaf of the CLI package: it imports no subcommand module. Each subcommand module
(``commands``, ``admin``, ``bench``) imports :data:`cli` from here and adds its commands to it;
:mod:`ectransport.cli.main` imports those modules by name, so which commands exist is written
down in one place, not left to whichever module happened to be imported first.

Settings come from defaults < ``--config FILE`` (TOML; default ``$ECTRANSPORT_CONFIG``) <
``ECTRANSPORT_SECTION__KEY`` environment variables < the flags typed (see ``ectransport.config``).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import click

from ectransport import __version__
from ectransport.cli.options import help_text, option
from ectransport.errors import ECTransportError
from ectransport.settings_schema import LEAVES

#: Exit status of an expected failure (one ``error:`` line on stderr, no traceback).
EXIT_ERROR = 2


def friendly(fn):
    """Turn expected errors into one line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except ECTransportError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(EXIT_ERROR)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def _log_option(key: str) -> Any:
    """A group-level ``[log]`` flag: unset unless typed (the file/environment may say)."""
    leaf = LEAVES["log", key]
    return option(leaf, default=None, show_default=False,
                  help=f"{help_text(leaf)} [default: {leaf.default}, or [log] {key}].")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="ectransport")
@_log_option("level")
@_log_option("format")
@click.option("--config", "config_file", default=None, type=click.Path(path_type=Path),
              help="TOML settings file for every subcommand (see `ectransport config show`); "
                   "default $ECTRANSPORT_CONFIG.")
@click.pass_context
def cli(ctx: click.Context, config_file: Path | None, **flags: str | None) -> None:
    """Move multimodal encoder-cache entries (vision/audio encoder outputs keyed by mm_hash)
    peer to peer between LLM-serving instances: a ZeroMQ control plane authenticated with
    CurveZMQ, and a data plane (NIXL by default).

    Start with `ectransport demo`: it runs a producer and a consumer as two processes on this
    machine and shows each fetched item verified bit for bit against a local recompute.
    """
    from ectransport.metrics.logs import configure_logging

    log_level, log_format = flags["setting__log__level"], flags["setting__log__format"]
    ctx.obj = {"config": config_file, "log_level": log_level.upper() if log_level else None,
               "log_format": log_format}
    level, fmt = log_level, log_format
    if level is None or fmt is None:  # the file/environment may say; a broken file is reported
        try:                          # by the subcommand that reads the settings
            from ectransport.config import load_settings

            log = load_settings(config_file).settings.log
            level, fmt = level or log.level, fmt or log.format
        except ECTransportError:
            pass
    configure_logging(level or "WARNING", fmt or "text")
