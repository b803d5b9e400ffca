"""llama.cpp members in process (GGUF as shipped), through llama-cpp-python's low-level API.

How a session keeps SpecEM linear (SPEC §2), as the transformers backend does:

* One KV sequence per request holds ``prompt + enc(R)``; it is prefilled on first use (opening a
  session only encodes the prompt and checks the context window).
* Drafting continues from that sequence and records the raw logit and log-prob of every token it
  picks, so scoring its own candidate costs nothing.
* Verification scores all other candidates in **one** ``llama_decode`` call: each candidate gets a
  scratch sequence that shares the committed prefix (``llama_memory_seq_cp`` tags the prefix
  cells, nothing is copied); only the scored positions request logits, and the first token of a
  candidate is scored from the logits the session already holds.
* Commit keeps the drafter's own KV rows when its draft wins and otherwise adopts the winner's
  scored rows; when the committed text is not a scored candidate (cut at a stop string), it rolls
  back to the first changed token and feeds the rest.

Cells are never reused below a session's newest cell: with this llama.cpp (llama-cpp-python
0.3.36) a sequence whose newer position sits in a *lower* KV cell than an older one gets wrong
attention (measured: logits off by 0.3–0.5 against a from-scratch evaluation). So a session owns a
private ``llama_context`` that it fills upwards; cells below an adopted winner (the session's own
losing draft, earlier candidates) are retired to a ballast sequence instead of freed, and the
context is refilled in one batched prefill once the ballast outweighs the live prefix.

Text stays the source of truth: the committed response is re-encoded as a whole and compared with
the cached ids, exactly as in :mod:`specem_core.backends.transformers`.

Concurrency: one :class:`LlamaCppModel` holds the weights once (memory-mapped) and a pool of
contexts; each open session takes one, so concurrent requests run at the same time without ever
seeing each other's KV rows. The pool has ``max_contexts`` entries (more requests wait for one).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specem_core.backends._drafts import DraftState, common_prefix, mean_score, plan_scores
from specem_core.backends.base import MemberSession, SamplingParams, SessionRequest
from specem_core.chat_format import ChatFormat, JinjaChatTemplate
from specem_core.errors import ContextWindowError, ModelNotFoundError, SpecEMError
from specem_core.types import Candidate, CandidateScore, Draft

_UTF8_EXTRA_TOKENS = 4
"""Extra tokens a draft may take to finish a multi-byte character split by the length cap."""
_DEFAULT_N_CTX = 4096
_SCRATCH_SEQUENCES = 14
"""Candidates one verification pass can fork (sequence ids 1..14; 0 is the session)."""
_BALLAST = 15
"""Sequence that keeps cells below the session's newest cells occupied (see ``_retire``)."""
_CANDIDATE_ROOM = 256
"""KV cells kept free for the candidates of a verification pass (not part of the context window)."""
_COMPACT_AFTER = 192
"""Retired cells tolerated before a session refills its context (when they also exceed its length)."""
_MAX_OUTPUTS = 128
"""Logit rows one decode call may return (bounds the per-context output buffer)."""
_BACKEND_LOCK = threading.Lock()
_BACKEND_READY = False


class LlamaCppError(SpecEMError, RuntimeError):
    """llama.cpp refused a call (no KV slot left, no free context, a failed decode)."""


def _lib() -> Any:
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
class _Work:
    """Tokens to decode in one context, and what to read back.

    ``outputs`` has one entry per token: ``None`` (no logits), ``-1`` (copy the full row) or a
    token id (return its raw logit and log-prob; the full row too when the index is in
    ``full_rows``)."""

    tokens: list[int]
    positions: list[int]
    seqs: list[int]
    outputs: list[int | None]
    full_rows: set[int] = field(default_factory=set)
    stats: dict[int, tuple[float, float]] = field(default_factory=dict)
    rows: dict[int, Any] = field(default_factory=dict)


