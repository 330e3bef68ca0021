"""Plane constructor options: the checks every plane makes, and the socket/thread bounds that the
request-serving planes (TCP, the shm plugin) share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ectransport.errors import ConfigError
from ectransport.settings_schema import API


def reject_unknown(what: str, options: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise ConfigError naming every option of ``options`` that is not in ``known``.

    ``what`` is the plane's name as messages say it (``"tcp plane"``).
    """
    known = set(known)
    unknown = set(options) - known
    if unknown:
        raise ConfigError(f"unknown {what} option(s) {sorted(unknown)}; "
                          f"expected some of {sorted(known)}")


#: Defaults of :class:`ServingOptions` (the schema's ``[planes.tcp]`` section), merged into each
#: serving plane's option table.
SERVING_DEFAULTS: dict[str, Any] = {
    k: getattr(API.planes.tcp, k)
    for k in ("connect_timeout_s", "io_timeout_s", "idle_timeout_s", "max_connections",
              "max_inflight", "max_idle_per_peer")
}


@dataclass(frozen=True)
class ServingOptions:
    """Timeouts (seconds) and bounds of a request-serving plane."""

    connect_timeout_s: float
    io_timeout_s: float
    idle_timeout_s: float
    max_connections: int
    max_inflight: int
    max_idle_per_peer: int

    @classmethod
    def parse(cls, opts: Mapping[str, Any]) -> ServingOptions:
        """Convert the six options of ``opts``; TypeError/ValueError for the caller to report."""
        return cls(
            connect_timeout_s=float(opts["connect_timeout_s"]),
            io_timeout_s=float(opts["io_timeout_s"]),
            idle_timeout_s=float(opts["idle_timeout_s"]),
            max_connections=int(opts["max_connections"]),
            max_inflight=int(opts["max_inflight"]),
            max_idle_per_peer=int(opts["max_idle_per_peer"]),
        )

    def check(self, what: str) -> None:
        """Raises ConfigError unless timeouts and max_connections/max_inflight are > 0 and
        max_idle_per_peer >= 0."""
        if min(self.connect_timeout_s, self.io_timeout_s, self.idle_timeout_s) <= 0 or min(
                self.max_connections, self.max_inflight) <= 0 or self.max_idle_per_peer < 0:
            raise ConfigError(f"{what} timeouts and max_connections/max_inflight must be > 0")
