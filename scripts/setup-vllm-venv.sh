#!/usr/bin/env bash
# Build .venv-vllm: a venv that sees the main environment's packages (torch, nixl, pyzmq,
# ectransport itself) and adds vLLM 0.33.0 for CPU, as issue 6 prescribes. Idempotent: when the
# venv already holds this exact recipe (stamp file), it returns at once.
#
#   bash scripts/setup-vllm-venv.sh            # then:
#   VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
#       .venv-vllm/bin/python -m pytest tests/vllm -q
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

DEPS=(numpy packaging psutil 'pyzmq>=25.0.0' regex 'pydantic>=2.12.0' cbor2
      'transformers<5.21.0,>=5.16.1' 'aiohttp>=3.14.4' 'requests>=2.33.0' 'oss-harmony>=0.0.11'
      'openai>=2.25.0' 'pillow>=13.0.0' pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo
      'prometheus_client>=0.18.0' 'fastapi<0.137.0,>=0.133.0' partial-json-parser
      'llguidance<1.8.0,>=1.7.0' apache-tvm-ffi==0.1.11)
RECIPE="torch==2.13.0 vllm==0.33.0 xgrammar==0.2.8 ${DEPS[*]}"
STAMP="$VENV/.ectransport-recipe"

# Full check (imports vLLM: seconds), run after installing.
check() {
  "$VENV/bin/python" -I - <<'PY'  # -I: not from the checkout (cwd), as a subprocess sees it
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase  # noqa: F401
import ectransport, nixl, zmq, torch  # noqa: F401
PY
}
# Fast check (package metadata only), for the already-built case.
installed() {
  "$VENV/bin/python" -I - <<'PY'  # -I: not from the checkout (cwd), as a subprocess sees it
import importlib.metadata as m, importlib.util as u
assert m.version("vllm") == "0.33.0" and m.version("xgrammar") == "0.2.8"
assert all(u.find_spec(n) for n in ("ectransport", "nixl", "zmq", "torch", "transformers"))
PY
}

# a venv built by an older version of this script may lack the link to the enclosing environment
[[ -x "$VENV/bin/python" ]] && "$PY" scripts/link-parent-env.py "$VENV"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]] && installed 2>/dev/null; then
  echo "setup-vllm-venv: $VENV is up to date"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV"
# --system-site-packages shows the *base* interpreter's packages only; run inside a virtualenv (as
# most users' `bash .ci/run` is), the packages installed there (torch, nixl, the editable
# ectransport) must be visible too: a .pth file adds that environment's site directories.
"$PY" scripts/link-parent-env.py "$VENV"
PIP=("$VENV/bin/pip" install -q)
# torch comes from the main environment (system site-packages); pip only checks it is there.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps vllm==0.33.0
# The resolver prints conflict lines for vLLM's unlisted extras; the install still succeeds.
"${PIP[@]}" "${DEPS[@]}"
"${PIP[@]}" --no-deps xgrammar==0.2.8
check
echo "$RECIPE" > "$STAMP"
echo "setup-vllm-venv: $VENV ready"
