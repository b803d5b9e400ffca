"""One request's state in a transformers member: how a session keeps SpecEM linear (SPEC §2).

* The committed prefix ``prompt + enc(R)`` lives in one ``DynamicCache``; it is prefilled once,
  on the session's first draft, score or commit (opening a session only renders, encodes and
  checks the context window, so a prompt that does not fit one member is rejected before any
  member does model work), from the longest prefix a finished request left in the member's prefix
  cache (``DynamicCache`` rows cropped to the common prefix).
* Drafting continues from that cache; the drafter records the raw logit and log-prob of every
  token it picks, so scoring its own candidate costs nothing when the candidate's canonical
  tokenization equals what it drafted.
* Verification is one forward pass over all other candidates, batched on the shared cache.
* The winner's KV rows from that pass become the new cache; the rest is dropped.
* Only the positions that are scored go through the LM head.
* Concurrent requests share the device: their forward passes run one at a time, and the one-token
  decode steps that several sessions of one model wait on are merged into one padded pass
  (the member's side: :mod:`specem_core.backends.transformers.batched`; ``request_batch_size=1``
  turns this off).

Text is the source of truth: the committed response ``R`` is re-encoded as a whole
(``enc(R + candidate)``) and compared with the cached ids, and the cache is rolled back to the
first differing token. Tokens that merge across a segment boundary, multi-byte characters split
between segments and a final word before EOS are therefore never lost or corrupted.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specem_core.backends._batching import DeviceQueue, Step
from specem_core.backends._local import LocalMember, LocalSession, consistent
from specem_core.backends._prefix_cache import PrefixStore
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.backends.transformers.batched import BatchSession, Block, ScoreJob
from specem_core.types import Candidate, CandidateScore, Draft

if TYPE_CHECKING:
    import torch

_DECODE_CONTEXT = 8
"""Committed tokens decoded with a draft, so that decoders that strip a leading space agree."""


@dataclass
class _Row:
    """A candidate scored in this round's batched pass, kept in case it wins."""

    batch_index: int
    full_ids: list[int]
    cache_len: int
    """Cache length after the candidate's last text token (EOS excluded)."""
    next_logits: Any


@dataclass
class _ScorePass:
    base: int
    layers: list[tuple[Any, Any]]
    pad: int = 0
    """Columns of left padding before the rows' KV (a pass merged with other sessions')."""
    rows: dict[str, _Row] = field(default_factory=dict)


class TransformersSessionMember(LocalMember, Protocol):
    """What a :class:`TransformersSession` needs of its member (a
    :class:`~specem_core.backends.transformers.member.TransformersMember`, which imports this
    module): the model, its device and tokenizer, the prefix cache and the batched passes."""

    model: Any
    device: Any
    cache_arg: str
    tokenizer: Any
    prefix_cache: bool
    prefixes: PrefixStore[list[tuple[Any, Any]]]
    eot_id: int
    stop_ids_in_vocab: list[int]

    def queue(self) -> DeviceQueue | None: ...
    def submit(self, queue: DeviceQueue, kind: str, payload: Any, run: Any) -> Any: ...
    def prefill_steps(self, steps: Sequence[Step[BatchSession]]) -> list[Any]: ...
    def decode_rows(self, steps: Sequence[Step[tuple[BatchSession, int]]]) -> list[Any]: ...
    def score_steps(self, steps: Sequence[Step[ScoreJob]]) -> list[Block]: ...
    def score_blocks(self, jobs: Sequence[ScoreJob]) -> list[Block]: ...


