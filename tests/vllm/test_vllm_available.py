"""Reports the vLLM tests as skipped when vLLM is not installed (the conftest then collects no
other file of this directory)."""

import pytest


def test_vllm_is_importable():
    pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.base",
                        reason="vLLM is not installed: the vLLM adapter tests are skipped "
                               "(scripts/setup-vllm-venv.sh builds .venv-vllm)")
