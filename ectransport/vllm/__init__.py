"""vLLM front end: ``ECTransportConnector``, an encoder-cache (EC) connector for vLLM's EPD
disaggregation that moves encoder outputs between instances with ectransport.

    --ec-transfer-config '{"ec_connector": "ECTransportConnector",
                           "ec_connector_module_path": "ectransport.vllm",
                           "ec_role": "ec_producer" | "ec_consumer" | "ec_both",
                           "ec_connector_extra_config": {...}}'

vLLM is imported when ``ECTransportConnector`` (or the metadata classes) is first looked up here,
not by ``import ectransport.vllm``: ``settings`` (extra-config validation), ``layout`` (hidden and
dtype from the model), ``region`` (the /dev/shm region shared with the workers) and ``trust``
(producer keys) work without vLLM. The scheduler process runs ``scheduler`` (with
``sched_producer`` / ``sched_consumer``), the workers run ``worker``. See ``docs/vllm.md``.
"""

from __future__ import annotations

from typing import Any

from ectransport.vllm.settings import Settings, parse_settings

_LAZY = {
    "ECTransportConnector": "ectransport.vllm.connector",
    "ECTransportMetadata": "ectransport.vllm.metadata",
    "ECTransportWorkerMetadata": "ectransport.vllm.metadata",
    "LoadOrder": "ectransport.vllm.metadata",
    "SaveOrder": "ectransport.vllm.metadata",
}

__all__ = ["ECTransportConnector", "ECTransportMetadata", "ECTransportWorkerMetadata",
           "LoadOrder", "SaveOrder", "Settings", "parse_settings"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ectransport.vllm' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ImportError(f"ectransport.vllm.{name} needs vLLM ({e}); install vLLM 0.33.0 "
                          "(scripts/setup-vllm-venv.sh)") from e
    globals()[name] = value
    return value
