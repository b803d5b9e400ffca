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
  (:class:`BatchedPasses`, the member's side, with :mod:`specem_core.backends._batching`'s queue;
  ``request_batch_size=1`` turns this off).

Text is the source of truth: the committed response ``R`` is re-encoded as a whole
(``enc(R + candidate)``) and compared with the cached ids, and the cache is rolled back to the
first differing token. Tokens that merge across a segment boundary, multi-byte characters split
between segments and a final word before EOS are therefore never lost or corrupted.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specem_core.backends._batching import BatchStats, DeviceQueue, Step, device_queue
from specem_core.backends._local import LocalSession, consistent
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.errors import ConfigError
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


class TransformersSession(LocalSession):
    """One request's state in a :class:`TransformersMember` (see the module docstring)."""

    def __init__(self, member: Any, request: SessionRequest) -> None:
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
        queue = self._m._queue()
        drafting = queue.drafting((id(self._m.model), "decode")) if queue is not None else nullcontext()
        with torch.inference_mode(), drafting:
            while True:
                if allowed_first and not ids:
                    mask = torch.full_like(logits, float("-inf"))
                    mask[allowed_first] = 0.0
                    token = self._pick(logits + mask, sampling, history)
                else:
                    token = self._pick(logits, sampling, history)
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
        queue = self._m._queue()
        if reused:
            self._next_logits = self._feed(self._prompt_ids[reused:])
        elif queue is None or len(self._prompt_ids) < 2:
            self._next_logits = self._feed(self._prompt_ids)
        else:  # requests arriving together prefill together
            self._next_logits = self._m._submit(queue, "prefill", self, self._m._prefill_steps)
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
        queue = self._m._queue()
        if queue is None:
            return self._forward(ids)
        if len(ids) == 1 and self._cache_len() > 0:
            return self._m._submit(queue, "decode", (self, ids[0]), self._m._decode_rows)
        return queue.exclusive(lambda: self._forward(ids))

    def _batchable(self) -> bool:
        """Whether this session's cache can be stacked with others' (one row, every layer filled)."""
        layers = self._cache.layers
        return bool(layers) and all(
            getattr(layer, "is_initialized", False) and layer.keys.shape[0] == 1 for layer in layers
        )

    def _forward(self, ids: Sequence[int]) -> Any:
        """The unqueued pass of :meth:`_feed`."""
        torch = self._torch
        with torch.inference_mode():
            input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self._m.device)
            cache = {self._m.cache_arg: self._cache}
            out = self._m.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **cache)
            return out.logits[0, -1].float()

    def _cache_length(self) -> int:
        return self._cache_len() if self._cache is not None and self._cache.layers else 0

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

    def _cache_len(self) -> int:
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
        if self._cache_len() > n or self._next_logits is None:
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
        queue = self._m._queue()
        if queue is None:
            block = self._m._score_blocks([job])[0]
        else:
            block = self._m._submit(queue, "score", job, self._m._score_steps)
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


PREFILL_TOKENS = 8192
"""At most this many (padded) prompt tokens in one merged prefill pass (bounds its memory)."""


@dataclass
class ScoreJob:
    """One session's verification block: candidate rows on its committed prefix cut at ``base``."""

    session: TransformersSession
    base: int
    seqs: list[list[int]]
    """Per candidate: the tokens fed after ``base`` (the re-read prefix tail, the candidate, EOS)."""
    first_scored: int
    """The first row position whose token is scored (its logits come from the position before)."""

    @property
    def width(self) -> int:
        return max(len(s) for s in self.seqs)


@dataclass
class Block:
    """A verification block's result: logits of row positions ``offset`` .. and the rows' KV."""

    logits: Any
    layers: list[tuple[Any, Any]]
    pad: int
    offset: int


