"""One request's state in a llama.cpp member: how a session keeps SpecEM linear (SPEC §2).

* One KV sequence per request holds ``prompt + enc(R)``; it is prefilled on first use (opening a
  session only encodes the prompt and checks the context window), from the longest prefix a
  finished request left in the model's prefix cache (:mod:`.model`).
* Drafting continues from that sequence and records the raw logit and log-prob of every token it
  picks, so scoring its own candidate costs nothing.
* Verification scores all other candidates in **one** ``llama_decode`` call: each candidate gets a
  scratch sequence that shares the committed prefix (``llama_memory_seq_cp`` tags the prefix
  cells, nothing is copied); only the scored positions request logits, and the first token of a
  candidate is scored from the logits the session already holds.
* Commit keeps the drafter's own KV rows when its draft wins and otherwise adopts the winner's
  scored rows; when the committed text is not a scored candidate (cut at a stop string), it rolls
  back to the first changed token and feeds the rest.

Cells are never reused below a session's newest cell: with the pinned llama.cpp a sequence whose
newer position sits in a *lower* KV cell than an older one gets wrong attention (logits off against
a from-scratch evaluation: ``tests/test_llama_cpp_backend.py``). So a session owns a private
``llama_context`` that it fills upwards; cells below an adopted winner (the session's own losing
draft, earlier candidates) are retired to a ballast sequence instead of freed, and the context is
refilled in one batched prefill once the ballast outweighs the live prefix.

Text stays the source of truth: the committed response is re-encoded as a whole and compared with
the cached ids, exactly as in the transformers backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specem_core.backends._local import LocalMember, LocalSession, consistent, mean_score, plan_scores
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.backends.llama_cpp._binding import (
    BALLAST,
    CANDIDATE_ROOM,
    COMPACT_AFTER,
    KVContext,
    LlamaCppError,
    Work,
    incomplete_utf8,
    logsumexp,
)
from specem_core.backends.llama_cpp.model import LlamaCppModel
from specem_core.types import Candidate, CandidateScore, Draft


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


class LlamaCppSessionMember(LocalMember, Protocol):
    """What a :class:`LlamaCppSession` needs of its member (a
    :class:`~specem_core.backends.llama_cpp.member.LlamaCppMember`, which imports this module):
    the model (its contexts and prefix cache), the end-of-turn token and byte decoding."""

    model: LlamaCppModel
    eot_id: int

    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...


class LlamaCppSession(LocalSession):
    """One request's state in a :class:`LlamaCppMember` (see the module docstring)."""

    _m: LlamaCppSessionMember

    def __init__(self, member: LlamaCppSessionMember, request: SessionRequest) -> None:
        import numpy as np

        self._m = member
        self._model = member.model
        self._np = np
        self._start(member, request)
        self._rng = np.random.default_rng(request.seed)
        self._ctx: KVContext | None = None
        self._length = 0
        """Positions of the session's sequence (0) held in the KV cache."""
        self._exact = 0
        """Leading positions of sequence 0 whose rows a prompt prefill computed (in chunks aligned
        as a cold prefill's, with ``history_invariant``) and nothing has replaced since."""
        self._committed_logits: Any = None
        """Next-token logits after the committed prefix."""
        self._next_logits: Any = None
        """Next-token logits after the last position held (the committed prefix, or a draft)."""
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
    def _draft_plain(
        self, max_tokens: int, sampling: SamplingParams, hints: Sequence[Candidate], score_eos: bool
    ) -> Draft:
        """``hints`` (candidates drafted before this one) are scored first, in one decode call, and
        the draft then runs over their rows for as long as its own picks equal a hint's tokens:
        each agreeing token costs no decode step (speculative drafting, exact for any sampling:
        the picks are made from the same logits, with the same random stream)."""
        assert self._ctx is not None
        with self._ctx.stepping():  # with continuous batching: other sessions' calls wait for its steps
            rows = self._score_hints(hints, score_eos) if hints else []
            return self._draft_from(self._committed_logits, [], max_tokens, sampling, rows)

    @consistent
    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Mean raw logit and mean log-prob of each candidate's tokens, all in one decode call
        (hints scored while drafting are not scored again)."""
        self._ensure_prefilled()
        if not self._early:
            self._drop_scratch()
        out, pending = self._plan(candidates, score_eos)
        for n, text, _full, _lcp, with_eos in pending:
            out[n] = self._early.get((text, with_eos))
        pending = [p for p in pending if out[p[0]] is None]
        if pending:
            assert self._ctx is not None
            with self._ctx.stepping():
                self._score_pass(pending, out)
        return [s if s is not None else CandidateScore() for s in out]

    @consistent
    def commit(self, text: str, *, final: bool = False) -> None:
        """Make ``committed + text`` the cached prefix (see the module docstring for the three paths).

        On the ``final`` commit only the two paths that cost no decode run (the draft's or a scored
        row's KV is kept), so that a follow-up request finds the whole answer in the prefix cache."""
        full = self._m.encode_response(self._text + text)
        row = self._rows.get(text)
        committed = self._committed_len()
        if self._ctx is None:
            pass  # accounting only: nothing is cached yet
        elif self._draft_won(text, full, final):
            self._drop_scratch(retire_below=True)  # hint rows under the draft stay occupied
            self._keep_draft_rows(full, final)
        elif row is not None and row.full_ids == full:
            self._adopt(row)
            self._cached_resp = full
        elif final:
            self._drop_scratch()  # the cache keeps the committed rows it holds
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
        """Return the session's context to the pool, with the rows of the prompt and committed
        response for a later request when the prefix cache is on (see :mod:`.model`)."""
        if self._closed:
            return
        self._closed = True
        keep: list[int] = []
        if self._ctx is not None and self._model.prefix_cache:
            with contextlib.suppress(LlamaCppError):
                keep = self._rows_to_keep()
        ctx, self._ctx = self._ctx, None
        self._scratch.clear()
        if ctx is not None:
            ctx.ballast = self._ballast
            self._model.release_context(ctx, keep)
        self._draft = None
        self._rows = {}

    def __del__(self) -> None:  # pragma: no cover - a session the engine did not close
        with contextlib.suppress(Exception):
            self.close()

    # -- KV bookkeeping ---------------------------------------------------------------------
    def _rows_to_keep(self) -> list[int]:
        """Cut the context down to the rows a later request may reuse (the prompt and committed
        response held in sequence 0) and return their ids; this round's candidate rows are freed.
        Every freed cell lies above the kept ones (candidates and drafts are allocated after the
        committed prefix), so the next session's cell-order rule holds."""
        assert self._ctx is not None
        keep = self.reusable_prefix()
        if self._model.chunk_invariant:  # only a prompt prefill's rows (the model hands over whole chunks)
            keep = keep[: self._exact]
        if not keep:
            return []
        self._drop_scratch()
        self._set_length(len(keep))
        if self._model.chunk_invariant:
            # every retired cell lies above the prefill's rows: the context then holds the kept
            # rows alone, in cells 0.., as a cold prefill leaves them
            self._ctx.drop_ballast()
            self._ballast = 0
        return keep

    def _ensure_prefilled(self) -> None:
        if self._closed:
            raise LlamaCppError(f"{self._m.name}: the session is closed")
        if self._ctx is None:
            self._ctx, reused = self._model.acquire_for_prompt(self._prompt_ids)
            self._length, self._ballast = reused, self._ctx.ballast
            self.cached_tokens = reused
            ids = self._prompt_ids[reused:] + self._resp_ids
            self.prefilled_tokens += len(ids)
            self._next_logits = self._feed(ids, aligned=True)
            self._exact = self._length
            self._committed_logits = self._next_logits
            self._cached_resp = list(self._resp_ids)
        elif self._behind is not None:  # catch up with the deferred commits in one batch
            cached, self._behind = self._behind, None
            self._drop_scratch()
            self._extend_to(self._resp_ids, cached)
            self._committed_logits = self._next_logits
            self._cached_resp = list(self._resp_ids)

    def _feed(self, ids: Sequence[int], *, aligned: bool = False) -> Any:
        """Append ``ids`` to the session's sequence; return the next-token logits (``aligned``: a
        prompt prefill, split as a cold one is with ``history_invariant``)."""
        assert self._ctx is not None
        n = len(ids)
        positions = list(range(self._length, self._length + n))
        work = Work(list(ids), positions, [0] * n, [None] * (n - 1) + [-1], aligned=aligned)
        self._ctx.decode(work)
        self._length += n
        return work.rows[n - 1]

    def _set_length(self, n: int) -> None:
        assert self._ctx is not None
        if self._length > n:
            self._ctx.truncate(0, n)
            self._length = n
            self._exact = min(self._exact, n)

    def _cache_length(self) -> int:
        return self._length

    def _committed_head(self) -> Any:
        return self._committed_logits

    def _set_head(self, logits: Any) -> None:
        self._next_logits = logits

    def _set_committed_head(self, logits: Any) -> None:
        self._committed_logits = self._next_logits = logits

    def _draft_text(self, ids: Sequence[int]) -> str:
        return str(self._m.decode_bytes(ids).decode("utf-8", errors="replace"))

    def _incomplete(self, ids: Sequence[int]) -> bool:
        return incomplete_utf8(bytes(self._m.decode_bytes(ids)))

    def _has_newline(self, token: int) -> bool:
        return b"\n" in self._m.decode_bytes([token])

    def _to_committed(self) -> None:
        """Drop leftover draft positions and scratch sequences; the committed logits are known."""
        self._ensure_prefilled()
        self._drop_scratch()
        self._set_length(self._committed_len())
        self._next_logits = self._committed_logits

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
            self._exact = min(self._exact, row.start)
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
        self._ctx.share(seq, BALLAST, start, end)
        self._ballast += end - start

    def _needs_compaction(self) -> bool:
        """Ballast costs attention work and cells: rebuild once it outweighs the live prefix."""
        return self._ballast > max(COMPACT_AFTER, self._length) or (
            self._length + self._ballast + CANDIDATE_ROOM > self._model.n_ctx
        )

    def _compact(self) -> None:
        """Start the context afresh with the committed prefix (one batched prefill)."""
        assert self._ctx is not None
        self._ctx.reset()
        self._scratch.clear()
        self._behind = None
        self._ballast = 0
        self._length = self._exact = 0
        self._committed_logits = self._next_logits = self._feed(self._prompt_ids + self._resp_ids, aligned=True)
        self._exact = self._length
        self._cached_resp = list(self._resp_ids)

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
            allowed = allowed_first if not ids else None
            token = self._pick(logits, sampling, history, allowed)
            if sampling.avoid_words:  # copy_break: the first word is not one of these

                def repick(out: list[int], at: Any = logits, ok: list[int] | None = allowed) -> int:
                    return self._pick(self._refusing(at, out), sampling, history, ok)

                token = self._avoiding(ids, token, sampling, repick)
            score = (float(logits[token]), float(logits[token]) - logsumexp(self._np, logits))
            eos_score = self._record_pick(token, score, ids, scores, history)
            if eos_score is not None:
                break
            if alive:
                at = len(ids) - 1
                alive = [r for r in alive if at < len(r.text_ids) and r.text_ids[at] == token]
                if alive:
                    source, hinted = alive[0], len(ids)
            if self._draft_is_full(ids, token, max_tokens, sampling):
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
        return self._finish_draft(ids, scores, eos_score, self._length - self._committed_len(), reused)

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

    def _refusing(self, logits: Any, refused: list[int]) -> Any:
        work = logits.copy()
        work[refused] = -self._np.inf
        return work

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
        head_lse = logsumexp(self._np, self._committed_logits)
        work = Work([], [], [], [])
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
