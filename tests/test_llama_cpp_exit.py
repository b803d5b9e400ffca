"""The llama.cpp backend at process exit (#63): a thread still inside ``llama_decode`` when the main
thread returns used to crash the process in llama.cpp's C++ static destructors (SIGSEGV), after
an otherwise clean run. The backend's gate (``_binding.NativeCalls``) makes the interpreter's exit
wait for the calls in flight and refuse new ones; ``scripts/repro/llama_cpp_exit_race.py`` shows
the crash without it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specem_core.backends.llama_cpp._binding import LlamaCppError, NativeCalls

ROOT = Path(__file__).resolve().parents[1]


def _hold_a_call(gate: NativeCalls) -> tuple[threading.Thread, threading.Event]:
    """A thread inside a gated call until the returned event is set."""
    inside, release = threading.Event(), threading.Event()

    def call() -> None:
        with gate.call("held"):
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=call)
    thread.start()
    assert inside.wait(30)
    return thread, release


def test_closing_the_gate_waits_for_the_call_in_flight_and_refuses_new_ones() -> None:
    gate = NativeCalls()
    holder, release = _hold_a_call(gate)
    assert gate.inside == 1
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(gate.close(timeout=30)))
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive()  # still waiting for the call in flight
    assert gate.closed
    with pytest.raises(LlamaCppError, match="process is exiting"), gate.call("late"):
        pass
    assert gate.inside == 1  # the refused call was not counted
    release.set()
    closer.join(30)
    holder.join(30)
    assert closed == [True]
    assert gate.inside == 0


def test_closing_the_gate_gives_up_after_its_timeout() -> None:
    gate = NativeCalls()
    holder, release = _hold_a_call(gate)
    try:
        assert gate.close(timeout=0.1) is False
        assert gate.inside == 1
    finally:
        release.set()
        holder.join(30)


CHILD = """
import atexit, sys, threading
from specem_core.backends.llama_cpp import _binding

# registered before the backend's own handler, so it runs after it (atexit runs last-in first-out)
atexit.register(lambda: print("gate", _binding.NATIVE_CALLS.closed, _binding.NATIVE_CALLS.inside, flush=True))
from specem_core.backends.llama_cpp import LlamaCppModel

model = LlamaCppModel(sys.argv[1], n_ctx=512, n_threads=2, max_contexts=1, prefix_cache=False)
context = model.acquire_context()
n = 256
work = _binding.Work(list(range(1, n + 1)), list(range(n)), [0] * n, [None] * (n - 1) + [-1])
decoding = threading.Event()

def decode_forever():
    while True:
        context.reset()
        decoding.set()
        try:
            context.decode(work)
        except _binding.LlamaCppError:  # the gate is closed: the process is exiting
            return

threading.Thread(target=decode_forever, daemon=True).start()
decoding.wait()  # the main thread returns while the daemon thread decodes
"""


@pytest.mark.slow
def test_a_process_exiting_while_a_daemon_thread_decodes_exits_0() -> None:
    """Without the gate 4 such processes in 10 died with SIGSEGV (status -11) on a 2-core machine
    (this child, on the backend before the fix); with it every one exits 0, and when the
    interpreter's exit handlers are done the gate is closed and no thread is inside llama.cpp."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    from specem_core.models import find_packaged, packaged_gguf

    smollm2 = find_packaged("smollm2")
    assert smollm2 is not None
    path = str(packaged_gguf(smollm2))
    for _ in range(6):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, path], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert done.stdout.strip().splitlines()[-1] == "gate True 0", done.stdout
