"""Continuous batching on llama.cpp: one ``llama_context`` whose forward passes serve every session.

With ``continuous_batching`` a :class:`~specem_core.backends.llama_cpp.LlamaCppModel` holds one
:class:`SharedContext` instead of a context per session. Its unified KV cache has room for
``max_contexts`` sessions of ``n_ctx`` cells each; a session takes a :class:`Slot` (16 sequence
ids: its own, the scratch sequences of its candidates, its ballast), which offers what a private
:class:`~specem_core.backends.llama_cpp._binding.Context` does, so the session code is the same.

A slot's decode work (draft steps, verification blocks, prefills, catch-up of committed text) is
queued; whichever waiting thread finds the context free runs one ``llama_decode`` call over the
work of *every* session waiting at the time, as llama-server's slots share a batch: the weights
are read once per call for all of them (what pays where a decode step is bound by reading them; on
two CPU cores the batched kernels are compute-bound from a few rows on). The
thread starting a call waits up to :data:`GATHER_S` for the sessions inside a
draft or a verification on this model that have not queued their next step yet, so that
concurrent requests fall into step. A call takes one-token steps first, then fills the rest of
``n_batch`` tokens with the longer work in arrival order (a long prompt's prefill is chunked
across calls, with other sessions' steps riding along). Every llama.cpp call on the context
(decode, KV edits, state copies) runs under one lock: llama.cpp's context is not thread-safe.

What it does not keep by default: with the packaged weight types llama.cpp's kernels are not
batch-invariant (docs/guides/how-it-works.md, "Exactness"), so a request's logits then depend on
what shares its calls, and a session's rows may land in cells below its older ones once another
session frees cells (the cell-order difference). With ``history_invariant`` too, the context runs
row-invariant kernels (:mod:`specem_core.backends.llama_cpp._invariant`: micro-batches of at most
63 tokens, a padding token where one would hold a single token) and frees no cell below a live one: removed rows are
*retired* to a context-wide ballast sequence, so every session's new rows land above its older
ones, as alone. The ballast is freed when no request is running (:meth:`SharedContext.compact`:
the cached prefixes are copied out and loaded back at the bottom of the cache), or, if the cells
run out first, during a call (counted in :attr:`SharedStats.order_breaks`; a request then running
may differ from its answer alone). Measured in docs/reports/performance.md, "Continuous batching
on llama.cpp".
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specem_core.backends.llama_cpp._binding import (
    BALLAST,
    MAX_OUTPUTS,
    NATIVE_CALLS,
    SCRATCH_SEQUENCES,
    LlamaCppError,
    LoadedModel,
    SequenceBook,
    Work,
)
from specem_core.backends.llama_cpp._invariant import INVARIANT_UBATCH, PAD_TOKENS, note_decode

SLOT_SEQUENCES = 2 + SCRATCH_SEQUENCES
"""Sequence ids of one slot: its session's (0), scratch sequences (1..14), its ballast (15)."""
MAX_SLOTS = 256 // SLOT_SEQUENCES
"""llama.cpp's ``LLAMA_MAX_SEQ`` (256) sequence ids, 16 per slot."""
_log = logging.getLogger(__name__)
GATHER_S = 0.02
"""How long the thread starting a call waits at most for the steps of the other sessions inside a
draft or a verification on the model. A session needs about a millisecond between two steps, but
the sessions pick their tokens one after another (Python's lock), so sixteen need more than 5 ms;
a step that misses a call would run beside it on the same cores instead (measured in the
Performance report, "Continuous batching on llama.cpp")."""


@dataclass
class SharedStats:
    """What a shared context's calls did (for tests, benchmarks and ``/health``-style reporting)."""

    calls: int = 0
    """``llama_decode`` calls."""
    shared_calls: int = 0
    """Calls that served more than one session."""
    jobs: int = 0
    """Pieces of work served (a job spread over several calls counts once per call)."""
    largest: int = 0
    """The most sessions one call served."""
    tokens: int = 0
    """Tokens decoded."""
    seconds: float = 0.0
    """Seconds spent in ``llama_decode`` and reading its rows."""
    padded_calls: int = 0
    """Calls that carried a padding token so that no micro-batch holds one token (row-invariant kernels)."""
    compactions: int = 0
    """Times the ballast was freed with no request running (row-invariant kernels)."""
    order_breaks: int = 0
    """Times the ballast was freed during a call because the cells ran out: requests then running
    may have rows below their older ones (row-invariant kernels)."""

    @property
    def sessions_per_call(self) -> float:
        """Mean sessions served per call (1.0: nothing was shared)."""
        return self.jobs / self.calls if self.calls else 0.0


