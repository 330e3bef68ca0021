"""What every module of the ectransport benchmark shares: sizes and row layout, the run's
:class:`Config` and targets, sample statistics, logging, the NIXL agents' environment, and the
raw TCP/ucxx request header. A leaf: it imports no other benchmark module (they all import it).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field

HIDDEN = 3584  # Qwen2-VL-7B; one row = 7168 bytes (bf16)
BLOCK = HIDDEN * 2
MiB = 1 << 20

SIZES = {  # label -> target bytes (rounded to whole rows of BLOCK bytes)
    "64KiB": 64 * 1024,
    "1MiB": MiB,
    "4.7MiB": int(4.7 * MiB),
    "8.8MiB": int(8.8 * MiB),
    "42MiB": 42 * MiB,
    "64MiB": 64 * MiB,
}

#: Raw NIXL agents use ectransport's NIXL plane agent config (UCX backend, progress thread pausing
#: this long between passes), so an A/B differs only by ectransport. NIXL's Python default (0:
#: the progress thread spins, ~1 core per agent) is measured alone as ``raw-nixl-spin``.
RAW_NIXL_DELAY_US = 100


def _has_v2() -> bool:
    from ectransport.protocol import SUPPORTED_VERSIONS

    return 2 in SUPPORTED_VERSIONS


#: This build speaks ECTP v2: the v1 path (a consumer configured ``versions=(1,)``) is measured
#: A/B with the default (v2) one.
HAS_V2 = _has_v2()

TARGETS = {
    "single_8.8MiB_vs_raw_nixl": 1.25,
    "pipelined_ge4MiB_fraction_of_raw": 0.85,
    "control_rtt_plain_s": 150e-6,
    "control_rtt_curve_s": 250e-6,
    "speedup_vs_safetensors_8.8MiB": 5.0,
}


@dataclass
class Config:
    mode: str = "quick"
    sizes: list[str] = field(default_factory=lambda: ["1MiB", "8.8MiB"])
    planes: list[str] = field(default_factory=lambda: ["nixl", "tcp"])
    curve_off: bool = False  # also measure ectransport with plain ZMQ
    warmup: int = 3
    reps: int = 15  # latency samples per path and size (after warm-up)
    thr_reps: int = 5  # throughput repetitions
    inflight: list[int] = field(default_factory=lambda: [4])
    thr_min_bytes: int = 4 * MiB  # pipelined throughput for sizes >= this
    consumers: list[int] = field(default_factory=list)
    consumers_size: str = "8.8MiB"
    rtt_samples: int = 40
    recompute_reps: int = 5
    recompute_direct_max: int = 9 * MiB  # larger sizes: per-token time of the largest direct size
    safetensors: bool = True
    scope: bool = True  # the nixl grant_scope A/B (issue 13, benchmarks/scope.py)
    scope_sizes: list[str] | None = None  # labels compared there; None = every size of the run
    scope_reps: int = 15  # samples per scope and size (half above 9 MiB)
    micro_reps: int = 30  # samples per case of the in-process scope micro-benchmarks
    vllm_p2p: bool = True  # vLLM's own ECCPUConnector P2P stack at each size (vllm_p2p.py)
    vllm_p2p_blocks: int = 1  # phases per path there (ABCD, DCBA, ...), samples pooled

    @classmethod
    def quick(cls) -> Config:
        # recompute: direct at 1 MiB only, the 8.8 MiB figure is its per-token time scaled
        return cls(recompute_direct_max=2 * MiB, warmup=2, reps=9, rtt_samples=30)

    @classmethod
    def full(cls) -> Config:
        return cls(mode="full", sizes=list(SIZES), planes=["nixl", "tcp", "ucx"], curve_off=True,
                   warmup=3, reps=25, thr_reps=5, inflight=[1, 4, 16], consumers=[1, 2, 8],
                   rtt_samples=200, scope_sizes=["64KiB", "1MiB", "8.8MiB", "64MiB"],
                   scope_reps=100, micro_reps=200, vllm_p2p_blocks=2)


def rows_of(label: str) -> int:
    return max(1, round(SIZES[label] / BLOCK))


def copies_of(nbytes: int) -> int:
    """Distinct entries per size on the producer (max pipelining depth for that size)."""
    return 16 if nbytes <= 9 * MiB else 4


def stats(xs: list[float]) -> dict:
    s = sorted(xs)
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    p90 = s[min(len(s) - 1, math.ceil(0.90 * len(s)) - 1)]
    return {"p50": statistics.median(s), "p90": p90, "p99": p99, "min": s[0], "max": s[-1],
            "n": len(s)}


#: UCX variables the user set before the benchmark started; any other UCX_* variable was put in
#: os.environ by ``import ucxx`` (UCX_RNDV_THRESH=8192, ...), which would change how NIXL agents
#: created later in this process talk UCX (measured: UCX_RNDV_THRESH=8192 in the READ initiator's
#: environment makes an 8.8 MiB NIXL READ 40-120 ms instead of ~1-1.5 ms here).
_USER_UCX_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))


@contextlib.contextmanager
def nixl_env():
    """Create NIXL agents without the UCX variables ucxx's import injected (restored after)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ)
             if k.startswith("UCX_") and k not in _USER_UCX_ENV}
    try:
        yield
    finally:
        os.environ.update(saved)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


#: Raw TCP / ucxx request: the index of the size asked for (int64, network order).
ROWS_HEADER = struct.Struct("!q")

#: ``Fetched.timings`` keys in order: submit → XferReq sent, → XferAck, → transfer posted, →
#: bytes landed, → result (seconds since the fetch started).
FETCH_PHASES = ("req", "ack", "posted", "landed", "total")
