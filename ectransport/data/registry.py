"""Discovery of data planes through the ``ectransport.data_planes`` entry-point group.

Each entry point maps a plane name to a *lazily imported* plane class; built-in planes register
the same way (in ``pyproject.toml``). Loading validates the class (:func:`accept`): a
:class:`~ectransport.data.base.ServingPlane`, :class:`~ectransport.data.base.FetchingPlane` or
both (:class:`~ectransport.data.base.DataTransport`), declaring a plugin API version itself (one
inherited from the contract's classes says nothing about what the plane was written for):

* :data:`~ectransport.data.base.PLUGIN_API_VERSION` (3): loaded as declared, one half or both;
* 2, through the **API-2 adapter**: API 2 knew one class with both halves, ``DataTransport``,
  whose methods API 3 kept with their signatures and meanings, so an API-2 plane is used as it is,
  as a plane with both halves; the adapter checks that it is a ``DataTransport`` and says so in
  the log;
* anything else is refused.

Each load logs (INFO) the API a plane declares and its halves. A broken plugin is logged and
skipped by :func:`try_load`, never crashes discovery. A caller says which halves it needs
(:func:`load_plane`: both; :func:`load_serving_plane`, :func:`load_fetching_plane`: one) and gets
a clear refusal for a plane without them.

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

from ectransport.data.base import (
    CONTRACT_CLASSES,
    PLUGIN_API_VERSION,
    SUPPORTED_API_VERSIONS,
    DataTransport,
    FetchingPlane,
    PlaneBase,
    ServingPlane,
    plane_halves,
)
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


def _load(name: str) -> tuple[type[PlaneBase], str]:
    """The validated class registered as ``name`` (:func:`accept`), and how messages name it."""
    info = discover().get(name)
    if info is None:
        known = ", ".join(sorted(discover())) or "none"
        raise PlaneUnavailable(f"unknown data plane {name!r} (installed: {known})")
    what = f"plane {name!r} from {info.dist}"
    try:
        loaded = info.entry_point.load()
    except Exception as e:
        raise PlaneUnavailable(f"{what} failed to import: {e}") from e
    return accept(loaded, what), what


def _lacks(what: str, cls: type, needed: str) -> PlaneUnavailable:
    return PlaneUnavailable(f"{what} has the {describe_halves(cls)} only; this node needs its "
                            f"{needed}")


def load_plane(name: str) -> type[DataTransport]:
    """Import and validate (:func:`accept`) the plane class registered as ``name``; it must have
    both halves (a :class:`DataTransport`). A producer that needs only the serving half uses
    :func:`load_serving_plane`, a consumer :func:`load_fetching_plane`.

    Raises:
        PlaneUnavailable: unknown name, import failure, not a plane, a plugin API version not in
            :data:`SUPPORTED_API_VERSIONS`, or a plane with one half only.
    """
    cls, what = _load(name)
    if not issubclass(cls, DataTransport):
        raise _lacks(what, cls, "serving and fetching halves (DataTransport)")
    return cls


def load_serving_plane(name: str) -> type[ServingPlane]:
    """:func:`load_plane` for a producer: the plane must have the serving half.

    Raises:
        PlaneUnavailable: as :func:`load_plane`, or a plane without the serving half.
    """
    cls, what = _load(name)
    if not issubclass(cls, ServingPlane):
        raise _lacks(what, cls, "serving half (ServingPlane)")
    return cls


def load_fetching_plane(name: str) -> type[FetchingPlane]:
    """:func:`load_plane` for a consumer: the plane must have the fetching half.

    Raises:
        PlaneUnavailable: as :func:`load_plane`, or a plane without the fetching half.
    """
    cls, what = _load(name)
    if not issubclass(cls, FetchingPlane):
        raise _lacks(what, cls, "fetching half (FetchingPlane)")
    return cls


def declared_api_version(cls: type) -> object:
    """The ``plugin_api_version`` that ``cls`` or one of its bases other than the contract's own
    classes (:data:`~ectransport.data.base.CONTRACT_CLASSES`) declares; None if only the
    contract's default applies."""
    for klass in cls.__mro__:
        if klass not in CONTRACT_CLASSES and "plugin_api_version" in vars(klass):
            return vars(klass)["plugin_api_version"]
    return None


