"""The settings object: every timeout, budget, size and path of ectransport in one typed place.

The schema itself — each field's type, range, default, unit and meaning, and each front end's
deliberate differences with their reasons — lives in :mod:`ectransport.settings_schema`, at the
bottom of the layers, so that the nodes take their defaults from it too. This module re-exports
it for the front ends: values are read from (later wins) the defaults, a TOML file,
``ECTRANSPORT_…`` environment variables and CLI flags — see :mod:`ectransport.config.load`;
``ectransport config show`` prints them with where each value came from.
"""

from __future__ import annotations

from ectransport.settings_schema import (
    API,
    CLI,
    DIFFERENCES,
    LEAVES,
    VLLM,
    ConsumerSettings,
    ControlClientSettings,
    ControlServerSettings,
    ControlSettings,
    DemoSettings,
    Differs,
    LayoutSettings,
    Leaf,
    LogSettings,
    MetricsSettings,
    NixlPlaneSettings,
    NodeSettings,
    PlanesSettings,
    ProducerSettings,
    SecuritySettings,
    Settings,
    TcpPlaneSettings,
    UcxPlaneSettings,
    VllmSettings,
    defaults,
)

__all__ = ["API", "CLI", "DIFFERENCES", "LEAVES", "VLLM", "ConsumerSettings",
           "ControlClientSettings", "ControlServerSettings", "ControlSettings", "DemoSettings",
           "Differs", "LayoutSettings", "Leaf", "LogSettings", "MetricsSettings",
           "NixlPlaneSettings", "NodeSettings", "PlanesSettings", "ProducerSettings",
           "SecuritySettings", "Settings", "TcpPlaneSettings", "UcxPlaneSettings",
           "VllmSettings", "defaults"]
