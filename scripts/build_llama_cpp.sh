#!/usr/bin/env bash
# Build (once) and install llama-cpp-python into ./.venv, with portable CPU flags.
#
#   bash scripts/build_llama_cpp.sh            # the plain package: the llama.cpp backend (scripts/install.sh)
#   bash scripts/build_llama_cpp.sh --server   # plus its [server] extra: the real OpenAI-compatible server
#                                              # the HTTP tests and benchmarks/http_rounds.py start on
#                                              # loopback (scripts/install_dev.sh)
#
# There is no binary wheel for linux x86_64 on PyPI, so we build the sdist. The default
# `-march=native` build segfaults on batched decode on some AVX512/AMX CPUs (research notes §4.3),
# hence the portable AVX2/FMA/F16C flags. The wheel is cached under ~/.cache/specem/wheels and
# reused on later runs; a fresh build takes ~10 min on 2 cores. Install it before anything that
# requires llama-cpp-python (`pip install -e ".[llamacpp]"`): pip then finds the requirement
# satisfied and never builds the sdist itself with the native flags.
#
# Environment:
#   PYTHON                 interpreter to install into (default: .venv/bin/python)
#   SPECEM_WHEEL_CACHE     wheel cache directory (default: ~/.cache/specem/wheels)
#   LLAMA_CPP_VERSION      sdist version to build (default: 0.3.36)
#   LLAMA_CPP_SERVER=1     same as --server
#   CMAKE_BUILD_PARALLEL_LEVEL  build parallelism (default: 2)
#   SPECEM_BUILD_NICE      nice level for the build (default: 19)
#   BUILD_ONLY=1           build/cache the wheel but do not install it
set -euo pipefail
cd "$(dirname "$0")/.."

SERVER=${LLAMA_CPP_SERVER:-0}
for arg in "$@"; do
    case "$arg" in
        --server) SERVER=1 ;;
        --no-server) SERVER=0 ;;
        -h | --help) sed -n '2,8p' "$0"; exit 0 ;;
        *) echo "build_llama_cpp: unknown option $arg (use --server or --no-server)" >&2; exit 2 ;;
    esac
done

PY=${PYTHON:-.venv/bin/python}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${SPECEM_WHEEL_CACHE:-$HOME/.cache/specem/wheels}
NICE=${SPECEM_BUILD_NICE:-19}
mkdir -p "$CACHE"

find_wheel() {
    local found
    for found in "$CACHE"/llama_cpp_python-"$VERSION"-*.whl; do
        if [ -e "$found" ]; then
            echo "$found"
            return 0
        fi
    done
    return 0
}

WHEEL=$(find_wheel)
if [ -z "$WHEEL" ]; then
    echo "build_llama_cpp: no cached wheel for llama-cpp-python==$VERSION in $CACHE; building from the sdist (~10 min)" >&2
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        nice -n "$NICE" "$PY" -m pip wheel --no-deps --no-binary=llama-cpp-python \
        "llama-cpp-python==$VERSION" -w "$TMP"
    cp "$TMP"/llama_cpp_python-"$VERSION"-*.whl "$CACHE"/
    WHEEL=$(find_wheel)
    echo "build_llama_cpp: cached $WHEEL" >&2
else
    echo "build_llama_cpp: reusing cached $WHEEL" >&2
fi

if [ "${BUILD_ONLY:-0}" != "1" ]; then
    if [ "$SERVER" = "1" ]; then
        # [server] pulls fastapi / uvicorn / sse-starlette / starlette-context / pydantic-settings.
        "$PY" -m pip install -q "${WHEEL}[server]"
        "$PY" -c "import llama_cpp, llama_cpp.server; print('llama_cpp', llama_cpp.__version__, '(with the server)')"
    else
        # the plain package (numpy, jinja2, diskcache, typing-extensions): what the backend needs
        "$PY" -m pip install -q "$WHEEL"
        "$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
    fi
fi
