"""The entry layout of a vLLM engine: model id, dtype and row width (``hidden``).

``hidden`` is the model's inputs-embeds width (``model_config.get_inputs_embeds_size()``), except
for deepstack vision models such as Qwen3-VL, whose encoder emits the main features and one extra
slice per deepstack layer side by side: when ``hf_config.vision_config`` has ``out_hidden_size``
and a non-empty ``deepstack_visual_indexes``, ``hidden = out_hidden_size × (1 +
len(deepstack_visual_indexes))`` (the rule of vLLM's ECCPUConnector). One block is one row of
``hidden × element_size`` bytes. Nothing in this module imports vLLM.
"""

from __future__ import annotations

from typing import Any

from ectransport.errors import ConfigError
from ectransport.node.common import Layout
from ectransport.vllm.settings import Settings


def model_hidden(model_config: Any) -> int:
    """The row width of encoder outputs for ``model_config`` (see module docstring)."""
    vision = getattr(getattr(model_config, "hf_config", None), "vision_config", None)
    out = getattr(vision, "out_hidden_size", None)
    deepstack = getattr(vision, "deepstack_visual_indexes", None)
    if out and deepstack:
        return int(out) * (1 + len(deepstack))
    return int(model_config.get_inputs_embeds_size())


def layout_for(vllm_config: Any, settings: Settings) -> Layout:
    """The :class:`Layout` of this engine: settings override the model config.

    Raises:
        ConfigError: no model config and the settings lack ``model_id``/``dtype``/``hidden``.
    """
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        model_id, dtype, hidden = settings.model_id, settings.dtype, settings.hidden
        if model_id is None or dtype is None or hidden is None:
            missing = [k for k in ("model_id", "dtype", "hidden") if getattr(settings, k) is None]
            raise ConfigError(f"vLLM runs without a model config here: set {', '.join(missing)} "
                              "in ec_connector_extra_config")
    else:
        model_id = settings.model_id or str(mc.model)
        dtype = settings.dtype or str(mc.dtype).removeprefix("torch.")
        hidden = settings.hidden or model_hidden(mc)
    try:
        layout = Layout(model_id=model_id, dtype=dtype, hidden=hidden)
        layout.compat_hash  # noqa: B018 - validates dtype and hidden
    except ValueError as e:
        raise ConfigError(f"cannot use this model's encoder outputs: {e}") from None
    return layout
