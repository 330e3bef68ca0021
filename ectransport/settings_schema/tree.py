"""The whole tree of settings (:class:`Settings`) and what the generators walk: its leaves,
each front end's defaults and the deliberate differences between them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import inspect as mi

from ectransport.settings_schema.fields import FRONT_ENDS, Differs, FrontEnd, Section
from ectransport.settings_schema.fleet import FleetSettings
from ectransport.settings_schema.nodes import (
    ConsumerSettings,
    LayoutSettings,
    NodeSettings,
    ProducerSettings,
    SecuritySettings,
    TrustSettings,
)
from ectransport.settings_schema.runtime import (
    ControlSettings,
    DemoSettings,
    LogSettings,
    MetricsSettings,
    PlanesSettings,
)
from ectransport.settings_schema.vllm import VllmSettings


class Settings(Section, frozen=True):
    """Everything configurable, by section (``[producer]``, ``[control.server]``, ...).

    ``Settings()`` holds the Python API's defaults; :func:`defaults` those of another front end.
    """

    layout: LayoutSettings = msgspec.field(default_factory=LayoutSettings)
    node: NodeSettings = msgspec.field(default_factory=NodeSettings)
    security: SecuritySettings = msgspec.field(default_factory=SecuritySettings)
    trust: TrustSettings = msgspec.field(default_factory=TrustSettings)
    producer: ProducerSettings = msgspec.field(default_factory=ProducerSettings)
    consumer: ConsumerSettings = msgspec.field(default_factory=ConsumerSettings)
    control: ControlSettings = msgspec.field(default_factory=ControlSettings)
    planes: PlanesSettings = msgspec.field(default_factory=PlanesSettings)
    metrics: MetricsSettings = msgspec.field(default_factory=MetricsSettings)
    log: LogSettings = msgspec.field(default_factory=LogSettings)
    demo: DemoSettings = msgspec.field(default_factory=DemoSettings)
    fleet: FleetSettings = msgspec.field(default_factory=FleetSettings)

    # -- what the nodes take ------------------------------------------------------------------
    def plane_options(self) -> dict[str, dict[str, Any]]:
        """Plane name → constructor options (unset values left to the node/plane defaults)."""
        return self.planes.options()


# -- the leaves: what the generators walk ---------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """One setting: its dotted path, type (``msgspec.inspect``, constraints included, the
    description unwrapped), description, default (the Python API's) and per-front-end details."""

    path: tuple[str, ...]
    type: Any
    description: str
    default: Any
    extra: dict[str, Any]

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def key(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        """The CLI flag (``--lease-s``; the field may name another one)."""
        return str(self.extra.get("flag") or "--" + self.key.replace("_", "-"))

    @property
    def meaning(self) -> str:
        """The description without its leading role (``producer: ``, ```demo`: ``), for a
        place that already says the role (a command's ``--help``, the vLLM table)."""
        m = _ROLE_PREFIX.match(self.description)
        return self.description[m.end():] if m else self.description

    @property
    def is_path(self) -> bool:
        return bool(self.extra.get("path"))

    @property
    def optional(self) -> bool:
        return isinstance(self.type, mi.UnionType) and \
            any(isinstance(t, mi.NoneType) for t in self.type.types)

    @property
    def base(self) -> Any:
        """The type without ``None`` (``int`` for ``int | None``)."""
        return strip_none(self.type)

    @property
    def is_dict(self) -> bool:
        return isinstance(self.base, mi.DictType)

    @property
    def is_list(self) -> bool:
        return isinstance(self.base, (mi.ListType, mi.VarTupleType))

    @property
    def is_str(self) -> bool:
        return isinstance(self.base, (mi.StrType, mi.LiteralType))

    def differs(self, front_end: FrontEnd) -> Differs | None:
        """This front end's deliberate default and its reason, or None."""
        d = self.extra.get(front_end)
        return d if isinstance(d, Differs) else None

    def default_for(self, front_end: FrontEnd) -> Any:
        d = self.differs(front_end)
        return self.default if d is None else d.value


_ROLE_PREFIX = re.compile(r"(producer|consumer|`serve`|`demo`): ")


def strip_none(t: Any) -> Any:
    if isinstance(t, mi.UnionType):
        rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
        return rest[0] if len(rest) == 1 else t
    return t


def leaves(cls: type = Settings, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Leaf]:
    """Every setting of ``cls`` (a section Struct), by path, in declaration order."""
    out: dict[tuple[str, ...], Leaf] = {}
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType), cls  # Settings and its sections are all Structs
    for f in info.fields:
        t, desc, extra = f.type, "", {}
        if isinstance(t, mi.Metadata):
            desc = (t.extra_json_schema or {}).get("description", "")
            extra = dict(t.extra or {})
            t = t.type
        path = (*prefix, f.name)
        if isinstance(t, mi.StructType):
            out.update(leaves(t.cls, path))
        else:
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            out[path] = Leaf(path, t, desc, default, extra)
    return out


#: Every setting of :class:`Settings`, by path.
LEAVES: dict[tuple[str, ...], Leaf] = leaves()
#: Every ECTransportConnector-only setting, by path (``("vllm", key)``).
VLLM_LEAVES: dict[tuple[str, ...], Leaf] = leaves(VllmSettings, ("vllm",))
#: Every deliberate difference: (front end, setting, its default there, the reason).
DIFFERENCES: tuple[tuple[FrontEnd, str, Any, str], ...] = tuple(
    (fe, leaf.name, d.value, d.reason)
    for leaf in LEAVES.values() for fe in FRONT_ENDS if (d := leaf.differs(fe)) is not None)


def replace_path(root: Any, path: tuple[str, ...], value: Any) -> Any:
    """``root`` (a frozen Struct) with the field at ``path`` set to ``value``."""
    if len(path) == 1:
        return msgspec.structs.replace(root, **{path[0]: value})
    return msgspec.structs.replace(
        root, **{path[0]: replace_path(getattr(root, path[0]), path[1:], value)})


def defaults(front_end: FrontEnd = "api") -> Settings:
    """The defaults of a front end: the fields' own, with that front end's differences."""
    s = Settings()
    for fe, name, value, _reason in DIFFERENCES:
        if fe == front_end:
            s = replace_path(s, tuple(name.split(".")), value)
    return s


#: The Python API's defaults: ``ProducerNode(lease_s=API.producer.lease_s, ...)``.
API: Settings = defaults("api")
#: The ``ectransport`` commands' and ``load_settings``' defaults.
CLI: Settings = defaults("cli")
#: ECTransportConnector's defaults for the keys it shares with :class:`Settings`.
VLLM: Settings = defaults("vllm")