def describe_halves(cls: type | object) -> str:
    """``"serving and fetching halves"``, ``"serving half"`` or ``"fetching half"``."""
    halves = plane_halves(cls)
    if len(halves) == 2:
        return "serving and fetching halves"
    return "serving half" if halves == ("serve",) else "fetching half" if halves else "no half"


def check_plane(cls: object, what: str) -> int:
    """What the registry requires of a plane class before loading it (the conformance kit checks
    the same); the plugin API version it declares. ``what`` names the plane in messages.

    * API 3 (:data:`PLUGIN_API_VERSION`): a :class:`ServingPlane`, a :class:`FetchingPlane` or
      both;
    * API 2: a :class:`DataTransport` (API 2 had no halves; it is loaded with both);
    * a plane with both halves derives from :class:`DataTransport`.

    Raises:
        PlaneUnavailable: not a plane class, no version declared, an unsupported version, an
            API-2 plane that is not a DataTransport, or both halves without DataTransport.
    """
    if not (isinstance(cls, type) and issubclass(cls, PlaneBase) and plane_halves(cls)):
        raise PlaneUnavailable(f"{what} is not a data plane (a ServingPlane, FetchingPlane or "
                               f"DataTransport subclass)")
    version = declared_api_version(cls)
    if version is None:
        raise PlaneUnavailable(
            f"{what} declares no plugin_api_version (set plugin_api_version = "
            f"ectransport.plugin.PLUGIN_API_VERSION in the class, once it implements that API)")
    if version not in SUPPORTED_API_VERSIONS or not isinstance(version, int):
        raise PlaneUnavailable(f"{what} implements plugin API {version!r}, ectransport loads "
                               f"{' and '.join(map(str, SUPPORTED_API_VERSIONS))}")
    if len(plane_halves(cls)) == 2 and not issubclass(cls, DataTransport):
        raise PlaneUnavailable(f"{what} derives from ServingPlane and FetchingPlane: a plane with "
                               f"both halves derives from DataTransport")
    if version == 2 and not issubclass(cls, DataTransport):
        raise PlaneUnavailable(f"{what} declares plugin API 2 but has the {describe_halves(cls)} "
                               f"only: API 2 planes are DataTransports (both halves); a plane with "
                               f"one half declares API {PLUGIN_API_VERSION}")
    return version


def accept(cls: object, what: str) -> type[PlaneBase]:
    """:func:`check_plane`, then the class as the runtime uses it, logging its API and halves:
    an API-3 plane as it is; an API-2 plane through the adapter (as it is, too: a DataTransport
    has both halves with API 2's methods; only the log line differs).

    Raises:
        PlaneUnavailable: see :func:`check_plane`.
    """
    version = check_plane(cls, what)
    assert isinstance(cls, type) and issubclass(cls, PlaneBase)  # check_plane made sure
    if version == PLUGIN_API_VERSION:
        log.info("%s: plugin API %d, %s", what, version, describe_halves(cls))
    else:
        log.info("%s: plugin API %d, loaded through the API-2 adapter as a plane with serving "
                 "and fetching halves (DataTransport); declare plugin_api_version = "
                 "PLUGIN_API_VERSION (%d) once it is checked against API %d", what, version,
                 PLUGIN_API_VERSION, PLUGIN_API_VERSION)
    return cls


def try_load(name: str) -> type[PlaneBase] | None:
    """The validated class registered as ``name``, with whichever halves it has (for listings),
    logging and returning None on failure (discovery never crashes)."""
    try:
        return _load(name)[0]
    except PlaneUnavailable as e:
        log.warning("skipping data plane: %s", e)
        return None
