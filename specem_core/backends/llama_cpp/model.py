"""GGUF weights loaded once, with a pool of llama.cpp contexts that keeps finished requests' KV rows.

A session takes a context for its request and gives it back at the end. With the prefix cache on
(the default), the context comes back *with* its rows and their token ids, and the next request
takes the context whose rows share the longest prefix with its prompt: it drops the rows past the
common prefix and prefills only the rest, as llama-cpp-python's ``Llama`` and the llama.cpp
server's slots do. The number of cached tokens is bounded per model (``prefix_cache_tokens``);
contexts past it are freed, least recently used first.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

from specem_core.backends._prefix_cache import (
    DEFAULT_PREFIX_CACHE_TOKENS,
    MIN_SHARED_FRACTION,
    PrefixMatch,
    PrefixStore,
    check_prefix_cache_tokens,
)
from specem_core.backends.llama_cpp._binding import (
    CANDIDATE_ROOM,
    COMPACT_AFTER,
    DEFAULT_N_CTX,
    INVARIANT_CHUNK,
    NATIVE_CALLS,
    Context,
    KVContext,
    LlamaCppError,
    default_threads,
    load_library,
)
from specem_core.backends.llama_cpp._invariant import require_row_invariant_kernels
from specem_core.backends.llama_cpp._shared import MAX_SLOTS, SharedContext, Slot
from specem_core.backends.llama_cpp._threads import free_cores
from specem_core.backends.llama_cpp._vocab import GgufVocabulary
from specem_core.errors import ConfigError, ModelNotFoundError

KV_BUDGET_BYTES = 256 * 2**20
"""The KV-cache memory one context may take by default (256 MiB): the default ``n_ctx`` is the
model's training context, capped at the largest power of two of cells whose f16 K and V rows fit
this budget, and never below :data:`~specem_core.backends.llama_cpp._binding.DEFAULT_N_CTX`
(4096). Each context holds its whole buffer (up to ``max_contexts`` of them per model, idle ones
kept for the prefix cache), so the budget is per context. Qwen2.5-1.5B (28 KiB a cell): 8192
cells, 224 MiB; Qwen2.5-0.5B (12 KiB): 16384 cells, 192 MiB; SmolLM2-135M (23 KiB, trained on
8192): 8192 cells, 184 MiB. Pass ``n_ctx`` for more (``member_kwargs={"n_ctx": 32768}``)."""

SNAPSHOT_MIN_TOKENS = 256
"""Finished prefixes at least this long are also copied to host memory (a few ms per thousand
tokens), so that concurrent requests sharing them (a served system prompt) each load them."""


class LlamaCppModel(GgufVocabulary):
    """GGUF weights loaded once (memory-mapped), with a pool of contexts for concurrent sessions.

    Args:
        path: the ``.gguf`` file.
        n_ctx: KV cells of each context, i.e. the tokens one request may use (prompt + answer +
            one round of candidates); at most the model's training context. Default: the training
            context capped by the per-context KV budget :data:`KV_BUDGET_BYTES` (see
            :func:`default_n_ctx`; 8192 for Qwen2.5-1.5B, 16384 for Qwen2.5-0.5B).
        n_threads: CPU threads per decode. ``"auto"`` (the default; ``None`` too): before each
            decode, as many as the cores other processes leave free, shared with this process's
            other decodes running at the time, between 1 and the CPUs available (at most 8), so
            that a busy CPU slows decoding down in proportion instead of stalling llama.cpp's
            spinning threads (see :mod:`specem_core.backends.llama_cpp._threads`; measured in
            docs/reports/performance.md, "A busy CPU"). An int pins the count.
        n_batch: most tokens per ``llama_decode`` call (longer inputs are split).
        max_contexts: concurrent sessions (each holds one context; more wait for a free one).
        n_gpu_layers: layers offloaded to a GPU when llama-cpp-python was built with one.
        flash_attention: llama.cpp's flash attention on (``True``) or off (``False``); default
            (``None``): see :func:`default_flash_attention` (off on a CPU, except for Q4_1 weights
            and with ``continuous_batching``).
        prefix_cache: keep a finished request's KV rows with its context, so that a request
            sharing a prefix with it (the next turn of a chat, the same system prompt or RAG
            context) prefills only what is new (see :meth:`acquire_for_prompt`).
        prefix_cache_tokens: the budget of the prefix cache, in tokens: each idle context that
            keeps rows is charged its ``n_ctx`` cells (past the budget the least recently used is
            freed), and the host-memory copies of long prefixes may hold as many tokens again
            (default :data:`~specem_core.backends._prefix_cache.DEFAULT_PREFIX_CACHE_TOKENS`: two idle
            contexts of 8,192 cells).
        history_invariant: a request's greedy answer does not depend on what ran before it or
            beside it in the process. With private contexts (the default), prompts are prefilled
            in chunks of :data:`~specem_core.backends.llama_cpp._binding.INVARIANT_CHUNK` tokens at
            positions divisible by it, and the prefix cache hands a later request only rows such a
            prefill computed, in whole chunks, in a context that holds nothing else: the rows it
            reuses are bit for bit the ones a cold prefill computes (llama.cpp's kernels are not
            batch-invariant for most weight types, so a row computed in another batch shape, such
            as a decoded answer token, would differ). With ``continuous_batching`` it takes the
            kernels' route instead: llama.cpp runs only paths whose result for a row does not
            depend on the other rows of its call (see :mod:`specem_core.backends.llama_cpp._invariant`;
            it sets ``GGML_CPU_TILED_MM=0`` for the process), and the shared context frees no KV
            cell below a live one; every row is then reusable. Decodes use ``n_threads`` threads
            whatever the load (``"auto"``'s maximum), since the thread count moves flash
            attention's logits too. The price is measured in docs/reports/performance.md
            ("History-invariant answers", "Continuous batching on llama.cpp").
        continuous_batching: concurrent sessions share ``llama_decode`` calls: the model holds
            one context whose unified KV cache has ``n_ctx`` cells for each of ``max_contexts``
            sessions (allocated at load: ``max_contexts`` times one context's KV memory), and the
            draft steps, verification blocks and prefill chunks of every session waiting at the
            time run in one call, so that the weights are read once for all of them (see
            :mod:`specem_core.backends.llama_cpp._shared`). More tokens per second with several
            requests at once; a request's logits then depend on what shares its calls (llama.cpp's
            kernels are not batch-invariant for most weight types) unless ``history_invariant``
            is set too. Flash attention is on unless ``flash_attention`` says otherwise (its
            kernel skips the cells of other sessions; with ``history_invariant`` it must be on).
            Measured in docs/reports/performance.md, "Continuous batching on llama.cpp".

    Raises:
        ConfigError: more than :data:`~specem_core.backends.llama_cpp._shared.MAX_SLOTS`
            ``max_contexts`` with ``continuous_batching``, ``flash_attention=False`` with it and
            ``history_invariant``, or both after another llama.cpp model decoded in the process
            with ggml's tiled matmul on.
        ModelNotFoundError: the file is missing, not a GGUF, truncated, or llama.cpp cannot load it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_ctx: int | None = None,
        n_threads: int | Literal["auto"] | None = "auto",
        n_batch: int = 512,
        max_contexts: int = 8,
        n_gpu_layers: int = 0,
        flash_attention: bool | None = None,
        wait_seconds: float = 600.0,
        prefix_cache: bool = True,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        history_invariant: bool = False,
        continuous_batching: bool = False,
    ) -> None:
        from specem_core.gguf import validate_gguf

        self.path = Path(path).expanduser()
        self.info = validate_gguf(self.path)  # a clear error before llama.cpp sees a bad file
        threads = thread_setting(n_threads)
        for name, flag in (("history_invariant", history_invariant), ("continuous_batching", continuous_batching)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        if flash_attention is not None and not isinstance(flash_attention, bool):
            raise ConfigError(f"flash_attention must be True, False or None, got {flash_attention!r}")
        self.batch_invariant = continuous_batching and history_invariant
        """Row-invariant kernels in a shared context (:mod:`._invariant`)."""
        if self.batch_invariant:
            require_row_invariant_kernels(self.path.name, flash_attention)
        lib = load_library()
        self.lib = lib
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        if self.batch_invariant:
            mparams.use_extra_bufts = False  # repacked weights have a 4-row GEMM and a 1-row GEMV
        model = lib.llama_model_load_from_file(str(self.path).encode("utf-8"), mparams)
        if not model:
            raise ModelNotFoundError(f"llama.cpp could not load {str(self.path)!r} (unsupported or damaged GGUF)")
        self.handle = model
        self._vocab = lib.llama_model_get_vocab(model)
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(model))
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        """f16 K and V bytes of one KV cell, all layers (from the GGUF's shapes; 0 when unknown)."""
        if n_ctx is None:
            n_ctx = default_n_ctx(self.n_ctx_train, self.kv_bytes_per_token)
        self.n_ctx = min(n_ctx, self.n_ctx_train) if self.n_ctx_train else n_ctx
        self.auto_threads, self.n_threads = threads
        """``auto_threads``: the count follows the free cores, up to ``n_threads``; else it is ``n_threads``."""
        if self.auto_threads:
            free_cores().estimate()  # the first reading: the first decode then sees a window
        self.n_batch = n_batch
        self.file_type = self._file_type()
        # continuous batching: one KV cache holds every session's rows; the flash-attention kernel
        # skips the cells another session's mask hides, the other path reads them all
        shared_default = continuous_batching and flash_attention is None
        self.flash_attn_type = -1 if shared_default else flash_attn_type(flash_attention, self.file_type, n_gpu_layers)
        """llama.cpp's ``flash_attn_type``: -1 its own choice (on for these builds), 0 off, 1 on."""
        self.max_contexts = max(1, max_contexts)
        self.wait_seconds = wait_seconds
        self._pool: list[KVContext] = []
        """Idle contexts holding no rows."""
        self.prefix_cache = prefix_cache
        self.history_invariant = history_invariant
        self.chunk_invariant = history_invariant and not continuous_batching
        """History invariance by aligned prefill chunks (private contexts; see ``history_invariant``)."""
        if continuous_batching and self.max_contexts > MAX_SLOTS:
            raise ConfigError(
                f"continuous_batching serves at most {MAX_SLOTS} sessions (max_contexts), not {self.max_contexts}"
            )
        self.continuous_batching = continuous_batching
        self.shared: SharedContext | None = None
        """With continuous batching, the context every session's slot lives in."""
        self.prefix_cache_tokens = check_prefix_cache_tokens(prefix_cache_tokens)
        self.prefixes: PrefixStore[KVContext] = PrefixStore(
            self.prefix_cache_tokens, self._free_context, cost=len if continuous_batching else lambda _: self.n_ctx
        )
        """Idle contexts holding a finished request's rows, by their token ids; each is charged the
        ``n_ctx`` cells it reserves (a slot of the shared context, allocated anyway: its rows)."""
        self.snapshots: PrefixStore[Any] = PrefixStore(self.prefix_cache_tokens)
        """Copies of finished requests' rows in host memory (``llama_state_seq_get_data``): what
        concurrent requests sharing a prefix load into contexts of their own, while the context
        that holds the rows serves one of them."""
        self._copying: set[threading.Thread] = set()
        """Background copies in progress (:meth:`settle` waits for them)."""
        self._created = 0
        self._in_use = 0
        self.peak_contexts_in_use = 0
        """Most contexts held at once since loading (concurrent sessions)."""
        self._pool_cond = threading.Condition()
        self._closed = False
        self.decode_calls = 0
        """How many ``llama_decode`` calls ran, all contexts together (for tests and benchmarks)."""
        self.decodes_by_threads: dict[int, int] = {}
        """How many :meth:`Context.decode` calls (each one or more ``llama_decode``) ran with each
        thread count (for benchmarks: what ``n_threads="auto"`` chose)."""
        self.chat_template: str | None = self._meta("tokenizer.chat_template")
        self.name = (self._meta("general.name") or self.path.stem).strip()
        self.architecture = self._meta("general.architecture") or ""
        self.bos_id = int(lib.llama_vocab_bos(self._vocab))
        self.eos_id = int(lib.llama_vocab_eos(self._vocab))
        self.eot_id = int(lib.llama_vocab_eot(self._vocab))
        self._pieces: list[bytes] | None = None
        self._texts: list[str] | None = None
        self._attrs: list[int] | None = None
        self._eog: frozenset[int] | None = None
        if continuous_batching:
            self.shared = SharedContext(self, self.max_contexts)
        # one context up front: it fails here, not in the first request, when memory is short
        self.release_context(self.acquire_context())

    def __repr__(self) -> str:
        threads = f"'auto' (at most {self.n_threads})" if self.auto_threads else str(self.n_threads)
        return f"LlamaCppModel(path={str(self.path)!r}, n_ctx={self.n_ctx}, threads={threads})"

    def decode_threads(self) -> AbstractContextManager[int]:
        """Threads for the decode the block runs: the pinned count, or what the free cores allow
        (the decode counts as running meanwhile, for the decodes that start beside it). With
        ``history_invariant`` always ``n_threads``: llama.cpp's flash-attention decode step splits
        the cached rows among its threads, so its logits change with their number. (Concurrent
        decodes then share the cores; letting them take turns instead measured slower:
        docs/reports/performance.md, "History-invariant answers".)"""
        if self.auto_threads and not self.history_invariant:
            return free_cores().decoding(self.n_threads)
        return contextlib.nullcontext(self.n_threads)

    @property
    def contexts_in_use(self) -> int:
        """Contexts held by open sessions right now."""
        return self._in_use

    # -- context pool -----------------------------------------------------------------------
    def acquire_context(self) -> KVContext:
        """An empty context for one session: a pooled one, a new one, or the next one released."""
        context, _ = self.acquire_for_prompt(())
        return context

    def acquire_for_prompt(self, prompt: Sequence[int]) -> tuple[KVContext, int]:
        """A context for a session whose prompt is ``prompt``, and how many of its leading tokens
        the context already holds (sequence 0, positions ``[0, reused)``; rows past them dropped).

        With the prefix cache on: the idle context sharing the longest prefix with ``prompt`` when
        it covers at least :data:`~specem_core.backends._prefix_cache.MIN_SHARED_FRACTION` of it, else an
        empty one (pooled or new), else the best partial match or the least recently used cached
        context, cleared; when every context is busy, the next one released.
        """
        deadline = time.monotonic() + self.wait_seconds
        wanted = max(1, math.ceil(MIN_SHARED_FRACTION * len(prompt)))
        # the context is chosen under the pool's lock; its rows are cut or loaded after it
        taken: KVContext | None = None
        reused = 0
        with self._pool_cond:
            while True:
                if self._closed:
                    raise LlamaCppError(f"{self.name}: the model was closed")
                if prompt and self.prefix_cache:
                    match = self.prefixes.find(prompt, min_reused=wanted, take=self.shared is None)
                    forked = self._fork(match, prompt) if match is not None and self.shared is not None else None
                    if forked is not None:  # a free slot sees the cached rows it shares (no copy)
                        taken, reused = forked, len(forked.held)
                        break
                    if match is not None and self.shared is not None:
                        match = self.prefixes.find(prompt, min_reused=wanted, take=True)
                    if match is not None:
                        taken, reused = match.entry.value, match.reused
                        break
                if self._pool:
                    taken = self._pool.pop()
                    break
                if self._created < self.max_contexts:
                    self._created += 1
                    break
                match = self.prefixes.find(prompt, take=True) if prompt else None
                if match is not None:  # a shorter match still beats clearing a context
                    taken, reused = match.entry.value, match.reused
                    break
                oldest = self.prefixes.pop_least_recent()
                if oldest is not None:
                    taken = oldest.value
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LlamaCppError(
                        f"{self.name}: all {self.max_contexts} llama.cpp contexts stayed busy "
                        f"for {self.wait_seconds:.0f}s (raise max_contexts)"
                    )
                self._pool_cond.wait(left)
            self._take()
        if taken is not None:
            with taken.copying:  # a background copy of its rows may still be reading them
                pass
            if taken.held and reused:
                return self._reuse(taken, reused, len(prompt))
            taken.reset()
            return self._load_snapshot(taken, prompt, wanted)
        try:
            context = self._new_context()
        except BaseException:
            with self._pool_cond:
                self._created -= 1
                self._in_use -= 1
                self._pool_cond.notify()
            raise
        return self._load_snapshot(context, prompt, wanted)

    def _load_snapshot(self, context: KVContext, prompt: Sequence[int], wanted: int) -> tuple[KVContext, int]:
        """An empty context, filled from the host-memory copy sharing the longest prefix with
        ``prompt`` when there is one (a concurrent request took the context holding those rows)."""
        if not (prompt and self.prefix_cache):
            return context, 0
        match = self.snapshots.find(prompt, min_reused=wanted)
        if match is None or not context.load_sequence(match.entry.value):
            return context, 0
        context.held = list(match.entry.ids)
        return self._reuse(context, match.reused, len(prompt))

    def _reuse(self, context: KVContext, reused: int, prompt_len: int) -> tuple[KVContext, int]:
        """Cut sequence 0 of a cached context to its first ``reused`` positions.

        The rows dropped are the newest of sequence 0, so the cells they free lie above every
        cell it keeps (the session's cell-order rule holds); the ballast stays occupied. A context
        whose memory cannot be cut (recurrent models), or whose ballast leaves too little room, is
        cleared instead, as is one whose ballast the session would refill at its first commit.
        """
        ballast = context.ballast
        if self.chunk_invariant:  # whole chunks only (the context holds no ballast then)
            reused -= reused % INVARIANT_CHUNK
        if (
            reused <= 0
            or ballast > max(COMPACT_AFTER, prompt_len)
            or ballast + prompt_len + CANDIDATE_ROOM > self.n_ctx
            or not context.try_truncate(0, reused)
        ):
            context.reset()
            return context, 0
        context.held = context.held[:reused]
        return context, reused

    def _fork(self, match: PrefixMatch[KVContext], prompt: Sequence[int]) -> KVContext | None:
        """(Pool lock held; continuous batching.) A free slot whose sequence 0 shares the cells of
        the first ``match.reused`` rows of the cached slot ``match`` (``llama_memory_seq_cp``), so
        that the cached slot keeps its whole rows for a request that extends them; None when the
        request extends all of them (it takes the cached slot itself) or no slot is free."""
        if match.reused >= len(match.entry.ids) or not (self._pool or self._created < self.max_contexts):
            return None
        assert self.shared is not None
        if self._pool:
            slot = self._pool.pop()
        else:
            slot = self.shared.take_slot()
            self._created += 1
        source = match.entry.value
        assert isinstance(source, Slot)
        assert isinstance(slot, Slot)
        slot.fork(source, match.reused)
        slot.held = list(prompt[: match.reused])
        return slot

    def _new_context(self) -> KVContext:
        """A private context, or with continuous batching a slot of the shared one."""
        if self.shared is None:
            return Context(self)
        return self.shared.take_slot()

    def _take(self) -> None:
        self._in_use += 1
        self.peak_contexts_in_use = max(self.peak_contexts_in_use, self._in_use)

    def release_context(self, context: KVContext, keep: Sequence[int] = ()) -> None:
        """Return ``context`` to the pool: cleared, or, with the prefix cache on and ``keep`` (the
        token ids of sequence 0's rows, which must be all it holds besides ballast), with its rows
        kept for a later request (the least recently used cached contexts are freed past the budget)."""
        cached = bool(keep) and self.prefix_cache and not self._closed
        if not cached:
            context.reset()
        else:
            context.held = list(keep)
        with self._pool_cond:
            self._in_use -= 1
            if self._closed:
                context.close()
            elif not cached:
                self._pool.append(context)
        if not cached:
            with self._pool_cond:
                self._pool_cond.notify()
            self._compact_when_idle()
            return
        # (not kept past the budget; a shared context's slots fork cached rows instead)
        copy = len(context.held) >= SNAPSHOT_MIN_TOKENS and self.n_ctx <= self.prefix_cache_tokens and not self.shared
        if copy:  # long prefixes are copied to host memory too, for concurrent requests, off the
            # request's path; a request that takes the context meanwhile waits for the copy
            context.copying.acquire()
        self.prefixes.add(context.held, context)  # may free older contexts (_free_context)
        with self._pool_cond:
            if copy:
                held = list(context.held)
                copier = threading.Thread(target=self._copy_rows, args=(context, held), daemon=True)
                self._copying.add(copier)
                copier.start()
            self._pool_cond.notify()
        self._compact_when_idle()

    def _compact_when_idle(self) -> None:
        """With row-invariant continuous batching: once no request runs and the shared context's
        ballast holds a slot's worth of cells, free it (the cached prefixes move to the bottom of
        the cache: :meth:`SharedContext.compact`)."""
        shared = self.shared
        if shared is None or not shared.invariant or shared.retired < self.n_ctx:
            return
        with self._pool_cond:
            if self._in_use or self._closed:
                return
            kept = [slot for slot in self.prefixes.values() if isinstance(slot, Slot)]
            loaded = shared.compact(kept)
        if not loaded:  # a prefix could not be loaded back: no cached slot is trusted to hold its rows
            self.prefixes.clear()

    def _copy_rows(self, context: KVContext, held: list[int]) -> None:
        try:
            with contextlib.suppress(LlamaCppError):  # the process is exiting: no copy is needed
                self.snapshots.add(held, context.save_sequence())
        finally:
            context.copying.release()
            with self._pool_cond:
                self._copying.discard(threading.current_thread())
                self._pool_cond.notify_all()

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until finished requests' rows are in the prefix cache (long prefixes are copied to
        host memory in the background first)."""
        deadline = time.monotonic() + timeout
        with self._pool_cond:
            while self._copying and time.monotonic() < deadline:
                self._pool_cond.wait(deadline - time.monotonic())

    def _free_context(self, context: KVContext) -> None:
        """Evicted from the prefix cache: free its memory (a new context is made when needed)."""
        with context.copying:
            context.close()
        with self._pool_cond:
            self._created -= 1
            self._pool_cond.notify()

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (their contexts are freed)."""
        self.prefixes.clear()
        self.snapshots.clear()

    # -- metadata and vocabulary ------------------------------------------------------------
    def _kv_bytes_per_token(self) -> int:
        """``n_layer × (n_embd_k_gqa + n_embd_v_gqa) × 2`` bytes (f16 cache) from the GGUF's
        ``<arch>.*`` keys; 0 when they are missing."""
        arch = self._meta("general.architecture") or ""

        def num(key: str) -> int:
            value = self._meta(f"{arch}.{key}")
            try:
                return int(value) if value is not None else 0
            except ValueError:
                return 0

        n_layer, n_embd, n_head = num("block_count"), num("embedding_length"), num("attention.head_count")
        n_head_kv = num("attention.head_count_kv") or n_head
        if not (n_layer and n_embd and n_head):
            return 0
        k_len = num("attention.key_length") or n_embd // n_head
        v_len = num("attention.value_length") or n_embd // n_head
        return n_layer * n_head_kv * (k_len + v_len) * 2

    def _file_type(self) -> int | None:
        """``general.file_type``: the weights' quantization (``LLAMA_FTYPE_*``), None when missing."""
        value = self._meta("general.file_type")
        return int(value) if value is not None and value.isdigit() else None

    def _meta(self, key: str) -> str | None:
        size = 1 << 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = int(self.lib.llama_model_meta_val_str(self.handle, key.encode(), buf, size))
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1
        return None

    def close(self) -> None:
        """Free the pooled contexts and the weights (contexts still in use are freed on release).

        Once the process is exiting (after the ``atexit`` handler of
        :class:`~specem_core.backends.llama_cpp._binding.NativeCalls`) nothing is freed: the memory
        goes with the process, and a daemon thread stopped by the interpreter's finalization may
        still hold this model's locks."""
        if NATIVE_CALLS.closed:
            return
        self.settle(timeout=10.0)
        with self._pool_cond:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, []
            self._pool_cond.notify_all()
        for context in pool:
            context.close()
        self.prefixes.clear()
        self.snapshots.clear()
        if self.shared is not None:
            self.shared.close()  # freed now, or when the last slot in use is released
        if self._in_use == 0:
            with contextlib.suppress(LlamaCppError), NATIVE_CALLS.call(f"{self.name}: llama_model_free"):
                self.lib.llama_model_free(self.handle)

    def __del__(self) -> None:  # pragma: no cover - depends on garbage collection
        with contextlib.suppress(Exception):
            self.close()


