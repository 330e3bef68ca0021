"""The ``ectransport`` command line.

Subcommands: ``demo`` (the main job: producer and consumer as two processes), ``serve`` and
``fetch`` (the two halves on different machines), ``keys`` (CURVE key management), ``planes``
(installed data planes). Every expected failure prints one ``error:`` line and exits non-zero.
"""

from __future__ import annotations

import functools
import logging
import sys

import click

from ectransport import __version__
from ectransport.errors import ECTransportError

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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="ectransport")
@click.option("--log-level", default="WARNING", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Logging level for ectransport's own loggers.")
def cli(log_level: str) -> None:
    """Move multimodal encoder-cache entries (vision/audio encoder outputs keyed by mm_hash)
    peer to peer between LLM-serving instances: a ZeroMQ control plane authenticated with
    CurveZMQ, and a data plane (NIXL by default).

    Start with `ectransport demo`: it runs a producer and a consumer as two processes on this
    machine and shows each fetched item verified bit for bit against a local recompute.
    """
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("nixl", "ucxx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, getattr(logging, log_level.upper())))


def main() -> None:
    from ectransport.cli import commands  # noqa: F401  (registers the subcommands)

    cli(prog_name="ectransport")


if __name__ == "__main__":  # pragma: no cover
    main()
