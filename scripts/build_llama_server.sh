#!/usr/bin/env bash
# Build llama.cpp's own OpenAI-compatible server (`llama-server`) from the llama.cpp source the
# project already compiles: the one vendored in the pinned llama-cpp-python sdist, with the same
# CPU flags as scripts/build_llama_cpp.sh (its level: AVX2, or AVX512 where the CPU has it).
#
#   bash scripts/build_llama_server.sh          # prints the binary's path when done
#
# The binary is cached per llama-cpp-python version and CPU level under
# ~/.cache/specem/llama-server/VERSION-LEVEL/llama-server (reused on later runs; a fresh build takes
# ~10 min on 2 cores). tests/llama_server.py's start_llama_cpp_server() and
# benchmarks/multiturn_servers.py --server llama.cpp start it; the members guide says what it offers.
#
# Environment:
#   PYTHON                 interpreter whose pip downloads the sdist (default: .venv/bin/python)
#   LLAMA_CPP_VERSION      sdist version (default: 0.3.36, as scripts/build_llama_cpp.sh)
#   SPECEM_LLAMA_SERVER_DIR  cache directory (default: ~/.cache/specem/llama-server)
#   CMAKE_BUILD_PARALLEL_LEVEL  build parallelism (default: 2)
#   SPECEM_BUILD_NICE      nice level for the build (default: 19)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
NICE=${SPECEM_BUILD_NICE:-19}
LEVEL=$(PRINT_LEVEL=1 bash scripts/build_llama_cpp.sh)
FLAGS=$(PRINT_FLAGS=1 bash scripts/build_llama_cpp.sh)
DIR=${SPECEM_LLAMA_SERVER_DIR:-$HOME/.cache/specem/llama-server}/$VERSION-$LEVEL
BIN=$DIR/llama-server

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "build_llama_server: reusing $BIN" >&2
    echo "$BIN"
    exit 0
fi

echo "build_llama_server: building llama-server ($LEVEL) from llama-cpp-python==$VERSION's llama.cpp (~10 min)" >&2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$VERSION" -d "$TMP"
tar -xzf "$TMP"/llama_cpp_python-"$VERSION".tar.gz -C "$TMP"
SRC=$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp
# the server only: no tests, examples or other tools; no libcurl (models come as files here)
# shellcheck disable=SC2086  # FLAGS is a list of -D arguments
nice -n "$NICE" cmake -S "$SRC" -B "$TMP/build" -DCMAKE_BUILD_TYPE=Release $FLAGS \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF >"$TMP/cmake.log" 2>&1 || { tail -30 "$TMP/cmake.log" >&2; exit 1; }
nice -n "$NICE" cmake --build "$TMP/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    >"$TMP/build.log" 2>&1 || { tail -30 "$TMP/build.log" >&2; exit 1; }
mkdir -p "$DIR"
cp "$TMP/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
"$BIN" --version >&2 || true
echo "$BIN"