@dataclass(eq=False)
class _Job:
    """One slot's :class:`Work`, waiting for (or part way through) the shared calls."""

    base: int
    work: Work
    done_tokens: int = 0
    done: bool = False
    error: BaseException | None = None

    @property
    def left(self) -> int:
        return len(self.work.tokens) - self.done_tokens


@dataclass
class _Piece:
    """The tokens ``[start, start + count)`` of a job, at batch indices ``[at, at + count)``."""

    job: _Job
    start: int
    count: int
    at: int
    outputs: list[int] = field(default_factory=list)


class SharedContext:
    """One ``llama_context`` with a unified KV cache shared by ``slots`` sessions (see the module)."""

    def __init__(self, model: LoadedModel, slots: int, gather_s: float = GATHER_S) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise LlamaCppError(f"{model.name}: continuous batching serves 1 to {MAX_SLOTS} sessions, not {slots}")
        lib = model.lib
        self._lib = lib
        self._model = model
        self.name = model.name
        self.slots = slots
        self.invariant = model.batch_invariant
        """Row-invariant kernels, and no cell freed below a live one (see the module)."""
        # row-invariant kernels: every slot's ballast is the context's, so the slots' own ballast ids
        # are free; the first slot's serves as the context's ballast, the second's as the padding's
        self.ballast_seq = BALLAST
        """The context-wide ballast: the cells sessions removed, kept occupied (row-invariant kernels)."""
        self.pad_seq = SLOT_SEQUENCES + BALLAST
        """The sequence of the padding token (row-invariant kernels)."""
        self.retired = 0
        """Cells (an upper bound) held by the context-wide ballast."""
        self.n_ctx = model.n_ctx * slots
        """KV cells in all: each slot's ``n_ctx`` window, so no session runs short of cells."""
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = model.n_batch
        cparams.n_ubatch = min(model.n_batch, INVARIANT_UBATCH) if self.invariant else model.n_batch
        self.n_ubatch = int(cparams.n_ubatch)
        """Tokens of one micro-batch (llama.cpp splits a call into them)."""
        cparams.n_seq_max = max(slots, 2 if self.invariant else 1) * SLOT_SEQUENCES
        cparams.n_outputs_max = max(MAX_OUTPUTS, cparams.n_seq_max)  # llama.cpp asks n_seq_max at least
        cparams.n_threads = model.n_threads
        cparams.n_threads_batch = model.n_threads
        cparams.kv_unified = True
        cparams.no_perf = True
        cparams.flash_attn_type = model.flash_attn_type
        ctx = lib.llama_init_from_model(model.handle, cparams)
        if not ctx:
            raise LlamaCppError(
                f"{model.name}: llama.cpp could not create a shared context of {self.n_ctx} cells "
                f"({slots} sessions x n_ctx={model.n_ctx}; lower max_contexts or n_ctx)"
            )
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        self._batch = lib.llama_batch_init(model.n_batch + PAD_TOKENS, 0, 1)
        self.threads = model.n_threads
        self.gather_s = gather_s
        self.native = threading.Lock()
        """Held around every llama.cpp call on the context (llama.cpp's context is not thread-safe)."""
        self.stats = SharedStats()
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._busy = False
        self._stepping: dict[int, int] = {}
        """Slots (by base) inside a draft or a verification, and how many blocks each is in."""
        self._free_bases = [i * SLOT_SEQUENCES for i in reversed(range(slots))]
        self._live = 0
        self._closed = False

    # -- slots -------------------------------------------------------------------------------
    def take_slot(self) -> Slot:
        """A slot with no rows (the model's pool decides when one is free)."""
        with self._cond:
            if not self._free_bases:
                raise LlamaCppError(f"{self._model.name}: all {self.slots} slots of the shared context are taken")
            base = self._free_bases.pop()
            self._live += 1
        return Slot(self, base)

    def release_slot(self, slot: Slot) -> None:
        """``slot`` is freed (its rows were removed): its sequence ids serve another session."""
        with self._cond:
            self._free_bases.append(slot.base)
            self._live -= 1
            free = self._closed and self._live == 0
        if free:
            self._free()

    def close(self) -> None:
        """Free the context once no slot is left (now, or when the last one is released)."""
        with self._cond:
            self._closed = True
            free = self._live == 0
        if free:
            self._free()

    def _free(self) -> None:
        import contextlib

        with contextlib.suppress(LlamaCppError), NATIVE_CALLS.call(f"{self._model.name}: llama_free"):
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)

    # -- KV edits (under the context's lock) ---------------------------------------------------
    def seq_rm(self, seq: int, start: int, end: int) -> bool:
        """Remove positions ``[start, end)`` of ``seq`` (``-1``: open); with row-invariant kernels
        their cells are retired to the context-wide ballast instead of freed."""
        lib = self._lib
        with self.native:
            if self.invariant:
                low = int(lib.llama_memory_seq_pos_min(self._mem, seq))
                high = int(lib.llama_memory_seq_pos_max(self._mem, seq))
                if high < 0:  # the sequence holds no row
                    return True
                first = max(low, start if start >= 0 else 0)
                last = min(high + 1, end if end >= 0 else high + 1)
                self._retire(seq, first, last)
            return bool(lib.llama_memory_seq_rm(self._mem, seq, start, end))

    def retire(self, seq: int, start: int, end: int) -> None:
        """Keep the cells of ``seq`` in ``[start, end)`` occupied by the context's ballast."""
        with self.native:
            self._retire(seq, start, end)

    def _retire(self, seq: int, start: int, end: int) -> None:
        """(Context lock held.) :meth:`retire`."""
        if end > start:
            self._lib.llama_memory_seq_cp(self._mem, seq, self.ballast_seq, start, end)
            self.retired += end - start

    def compact(self, keep: list[Slot]) -> bool:
        """(No request running; row-invariant kernels.) Free the ballast: the rows of the slots in
        ``keep`` (sequence 0 each: cached prefixes) are copied to host memory, the cache is cleared
        and they are loaded back from its first cell up, in order, so that no freed cell lies below
        a kept one. Returns False when a prefix could not be loaded back (its slot is then empty)."""
        copies = [(slot, self.save_sequence(slot.base)) for slot in keep]
        with self.native:
            self._lib.llama_memory_clear(self._mem, False)
        self.retired = 0
        self.stats.compactions += 1
        loaded = True
        for slot, data in copies:
            slot.ballast = 0
            slot.free_scratch = list(range(SCRATCH_SEQUENCES, 0, -1))
            if not self.load_sequence(data, slot.base):
                slot.held = []
                loaded = False
        return loaded

    def seq_cp(self, src: int, dst: int, start: int, end: int) -> None:
        with self.native:
            self._lib.llama_memory_seq_cp(self._mem, src, dst, start, end)

    def save_sequence(self, seq: int) -> Any:
        import numpy as np

        lib = self._lib
        with self.native:
            size = int(lib.llama_state_seq_get_size(self._ctx, seq))
            buf = np.empty(size, dtype=np.uint8)
            pointer = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            with NATIVE_CALLS.call(f"{self._model.name}: llama_state_seq_get_data"):
                written = int(lib.llama_state_seq_get_data(self._ctx, pointer, size, seq))
        return buf[:written]

    def load_sequence(self, data: Any, seq: int) -> bool:
        pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        with self.native, NATIVE_CALLS.call(f"{self._model.name}: llama_state_seq_set_data"):
            return int(self._lib.llama_state_seq_set_data(self._ctx, pointer, int(data.size), seq)) != 0

    # -- shared calls ------------------------------------------------------------------------------
    def stepping(self, base: int) -> _Stepping:
        """Around a draft or a verification of the slot at ``base``: its steps are worth waiting for."""
        return _Stepping(self, base)

    def decode(self, base: int, work: Work) -> Work:
        """Run ``work`` of the slot at ``base`` in shared calls; returns when all of it ran."""
        if not work.tokens:
            return work
        job = _Job(base, work)
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()
            while not job.done:
                if self._busy:
                    self._cond.wait()
                    continue
                self._busy = True
                pieces = self._gather()
                self._cond.release()
                try:
                    self._run(pieces)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self._jobs = [j for j in self._jobs if not j.done]
                    self._cond.notify_all()
        if job.error is not None:
            raise job.error
        return work

    def _gather(self) -> list[_Piece]:
        """(Lock held, context claimed.) Wait briefly for the steps of the other stepping sessions,
        then plan one call: one-token steps first, then the rest in arrival order, up to
        ``n_batch`` tokens and :data:`MAX_OUTPUTS` logit rows."""
        deadline = time.monotonic() + self.gather_s
        while set(self._stepping) - {j.base for j in self._jobs}:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)
        order = sorted(self._jobs, key=lambda j: j.left > 1)  # stable: arrival order within each kind
        budget, outputs = self._model.n_batch, MAX_OUTPUTS
        pieces: list[_Piece] = []
        at = 0
        for job in order:
            work = job.work
            start = i = job.done_tokens
            end = len(work.tokens)
            while i < end and budget:
                wants = work.outputs[i] is not None
                if wants and not outputs:
                    break
                outputs -= wants
                budget -= 1
                i += 1
            if i > start:
                pieces.append(_Piece(job, start, i - start, at))
                at += i - start
            if not budget or not outputs:
                break
        return pieces

    def _run(self, pieces: list[_Piece]) -> None:
        """One ``llama_decode`` over ``pieces``; each job's rows are read back into its work."""

        lib, model, batch = self._lib, self._model, self._batch
        start_time = time.perf_counter()
        try:
            for piece in pieces:
                work, base = piece.job.work, piece.job.base
                for k in range(piece.count):
                    i, b = piece.start + k, piece.at + k
                    batch.token[b] = work.tokens[i]
                    batch.pos[b] = work.positions[i]
                    batch.n_seq_id[b] = 1
                    batch.seq_id[b][0] = base + work.seqs[i]
                    batch.logits[b] = 1 if work.outputs[i] is not None else 0
            batch.n_tokens = sum(p.count for p in pieces)
            n = batch.n_tokens
            # a micro-batch of one token (a lone step, or the last of a call llama.cpp splits into
            # n_ubatch tokens each) would take flash attention's split-KV path (see _invariant)
            padded = self.invariant and n % self.n_ubatch == 1
            if padded:
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = batch.token[0], 0, 1
                batch.seq_id[n][0], batch.logits[n] = self.pad_seq, 0
                batch.n_tokens = n + 1
                self.stats.padded_calls += 1
            with self._model.decode_threads() as threads, self.native:
                if threads != self.threads:
                    lib.llama_set_n_threads(self._ctx, threads, threads)
                    self.threads = threads
                model.decodes_by_threads[threads] = model.decodes_by_threads.get(threads, 0) + 1
                status = self._decode_call(batch)
                if status == 1 and self.invariant and self.retired:
                    self._break_order()
                    status = self._decode_call(batch)
                if padded:
                    lib.llama_memory_seq_rm(self._mem, self.pad_seq, -1, -1)
                model.decode_calls += 1
                if status != 0:
                    why = "no KV slot left" if status == 1 else f"llama_decode returned {status}"
                    raise LlamaCppError(f"{model.name}: {why} (shared context of {self.n_ctx} cells)")
                for piece in pieces:
                    for k in range(piece.count):
                        piece.job.work.read_row(piece.start + k, lib, self._ctx, piece.at + k, model.n_vocab)
        except BaseException as exc:  # every session in the call sees the failure (the engine retries)
            for piece in pieces:
                piece.job.error = exc
                piece.job.done = True
            return
        finally:
            self._record(pieces, time.perf_counter() - start_time)
        for piece in pieces:
            piece.job.done_tokens += piece.count
            piece.job.done = piece.job.left == 0

    def _decode_call(self, batch: Any) -> int:
        """(Context lock held.) One ``llama_decode``."""
        with NATIVE_CALLS.call(f"{self._model.name}: llama_decode"):
            status = int(self._lib.llama_decode(self._ctx, batch))
        note_decode()
        return status

    def _break_order(self) -> None:
        """(Context lock held.) The cells ran out with requests running: free the ballast anyway."""
        self._lib.llama_memory_seq_rm(self._mem, self.ballast_seq, -1, -1)
        self.stats.order_breaks += 1
        _log.warning(
            "%s: the shared context's cells ran out with %d retired; freed them during a call, so a request "
            "running now may differ from its answer alone (raise n_ctx or max_contexts)",
            self._model.name,
            self.retired,
        )
        self.retired = 0

    def _record(self, pieces: list[_Piece], seconds: float) -> None:
        stats = self.stats
        stats.calls += 1
        stats.jobs += len(pieces)
        stats.shared_calls += len(pieces) > 1
        stats.largest = max(stats.largest, len(pieces))
        stats.tokens += sum(p.count for p in pieces)
        stats.seconds += seconds


