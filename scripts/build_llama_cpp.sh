#!/usr/bin/env bash
# Build (once per CPU level) and install llama-cpp-python into ./.venv.
#
#   bash scripts/build_llama_cpp.sh            # the plain package: the llama.cpp backend (scripts/install.sh)
#   bash scripts/build_llama_cpp.sh --server   # plus its [server] extra: the real OpenAI-compatible server
#                                              # the HTTP tests and benchmarks/http_rounds.py start on
#                                              # loopback (scripts/install_dev.sh)
#
# There is no binary wheel for linux x86_64 on PyPI, so we build the sdist. The default
# `-march=native` build segfaults on batched decode on some CPUs with AMX (research notes §4.3), so
# the flags are explicit and AMX stays off: AVX2/FMA/F16C everywhere, plus AVX512 (and its VBMI,
# VNNI and BF16 extensions, each where /proc/cpuinfo lists it) on CPUs that have it. On AVX512
# CPUs that makes the batched kernels (verification blocks) about a quarter faster
# (benchmarks/llama_cpp_builds.py; README "Performance"). scripts/check_llama_cpp.py checks a build
# after install.sh has the weights; a build that fails it is marked, and the next run of this
# script falls back to AVX2. Wheels are cached per CPU level under ~/.cache/specem/wheels/LEVEL and
# reused on later runs; a fresh build takes ~5-10 min on 2 cores. Install it before anything that
# requires llama-cpp-python (`pip install -e ".[llamacpp]"`): pip then finds the requirement
# satisfied and never builds the sdist itself with the native flags.
#
# Environment:
#   PYTHON                 interpreter to install into (default: .venv/bin/python)
#   SPECEM_WHEEL_CACHE     wheel cache directory (default: ~/.cache/specem/wheels)
#   SPECEM_LLAMA_CPU       auto (default: the best level this CPU supports and no failed check
#                          has marked) | avx512 | avx2
#   CMAKE_ARGS             your own llama.cpp flags instead (cached under a level named by their hash)
#   LLAMA_CPP_VERSION      sdist version to build (default: 0.3.36)
#   LLAMA_CPP_SERVER=1     same as --server
#   CMAKE_BUILD_PARALLEL_LEVEL  build parallelism (default: 2)
#   SPECEM_BUILD_NICE      nice level for the build (default: 19)
#   BUILD_ONLY=1           build/cache the wheel but do not install it
#   PRINT_LEVEL=1          print the level this run would use, and nothing else
#   PRINT_FLAGS=1          print its CMake flags, and nothing else
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
REQUEST=${SPECEM_LLAMA_CPU:-auto}
# What the build compiles beyond the libraries the package loads (checked in 0.3.36's sdist):
# llama.cpp's tests, tools, examples and server default to OFF when it is built as a subproject
# (LLAMA_STANDALONE=OFF, vendor/llama.cpp/CMakeLists.txt); the multimodal library is turned off
# here (LLAVA_BUILD=OFF); the common library is forced ON by llama-cpp-python's own CMakeLists
# (a FORCE'd cache entry, which -D cannot override). Nothing else is left to turn off.
BASE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"