class BatchedPasses:
    """The member's side of cross-request batching (mixed into :class:`TransformersMember`)."""

    model: Any
    pad_id: int
    device: Any
    cache_arg: str
    _request_batch_size: int

    @property
    def request_batch_size(self) -> int:
        """At most this many concurrent requests' one-token decode steps share a forward pass.

        With more than 1 (default 16), every forward pass of a member on this device goes through
        one queue: passes run one at a time, and the decode steps that sessions drafting at the
        same time wait on are merged into one left-padded batch (each row keeps its own positions
        and mask). A lone request takes the unbatched path, so its numerics do not change; merged
        rows agree with it up to floating-point rounding. 1 restores the unqueued behaviour
        (concurrent requests run their passes side by side).
        """
        return self._request_batch_size

    @request_batch_size.setter
    def request_batch_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"request_batch_size must be an integer >= 1, got {value!r}")
        self._request_batch_size = value

    @property
    def batch_stats(self) -> BatchStats | None:
        """What the device queue did so far (shared by the members on this device), or ``None``
        when batching is off."""
        queue = self._queue()
        return queue.stats if queue is not None else None

    def _queue(self) -> DeviceQueue | None:
        return device_queue(str(self.device)) if self._request_batch_size > 1 else None

    def _submit(self, queue: DeviceQueue, kind: str, payload: Any, run: Any) -> Any:
        """Wait for ``payload``'s turn in a merged pass of this model's ``kind`` steps."""
        return queue.step(Step((id(self.model), kind), payload, run, self._request_batch_size, kind=kind))

    def _decode_rows(self, steps: Sequence[Step[tuple[TransformersSession, int]]]) -> list[Any]:
        """One forward pass for several sessions' one-token steps; next-token logits per step.

        Each session's cache is left-padded to the longest and stacked; the attention mask hides
        the padding and ``position_ids`` keep each row's own positions, so a row computes what the
        session would alone (up to rounding). The new KV row goes back to each session's cache.
        """
        torch = torch_module()
        sessions = [s.payload[0] for s in steps]
        if len(steps) == 1 or not all(s._batchable() for s in sessions):
            return [sess._forward([step.payload[1]]) for sess, step in zip(sessions, steps, strict=True)]
        lengths = [sess._cache_len() for sess in sessions]
        width, rows = max(lengths), len(sessions)
        with torch.inference_mode():
            stacked = stack_prefixes([(sess._cache.layers, n, 1) for sess, n in zip(sessions, lengths, strict=True)])
            mask = torch.zeros((rows, width + 1), dtype=torch.long, device=self.device)
            for row, n in enumerate(lengths):
                mask[row, width - n :] = 1
            output = self.model(
                input_ids=torch.tensor([[step.payload[1]] for step in steps], dtype=torch.long, device=self.device),
                attention_mask=mask,
                position_ids=torch.tensor([[n] for n in lengths], dtype=torch.long, device=self.device),
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_arg: stacked},
            )
            merged_layers: list[Any] = list(stacked.layers)
            for row, sess in enumerate(sessions):
                for layer, merged in zip(sess._cache.layers, merged_layers, strict=True):
                    layer.keys = torch.cat([layer.keys, merged.keys[row : row + 1, :, -1:, :]], dim=-2)
                    layer.values = torch.cat([layer.values, merged.values[row : row + 1, :, -1:, :]], dim=-2)
            logits = output.logits[:, -1].float()
            return [logits[row].clone() for row in range(rows)]

    def _prefill_steps(self, steps: Sequence[Step[TransformersSession]]) -> list[Any]:
        """Prompt prefills of several new sessions, right-padded into passes of at most
        ``PREFILL_TOKENS`` padded tokens; next-token logits per session."""
        sessions = [step.payload for step in steps]
        order = sorted(range(len(sessions)), key=lambda i: len(sessions[i]._prompt_ids))
        results: dict[int, Any] = {}
        chunk: list[int] = []
        for i in order:  # shortest first, so that a pass pads little
            longest = len(sessions[i]._prompt_ids)
            if chunk and longest * (len(chunk) + 1) > PREFILL_TOKENS:
                results.update(zip(chunk, self._prefill_together([sessions[j] for j in chunk]), strict=True))
                chunk = []
            chunk.append(i)
        results.update(zip(chunk, self._prefill_together([sessions[j] for j in chunk]), strict=True))
        return [results[i] for i in range(len(sessions))]

    def _prefill_together(self, sessions: Sequence[TransformersSession]) -> list[Any]:
        """One pass over several prompts on empty caches (right-padded); each session keeps its rows."""
        if len(sessions) == 1:
            return [sessions[0]._forward(sessions[0]._prompt_ids)]
        torch = torch_module()
        from transformers import DynamicCache

        lengths = [len(sess._prompt_ids) for sess in sessions]
        width = max(lengths)
        last = sorted({n - 1 for n in lengths})  # the positions whose logits are needed
        with torch.inference_mode():
            mask = torch.zeros((len(sessions), width), dtype=torch.long, device=self.device)
            for row, n in enumerate(lengths):
                mask[row, :n] = 1
            ids = [sess._prompt_ids + [self.pad_id] * (width - n) for sess, n in zip(sessions, lengths, strict=True)]
            cache = DynamicCache()
            output = self.model(
                input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=torch.tensor(last, dtype=torch.long, device=self.device),
                **{self.cache_arg: cache},
            )
            logits = output.logits.float()
            merged: list[Any] = list(cache.layers)
            out = []
            for row, (sess, n) in enumerate(zip(sessions, lengths, strict=True)):
                for index, layer in enumerate(merged):  # a copy per session: the padded pass is freed
                    keys, values = layer.keys[row : row + 1, :, :n, :], layer.values[row : row + 1, :, :n, :]
                    sess._cache.update(keys, values, index)
                out.append(logits[row, last.index(n - 1)].clone())
            return out

    def _score_steps(self, steps: Sequence[Step[ScoreJob]]) -> list[Block]:
        return self._score_blocks([step.payload for step in steps])

    def _score_blocks(self, jobs: Sequence[ScoreJob]) -> list[Block]:
        """One forward pass for the verification blocks of one or more sessions.

        Alone, a session's candidate rows share its cache (expanded, no copy). Several sessions'
        rows are stacked like decode steps: each session's prefix left-padded to the longest and
        copied into its rows, the candidates right-padded, positions per row.
        """
        torch = torch_module()
        with torch.inference_mode():
            if len(jobs) == 1 or not all(job.session._batchable() for job in jobs):
                return [self._score_alone(job) for job in jobs]
            width = max(job.width for job in jobs)
            length = max(job.base for job in jobs)
            offset = min(job.first_scored - 1 for job in jobs)
            rows = sum(len(job.seqs) for job in jobs)
            stacked = stack_prefixes([(job.session._cache.layers, job.base, len(job.seqs)) for job in jobs])
            mask = torch.ones((rows, length + width), dtype=torch.long, device=self.device)
            input_ids, positions = [], []
            row = 0
            for job in jobs:
                for seq in job.seqs:
                    mask[row, : length - job.base] = 0
                    input_ids.append(seq + [self.pad_id] * (width - len(seq)))
                    positions.append(list(range(job.base, job.base + width)))
                    row += 1
            output = self.model(
                input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
                attention_mask=mask,
                position_ids=torch.tensor(positions, dtype=torch.long, device=self.device),
                use_cache=True,
                logits_to_keep=width - offset,
                **{self.cache_arg: stacked},
            )
            logits = output.logits.float()
            merged: list[Any] = [(layer.keys, layer.values) for layer in stacked.layers]
            blocks, row = [], 0
            for job in jobs:
                n = len(job.seqs)
                layers_of_job = [(k[row : row + n], v[row : row + n]) for k, v in merged]
                blocks.append(Block(logits[row : row + n], layers_of_job, length - job.base, offset))
                row += n
            return blocks

    def _score_alone(self, job: ScoreJob) -> Block:
        """One session's block on its own cache, expanded to the candidates (the unbatched path)."""
        torch = torch_module()
        session = job.session
        cache = session._cache
        keep = job.width - (job.first_scored - 1)
        snapshot = [(layer.keys, layer.values) for layer in cache.layers]
        session._set_length(job.base)
        batch = len(job.seqs)
        if batch > 1:
            for layer in cache.layers:
                if getattr(layer, "is_initialized", False):
                    layer.keys = layer.keys.expand(batch, -1, -1, -1)
                    layer.values = layer.values.expand(batch, -1, -1, -1)
        input_ids = torch.tensor(
            [s + [self.pad_id] * (job.width - len(s)) for s in job.seqs], dtype=torch.long, device=self.device
        )
        try:
            output = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=keep, **{self.cache_arg: cache})
            layers = [(layer.keys, layer.values) for layer in cache.layers]
        finally:
            for layer, (keys, values) in zip(cache.layers, snapshot, strict=True):
                layer.keys, layer.values = keys, values
        return Block(output.logits.float(), layers, 0, job.width - keep)


def torch_module() -> Any:
    import torch

    return torch


def stack_prefixes(parts: Sequence[tuple[Any, int, int]]) -> Any:
    """A ``DynamicCache`` holding, per part ``(cache layers, length, rows)``, ``rows`` copies of the
    first ``length`` cached positions, left-padded with zeros to the longest part."""
    from transformers import DynamicCache

    longest = max(length for _, length, _ in parts)
    total = sum(rows for _, _, rows in parts)
    stacked = DynamicCache()
    for index, layers in enumerate(zip(*(layers for layers, _, _ in parts), strict=True)):
        keys = layers[0].keys.new_zeros((total, layers[0].keys.shape[1], longest, layers[0].keys.shape[3]))
        values = layers[0].values.new_zeros((total, layers[0].values.shape[1], longest, layers[0].values.shape[3]))
        row = 0
        for layer, (_, length, rows) in zip(layers, parts, strict=True):
            keys[row : row + rows, :, longest - length :, :] = layer.keys[:, :, :length, :]
            values[row : row + rows, :, longest - length :, :] = layer.values[:, :, :length, :]
            row += rows
        stacked.update(keys, values, index)
    return stacked
