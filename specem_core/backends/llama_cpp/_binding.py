"""The llama.cpp binding: the ctypes library, one ``llama_context`` and a batch of work for it.

Everything here talks to llama-cpp-python's low-level API; the model, member and session modules
build on it. Each context holds sequence 0 for its session, scratch sequences for candidates and a
ballast sequence that keeps retired cells occupied (see :mod:`.session` for why).
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import ctypes
import logging
import math
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specem_core.backends.llama_cpp._invariant import note_decode
from specem_core.errors import ModelNotFoundError, SpecEMError

DEFAULT_N_CTX = 4096
SCRATCH_SEQUENCES = 14
"""Candidates one verification pass can fork (sequence ids 1..14; 0 is the session)."""
BALLAST = 15
"""Sequence that keeps cells below the session's newest cells occupied (see ``_retire``)."""
CANDIDATE_ROOM = 256
"""KV cells kept free for the candidates of a verification pass (not part of the context window)."""
COMPACT_AFTER = 192
"""Retired cells tolerated before a session refills its context (when they also exceed its length)."""
MAX_OUTPUTS = 128
"""Logit rows one decode call may return (bounds the per-context output buffer)."""
INVARIANT_CHUNK = 64
"""With ``history_invariant``, prompts are prefilled in chunks of this many tokens that start at
positions divisible by it, and the prefix cache hands over only whole such chunks: a row's values
then depend on nothing but the tokens up to its chunk's end, whatever ran before (64: the chunk
size whose prefill speed is within a few per cent of 512's on a CPU, measured in the Performance
report)."""
EXIT_WAIT_SECONDS = 300.0
"""How long the interpreter's exit waits for llama.cpp calls in flight (see :class:`NativeCalls`)."""
_BACKEND_LOCK = threading.Lock()
_BACKEND_READY = False
_log = logging.getLogger(__name__)


class LoadedModel(Protocol):
    """What a context needs of its model (:class:`~specem_core.backends.llama_cpp.LlamaCppModel`)."""

    lib: Any
    handle: Any
    name: str
    n_ctx: int
    n_batch: int
    n_threads: int
    chunk_invariant: bool
    batch_invariant: bool
    flash_attn_type: int
    n_vocab: int
    decode_calls: int
    decodes_by_threads: dict[int, int]

    def decode_threads(self) -> AbstractContextManager[int]:
        """Threads for the decode the block runs (counted as running meanwhile)."""
        ...


class KVContext(Protocol):
    """What a session holds its KV rows in: a private :class:`Context`, or a slot of a context
    shared by the model's sessions (:class:`~specem_core.backends.llama_cpp._shared.Slot`)."""

    free_scratch: list[int]
    ballast: int
    held: list[int]
    copying: threading.Lock

    def reset(self) -> None: ...
    def truncate(self, seq: int, length: int) -> None: ...
    def try_truncate(self, seq: int, length: int) -> bool: ...
    def drop_ballast(self) -> None: ...
    def save_sequence(self) -> Any: ...
    def load_sequence(self, data: Any) -> bool: ...
    def share(self, src: int, dst: int, start: int, end: int) -> None: ...
    def take_scratch(self) -> int: ...
    def drop_scratch(self, seq: int) -> None: ...
    def decode(self, work: Work) -> Work: ...
    def stepping(self) -> AbstractContextManager[None]: ...
    def close(self) -> None: ...


class LlamaCppError(SpecEMError, RuntimeError):
    """llama.cpp refused a call (no KV slot left, no free context, a failed decode)."""


