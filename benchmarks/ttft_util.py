"""What the TTFT benchmark's modules share (``vllm_ttft``, ``ttft_fleet``): quantiles, the CPU's
name, a temporary environment. A leaf: it imports no other benchmark module."""

from __future__ import annotations

import contextlib
import os
import statistics


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; ``xs`` non-empty."""
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "p50_ms": pct(xs, 0.5) * 1e3,
        "p90_ms": pct(xs, 0.9) * 1e3,
        "mean_ms": statistics.fmean(xs) * 1e3,
    }


@contextlib.contextmanager
def _env(extra: dict[str, str]):
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cpu() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return f"x{os.cpu_count()}"
