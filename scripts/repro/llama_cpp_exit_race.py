"""llama.cpp crashes at process exit when a thread is inside ``llama_decode``: a minimal reproduction.

Found with llama-cpp-python 0.3.36 (its llama.cpp: libllama.so.0.5.0, libggml-cpu.so.0.25.3), CPU
build with OpenMP (``OPENMP = 1 | REPACK = 1`` in ``llama_print_system_info``), CPython 3.11.

What crashes and why: a Python daemon thread is inside ``llama_decode`` (ctypes releases the GIL)
when the main thread returns. CPython's finalization does not wait for daemon threads, and then
C ``exit()`` runs the C++ static destructors of the loaded libraries. One of them is
ggml-cpu's function-local static ``std::vector`` of "extra" buffer types
(``ggml_backend_cpu_get_extra_buffer_types()``), which ``ggml_cpu_extra_compute_forward`` walks
for *every* graph node. The decode's OpenMP worker threads keep walking that vector after its
storage was freed, read a garbage pointer and die with SIGSEGV (exit status -11). The core dump::

    Thread 1 (OpenMP worker):  ggml_cpu_extra_compute_forward <- libggml-cpu <- libgomp
    Thread 2 (daemon thread):  GOMP_parallel <- ggml_graph_compute <- llama_decode <- ffi_call
    Thread 4 (main):           free <- std::map<llm_kv, ...>::~map <- __run_exit_handlers <- exit

``Py_FinalizeEx`` takes only milliseconds, so whether a decode is still running when the
destructors run is a race: ``specem serve`` lost it in about 1 shutdown in 8 when SIGTERM ended
answers mid-round. This script makes it likely: a daemon thread decodes 256 tokens per call in a
loop (a call lasts far longer than finalization) and the main thread returns mid-call.

The workaround (what SpecEM's llama.cpp backend does, ``specem_core/backends/llama_cpp/_binding.py``,
:class:`NativeCalls`): every call that may run llama.cpp's threads goes through a gate; an
``atexit`` handler (Python runs those before finalization, while daemon threads still run) closes
the gate and waits until the calls in flight have returned. A thread that tries a new call after
that gets an error instead, so no thread is inside llama.cpp when ``exit()`` runs its destructors.

    python scripts/repro/llama_cpp_exit_race.py             # 10 processes each way; the counts
    python scripts/repro/llama_cpp_exit_race.py --runs 20 --model path/to/model.gguf

Exits 0 when every process with the workaround exited 0 (and prints how many without it
crashed); 1 otherwise.
"""

from __future__ import annotations

import argparse
import atexit
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path


def packaged_smollm2() -> str:
    """The GGUF of SmolLM2-135M-Instruct shipped with SpecEM's model packages."""
    from specem_core.models import find_packaged, packaged_gguf

    model = find_packaged("smollm2")
    assert model is not None
    return str(packaged_gguf(model))


class Gate:
    """The workaround: no native call starts once the interpreter exits; the ones in flight are awaited."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._closed = False

    def enter(self) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the interpreter is exiting")
            self._in_flight += 1

    def leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._in_flight == 0)  # a call always returns


def child(model_path: str, workaround: bool) -> None:
    """Load the model, decode in a daemon thread, return from the main thread mid-decode."""
    import llama_cpp as lib

    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(model_path.encode(), lib.llama_model_default_params())
    params = lib.llama_context_default_params()
    n = 256
    params.n_ctx, params.n_batch, params.n_ubatch = 2 * n, n, n
    params.n_threads = params.n_threads_batch = 2
    ctx = lib.llama_init_from_model(model, params)
    batch = lib.llama_batch_init(n, 0, 1)
    for i in range(n):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = 1 + i % 1000, i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, int(i == n - 1)
    batch.n_tokens = n
    memory = lib.llama_get_memory(ctx)
    gate = Gate()
    if workaround:
        atexit.register(gate.close)
    decoding = threading.Event()

    def decode_forever() -> None:
        while True:
            lib.llama_memory_clear(memory, True)
            try:
                gate.enter()
            except RuntimeError:  # the workaround's gate is closed: the process is exiting
                return
            try:
                decoding.set()
                lib.llama_decode(ctx, batch)
            finally:
                gate.leave()

    threading.Thread(target=decode_forever, daemon=True).start()
    decoding.wait()  # the main thread returns now, while the thread decodes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="processes each way")
    parser.add_argument("--model", help="a GGUF (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--child", choices=("plain", "workaround"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = args.model or packaged_smollm2()
    if args.child:
        child(model, args.child == "workaround")
        return 0
    failed = {}
    for mode in ("plain", "workaround"):
        command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--model", model]
        statuses = Counter(
            subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode
            for _ in range(args.runs)
        )
        failed[mode] = args.runs - statuses[0]
        print(f"{mode:10} exit statuses of {args.runs} processes: {dict(sorted(statuses.items()))}", flush=True)
    print(f"without the workaround {failed['plain']}/{args.runs} crashed, with it {failed['workaround']}/{args.runs}")
    return 0 if failed["workaround"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
