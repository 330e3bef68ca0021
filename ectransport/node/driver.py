"""What both drivers share: the parts they are given (:class:`Parts`: control connection, data
planes, region), the observer list, and closing everything in the right order.

A driver is the sans-thread core of a node (STYLE.md §7: control and planes are passed in, never
built inside): it owns no thread, and its ``step(now)`` does one bounded round of work. A node
*has* a driver and runs it on one I/O thread; tests step a driver themselves with a clock of
their own. The nodes build the default control plane (ZeroMQ + CURVE) and the planes
(:func:`load_planes`) from their settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ectransport.control.base import ControlClient, ControlServer
from ectransport.data.base import DataTransport, identity_of
from ectransport.data.registry import load_plane
from ectransport.store import BlockRegion

log = logging.getLogger("ectransport.node")

Observer = Callable[[str, dict[str, Any]], None]
C = TypeVar("C", ControlClient, ControlServer)
#: ``(plane name, plane class, options) -> options``: adjusts one plane's constructor options.
OptionHook = Callable[[str, type[DataTransport], dict[str, Any]], dict[str, Any]]


def load_planes(names: tuple[str, ...], *, node_id: str, region: BlockRegion,
                public_key: str | None,
                plane_options: Mapping[str, Mapping[str, Any]] | None = None,
                adjust: OptionHook | None = None,
                loader: Callable[[str], type[DataTransport]] = load_plane,
                ) -> dict[str, DataTransport]:
    """Construct the named data planes over ``region``, in order (best first); ``loader`` maps a
    name to its plane class (default: the entry-point registry).

    If one fails, those already built are closed before the error propagates.

    Raises:
        PlaneUnavailable: a plane cannot run here; ConfigError: bad options.
    """
    planes: dict[str, DataTransport] = {}
    try:
        for name in names:
            cls = loader(name)
            opts = dict((plane_options or {}).get(name, {}))
            if adjust is not None:
                opts = adjust(name, cls, opts)
            planes[name] = cls(node_id=node_id, region=region, identity=identity_of(public_key),
                               **opts)
    except BaseException:
        for p in planes.values():
            p.close()
        raise
    return planes


class Observers:
    """The observer list of a node: added from any thread (copy on write), called on the driving
    thread; one that raises is logged and ignored."""

    def __init__(self, first: Observer | None = None):
        self._list: tuple[Observer, ...] = (first,) if first is not None else ()

    def add(self, observer: Observer) -> None:
        self._list = (*self._list, observer)

    def __bool__(self) -> bool:
        return bool(self._list)

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        for obs in self._list:
            try:
                obs(event, fields)
            except Exception:
                log.exception("observer failed on %s (ignored)", event)


@dataclass
class Parts(Generic[C]):
    """What a driver is given and closes: the control connection (client or server), the data
    planes by name (best first) and the region (closed only if ``own_region``: the node made it).
    """

    control: C
    planes: dict[str, DataTransport]
    region: BlockRegion
    own_region: bool

    def plane_transports(self) -> dict[str, str]:
        """Plane name → what it runs on underneath (e.g. the UCX transports)."""
        return {n: p.describe_transport() for n, p in self.planes.items()}

    def close(self) -> None:
        close_all(self.control, self.planes, self.region if self.own_region else None)


def close_all(control: ControlClient | ControlServer | None, planes: dict[str, DataTransport],
              region: BlockRegion | None) -> None:
    """Close what a node built (also after a failed constructor: any part may be missing)."""
    if control is not None:
        control.close()
    for p in planes.values():
        p.close()
    planes.clear()
    if region is not None:
        region.close()