class NativeCalls:
    """The llama.cpp calls in flight, process-wide, with a gate that the interpreter's exit closes.

    Why: a thread still inside ``llama_decode`` when the process exits crashes it. CPython does not
    wait for daemon threads (``specem serve``'s request workers, the prefix-cache copies, any
    caller's), and C ``exit()`` then runs the C++ static destructors of llama.cpp's libraries:
    ggml-cpu's static vector of extra buffer types is freed while the decode's OpenMP workers still
    walk it in ``ggml_cpu_extra_compute_forward`` for every graph node, and the process dies with
    SIGSEGV (status -11) after an otherwise clean run (llama-cpp-python 0.3.36; reproduced by
    ``scripts/repro/llama_cpp_exit_race.py``; docs/guides/reliability.md, "A clean exit").

    The workaround: the calls that run llama.cpp's compute threads or take long (decode, KV-row
    copies) and the calls that free its objects go through :meth:`call`; an ``atexit`` handler
    (Python runs those before finalization, while daemon threads still run) closes the gate and
    waits for the calls in flight (:data:`EXIT_WAIT_SECONDS` at most). A call tried after that
    raises :class:`LlamaCppError`; frees are skipped (the process is ending).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the gate is closed (the interpreter is exiting)."""
        return self._closed

    @property
    def inside(self) -> int:
        """Threads inside a gated llama.cpp call now."""
        return self._inside

    @contextlib.contextmanager
    def call(self, what: str) -> Iterator[None]:
        """Around one llama.cpp call (``what`` names it in the error).

        Raises:
            LlamaCppError: the interpreter is exiting; no llama.cpp call starts any more.
        """
        with self._cond:
            if self._closed:
                raise LlamaCppError(f"{what}: the process is exiting, llama.cpp calls are stopped")
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                if self._inside == 0:
                    self._cond.notify_all()

    def close(self, timeout: float | None = EXIT_WAIT_SECONDS) -> bool:
        """Let no call start any more, and wait (at most ``timeout`` seconds) for the calls in
        flight to return. Returns whether none is left."""
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: self._inside == 0, timeout)


NATIVE_CALLS = NativeCalls()
"""The gate every llama.cpp call that may run at exit goes through (see :class:`NativeCalls`)."""


def _close_native_calls() -> None:
    """``atexit``: no llama.cpp call runs when the C++ static destructors do."""
    if not NATIVE_CALLS.close():
        _log.warning(
            "exiting while %d llama.cpp call(s) still run after %.0fs: the process may crash at exit",
            NATIVE_CALLS.inside,
            EXIT_WAIT_SECONDS,
        )


def load_library() -> Any:
    """The llama_cpp ctypes module, initialised once (quiet unless its logger says otherwise)."""
    global _BACKEND_READY
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelNotFoundError(
            "the llama.cpp backend needs llama-cpp-python: bash scripts/build_llama_cpp.sh "
            "(or pip install 'specem[llamacpp]')"
        ) from exc
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            log = logging.getLogger("llama-cpp-python")
            if log.level == logging.NOTSET:  # llama.cpp prints every load step otherwise
                log.setLevel(logging.CRITICAL)
            llama_cpp.llama_backend_init()
            atexit.register(_close_native_calls)
            _BACKEND_READY = True
    return llama_cpp


def default_threads() -> int:
    """Threads per decode: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        n = os.cpu_count() or 2
    return max(1, min(n, 8))


@dataclass
class Work:
    """Tokens to decode in one context, and what to read back.

    ``outputs`` has one entry per token: ``None`` (no logits), ``-1`` (copy the full row) or a
    token id (return its raw logit and log-prob; the full row too when the index is in
    ``full_rows``)."""

    tokens: list[int]
    positions: list[int]
    seqs: list[int]
    outputs: list[int | None]
    full_rows: set[int] = field(default_factory=set)
    aligned: bool = False
    """A prompt prefill: with ``history_invariant`` in a private context it is split where a
    position is divisible by :data:`INVARIANT_CHUNK`, as a cold prefill of the same prompt is."""
    stats: dict[int, tuple[float, float]] = field(default_factory=dict)
    rows: dict[int, Any] = field(default_factory=dict)

    def read_row(self, index: int, lib: Any, ctx: Any, batch_index: int, n_vocab: int) -> None:
        """After the decode call that held token ``index`` at ``batch_index``: keep what
        ``outputs[index]`` asks of its logits row (the row, and/or the target's raw logit and
        log-prob)."""
        import numpy as np

        want = self.outputs[index]
        if want is None:
            return
        row = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, batch_index), shape=(n_vocab,))
        if want < 0 or index in self.full_rows:
            self.rows[index] = row.astype(np.float32, copy=True)
        if want >= 0:
            top = float(row.max())
            raw = float(row[want])
            self.stats[index] = (raw, raw - top - math.log(float(np.exp(row - top).sum())))


class SequenceBook:
    """The sequences of one session's KV rows: cutting them, and the free scratch sequences (shared
    by a private :class:`Context` and a slot of a shared one)."""

    free_scratch: list[int]
    name: str
    """The model's name, for errors."""

    def try_truncate(self, seq: int, length: int) -> bool:
        raise NotImplementedError

    def truncate(self, seq: int, length: int) -> None:
        """Keep positions ``[0, length)`` of ``seq``."""
        if not self.try_truncate(seq, length):
            raise LlamaCppError(f"{self.name}: could not remove positions >= {length} of sequence {seq}")

    def take_scratch(self) -> int:
        if not self.free_scratch:
            raise LlamaCppError(f"{self.name}: more than {SCRATCH_SEQUENCES} candidates in one pass")
        return self.free_scratch.pop()

    def drop_scratch(self, seq: int) -> None:
        self.truncate(seq, 0)
        self.free_scratch.append(seq)


