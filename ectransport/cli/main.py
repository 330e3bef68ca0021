"""The ``ectransport`` command line: the group (:mod:`ectransport.cli.app`) with every
subcommand module imported here, by name.

Subcommands: ``demo`` (the main job: producer and consumer as two processes), ``serve`` and
``fetch`` (the two halves on different machines; :mod:`~ectransport.cli.commands`), ``keys``
(CURVE key management; ``keys ca``, ``issue`` and ``revoke`` are in :mod:`~ectransport.cli.certs`),
``planes`` (installed data planes), ``config show`` (the effective settings), ``doctor`` (what
this machine offers; :mod:`~ectransport.cli.admin`), ``bench``
(:mod:`~ectransport.cli.bench`), ``fleet status|who-has`` (the fleet directory;
:mod:`~ectransport.cli.fleet`). Every expected failure prints one ``error:`` line and exits
non-zero.
"""

from __future__ import annotations

from ectransport.cli import admin, bench, certs, commands, fleet
from ectransport.cli.app import EXIT_ERROR, cli, friendly

__all__ = ["EXIT_ERROR", "SUBCOMMAND_MODULES", "cli", "friendly", "main"]

#: The modules whose commands :data:`cli` carries (each adds its own when imported).
SUBCOMMAND_MODULES = (commands, admin, certs, bench, fleet)


def main() -> None:
    """The ``ectransport`` console script."""
    cli(prog_name="ectransport")


if __name__ == "__main__":  # pragma: no cover
    main()