class _Stepping:
    """Counts a session as stepping on the shared context while the block runs."""

    def __init__(self, shared: SharedContext, base: int) -> None:
        self._shared = shared
        self._base = base

    def __enter__(self) -> None:
        shared = self._shared
        with shared._cond:
            shared._stepping[self._base] = shared._stepping.get(self._base, 0) + 1

    def __exit__(self, *exc: object) -> None:
        shared = self._shared
        with shared._cond:
            shared._stepping[self._base] -= 1
            if not shared._stepping[self._base]:
                del shared._stepping[self._base]
            shared._cond.notify_all()  # a call being gathered may stop waiting for this session


class Slot(SequenceBook):
    """A session's share of a :class:`SharedContext`: sequence ids ``base .. base + 15``, with the
    interface of a private :class:`~specem_core.backends.llama_cpp._binding.Context`."""

    def __init__(self, shared: SharedContext, base: int) -> None:
        self.shared = shared
        self.base = base
        self.name = shared.name
        self.free_scratch = list(range(SCRATCH_SEQUENCES, 0, -1))
        self.ballast = 0
        """Cells (an upper bound) retired to the ballast sequence since the slot was last cleared."""
        self.held: list[int] = []
        """Token ids of sequence 0's rows while the slot waits in the prefix cache."""
        self.copying = threading.Lock()
        """Held while a background copy reads sequence 0's rows (see the model's prefix cache)."""
        self._closed = False

    def reset(self) -> None:
        """Forget every KV row of the slot's sequences."""
        for seq in range(SLOT_SEQUENCES):
            if not (seq == BALLAST and self.shared.invariant):  # the context's ballast keeps its cells
                self.shared.seq_rm(self.base + seq, -1, -1)
        self.free_scratch = list(range(SCRATCH_SEQUENCES, 0, -1))
        self.ballast = 0
        self.held = []

    def try_truncate(self, seq: int, length: int) -> bool:
        return self.shared.seq_rm(self.base + seq, length, -1)

    def drop_ballast(self) -> None:
        if not self.shared.invariant:  # (row-invariant kernels: the context's ballast keeps them)
            self.shared.seq_rm(self.base + BALLAST, 0, -1)
        self.ballast = 0

    def save_sequence(self) -> Any:
        return self.shared.save_sequence(self.base)

    def load_sequence(self, data: Any) -> bool:
        if self.shared.load_sequence(data, self.base):
            return True
        self.reset()
        return False

    def share(self, src: int, dst: int, start: int, end: int) -> None:
        if dst == BALLAST and self.shared.invariant:  # retired: to the context's ballast
            self.shared.retire(self.base + src, start, end)
            return
        self.shared.seq_cp(self.base + src, self.base + dst, start, end)

    def fork(self, source: Slot, length: int) -> None:
        """Let this (empty) slot's sequence 0 see positions ``[0, length)`` of ``source``'s: the
        cells are shared, not copied (a cached prompt's rows, read by another request)."""
        self.shared.seq_cp(source.base, self.base, 0, length)

    def decode(self, work: Work) -> Work:
        return self.shared.decode(self.base, work)

    def stepping(self) -> _Stepping:
        return self.shared.stepping(self.base)

    def close(self) -> None:
        """Remove the slot's rows and give its sequence ids back."""
        if self._closed:
            return
        self._closed = True
        if not NATIVE_CALLS.closed:
            self.reset()
        self.shared.release_slot(self)