# the CPU's flags, as words (empty where /proc/cpuinfo is missing: then AVX2 only)
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2 || true) "
has() { case "$CPU_FLAGS" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# LEVEL names the build (and its cache folder); FLAGS are its CMake arguments
avx512_level() {
    local level=avx512 flags="$BASE_FLAGS -DGGML_AVX512=ON"
    for f in avx512f avx512cd avx512vl avx512dq avx512bw; do has "$f" || return 1; done
    if has avx512vbmi; then level+=-vbmi; flags+=" -DGGML_AVX512_VBMI=ON"; fi
    if has avx512_vnni; then level+=-vnni; flags+=" -DGGML_AVX512_VNNI=ON"; fi
    if has avx512_bf16; then level+=-bf16; flags+=" -DGGML_AVX512_BF16=ON"; fi
    LEVEL=$level FLAGS=$flags
}
if [ -n "${CMAKE_ARGS:-}" ]; then
    LEVEL=custom-$(printf '%s' "$CMAKE_ARGS" | sha256sum | cut -c1-12) FLAGS=$CMAKE_ARGS
else
    case "$REQUEST" in
        avx2) LEVEL=avx2 FLAGS=$BASE_FLAGS ;;
        avx512)
            avx512_level || { echo "build_llama_cpp: this CPU has no AVX512 (F/CD/VL/DQ/BW)" >&2; exit 2; } ;;
        auto)
            if ! avx512_level || [ -e "$CACHE/$LEVEL/FAILED_CHECK" ]; then
                [ -e "$CACHE/${LEVEL:-avx512}/FAILED_CHECK" ] &&
                    echo "build_llama_cpp: the ${LEVEL} build failed scripts/check_llama_cpp.py here before; using AVX2" >&2
                LEVEL=avx2 FLAGS=$BASE_FLAGS
            fi ;;
        *) echo "build_llama_cpp: SPECEM_LLAMA_CPU must be auto, avx512 or avx2, not $REQUEST" >&2; exit 2 ;;
    esac
fi
if [ "${PRINT_LEVEL:-0}" = "1" ]; then
    echo "$LEVEL"
    exit 0
fi
if [ "${PRINT_FLAGS:-0}" = "1" ]; then  # scripts/build_llama_server.sh builds with the same flags
    echo "$FLAGS"
    exit 0
fi
DIR=$CACHE/$LEVEL
mkdir -p "$DIR"

find_wheel() {
    local found
    for found in "$DIR"/llama_cpp_python-"$VERSION"-*.whl; do
        if [ -e "$found" ]; then
            echo "$found"
            return 0
        fi
    done
    return 0
}

WHEEL=$(find_wheel)
if [ -z "$WHEEL" ]; then
    echo "build_llama_cpp: no cached $LEVEL wheel for llama-cpp-python==$VERSION in $DIR; building from the sdist (~5-10 min)" >&2
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    # --no-cache-dir: pip's own wheel cache is keyed by the sdist, not by CMAKE_ARGS, and would hand
    # back a wheel built with other flags
    CMAKE_ARGS="$FLAGS" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        nice -n "$NICE" "$PY" -m pip wheel --no-cache-dir --no-deps --no-binary=llama-cpp-python \
        "llama-cpp-python==$VERSION" -w "$TMP"
    cp "$TMP"/llama_cpp_python-"$VERSION"-*.whl "$DIR"/
    rm -f "$DIR/FAILED_CHECK"
    WHEEL=$(find_wheel)
    echo "build_llama_cpp: cached $WHEEL" >&2
else
    echo "build_llama_cpp: reusing cached $WHEEL" >&2
fi

if [ "${BUILD_ONLY:-0}" != "1" ]; then
    # the level of the build installed now ("none"; "unknown" for one this script did not mark)
    INSTALLED=$("$PY" -c 'import importlib.util as u, pathlib as p; s = u.find_spec("llama_cpp")
m = p.Path(s.origin).parent / "SPECEM_BUILD_LEVEL" if s and s.origin else None
print("none" if m is None else m.read_text().strip() if m.exists() else "unknown")')
    # the package's dependencies (numpy, jinja2, diskcache, typing-extensions; with --server also
    # fastapi / uvicorn / sse-starlette / starlette-context / pydantic-settings); pip keeps an
    # installed build of the same version, so another level's build is replaced explicitly
    if [ "$SERVER" = "1" ]; then
        "$PY" -m pip install -q "${WHEEL}[server]"
    else
        "$PY" -m pip install -q "$WHEEL"
    fi
    if [ "$INSTALLED" != "none" ] && [ "$INSTALLED" != "$LEVEL" ]; then
        "$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL"
    fi
    echo "$LEVEL" >"$("$PY" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')/SPECEM_BUILD_LEVEL"
    if [ "$SERVER" = "1" ]; then
        "$PY" -c "import llama_cpp, llama_cpp.server; print('llama_cpp', llama_cpp.__version__, '($LEVEL build, with the server)')"
    else
        "$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, '($LEVEL build)')"
    fi
fi