class _Context:
    """One ``llama_context``: a KV cache with sequence 0 for a session and scratch sequences."""

    def __init__(self, model: LlamaCppModel) -> None:
        lib = model._lib
        self._lib = lib
        self._model = model
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = model.n_ctx
        cparams.n_batch = model.n_batch
        cparams.n_ubatch = model.n_batch
        cparams.n_seq_max = 2 + _SCRATCH_SEQUENCES
        cparams.n_outputs_max = _MAX_OUTPUTS
        cparams.n_threads = model.n_threads
        cparams.n_threads_batch = model.n_threads
        cparams.kv_unified = True  # sequences share cells: a candidate forks the prefix for free
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(model._model, cparams)
        if not ctx:
            raise LlamaCppError(f"{model.name}: llama.cpp could not create a context (n_ctx={model.n_ctx})")
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        self._batch = lib.llama_batch_init(model.n_batch, 0, 1)
        self.free_scratch = list(range(_SCRATCH_SEQUENCES, 0, -1))
        self.decode_calls = 0

    def reset(self) -> None:
        """Forget every KV row (the context goes back to the pool)."""
        self._lib.llama_memory_clear(self._mem, True)
        self.free_scratch = list(range(_SCRATCH_SEQUENCES, 0, -1))

    def truncate(self, seq: int, length: int) -> None:
        """Keep positions ``[0, length)`` of ``seq``."""
        if not self._lib.llama_memory_seq_rm(self._mem, seq, length, -1):
            raise LlamaCppError(f"{self._model.name}: could not remove positions >= {length} of sequence {seq}")

    def share(self, src: int, dst: int, start: int, end: int) -> None:
        """Let ``dst`` see positions ``[start, end)`` of ``src`` (cells are shared, not copied)."""
        self._lib.llama_memory_seq_cp(self._mem, src, dst, start, end)

    def take_scratch(self) -> int:
        if not self.free_scratch:
            raise LlamaCppError(f"{self._model.name}: more than {_SCRATCH_SEQUENCES} candidates in one pass")
        return self.free_scratch.pop()

    def drop_scratch(self, seq: int) -> None:
        self.truncate(seq, 0)
        self.free_scratch.append(seq)

    def decode(self, work: _Work) -> _Work:
        """Run ``work`` (split into calls of at most ``n_batch`` tokens and ``_MAX_OUTPUTS`` rows)."""
        import numpy as np

        lib, model = self._lib, self._model
        n_vocab = model.n_vocab
        i = 0
        n = len(work.tokens)
        while i < n:
            batch = self._batch
            count = outputs = 0
            while i + count < n and count < model.n_batch:
                wants = work.outputs[i + count] is not None
                if wants and outputs == _MAX_OUTPUTS:
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
            status = int(lib.llama_decode(self._ctx, batch))
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
                want = work.outputs[i + b]
                if want is None:
                    continue
                row = np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, b), shape=(n_vocab,))
                if want < 0 or (i + b) in work.full_rows:
                    work.rows[i + b] = row.astype(np.float32, copy=True)
                if want >= 0:
                    top = float(row.max())
                    raw = float(row[want])
                    work.stats[i + b] = (raw, raw - top - math.log(float(np.exp(row - top).sum())))
            i += count
        return work

    def close(self) -> None:
        self._lib.llama_batch_free(self._batch)
        self._lib.llama_free(self._ctx)


