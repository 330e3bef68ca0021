"""Discovery of data planes through the ``ectransport.data_planes`` entry-point group.

Each entry point maps a plane name to a *lazily imported* :class:`DataTransport` subclass; built-in
planes register the same way (in ``pyproject.toml``). Loading validates that the object implements
the contract and declares :data:`PLUGIN_API_VERSION` itself (:func:`check_plane`; a version inherited
from ``DataTransport``'s default says nothing about what the plane was written for); a broken plugin
is logged and skipped, never crashes discovery.

Collision rule: when two distributions register the same name, the built-in (distribution
``ectransport``) wins; among third parties the first in sorted distribution-name order wins, and the
others are reported as shadowed.

``ECTRANSPORT_PLANES`` (comma-separated names) restricts which planes may load.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from ectransport.data.base import PLUGIN_API_VERSION, DataTransport
from ectransport.errors import PlaneUnavailable

GROUP = "ectransport.data_planes"
ENV_FILTER = "ECTRANSPORT_PLANES"
log = logging.getLogger("ectransport.data.registry")


@dataclass(frozen=True)
class PlaneInfo:
    """A discovered plane: its entry point, the distribution that provides it, and shadowed ones."""

    name: str
    entry_point: EntryPoint
    dist: str
    shadowed: tuple[str, ...] = ()


def discover() -> dict[str, PlaneInfo]:
    """Name → :class:`PlaneInfo` of every registered plane allowed by ``ECTRANSPORT_PLANES``."""
    allowed = {n.strip() for n in os.environ.get(ENV_FILTER, "").split(",") if n.strip()}
    found: dict[str, list[tuple[str, EntryPoint]]] = {}
    for ep in entry_points(group=GROUP):
        if allowed and ep.name not in allowed:
            continue
        dist = ep.dist.name if ep.dist is not None else "?"
        found.setdefault(ep.name, []).append((dist, ep))
    out = {}
    for name, cands in found.items():
        uniq = {(d, ep.value): (d, ep) for d, ep in cands}  # editable installs may list twice
        ordered = sorted(uniq.values(), key=lambda c: (c[0] != "ectransport", c[0]))
        dist, ep = ordered[0]
        out[name] = PlaneInfo(name, ep, dist, tuple(d for d, _ in ordered[1:]))
    return out


def load_plane(name: str) -> type[DataTransport]:
    """Import and validate the plane class registered as ``name``.

    Raises:
        PlaneUnavailable: unknown name, import failure, not a DataTransport, or a plugin API
            version other than :data:`PLUGIN_API_VERSION`.
    """
    info = discover().get(name)
    if info is None:
        known = ", ".join(sorted(discover())) or "none"
        raise PlaneUnavailable(f"unknown data plane {name!r} (installed: {known})")
    try:
        cls = info.entry_point.load()
    except Exception as e:
        raise PlaneUnavailable(f"plane {name!r} from {info.dist} failed to import: {e}") from e
    check_plane(cls, f"plane {name!r} from {info.dist}")
    assert isinstance(cls, type) and issubclass(cls, DataTransport)  # check_plane made sure
    return cls


def declared_api_version(cls: type) -> object:
    """The ``plugin_api_version`` that ``cls`` or one of its bases other than
    :class:`DataTransport` declares; None if only ``DataTransport``'s default applies."""
    for klass in cls.__mro__:
        if klass is DataTransport:
            return None
        if "plugin_api_version" in vars(klass):
            return vars(klass)["plugin_api_version"]
    return None


def check_plane(cls: object, what: str) -> None:
    """What the registry requires of a plane class before loading it (the conformance kit checks
    the same): a :class:`DataTransport` subclass that declares ``plugin_api_version`` equal to
    :data:`PLUGIN_API_VERSION`. ``what`` names the plane in the message.

    Raises:
        PlaneUnavailable: not a DataTransport subclass, no version declared, or another version.
    """
    if not (isinstance(cls, type) and issubclass(cls, DataTransport)):
        raise PlaneUnavailable(f"{what} is not a DataTransport subclass")
    version = declared_api_version(cls)
    if version is None:
        raise PlaneUnavailable(
            f"{what} declares no plugin_api_version (set plugin_api_version = "
            f"ectransport.plugin.PLUGIN_API_VERSION in the class, once it implements that API)")
    if version != PLUGIN_API_VERSION:
        raise PlaneUnavailable(f"{what} implements plugin API {version!r}, ectransport needs "
                               f"{PLUGIN_API_VERSION}")


def try_load(name: str) -> type[DataTransport] | None:
    """:func:`load_plane`, logging and returning None on failure (discovery never crashes)."""
    try:
        return load_plane(name)
    except PlaneUnavailable as e:
        log.warning("skipping data plane: %s", e)
        return None
