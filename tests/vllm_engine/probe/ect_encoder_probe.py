"""Test-only vLLM general plugin: counts the multimodal items the vision encoder computes.

Found by vLLM through the ``vllm.general_plugins`` entry point of the ``.dist-info`` beside this
file, when the real-engine tests put this directory on ``PYTHONPATH`` of an engine (vLLM loads
general plugins in every process, the worker included). It does something only when
``ECT_ENCODER_PROBE`` names a file: every call of ``embed_multimodal`` (vLLM's encoder entry
point for a multimodal model) appends one line with the number of items it computed. Nothing is
installed; an engine started without this directory on its path is untouched.
"""

from __future__ import annotations

import os


def register() -> None:
    path = os.environ.get("ECT_ENCODER_PROBE")
    if not path:
        return
    from vllm.model_executor.models import qwen2_vl

    cls = qwen2_vl.Qwen2VLForConditionalGeneration
    if getattr(cls.embed_multimodal, "_ect_probe", False):
        return
    original = cls.embed_multimodal

    def embed_multimodal(self, **kwargs):
        out = original(self, **kwargs)
        n = len(out) if out is not None else 0
        with open(path, "a") as f:
            f.write(f"{n}\n")
        return out

    embed_multimodal._ect_probe = True
    cls.embed_multimodal = embed_multimodal


def count(path: str) -> int:
    """Items encoded so far by the engine whose probe file is ``path``."""
    try:
        with open(path) as f:
            return sum(int(line) for line in f if line.strip())
    except FileNotFoundError:
        return 0