def thread_setting(n_threads: object) -> tuple[bool, int]:
    """``(auto, count)`` for a model's ``n_threads``: ``"auto"``/``None`` follow the free cores up
    to :func:`~specem_core.backends.llama_cpp.default_threads`; a positive int is pinned.

    Raises:
        ConfigError: anything else.
    """
    if n_threads is None or n_threads == "auto":
        return True, default_threads()
    if isinstance(n_threads, int) and not isinstance(n_threads, bool) and n_threads >= 1:
        return False, n_threads
    raise ConfigError(f"n_threads must be 'auto' or a positive int, got {n_threads!r}")


FTYPE_MOSTLY_Q4_1 = 3
"""``LLAMA_FTYPE_MOSTLY_Q4_1``: the weights whose CPU kernels are batch-invariant with flash attention."""


def default_flash_attention(file_type: int | None, n_gpu_layers: int) -> bool | None:
    """Flash attention for a model loaded without an explicit ``flash_attention``: ``None`` (llama.cpp's
    own choice, which turns it on) on a GPU and for Q4_1 weights, ``False`` for other weights on a CPU.

    Why: on a CPU, flash attention slows down the calls a follow-up turn is made of (a few new
    tokens on a long cached prefix, candidates scored on a long prompt); measured by
    ``benchmarks/multiturn.py`` (docs/reports/performance.md, "Follow-up turns and flash
    attention", with its memory figures). Q4_1 weights keep it: their kernels are batch-invariant only with
    it on, which is what makes their cached scores equal a fresh evaluation bit for bit; the other
    packaged types are batch-invariant neither way.
    """
    if n_gpu_layers != 0 or file_type == FTYPE_MOSTLY_Q4_1:
        return None
    return False


def flash_attn_type(flash_attention: bool | None, file_type: int | None, n_gpu_layers: int) -> int:
    """llama.cpp's ``flash_attn_type`` for a context: -1 (auto), 0 (disabled) or 1 (enabled)."""
    chosen = default_flash_attention(file_type, n_gpu_layers) if flash_attention is None else flash_attention
    return -1 if chosen is None else int(chosen)


def default_n_ctx(n_ctx_train: int, kv_bytes_per_token: int, budget: int = KV_BUDGET_BYTES) -> int:
    """The default context of a model: its training context (``n_ctx_train``; 0: unknown), capped
    at the largest power of two of cells whose KV rows fit ``budget`` bytes, and at least
    :data:`~specem_core.backends.llama_cpp._binding.DEFAULT_N_CTX` (or the training context when
    that is smaller)."""
    cells = DEFAULT_N_CTX
    if kv_bytes_per_token > 0:
        fit = budget // kv_bytes_per_token
        if fit >= DEFAULT_N_CTX:
            cells = 1 << (fit.bit_length() - 1)
    return min(cells, n_ctx_train) if n_ctx_train > 0 else cells