class LlamaCppModel:
    """GGUF weights loaded once (memory-mapped), with a pool of contexts for concurrent sessions.

    Args:
        path: the ``.gguf`` file.
        n_ctx: KV cells of each context, i.e. the tokens one request may use (prompt + answer +
            one round of candidates); default 4096, at most the model's training context.
        n_threads: CPU threads per decode (default: the CPUs available, at most 8).
        n_batch: most tokens per ``llama_decode`` call (longer inputs are split).
        max_contexts: concurrent sessions (each holds one context; more wait for a free one).
        n_gpu_layers: layers offloaded to a GPU when llama-cpp-python was built with one.

    Raises:
        ModelNotFoundError: the file is missing, not a GGUF, truncated, or llama.cpp cannot load it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_batch: int = 512,
        max_contexts: int = 8,
        n_gpu_layers: int = 0,
        wait_seconds: float = 600.0,
    ) -> None:
        from specem_core.gguf import validate_gguf

        self.path = Path(path).expanduser()
        self.info = validate_gguf(self.path)  # a clear error before llama.cpp sees a bad file
        lib = _lib()
        self._lib = lib
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        model = lib.llama_model_load_from_file(str(self.path).encode("utf-8"), mparams)
        if not model:
            raise ModelNotFoundError(f"llama.cpp could not load {str(self.path)!r} (unsupported or damaged GGUF)")
        self._model = model
        self._vocab = lib.llama_model_get_vocab(model)
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(model))
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.n_ctx = min(n_ctx or _DEFAULT_N_CTX, self.n_ctx_train) if self.n_ctx_train else (n_ctx or _DEFAULT_N_CTX)
        self.n_threads = n_threads or default_threads()
        self.n_batch = n_batch
        self.max_contexts = max(1, max_contexts)
        self.wait_seconds = wait_seconds
        self._pool: list[_Context] = []
        self._created = 0
        self._in_use = 0
        self.peak_contexts_in_use = 0
        """Most contexts held at once since loading (concurrent sessions)."""
        self._pool_cond = threading.Condition()
        self._closed = False
        self.decode_calls = 0
        """How many ``llama_decode`` calls ran, all contexts together (for tests and benchmarks)."""
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
        # one context up front: it fails here, not in the first request, when memory is short
        self.release_context(self.acquire_context())

    def __repr__(self) -> str:
        return f"LlamaCppModel(path={str(self.path)!r}, n_ctx={self.n_ctx}, threads={self.n_threads})"

    @property
    def contexts_in_use(self) -> int:
        """Contexts held by open sessions right now."""
        return self._in_use

    # -- context pool -----------------------------------------------------------------------
    def acquire_context(self) -> _Context:
        """A context for one session: a pooled one, a new one, or the next one released."""
        deadline = time.monotonic() + self.wait_seconds
        with self._pool_cond:
            while True:
                if self._closed:
                    raise LlamaCppError(f"{self.name}: the model was closed")
                if self._pool:
                    self._take()
                    return self._pool.pop()
                if self._created < self.max_contexts:
                    self._created += 1
                    self._take()
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LlamaCppError(
                        f"{self.name}: all {self.max_contexts} llama.cpp contexts stayed busy "
                        f"for {self.wait_seconds:.0f}s (raise max_contexts)"
                    )
                self._pool_cond.wait(left)
        try:
            return _Context(self)
        except BaseException:
            with self._pool_cond:
                self._created -= 1
                self._in_use -= 1
                self._pool_cond.notify()
            raise

    def _take(self) -> None:
        self._in_use += 1
        self.peak_contexts_in_use = max(self.peak_contexts_in_use, self._in_use)

    def release_context(self, context: _Context) -> None:
        """Clear ``context`` and return it to the pool."""
        context.reset()
        with self._pool_cond:
            self._in_use -= 1
            if self._closed:
                context.close()
            else:
                self._pool.append(context)
            self._pool_cond.notify()

    # -- metadata and vocabulary ------------------------------------------------------------
    def _meta(self, key: str) -> str | None:
        size = 1 << 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = int(self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, size))
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1
        return None

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text`` (``parse_special``: control-token text such as ``<|im_start|>`` is one token)."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        for _ in range(2):
            out = (ctypes.c_int32 * cap)()
            n = int(self._lib.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special))
            if n >= 0:
                return list(out[:n])
            cap = -n
        raise LlamaCppError(f"{self.name}: tokenization failed")

    def piece(self, token: int) -> bytes:
        """The bytes one token stands for (control tokens render as nothing)."""
        return self._all_pieces()[token] if 0 <= token < self.n_vocab else b""

    def _all_pieces(self) -> list[bytes]:
        if self._pieces is None:
            buf = ctypes.create_string_buffer(256)
            pieces = []
            for t in range(self.n_vocab):
                n = int(self._lib.llama_token_to_piece(self._vocab, t, buf, 256, 0, False))
                pieces.append(buf.raw[:n] if n > 0 else b"")
            self._pieces = pieces
        return self._pieces

    def piece_texts(self) -> list[str]:
        """Each token's bytes as text ('' where they are not whole UTF-8 characters); computed once
        per model, shared by its members (token healing)."""
        if self._texts is None:
            texts = []
            for piece in self._all_pieces():
                try:
                    texts.append(piece.decode("utf-8"))
                except UnicodeDecodeError:
                    texts.append("")
            self._texts = texts
        return self._texts

    def token_attrs(self) -> list[int]:
        """``llama_token_attr`` flags of every token."""
        if self._attrs is None:
            self._attrs = [int(self._lib.llama_vocab_get_attr(self._vocab, t)) for t in range(self.n_vocab)]
        return self._attrs

    def end_of_generation_ids(self) -> frozenset[int]:
        """Tokens that end a generation (EOS, EOT, ``<|im_end|>``…)."""
        if self._eog is None:
            self._eog = frozenset(t for t in range(self.n_vocab) if self._lib.llama_vocab_is_eog(self._vocab, t))
        return self._eog

    def token_text(self, token: int) -> str:
        """The text of one token as rendered in a chat template (special tokens included)."""
        buf = ctypes.create_string_buffer(256)
        n = int(self._lib.llama_token_to_piece(self._vocab, token, buf, 256, 0, True))
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    def close(self) -> None:
        """Free the pooled contexts and the weights (contexts still in use are freed on release)."""
        with self._pool_cond:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, []
            self._pool_cond.notify_all()
        for context in pool:
            context.close()
        if self._in_use == 0:
            self._lib.llama_model_free(self._model)

    def __del__(self) -> None:  # pragma: no cover - depends on garbage collection
        with contextlib.suppress(Exception):
            self.close()


class LlamaCppMember:
    """A GGUF model run by llama.cpp in process, as a SpecEM member.

    Example:
        >>> member = LlamaCppMember.from_gguf("qwen2.5-coder-0.5b-instruct.gguf")     # doctest: +SKIP
        >>> model = LlamaCppModel("model.gguf", n_ctx=16384)                           # doctest: +SKIP
        >>> a = LlamaCppMember(model, name="a"); b = LlamaCppMember(model, name="b")   # shared weights

    Args:
        model: a loaded :class:`LlamaCppModel` (shareable between members and requests).
        name: unique name in the ensemble (default: the GGUF's ``general.name``).
        can_draft / can_verify: the member's roles.
        chat_template: overrides the GGUF's ``tokenizer.chat_template``; a model without one uses
            the plain format of :mod:`specem_core.chat_format`.
    """

    def __init__(
        self,
        model: LlamaCppModel,
        *,
        name: str | None = None,
        can_draft: bool = True,
        can_verify: bool = True,
        chat_template: str | None = None,
    ) -> None:
        self.model = model
        self.name = name or model.name
        self.can_draft = can_draft
        self.can_verify = can_verify
        template = chat_template or model.chat_template
        bos = model.token_text(model.bos_id) if model.bos_id >= 0 else ""
        eos = model.token_text(model.eos_id) if model.eos_id >= 0 else ""
        self.chat = ChatFormat(JinjaChatTemplate(template, bos, eos) if template else None, template)
        self.stop_ids = model.end_of_generation_ids()
        self.eot_id = self._find_end_of_turn()
        control = 1 << 3  # LLAMA_TOKEN_ATTR_CONTROL
        # Control tokens other than the end of turn never belong in a drafted answer.
        self.suppress_ids = sorted(
            t for t, attr in enumerate(model.token_attrs()) if attr & control and t not in self.stop_ids
        )
        self._extending: dict[str, list[int]] = {}
        self._concatenates: bool | None = None

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        can_draft: bool = True,
        can_verify: bool = True,
        chat_template: str | None = None,
        **model_kwargs: Any,
    ) -> LlamaCppMember:
        """Load ``path`` (keyword arguments go to :class:`LlamaCppModel`: ``n_ctx``, ``n_threads``…)."""
        model = LlamaCppModel(path, **model_kwargs)
        return cls(model, name=name, can_draft=can_draft, can_verify=can_verify, chat_template=chat_template)

    # -- Member protocol --------------------------------------------------------------------
    @property
    def context_window(self) -> int | None:
        """Tokens one request may use: a context's cells less room for one round of candidates."""
        return self.model.n_ctx - min(_CANDIDATE_ROOM, self.model.n_ctx // 2)

    @property
    def draft_cost(self) -> int:
        """Relative cost of a drafted token: the GGUF's size (the engine lets cheaper members draft
        first, so that costlier ones can reuse their tokens; ``SpecEMConfig.draft_hints``)."""
        return self.model.info.file_size  # read once, when the model was validated

    @property
    def concurrency_key(self) -> str:
        """All llama.cpp members of a process share its CPUs: within a request they run one after another."""
        return "llamacpp:cpu"

    def open(self, request: SessionRequest) -> LlamaCppSession:
        """Render and encode the prompt; the prefill waits for the first draft or score."""
        return LlamaCppSession(self, request)

    def __repr__(self) -> str:
        return (
            f"LlamaCppMember(name={self.name!r}, path={str(self.model.path)!r}, "
            f"draft={self.can_draft}, verify={self.can_verify})"
        )

    # -- tokenizer helpers ------------------------------------------------------------------
    def encode_prompt(self, request: SessionRequest) -> list[int]:
        """The member's own chat-formatted prompt as token ids."""
        text = self.chat.render(request.messages, request.tools)
        # Templates write BOS themselves; the plain format needs the tokenizer's own BOS.
        return self.model.tokenize(text, add_special=not self.chat.uses_template, parse_special=True)

    def encode_response(self, text: str) -> list[int]:
        """Canonical ids of the response text (no special tokens are parsed in model output)."""
        return self.model.tokenize(text, add_special=False, parse_special=False) if text else []

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.model.piece(t) for t in ids)

    def token_text(self, token: int) -> str:
        """The text one token stands for alone ('' for tokens that are not whole characters)."""
        texts = self._token_texts()
        return texts[token] if 0 <= token < len(texts) else ""

    def tokens_extending(self, prefix: str) -> list[int]:
        """Ids of the (non-special) tokens whose text starts with ``prefix`` (cached per prefix)."""
        if prefix not in self._extending:
            banned = set(self.stop_ids) | set(self.suppress_ids)
            self._extending[prefix] = [
                i for i, t in enumerate(self._token_texts()) if t.startswith(prefix) and i not in banned
            ]
            if len(self._extending) > 4096:
                self._extending.pop(next(iter(self._extending)))
        return list(self._extending[prefix])

    def token_texts_concatenate(self) -> bool:
        """True when the tokens' texts joined give the text back (byte-level BPE)."""
        if self._concatenates is None:
            probe = "Hello world. It's 2024, e.g. www.example.com!"
            ids = self.encode_response(probe)
            self._concatenates = bool(ids) and "".join(self.token_text(i) for i in ids) == probe
        return self._concatenates

    def _token_texts(self) -> list[str]:
        return self.model.piece_texts()

    def _find_end_of_turn(self) -> int:
        after = self.chat.end_of_turn_text()
        if after:
            ids = self.model.tokenize(after, add_special=False, parse_special=True)
            if ids and ids[0] in self.stop_ids:
                return int(ids[0])
        for candidate in (self.model.eot_id, self.model.eos_id):
            if candidate >= 0:
                return candidate
        raise ModelNotFoundError(f"{self.name}: the GGUF defines no EOS / end-of-turn token")


@dataclass
class _Row:
    """A candidate scored in this round's pass, kept in case it wins and its rows can be adopted."""

    seq: int
    full_ids: list[int]
    start: int
    """First position of the row (the committed length when it adds to the committed ids)."""
    cache_len: int
    """Sequence length after the candidate's text tokens (EOS excluded)."""
    next_logits: Any
    """Logits after the last text token."""
    hint: bool = False
    """Scored before this session drafted (a hint): the draft's own cells lie above it."""
    text_ids: list[int] = field(default_factory=list)
    """The candidate's tokens after the committed ids (hints that extend them)."""
    step_logits: list[Any] = field(default_factory=list)
    """Logits after each of ``text_ids`` (hints that extend the committed ids): speculative drafting."""


@dataclass
class _Scratch:
    """Cells ``[start, end)`` of a scratch sequence, in allocation order within the session."""

    seq: int
    start: int
    end: int
    kept: int = 0
    """Leading positions the session's own sequence took over (a hint the draft agreed with)."""
    below: bool = False
    """The session's draft continued past these cells: they lie below its newest cell."""


class LlamaCppSession(MemberSession):
    """One request's state in a :class:`LlamaCppMember` (see the module docstring)."""

    def __init__(self, member: LlamaCppMember, request: SessionRequest) -> None:
        import numpy as np

        self._m = member
        self._model = member.model
        self._np = np
        self._prompt_ids = member.encode_prompt(request)
        if not self._prompt_ids:
            raise ContextWindowError(f"{member.name}: the prompt encodes to no tokens")
        window = member.context_window
        if window and len(self._prompt_ids) + 2 > window:
            raise ContextWindowError(
                f"the prompt is {len(self._prompt_ids)} tokens for member {member.name!r}, "
                f"whose context window is {window}"
            )
        self._text = ""
        self._resp_ids: list[int] = []
        self._rng = np.random.default_rng(request.seed)
        self._ctx: _Context | None = None
        self._length = 0
        """Positions of the session's sequence (0) held in the KV cache."""
        self._committed_logits: Any = None
        """Next-token logits after the committed prefix."""
        self._next_logits: Any = None
        """Next-token logits after the last position held (the committed prefix, or a draft)."""
        self._draft: DraftState | None = None
        self._rows: dict[str, _Row] = {}
        self._scratch: list[_Scratch] = []
        """This round's candidate rows, in allocation order."""
        self._early: dict[tuple[str, bool], CandidateScore] = {}
        """Scores of this round's hints, by (text, end of turn scored), computed while drafting."""
        self._ballast = 0
        """Cells (an upper bound) retired to the ballast sequence since the last (re)fill."""
        self._behind: list[int] | None = None
        """The response ids the cache holds while committed text waits to be fed (``None``: up to date)."""
        self._closed = False

    # -- protocol ---------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        """Prompt length in this member's tokens."""
        return len(self._prompt_ids)

    @property
    def completion_tokens(self) -> int:
        """Committed response length in this member's tokens."""
        return len(self._resp_ids)

    def draft(
        self,
        max_tokens: int,
        sampling: SamplingParams,
        *,
        hints: Sequence[Candidate] = (),
        score_eos: bool = False,
    ) -> Draft:
        """Continue from the committed prefix by up to ``max_tokens`` tokens.

        ``hints`` (candidates drafted before this one) are scored first, in one decode call, and
        the draft then runs over their rows for as long as its own picks equal a hint's tokens:
        each agreeing token costs no decode step (speculative drafting, exact for any sampling:
        the picks are made from the same logits, with the same random stream).
        """
        self._to_committed()
        if sampling.token_healing:
            healed = self._draft_healed(max_tokens, sampling)
            if healed is not None:
                return healed
        rows = self._score_hints(hints, score_eos) if hints else []
        return self._draft_from(self._committed_logits, [], max_tokens, sampling, rows)

    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Mean raw logit and mean log-prob of each candidate's tokens, all in one decode call
        (hints scored while drafting are not scored again)."""
        self._ensure_prefilled()
        if not self._early:
            self._drop_scratch()
        out, pending = plan_scores(
            candidates,
            encode=self._m.encode_response,
            committed_text=self._text,
            committed_ids=self._resp_ids,
            draft=self._draft,
            score_eos=score_eos,
        )
        for n, text, _full, _lcp, with_eos in pending:
            out[n] = self._early.get((text, with_eos))
        pending = [p for p in pending if out[p[0]] is None]
        if pending:
            self._score_pass(pending, out)
        return [s if s is not None else CandidateScore() for s in out]

    def commit(self, text: str, *, final: bool = False) -> None:
        """Make ``committed + text`` the cached prefix (see the module docstring for the three paths)."""
        full = self._m.encode_response(self._text + text)
        draft, row = self._draft, self._rows.get(text)
        committed = self._committed_len()
        if final or self._ctx is None:
            pass  # accounting only: nobody continues from here (or nothing is cached yet)
        elif (
            draft is not None
            and draft.canonical
            and draft.text == text
            and not draft.ended
            and full == self._resp_ids + draft.ids
        ):
            self._drop_scratch(retire_below=True)  # hint rows under the draft stay occupied
            self._set_length(committed + draft.fed)
            unfed = draft.ids[draft.fed :]
            self._next_logits = self._feed(unfed) if unfed else self._next_logits
        elif row is not None and row.full_ids == full:
            self._adopt(row)
        else:  # text this session neither drafted nor scored: fed when the session is next used,
            # so a member that has stopped drafting (Model Exit) costs nothing while one candidate wins alone
            self._drop_scratch()
            self._set_length(committed)
            if self._behind is None:
                self._behind = self._resp_ids
        self._resp_ids = full
        self._text += text
        self._committed_logits = self._next_logits
        self._draft = None
        self._rows = {}
        if not final and self._ctx is not None and self._needs_compaction():
            self._compact()

    def close(self) -> None:
        """Return the session's context to the pool."""
        if self._closed:
            return
        self._closed = True
        ctx, self._ctx = self._ctx, None
        self._scratch.clear()
        if ctx is not None:
            self._model.release_context(ctx)
        self._draft = None
        self._rows = {}

    def __del__(self) -> None:  # pragma: no cover - a session the engine did not close
        with contextlib.suppress(Exception):
            self.close()

    # -- KV bookkeeping ---------------------------------------------------------------------
    def _committed_len(self) -> int:
        return len(self._prompt_ids) + len(self._resp_ids)

    def _ensure_prefilled(self) -> None:
        if self._closed:
            raise LlamaCppError(f"{self._m.name}: the session is closed")
        if self._ctx is None:
            self._ctx = self._model.acquire_context()
            self._length = self._ballast = 0
            self._next_logits = self._feed(self._prompt_ids + self._resp_ids)
            self._committed_logits = self._next_logits
        elif self._behind is not None:  # catch up with the deferred commits in one batch
            cached, self._behind = self._behind, None
            self._drop_scratch()
            self._extend_to(self._resp_ids, cached)
            self._committed_logits = self._next_logits

    def _feed(self, ids: Sequence[int]) -> Any:
        """Append ``ids`` to the session's sequence; return the next-token logits."""
        assert self._ctx is not None
        n = len(ids)
        work = _Work(list(ids), list(range(self._length, self._length + n)), [0] * n, [None] * (n - 1) + [-1])
        self._ctx.decode(work)
        self._length += n
        return work.rows[n - 1]

    def _set_length(self, n: int) -> None:
        assert self._ctx is not None
        if self._length > n:
            self._ctx.truncate(0, n)
            self._length = n

    def _to_committed(self) -> None:
        """Drop leftover draft positions and scratch sequences; the committed logits are known."""
        self._ensure_prefilled()
        self._drop_scratch()
        self._set_length(self._committed_len())
        self._next_logits = self._committed_logits

    def _extend_to(self, full: list[int], cached: list[int] | None = None) -> None:
        """Roll the sequence back to the common prefix of ``full`` and the cached response ids
        (``cached``, default the committed ones) and feed the rest."""
        lcp = common_prefix(self._resp_ids if cached is None else cached, full)
        start = len(self._prompt_ids) + lcp
        tail = full[lcp:]
        if not tail:  # nothing new: recompute the logits of the last kept token
            start -= 1
            tail = [(self._prompt_ids + full)[start]]
        self._set_length(start)
        self._next_logits = self._feed(tail)

    def _drop_scratch(self, *, retire_below: bool = False) -> None:
        """Free this round's candidate rows; with ``retire_below``, rows the session's sequence
        grew past (hints under its draft) are retired instead, since it keeps its newest cells."""
        assert self._ctx is not None
        while self._scratch:
            entry = self._scratch.pop()
            if retire_below and entry.below:
                self._retire(entry.seq, entry.start + entry.kept, entry.end)
            self._ctx.drop_scratch(entry.seq)
        self._rows = {}
        self._early = {}

    def _adopt(self, row: _Row) -> None:
        """Make the winner's scored rows the session's cache.

        Every cell allocated before the winner's (the session's draft, candidates earlier in the
        pass) lies below it: those are retired to the ballast sequence rather than freed, so the
        session never reuses a cell below its newest one; later cells are freed. A winning hint
        was scored before the draft: the draft's own cells lie above it, and those it took over
        from a hint belong to that hint's rows (retired or freed with them).
        """
        ctx = self._ctx
        assert ctx is not None
        if self._length > row.start:
            # below the winner: the draft's rows and committed rows it re-reads; a hint was scored
            # before the draft, so only the committed rows it re-reads (a boundary merge) lie below it
            below = min(self._length, self._committed_len()) if row.hint else self._length
            if below > row.start:
                self._retire(0, row.start, below)
            ctx.truncate(0, row.start)
        ctx.share(row.seq, 0, row.start, row.cache_len)
        for entry in self._scratch:
            if entry.seq == row.seq:
                break
            # positions the session took over from an earlier hint were retired with its own rows
            self._retire(entry.seq, entry.start if row.hint else entry.start + entry.kept, entry.end)
        self._drop_scratch()
        self._length = row.cache_len
        self._next_logits = row.next_logits

    def _retire(self, seq: int, start: int, end: int) -> None:
        """Keep the cells of ``seq`` in ``[start, end)`` occupied (by the ballast sequence)."""
        assert self._ctx is not None
        self._ctx.share(seq, _BALLAST, start, end)
        self._ballast += end - start

    def _needs_compaction(self) -> bool:
        """Ballast costs attention work and cells: rebuild once it outweighs the live prefix."""
        return self._ballast > max(_COMPACT_AFTER, self._length) or (
            self._length + self._ballast + _CANDIDATE_ROOM > self._model.n_ctx
        )

    def _compact(self) -> None:
        """Start the context afresh with the committed prefix (one batched prefill)."""
        assert self._ctx is not None
        self._ctx.reset()
        self._scratch.clear()
        self._behind = None
        self._ballast = 0
        self._length = 0
        self._committed_logits = self._next_logits = self._feed(self._prompt_ids + self._resp_ids)

    # -- drafting ---------------------------------------------------------------------------
    def _draft_from(
        self,
        logits: Any,
        allowed_first: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        hints: Sequence[_Row] = (),
    ) -> Draft:
        """The drafting loop from ``logits`` (the first pick limited to ``allowed_first`` when given).

        While the picks equal the tokens of one of ``hints`` (rows scored on the committed prefix),
        the next logits come from that hint's row instead of a decode step; the agreeing positions
        are then taken over from the hint's cells (shared, not recomputed)."""
        history = set(self._prompt_ids) | set(self._resp_ids)
        ids: list[int] = []
        scores: list[tuple[float, float]] = []
        eos_score: tuple[float, float] | None = None
        alive = [r for r in hints if r.step_logits]
        source: _Row | None = None
        hinted = reused = 0  # hinted: leading ids whose KV rows are source's, not yet the session's
        while True:
            token = self._pick(logits, sampling, history, allowed_first if not ids else None)
            score = (float(logits[token]), float(logits[token]) - _logsumexp(self._np, logits))
            if token in self._m.stop_ids:
                eos_score = score
                break
            ids.append(token)
            scores.append(score)
            history.add(token)
            if alive:
                at = len(ids) - 1
                alive = [r for r in alive if at < len(r.text_ids) and r.text_ids[at] == token]
                if alive:
                    source, hinted = alive[0], len(ids)
            if len(ids) >= max_tokens and (
                not _incomplete_utf8(self._m.decode_bytes(ids)) or len(ids) >= max_tokens + _UTF8_EXTRA_TOKENS
            ):
                break
            if sampling.stop_at_line_end and b"\n" in self._m.decode_bytes([token]):
                break
            if alive and source is not None:
                logits = source.step_logits[hinted - 1]
                continue
            if source is not None and hinted:
                self._take_hint_rows(source, hinted)
                reused, hinted = hinted, 0
            for entry in self._scratch:  # the draft's own cells now lie above the hints' rows
                entry.below = True
            logits = self._feed([token])
        if source is not None and hinted:
            self._take_hint_rows(source, hinted)
            reused = hinted
        ended = eos_score is not None
        fed = self._length - self._committed_len()
        canonical = True
        while ids and _incomplete_utf8(self._m.decode_bytes(ids)):  # never hand out half a character
            ids.pop()
            scores.pop()
            ended, eos_score, canonical = False, None, False
        text = self._m.decode_bytes(ids).decode("utf-8", errors="replace")
        for stop in self._m.chat.turn_stop_strings:
            cut = text.find(stop)
            if cut != -1:
                text, ended, canonical = text[:cut], True, False
        fed = min(fed, len(ids))
        self._draft = DraftState(ids, scores, eos_score, ended, text, fed, canonical)
        return Draft(text=text, ended=ended, tokens=len(ids) + (1 if eos_score is not None else 0), reused=reused)

    def _score_hints(self, hints: Sequence[Candidate], score_eos: bool) -> list[_Row]:
        """Score ``hints`` now (one decode call), keeping every row of those that extend the
        committed ids for speculative drafting; ``score`` answers for them from here."""
        out, pending = plan_scores(
            hints,
            encode=self._m.encode_response,
            committed_text=self._text,
            committed_ids=self._resp_ids,
            draft=None,
            score_eos=score_eos,
        )
        if not pending:
            return []
        self._score_pass(pending, out, hints=True)
        for n, text, _full, _lcp, with_eos in pending:
            score = out[n]
            if score is not None:
                self._early[(text, with_eos)] = score
        return [row for row in self._rows.values() if row.step_logits]

    def _take_hint_rows(self, row: _Row, n: int) -> None:
        """The session's sequence takes over the first ``n`` positions of a hint's row."""
        assert self._ctx is not None
        assert self._length == row.start
        self._ctx.share(row.seq, 0, row.start, row.start + n)
        for entry in self._scratch:
            if entry.seq == row.seq:
                entry.kept = n
        self._length = row.start + n
        self._next_logits = row.step_logits[n - 1]

    def _draft_healed(self, max_tokens: int, sampling: SamplingParams) -> Draft | None:
        """Token healing (see the transformers backend): redraw the last committed token among the
        tokens extending its text; None when not applicable."""
        if not self._resp_ids or not self._m.token_texts_concatenate():
            return None
        last = self._resp_ids[-1]
        tail = self._m.token_text(last)
        if not tail or not self._text.endswith(tail):
            return None
        allowed = self._m.tokens_extending(tail)
        if len(allowed) <= 1:
            return None  # only the token itself: nothing to heal
        n = self._committed_len()
        committed = self._prompt_ids + self._resp_ids
        saved_resp, saved_text = self._resp_ids, self._text
        self._set_length(n - 2)
        logits = self._feed([committed[n - 2]])  # next-token logits before the last committed token
        self._resp_ids, self._text = saved_resp[:-1], saved_text[: len(saved_text) - len(tail)]
        try:
            draft = self._draft_from(logits, allowed, max_tokens + 1, sampling)
        finally:
            self._resp_ids, self._text = saved_resp, saved_text
            self._set_length(n - 1)  # back to the committed prefix: the healed draft's KV is not reused
            self._committed_logits = self._next_logits = self._feed([committed[n - 1]])
        assert self._draft is not None
        if not draft.text.startswith(tail):
            self._draft = None
            return self._draft_from(self._committed_logits, [], max_tokens, sampling)
        text = draft.text[len(tail) :]
        self._draft = replace(self._draft, text=text, canonical=False)
        return Draft(text=text, ended=draft.ended, tokens=draft.tokens)

    def _pick(self, logits: Any, sampling: SamplingParams, history: set[int], allowed: list[int] | None) -> int:
        np = self._np
        work = logits
        banned = self._m.suppress_ids + (sorted(self._m.stop_ids) if sampling.ignore_eos else [])
        if banned or allowed or (sampling.repetition_penalty != 1.0 and history):
            work = logits.copy()
        if banned:
            work[banned] = -np.inf
        if allowed:
            mask = np.full_like(work, -np.inf)
            mask[allowed] = 0.0
            work = work + mask
        if sampling.repetition_penalty != 1.0 and history:
            idx = np.fromiter(sorted(history), dtype=np.int64)
            picked = work[idx]
            work[idx] = np.where(picked > 0, picked / sampling.repetition_penalty, picked * sampling.repetition_penalty)
        if sampling.temperature <= 0:
            return int(np.argmax(work))
        work = work.astype(np.float64) / sampling.temperature
        if sampling.top_k > 0:
            k = min(sampling.top_k, work.size)
            kth = np.partition(work, -k)[-k]
            work = np.where(work < kth, -np.inf, work)
        top = np.max(work)
        probs = np.exp(work - top)
        probs /= probs.sum()
        if sampling.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            sorted_probs = probs[order]
            keep = np.cumsum(sorted_probs) - sorted_probs < sampling.top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self._rng.choice(probs.size, p=probs))

    # -- verification -----------------------------------------------------------------------
    def _score_pass(
        self,
        pending: list[tuple[int, str, list[int], int, bool]],
        out: list[CandidateScore | None],
        *,
        hints: bool = False,
    ) -> None:
        """One decode call scoring ``pending``: one scratch sequence per candidate on the shared prefix.

        A candidate that adds to the committed ids starts at the committed length and its first
        token is scored from the committed logits; one that re-tokenizes part of the committed
        text (a boundary merge) starts one token before the first changed id, which it re-reads.
        With ``hints`` the rows of candidates that add to the committed ids keep the logits of
        every position (for speculative drafting).
        """
        ctx = self._ctx
        assert ctx is not None
        prompt_len = len(self._prompt_ids)
        committed_ids = self._prompt_ids + self._resp_ids
        committed = len(committed_ids)
        head_lse = _logsumexp(self._np, self._committed_logits)
        work = _Work([], [], [], [])
        plans: list[tuple[int, str, list[int], list[int], int, bool, int, int, int, int]] = []
        for n, text, full, lcp, with_eos in pending:
            text_ids = full[lcp:]
            targets = text_ids + ([self._m.eot_id] if with_eos else [])
            extends = lcp == len(self._resp_ids)
            # a row holds every text token (so that it can become the cache), plus the committed
            # token it re-reads when it does not extend the committed ids
            start = committed if extends else prompt_len + lcp - 1
            row = text_ids if extends else [committed_ids[start], *text_ids]
            first_target = 1 if extends else 0  # the row position p predicts targets[p + first_target]
            offset, seq = len(work.tokens), -1
            if row:
                seq = ctx.take_scratch()
                self._scratch.append(_Scratch(seq, start, start + len(row)))
                ctx.share(0, seq, 0, start)
                work.tokens += row
                work.positions += range(start, start + len(row))
                work.seqs += [seq] * len(row)
                for p in range(len(row)):
                    t = p + first_target
                    work.outputs.append(targets[t] if t < len(targets) else -1)
                if text_ids:
                    work.full_rows.add(offset + len(row) - 1)  # the logits after the text seed the next round
                if hints and extends:
                    work.full_rows.update(range(offset, offset + len(row)))
            plans.append((n, text, full, targets, first_target, extends, start, offset, len(row), seq))
        if work.tokens:
            ctx.decode(work)
        for n, text, full, targets, first_target, extends, start, offset, length, seq in plans:
            stats = [work.stats[offset + p] for p in range(length) if p + first_target < len(targets)]
            if extends:
                raw = float(self._committed_logits[targets[0]])
                stats.insert(0, (raw, raw - head_lse))
            out[n] = mean_score(stats)
            if seq >= 0 and length and text not in self._rows and (offset + length - 1) in work.rows:
                steps = [work.rows[offset + p] for p in range(length)] if hints and extends else []
                self._rows[text] = _Row(
                    seq,
                    full,
                    start,
                    start + length,
                    work.rows[offset + length - 1],
                    hint=hints,
                    text_ids=full[len(self._resp_ids) :] if steps else [],
                    step_logits=steps,
                )