class TransformersSession(LocalSession):
    """One request's state in a :class:`TransformersMember` (see the module docstring)."""

    _m: TransformersSessionMember

    def __init__(self, member: TransformersSessionMember, request: SessionRequest) -> None:
        import torch
        from transformers import DynamicCache

        self._m = member
        self._torch = torch
        self._start(member, request)
        self._cache: Any = DynamicCache()  # layers are read and re-pointed directly (views, no copies)
        self._generator: torch.Generator | None = None
        if request.seed is not None:
            self._generator = torch.Generator(device="cpu")
            self._generator.manual_seed(request.seed)
        self._pass: _ScorePass | None = None
        self._next_logits: Any = None
        """Next-token logits after the cached committed prefix (``None`` until prefilled)."""
        self._prefilled = False

    # -- what merged passes need of this session (batched.BatchSession) --------------------
    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids."""
        return self._prompt_ids

    @property
    def kv(self) -> Any:
        """The ``DynamicCache`` of the committed prefix (and this round's draft rows)."""
        return self._cache

    def set_length(self, n: int) -> None:
        """Crop the cache to ``n`` positions (a view; no copy)."""
        self._set_length(n)

    # -- protocol ---------------------------------------------------------------------------
    def _draft_plain(
        self, max_tokens: int, sampling: SamplingParams, hints: Sequence[Candidate], score_eos: bool
    ) -> Draft:
        """``hints`` are not used by this backend: its batched verification already costs about one
        decode step."""
        return self._draft_from(self._next_logits, [], max_tokens, sampling)

    def _draft_from(self, logits: Any, allowed_first: list[int], max_tokens: int, sampling: SamplingParams) -> Draft:
        """The drafting loop from ``logits`` (the first pick limited to ``allowed_first`` when given)."""
        torch = self._torch
        history = set(self._prompt_ids) | set(self._resp_ids)
        ids: list[int] = []
        scores: list[tuple[float, float]] = []
        eos_score: tuple[float, float] | None = None
        queue = self._m.queue()
        drafting = queue.drafting((id(self._m.model), "decode")) if queue is not None else nullcontext()
        with torch.inference_mode(), drafting:
            while True:
                picked = logits
                if allowed_first and not ids:
                    mask = torch.full_like(logits, float("-inf"))
                    mask[allowed_first] = 0.0
                    picked = logits + mask
                token = self._pick(picked, sampling, history)
                if sampling.avoid_words:  # copy_break: the first word is not one of these

                    def repick(out: list[int], at: Any = picked) -> int:
                        return self._pick(self._refusing(at, out), sampling, history)

                    token = self._avoiding(ids, token, sampling, repick)
                score = (float(logits[token]), float(torch.log_softmax(logits, dim=-1)[token]))
                eos_score = self._record_pick(token, score, ids, scores, history)
                if eos_score is not None:
                    break
                if self._draft_is_full(ids, token, max_tokens, sampling):
                    break
                logits = self._feed([token])
        fed = len(ids) if eos_score is not None else max(len(ids) - 1, 0)
        return self._finish_draft(ids, scores, eos_score, fed)

    @consistent
    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Mean raw logit and mean log-prob of each candidate's tokens (see the module docstring)."""
        torch = self._torch
        out, pending = self._plan(candidates, score_eos)
        self._pass = None
        if pending:
            self._ensure_prefilled()
            with torch.inference_mode():
                self._score_batch(pending, out)
        return [s if s is not None else CandidateScore() for s in out]

    @consistent
    def commit(self, text: str, *, final: bool = False) -> None:
        """Make ``committed + text`` the cached prefix, reusing this round's KV when possible (on
        the ``final`` commit only where that costs no forward pass: for the prefix cache)."""
        torch = self._torch
        full = self._m.encode_response(self._text + text)
        score_pass = self._pass
        if not final:
            self._ensure_prefilled()
        with torch.inference_mode():
            if final and not self._prefilled:
                pass  # accounting only: nothing is cached
            elif self._draft_won(text, full, final):
                self._keep_draft_rows(full, final)
            elif score_pass is not None and text in score_pass.rows and score_pass.rows[text].full_ids == full:
                row = score_pass.rows[text]
                cut = slice(score_pass.pad, score_pass.pad + row.cache_len)
                for layer, (keys, values) in zip(self._cache.layers, score_pass.layers, strict=True):
                    layer.keys = keys[row.batch_index : row.batch_index + 1, :, cut, :]
                    layer.values = values[row.batch_index : row.batch_index + 1, :, cut, :]
                self._next_logits = row.next_logits
                self._cached_resp = full
            elif not final:
                self._extend_to(full)
                self._cached_resp = full
        self._resp_ids = full
        self._text += text
        self._draft = None
        self._pass = None

    def close(self) -> None:
        """Drop the cache, keeping the prompt's and committed answer's rows in the member's prefix
        cache when it is on."""
        if self._cache is not None and self._m.prefix_cache:
            self._keep_prefix()
        self._cache = None
        self._draft = None
        self._pass = None

    # -- internals --------------------------------------------------------------------------
    def _ensure_prefilled(self) -> None:
        """Prefill the prompt, once, then the response committed without KV work (``final``).

        Everything after it (``_to_committed``, ``_draft_healed``, ``_score_batch``, ``commit``)
        assumes the committed prefix is cached and ``_next_logits`` follows it.
        """
        if self._prefilled:
            return
        reused = self._load_prefix() if self._m.prefix_cache else 0
        queue = self._m.queue()
        if reused:
            self._next_logits = self._feed(self._prompt_ids[reused:])
        elif queue is None or len(self._prompt_ids) < 2:
            self._next_logits = self._feed(self._prompt_ids)
        else:  # requests arriving together prefill together
            self._next_logits = self._m.submit(queue, "prefill", self, self._m.prefill_steps)
        self.cached_tokens = reused
        self.prefilled_tokens += len(self._prompt_ids) - reused + len(self._resp_ids)
        self._prefilled = True
        if self._resp_ids:  # only after a ``final`` commit: nobody drafts from there, but stay exact
            self._next_logits = self._feed(self._resp_ids)
        self._cached_resp = list(self._resp_ids)

    def _load_prefix(self) -> int:
        """Start the cache from the longest prefix of the prompt a finished request left in the
        member's prefix cache (a copy: entries stay read-only); how many positions it holds."""
        match = self._m.prefixes.find(self._prompt_ids)
        if match is None:
            return 0
        n = match.reused
        for index, (keys, values) in enumerate(match.entry.value):
            self._cache.update(keys[..., :n, :], values[..., :n, :], index)
        return int(n)

    def _keep_prefix(self) -> None:
        """Offer the rows of the prompt and committed answer to the member's prefix cache (copied
        out of this round's batched tensors, so that those can be freed)."""
        keep = self.reusable_prefix()
        layers = self._cache.layers
        if not keep or not all(
            type(layer).__name__ == "DynamicLayer" and layer.is_initialized and layer.keys.shape[0] == 1
            for layer in layers
        ):  # sliding-window or unfilled layers cannot be cut at any position
            return
        n = len(keep)
        with self._torch.inference_mode():
            rows = [(layer.keys[..., :n, :].clone(), layer.values[..., :n, :].clone()) for layer in layers]
        self._m.prefixes.add(keep, rows)

    def _committed_len(self) -> int:
        return len(self._prompt_ids) + len(self._resp_ids)

    def _feed(self, ids: Sequence[int]) -> Any:
        """Run ``ids`` through the model on top of the cache; return next-token logits (fp32).

        Through the device queue when batching is on: a one-token step may share its pass with
        other sessions' steps, anything else waits for the device.
        """
        queue = self._m.queue()
        if queue is None:
            return self.forward(ids)
        if len(ids) == 1 and self.kv_length() > 0:
            return self._m.submit(queue, "decode", (self, ids[0]), self._m.decode_rows)
        return queue.exclusive(lambda: self.forward(ids))

    def batchable(self) -> bool:
        """Whether this session's cache can be stacked with others' (one row, every layer filled)."""
        layers = self._cache.layers
        return bool(layers) and all(
            getattr(layer, "is_initialized", False) and layer.keys.shape[0] == 1 for layer in layers
        )

    def forward(self, ids: Sequence[int]) -> Any:
        """The unqueued pass of :meth:`_feed` (this session's own, unmerged)."""
        torch = self._torch
        with torch.inference_mode():
            input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self._m.device)
            cache = {self._m.cache_arg: self._cache}
            out = self._m.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **cache)
            return out.logits[0, -1].float()

    def _cache_length(self) -> int:
        return self.kv_length() if self._cache is not None and self._cache.layers else 0

    def _committed_head(self) -> Any:
        return self._next_logits

    def _set_head(self, logits: Any) -> None:
        self._next_logits = logits

    def _set_committed_head(self, logits: Any) -> None:
        self._next_logits = logits

    def _draft_text(self, ids: Sequence[int]) -> str:
        return self._decode_continuation(ids)

    def _incomplete(self, ids: Sequence[int]) -> bool:
        return self._decode_continuation(ids).endswith("\ufffd")

    def _has_newline(self, token: int) -> bool:
        return "\n" in self._m.tokenizer.decode([token])

    def kv_length(self) -> int:
        """Positions held by the cache."""
        layer = self._cache.layers[0]
        return int(layer.keys.shape[-2]) if getattr(layer, "is_initialized", False) else 0

    def _set_length(self, n: int) -> None:
        """Crop every layer to ``n`` positions (a view; no copy)."""
        for layer in self._cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys[..., :n, :]
                layer.values = layer.values[..., :n, :]

    def _to_committed(self) -> None:
        """Drop leftover draft positions; make sure next-token logits are known."""
        self._ensure_prefilled()
        n = self._committed_len()
        if self.kv_length() > n or self._next_logits is None:
            self._set_length(n - 1)
            self._next_logits = self._feed([(self._prompt_ids + self._resp_ids)[n - 1]])

    def _decode_continuation(self, ids: Sequence[int]) -> str:
        tok = self._m.tokenizer
        context = self._resp_ids[-_DECODE_CONTEXT:]
        head = tok.decode(context)
        whole = tok.decode(list(context) + list(ids))
        if whole.startswith(head):
            return str(whole[len(head) :])
        head = tok.decode(self._resp_ids)
        whole = tok.decode(self._resp_ids + list(ids))
        return str(whole[len(head) :]) if whole.startswith(head) else str(tok.decode(list(ids)))

    def _refusing(self, logits: torch.Tensor, refused: list[int]) -> torch.Tensor:
        work = logits.clone()
        work[refused] = float("-inf")
        return work

    def _pick(self, logits: torch.Tensor, sampling: SamplingParams, history: set[int]) -> int:
        torch = self._torch
        work = logits
        banned = self._m.suppress_ids + (self._m.stop_ids_in_vocab if sampling.ignore_eos else [])
        if banned:
            work = work.clone()
            work[banned] = float("-inf")
        if sampling.repetition_penalty != 1.0 and history:
            idx = torch.tensor(sorted(history), dtype=torch.long, device=logits.device)
            picked = work[idx]
            penalized = torch.where(
                picked > 0, picked / sampling.repetition_penalty, picked * sampling.repetition_penalty
            )
            work = work.clone()
            work[idx] = penalized
        if sampling.temperature <= 0:
            return int(torch.argmax(work))
        work = work / sampling.temperature
        if sampling.top_k > 0:
            kth = torch.topk(work, min(sampling.top_k, work.numel())).values[-1]
            work = work.masked_fill(work < kth, float("-inf"))
        probs = torch.softmax(work, dim=-1)
        if sampling.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        return int(torch.multinomial(probs.cpu(), 1, generator=self._generator))

    def _score_batch(
        self, pending: list[tuple[int, str, list[int], int, bool]], out: list[CandidateScore | None]
    ) -> None:
        """One forward pass scoring ``pending`` candidates batched on the shared cache (merged with
        other sessions' verification blocks when batching across requests)."""
        prompt_len = len(self._prompt_ids)
        committed = self._prompt_ids + self._resp_ids
        base = min(prompt_len + lcp for _, _, _, lcp, _ in pending) - 1
        seqs: list[list[int]] = []
        for _, _, full, lcp, with_eos in pending:
            seq = committed[base : prompt_len + lcp] + full[lcp:]
            seqs.append(seq + ([self._m.eot_id] if with_eos else []))
        first_scored = min(prompt_len + lcp - base for _, _, _, lcp, _ in pending)
        job = ScoreJob(self, base, seqs, first_scored)
        queue = self._m.queue()
        if queue is None:
            block = self._m.score_blocks([job])[0]
        else:
            block = self._m.submit(queue, "score", job, self._m.score_steps)
        self._finish_score(pending, job, block, out)

    def _finish_score(
        self,
        pending: list[tuple[int, str, list[int], int, bool]],
        job: ScoreJob,
        block: Block,
        out: list[CandidateScore | None],
    ) -> None:
        """Scores from the block's logits; the block's KV rows are kept in case a candidate wins."""
        torch = self._torch
        logits = block.logits  # [rows, kept, vocab]: row positions block.offset ..
        logprobs = torch.log_softmax(logits, dim=-1)
        prompt_len = len(self._prompt_ids)
        score_pass = _ScorePass(base=job.base, layers=block.layers, pad=block.pad)
        for b, ((n, text, full, lcp, with_eos), seq) in enumerate(zip(pending, job.seqs, strict=True)):
            start = prompt_len + lcp - job.base  # first scored position in the row
            targets = seq[start:]
            positions = torch.arange(start - 1, len(seq) - 1, device=logits.device) - block.offset
            target_ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
            raw = logits[b, positions, target_ids]
            lps = logprobs[b, positions, target_ids]
            out[n] = CandidateScore(mean_logit=float(raw.mean()), mean_logprob=float(lps.mean()), n_tokens=len(targets))
            text_end = len(seq) - (1 if with_eos else 0)  # row positions holding the candidate's text
            if text_end - 1 - block.offset >= 0 and (text not in score_pass.rows or not with_eos):
                next_logits = logits[b, text_end - 1 - block.offset].clone()
                score_pass.rows[text] = _Row(b, full, job.base + text_end, next_logits)
        self._pass = score_pass
