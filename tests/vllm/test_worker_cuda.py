"""Tensors through the worker delegate: device → shared host region → device, bytes checked.

Runs under pytest where CUDA and vLLM are present; on a GPU machine without vLLM run it as a
script (``python tests/vllm/test_worker_cuda.py``): it then stubs vLLM's connector base classes,
which is all the worker delegate needs of vLLM.
"""

from __future__ import annotations

import sys
import tempfile
import time
import types
from types import SimpleNamespace

import torch

try:
    import pytest
except ImportError:  # pragma: no cover - script mode without pytest
    pytest = SimpleNamespace(mark=SimpleNamespace(skipif=lambda *a, **k: (lambda f: f)))


def _stub_vllm() -> None:  # pragma: no cover - script mode on a machine without vLLM
    from abc import ABC

    names = ["vllm", "vllm.distributed", "vllm.distributed.ec_transfer",
             "vllm.distributed.ec_transfer.ec_connector",
             "vllm.distributed.ec_transfer.ec_connector.base"]
    for n in names:
        sys.modules.setdefault(n, types.ModuleType(n))
    base = sys.modules[names[-1]]

    base.ECConnectorBase = type("ECConnectorBase", (), {})
    base.ECConnectorMetadata = type("ECConnectorMetadata", (ABC,), {})
    base.ECConnectorWorkerMetadata = type("ECConnectorWorkerMetadata", (ABC,), {})
    base.ECConnectorRole = SimpleNamespace(SCHEDULER=0, WORKER=1)


def check_round_trip(shm_dir: str, device: str = "cuda", hidden: int = 1024,
                     rows: int = 576) -> dict:
    """Save ``[rows, hidden]`` bf16 from ``device`` into two far-apart spans of a shared region,
    check the host bytes, load them back onto ``device``, check the tensor; returns timings."""
    from ectransport.node.common import Layout
    from ectransport.vllm.metadata import ECTransportMetadata, LoadOrder, SaveOrder
    from ectransport.vllm.region import SharedRegion, region_path
    from ectransport.vllm.worker import WorkerDelegate

    layout = Layout("test/model", "bfloat16", hidden)
    region = SharedRegion(region_path(shm_dir, "cuda-check"), 4 * rows, layout.block_bytes)
    cfg = SimpleNamespace(device_config=SimpleNamespace(device=torch.device(device)))
    worker = WorkerDelegate(cfg, layout, producer=True, consumer=True)
    try:
        src = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
        nbytes = src.numel() * 2
        half = (rows // 2) * layout.block_bytes  # two runs, the second one far away
        far = (2 * rows + 1) * layout.block_bytes
        spans = ((layout.block_bytes, half), (far, nbytes - half))
        t0 = time.perf_counter()
        worker.on_bind(ECTransportMetadata(region.path, region.nbytes,
                                           saves=[SaveOrder("x", 3, spans, nbytes,
                                                            (rows, hidden))]))
        cache = {"x": src}
        worker.save_caches(cache, "x")
        report = _wait_report(worker, "saved")
        t_save = time.perf_counter() - t0
        assert report.saved == [("x", 3)] and not report.save_failed
        buf = region.region.buf
        host = b"".join(bytes(buf[off: off + n]) for off, n in spans)
        assert host == src.view(torch.uint8).cpu().numpy().tobytes(), "save bytes differ"

        t0 = time.perf_counter()
        loads = [LoadOrder("x", 7, spans, nbytes, (rows, hidden))]
        worker.on_bind(ECTransportMetadata(region.path, region.nbytes, loads=loads))
        out: dict[str, torch.Tensor] = {}
        worker.start_load_caches(out)
        report = _wait_report(worker, "loaded")
        t_load = time.perf_counter() - t0
        got = out["x"]
        assert got.device.type == device and got.dtype == torch.bfloat16
        assert got.shape == (rows, hidden)
        assert torch.equal(got.view(torch.int16), src.view(torch.int16)), "load bytes differ"
        return {"bytes": nbytes, "spans": len(spans), "save_s": t_save, "load_s": t_load}
    finally:
        worker.shutdown()
        region.close()


def _wait_report(worker, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        report = worker.build_worker_meta()
        if report is not None and getattr(report, what):
            return report
        assert time.monotonic() < deadline, f"no {what} report"


def test_cpu_round_trip(tmp_path):
    """The same path on CPU tensors (runs everywhere)."""
    assert check_round_trip(str(tmp_path), "cpu", hidden=64, rows=100)["spans"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip(tmp_path):
    assert check_round_trip(str(tmp_path), "cuda")["bytes"] > 0


if __name__ == "__main__":  # pragma: no cover
    try:
        import vllm.distributed.ec_transfer.ec_connector.base  # noqa: F401
    except ImportError:
        _stub_vllm()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        print(check_round_trip(d, "cuda"))
