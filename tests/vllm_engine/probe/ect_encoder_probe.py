"""Test-only vLLM general plugin: counts the multimodal items the vision encoder computes.

Found by vLLM through the ``vllm.general_plugins`` entry point of the ``.dist-info`` beside this
file, when the real-engine tests (or ``benchmarks/vllm_ttft.py``) put this directory on
``PYTHONPATH`` of an engine (vLLM loads general plugins in every process, the worker included).
Nothing is installed; an engine started without this directory on its path is untouched.

- ``ECT_ENCODER_PROBE`` names a file: every call of ``embed_multimodal`` (vLLM's encoder entry
  point for a multimodal model) appends one line ``<items computed> <seconds it took>``.
- ``ECT_DEBUG_LOG`` names a file: ectransport's loggers write DEBUG records there, from every
  process of the engine (the scheduler's fetch timings, for the TTFT benchmark).
"""

from __future__ import annotations

import os
import time


def register() -> None:
    if log_path := os.environ.get("ECT_DEBUG_LOG"):
        import logging

        lg = logging.getLogger("ectransport")
        if not any(getattr(h, "_ect_probe", False) for h in lg.handlers):
            h = logging.FileHandler(log_path)
            h._ect_probe = True  # type: ignore[attr-defined]
            h.setFormatter(logging.Formatter("%(created).6f %(process)d %(name)s %(message)s"))
            lg.addHandler(h)
            lg.setLevel(logging.DEBUG)
    path = os.environ.get("ECT_ENCODER_PROBE")
    if not path:
        return
    from vllm.model_executor.models import qwen2_vl

    cls = qwen2_vl.Qwen2VLForConditionalGeneration
    if getattr(cls.embed_multimodal, "_ect_probe", False):
        return
    original = cls.embed_multimodal

    def embed_multimodal(self, **kwargs):
        t0 = time.perf_counter()
        out = original(self, **kwargs)
        took = time.perf_counter() - t0
        n = len(out) if out is not None else 0
        with open(path, "a") as f:
            f.write(f"{n} {took:.6f}\n")
        return out

    embed_multimodal._ect_probe = True
    cls.embed_multimodal = embed_multimodal


def records(path: str) -> list[tuple[int, float]]:
    """``(items, seconds)`` per encoder call so far of the engine whose probe file is ``path``."""
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        return []
    return [(int(r[0]), float(r[1]) if len(r) > 1 else 0.0) for r in rows]


def count(path: str) -> int:
    """Items encoded so far by the engine whose probe file is ``path``."""
    return sum(n for n, _ in records(path))