def _logsumexp(np: Any, row: Any) -> float:
    top = float(row.max())
    return top + math.log(float(np.exp(row - top).sum()))


def _incomplete_utf8(data: bytes) -> bool:
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
    lib = _lib()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, ftype)
    params.allow_requantize = True
    if lib.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise ModelNotFoundError(f"cannot requantize {source} to {ftype}")
    return Path(target)


def evaluate_from_scratch(model: LlamaCppModel, ids: Sequence[int], positions: Callable[[int], bool]) -> dict[int, Any]:
    """Logit rows of ``ids`` evaluated in a fresh context (no cache reuse): the reference the
    tests and the naive loop compare the cached sessions with. ``positions(i)`` selects rows."""
    ctx = model.acquire_context()
    try:
        n = len(ids)
        work = _Work(list(ids), list(range(n)), [0] * n, [-1 if positions(i) else None for i in range(n)])
        return ctx.decode(work).rows
    finally:
        model.release_context(ctx)


def batch_noise(model: LlamaCppModel, ids: Sequence[int]) -> float:
    """How far ``model``'s logits move when ``ids`` are decoded one token per call instead of in one
    batch (max |diff| over every position's raw logits). llama.cpp's kernels are batch-invariant
    for some quantization types only: 0.0 for Q4_1 below 64 positions, about 0.3-0.5 for Qwen2.5's
    Q4_K/Q5_0/Q6_K rows, several units for Gemma 3. A cached session mixes both schedules, so it
    cannot be closer to one from-scratch evaluation than this."""
    batched = evaluate_from_scratch(model, ids, lambda i: True)
    ctx = model.acquire_context()
    try:
        worst = 0.0
        for i, token in enumerate(ids):
            row = ctx.decode(_Work([token], [i], [0], [-1])).rows[0]
            worst = max(worst, float(abs(row - batched[i]).max()))
        return worst
    finally:
        model.release_context(ctx)


def generate_greedy(
    model: LlamaCppModel, ids: Sequence[int], max_tokens: int, *, banned: Sequence[int] = ()
) -> list[int]:
    """Plain greedy decoding of one model, one token per ``llama_decode`` (no ensemble): the floor
    the speed benchmark compares the engine with. ``banned`` tokens (e.g. EOS) are never picked."""
    import numpy as np

    ctx = model.acquire_context()
    try:
        out: list[int] = []
        feed, pos = list(ids), 0
        while len(out) < max_tokens:
            n = len(feed)
            row = ctx.decode(_Work(feed, list(range(pos, pos + n)), [0] * n, [None] * (n - 1) + [-1])).rows[n - 1]
            pos += n
            if banned:
                row[list(banned)] = -np.inf
            out.append(int(np.argmax(row)))
            feed = [out[-1]]
        return out
    finally:
        model.release_context(ctx)
