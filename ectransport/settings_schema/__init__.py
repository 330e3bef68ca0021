"""The settings schema: every timeout, budget, size and path of ectransport, declared once.

Each setting is one field of a frozen msgspec Struct of this package: its name (unit in the name: ``_s``
seconds, ``_bytes`` bytes), its type and range, its default and its description (unit again,
and meaning). Everything else is generated from these fields:

- the Python API's defaults: ``ProducerNode(lease_s=API.producer.lease_s, ...)`` — this module
  sits just above ``ectransport.protocol`` so that every layer may read it;
- ``ectransport.config``: the TOML file, the ``ECTRANSPORT_SECTION__KEY`` variables and
  ``ectransport config show`` (one key per field);
- ``ectransport.cli``: the flags of ``serve``, ``fetch``, ``demo`` (type, range, default, help);
- ``ectransport.vllm.settings``: the ``ec_connector_extra_config`` keys (public names mapped to
  fields here; the vLLM-only ones are :class:`VllmSettings`).

A front end that deliberately uses another default says so at the field, once, with the reason:
``doc(..., cli=Differs(1 << 30, "why"))``. :func:`defaults` applies them; :data:`DIFFERENCES`
lists them (``docs/configuration.md`` prints that list).

The sections live in one module per concern: :mod:`.fields` (value types, :func:`doc`,
:class:`Section`), :mod:`.nodes` (layout, node, security, trust, producer, consumer),
:mod:`.runtime` (control sockets, planes, metrics, logs, demo), :mod:`.fleet`, :mod:`.vllm`, and
:mod:`.tree` (:class:`Settings` and the leaves the generators walk). Import them from here.
"""

from ectransport.settings_schema.fields import (
    FRONT_ENDS,
    Differs,
    FrontEnd,
    GiB,
    MiB,
    NonNegInt,
    Port,
    PosInt,
    Seconds,
    Section,
    Text,
    checked,
    doc,
)
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
    ControlClientSettings,
    ControlServerSettings,
    ControlSettings,
    DemoSettings,
    LogSettings,
    MetricsSettings,
    NixlPlaneSettings,
    PlanesSettings,
    TcpPlaneSettings,
    UcxPlaneSettings,
)
from ectransport.settings_schema.tree import (
    API,
    CLI,
    DIFFERENCES,
    LEAVES,
    VLLM,
    VLLM_LEAVES,
    Leaf,
    Settings,
    defaults,
    leaves,
    replace_path,
    strip_none,
)
from ectransport.settings_schema.vllm import VllmSettings

__all__ = [
    "API", "CLI", "DIFFERENCES", "FRONT_ENDS", "LEAVES", "VLLM", "VLLM_LEAVES",
    "ConsumerSettings", "ControlClientSettings", "ControlServerSettings", "ControlSettings",
    "DemoSettings", "Differs", "FleetSettings", "FrontEnd", "GiB", "LayoutSettings", "Leaf",
    "LogSettings", "MetricsSettings", "MiB", "NixlPlaneSettings", "NodeSettings", "NonNegInt",
    "PlanesSettings", "Port", "PosInt", "ProducerSettings", "Seconds", "Section",
    "SecuritySettings", "Settings", "TcpPlaneSettings", "Text", "TrustSettings",
    "UcxPlaneSettings", "VllmSettings", "checked", "defaults", "doc", "leaves", "replace_path",
    "strip_none",
]