class Context(SequenceBook):
    """One ``llama_context``: a KV cache with sequence 0 for a session and scratch sequences."""

    def __init__(self, model: LoadedModel) -> None:
        lib = model.lib
        self._lib = lib
        self._model = model
        self.name = model.name
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = model.n_ctx
        cparams.n_batch = model.n_batch
        cparams.n_ubatch = model.n_batch
        cparams.n_seq_max = 2 + SCRATCH_SEQUENCES
        cparams.n_outputs_max = MAX_OUTPUTS
        cparams.n_threads = model.n_threads
        cparams.n_threads_batch = model.n_threads
        cparams.kv_unified = True  # sequences share cells: a candidate forks the prefix for free
        cparams.no_perf = True
        cparams.flash_attn_type = model.flash_attn_type
        ctx = lib.llama_init_from_model(model.handle, cparams)
        if not ctx:
            raise LlamaCppError(f"{model.name}: llama.cpp could not create a context (n_ctx={model.n_ctx})")
        self._ctx = ctx
        self.threads = model.n_threads
        """Threads its decodes use now (``llama_set_n_threads`` before a decode that wants others)."""
        self._mem = lib.llama_get_memory(ctx)
        self._batch = lib.llama_batch_init(model.n_batch, 0, 1)
        self.free_scratch = list(range(SCRATCH_SEQUENCES, 0, -1))
        self.decode_calls = 0
        self.ballast = 0
        """Cells (an upper bound) retired to the ballast sequence since the context was last cleared."""
        self.held: list[int] = []
        """Token ids of sequence 0's rows while the context waits in the prefix cache."""
        self.copying = threading.Lock()
        """Held while a background copy reads sequence 0's rows (see the model's prefix cache)."""

    def reset(self) -> None:
        """Forget every KV row (the context goes back to the pool)."""
        self._lib.llama_memory_clear(self._mem, True)
        self.free_scratch = list(range(SCRATCH_SEQUENCES, 0, -1))
        self.ballast = 0
        self.held = []

    def drop_ballast(self) -> None:
        """Free the cells retired to the ballast sequence (safe only when every cell of sequence 0
        lies below them: the context then holds sequence 0's rows alone, in cell order)."""
        self._lib.llama_memory_seq_rm(self._mem, BALLAST, 0, -1)
        self.ballast = 0

    def try_truncate(self, seq: int, length: int) -> bool:
        """Keep positions ``[0, length)`` of ``seq``; False where llama.cpp cannot cut the sequence
        there (recurrent or hybrid memory): nothing was removed."""
        return bool(self._lib.llama_memory_seq_rm(self._mem, seq, length, -1))

    def save_sequence(self) -> Any:
        """Sequence 0's KV rows as a byte array (``llama_state_seq_get_data``, one copy into an
        uninitialised numpy buffer): a prefix another context can load while this one serves its
        own request."""
        import numpy as np

        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, 0))
        buf = np.empty(size, dtype=np.uint8)
        pointer = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        with NATIVE_CALLS.call(f"{self._model.name}: llama_state_seq_get_data"):
            written = int(lib.llama_state_seq_get_data(self._ctx, pointer, size, 0))
        return buf[:written]

    def load_sequence(self, data: Any) -> bool:
        """Fill sequence 0 of this (empty) context from :meth:`save_sequence`'s array; False when
        llama.cpp refuses it (nothing is loaded then). The rows land in cells 0.. in position
        order, so the session's cell-order rule holds."""
        pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        with NATIVE_CALLS.call(f"{self._model.name}: llama_state_seq_set_data"):
            loaded = int(self._lib.llama_state_seq_set_data(self._ctx, pointer, int(data.size), 0))
        if loaded == 0:
            self.reset()
            return False
        return True

    def share(self, src: int, dst: int, start: int, end: int) -> None:
        """Let ``dst`` see positions ``[start, end)`` of ``src`` (cells are shared, not copied)."""
        self._lib.llama_memory_seq_cp(self._mem, src, dst, start, end)

    def stepping(self) -> AbstractContextManager[None]:
        """Around a draft or a verification (a private context waits for no other session)."""
        return contextlib.nullcontext()

    def decode(self, work: Work) -> Work:
        """Run ``work`` (split into calls of at most ``n_batch`` tokens and ``MAX_OUTPUTS`` rows) with
        the threads the model chooses now (see :mod:`specem_core.backends.llama_cpp._threads`)."""
        with self._model.decode_threads() as threads:
            if threads != self.threads:
                self._lib.llama_set_n_threads(self._ctx, threads, threads)
                self.threads = threads
            by_threads = self._model.decodes_by_threads
            by_threads[threads] = by_threads.get(threads, 0) + 1
            return self._decode(work)

    def _decode(self, work: Work) -> Work:

        lib, model = self._lib, self._model
        n_vocab = model.n_vocab
        i = 0
        n = len(work.tokens)
        aligned = work.aligned and model.chunk_invariant
        while i < n:
            batch = self._batch
            count = outputs = 0
            while i + count < n and count < model.n_batch:
                if aligned and count and work.positions[i + count] % INVARIANT_CHUNK == 0:
                    break
                wants = work.outputs[i + count] is not None
                if wants and outputs == MAX_OUTPUTS:
                    break
                b = count
                batch.token[b] = work.tokens[i + b]
                batch.pos[b] = work.positions[i + b]
                batch.n_seq_id[b] = 1
                batch.seq_id[b][0] = work.seqs[i + b]
                batch.logits[b] = 1 if wants else 0
                outputs += wants
                count += 1
            batch.n_tokens = count
            with NATIVE_CALLS.call(f"{model.name}: llama_decode"):
                status = int(lib.llama_decode(self._ctx, batch))
            note_decode()
            self.decode_calls += 1
            model.decode_calls += 1
            if status != 0:
                why = (
                    "no KV slot left (load the model with a larger n_ctx)"
                    if status == 1
                    else f"llama_decode returned {status}"
                )
                raise LlamaCppError(f"{model.name}: {why}")
            for b in range(count):
                work.read_row(i + b, lib, self._ctx, b, n_vocab)
            i += count
        return work

    def close(self) -> None:
        """Free the context (skipped once the process is exiting: see :class:`NativeCalls`)."""
        with contextlib.suppress(LlamaCppError), NATIVE_CALLS.call(f"{self._model.name}: llama_free"):
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)


def logsumexp(np: Any, row: Any) -> float:
    """log(sum(exp(row))), computed stably."""
    top = float(row.max())
    return top + math.log(float(np.exp(row - top).sum()))


def incomplete_utf8(data: bytes) -> bool:
    """True when ``data`` ends inside a multi-byte UTF-8 character."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data, final=False)
    return bool(decoder.getstate()[0])


def requantize(
    source: str | os.PathLike[str], target: str | os.PathLike[str], ftype: str = "LLAMA_FTYPE_MOSTLY_Q4_1"
) -> Path:
    """Write ``source`` requantized to ``ftype`` (llama.cpp's own quantizer) at ``target``.

    Q4_1 is the type whose CPU kernels are batch-invariant (below 64 cached positions), so a member
    requantized to it makes decisions that do not depend on how its tokens were batched.

    Raises:
        ModelNotFoundError: ``source`` cannot be read or requantized.
    """
    lib = load_library()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, ftype)
    params.allow_requantize = True
    if lib.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise ModelNotFoundError(f"cannot requantize {source} to {ftype}")
    return Path(target)
