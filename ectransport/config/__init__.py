"""One typed settings object for ectransport (a front end, like the CLI).

    from ectransport.config import load_settings
    loaded = load_settings("ectransport.toml")          # file < ECTRANSPORT_… env < flags
    node = ProducerNode.from_settings(loaded.settings, layout=..., security=...)

The schema (every field, its default, unit and meaning, and each front end's deliberate
differences) is :mod:`ectransport.settings_schema`. See ``docs/configuration.md`` and
``ectransport config show``.
"""

from ectransport.config.load import CONFIG_ENV, LEAVES, Loaded, load_settings
from ectransport.config.settings import DIFFERENCES, Settings, defaults
from ectransport.config.show import redact, render

__all__ = ["CONFIG_ENV", "DIFFERENCES", "LEAVES", "Loaded", "Settings", "defaults",
           "load_settings", "redact", "render"]
