"""The SpecEM loop for one request (SPEC §1), round by round as the paper states it.

Each round:

1. **draft** — every drafting member continues the prompt plus the committed answer by up to
   ``segment_len`` tokens (:meth:`Run.draft`);
2. **verify** — every verifying member scores every candidate: the mean logit (or log-prob) of
   the candidate's tokens after its own prompt (:meth:`Run.verify`);
3. **normalize** — each verifier's scores over the candidates become a row that sums to 1 (also
   in :meth:`Run.verify`, through :func:`specem_core.vote.score_rows`);
4. **Hedge** — the verifier weights (this request's, one per verifier) move towards the members
   whose rows agreed with the others';
5. **vote** — the weighted sum of the rows picks the winner (ties: the first member)
   (4–5: :meth:`Run.vote`, through :func:`specem_core.vote.tally`; the arithmetic of 3–5 is
   :mod:`specem_core.scoring`'s);
6. **broadcast** — the winner is appended to the answer (:meth:`Run.extend_answer`) and every
   member continues from it (:meth:`Run.broadcast`);
7. **stop** — the winner ended its turn, a stop string appeared (:meth:`Run.extend_answer`), or
   the answer is long enough (:meth:`Run.events`).

A member left alone (a one-member ensemble, or the others excluded) has nothing to vote on: its
segments are only requests and streamed chunks, so they double from ``segment_len`` up to
:data:`LONE_SEGMENT_GROWTH` times it (fewer requests to a server member; the text is usually the
same: each commit re-tokenizes the answer, so text written in other tokens than the tokenizer's
own split can continue differently).

Our additions sit beside the steps, each a named option: Model Exit (members that keep losing
stop drafting), the trusted member's rules (:mod:`specem_core.trusted`), constraints that keep a
tool call or a JSON answer parseable (:mod:`specem_core.tools`), member weights learned across
requests (:class:`~specem_core.weights.MemberWeights`: they start a request's verifier weights).
Calls to members are retried and failing members excluded by
:class:`~specem_core.member_calls.MemberCalls`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specem_core.backends.base import (
    CachingSession,
    Member,
    MemberSession,
    SamplingParams,
    ServerSession,
    SessionRequest,
    draft_cost,
)
from specem_core.candidates import constrain, to_line_end
from specem_core.config import SpecEMConfig
from specem_core.copies import CopyGuard, in_code_or_math
from specem_core.errors import MemberError
from specem_core.member_calls import MemberCalls
from specem_core.observers import MemberObserver
from specem_core.scoring import ModelExit, argmax_first, combine, normalize_row
from specem_core.stops import find_stop, stop_holdback
from specem_core.tools import CandidateFilter as CandidateFilter  # re-exported: the engine's import path
from specem_core.tools import Constraint, as_constraint, call_in_progress, opens_call
from specem_core.trusted import TrustedMember, check_trusted_member, choose_trusted, gated, unanimous_call_opening
from specem_core.types import (
    Candidate,
    CandidateScore,
    Draft,
    Exclusion,
    FinishReason,
    GenerationResult,
    MemberUsage,
    Segment,
    StreamEvent,
    Trusted,
    Usage,
)
from specem_core.vote import Vote, distinct, row_values, score_rows, tally
from specem_core.weights import MemberWeights

COPY_REDRAFTS = 2
"""How many times a round is drafted again because its winner copies from its first word
(``copy_break``); after that the vote stands."""
LONE_SEGMENT_GROWTH = 4
"""How long a lone member's segments grow, in ``segment_len``: doubling from one up to this many
(10, 20, 40, 40, … tokens by default), so a chunk of a streamed answer stays short."""


@dataclass
class Drafting:
    """Who drafts a round."""

    members: list[int]
    """The drafters, in member order."""
    solo: int | None
    """The trusted member when it drafts this round alone (its draft is committed unvoted)."""
    decides_opening: bool
    """This round decides whether the answer opens with a tool call (``unanimous_tool_calls``)."""
    available: list[int]
    """Every drafter that could draft this round (not excluded, not exited)."""


class Run:
    """One request: its members' sessions, the committed answer and the round loop.

    Args:
        members: the engine's members, in tie-break order.
        config: the request's configuration.
        messages: the validated conversation (with any instruction a tool or JSON plan adds).
        tools: tool schemas rendered into every member's prompt.
        constraint: a filter on candidates (a
            :class:`~specem_core.tools.constraints.CandidateFilter`; kept as a
            :class:`~specem_core.tools.constraints.Constraint`, wrapped when it is not one).
        prefill: a forced start of the answer (a tool call, a JSON object).
        prefill_choices: continuations of ``prefill`` the verifiers vote on (which tool a forced
            call names).
        learned: member weights learned across requests (``None``: the paper's per-request rule).
        observers: the engine's observers of member calls (:mod:`specem_core.observers`).
    """

    def __init__(
        self,
        members: Sequence[Member],
        config: SpecEMConfig,
        messages: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        constraint: CandidateFilter | None,
        prefill: str = "",
        prefill_choices: Sequence[str] = (),
        learned: MemberWeights | None = None,
        observers: Iterable[MemberObserver] = (),
    ) -> None:
        self.members = list(members)
        self.config = config
        self.messages = messages
        self.tools = list(tools) if tools else None
        self.constraint: Constraint | None = None if constraint is None else as_constraint(constraint)
        self.prefill = prefill
        self.prefill_choices = list(prefill_choices)
        self.learned = learned
        self.cancelled = threading.Event()
        """Set to stop the loop after the current round (an async consumer went away)."""
        self.calls = MemberCalls(self.members, config.member_retries, config.parallel, observers)
        self.usage = [MemberUsage(member=m.name) for m in self.members]
        self.exited: set[int] = set()
        """Drafters Model Exit stopped (they keep verifying)."""
        check_trusted_member(self.members, config.trusted_member)
        self.copy_guard = CopyGuard(messages, config.copy_guard_words)
        """Which candidates repeat an earlier answer (``copy_guard_words``)."""
        self.avoid: tuple[str, ...] = ()
        """Words this round's drafts may not start with (``copy_break``)."""
        self.trust = TrustedMember(None, config, tools=bool(self.tools))
        """The trusted member, chosen once the verifier weights are known (:meth:`events`)."""
        self.trusted: Trusted | None = None
        """Which member it is and why (the result's ``trusted``)."""
        self.text = ""
        """The committed answer."""
        self.segments: list[Segment] = []
        self.sampling = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            repetition_penalty=config.repetition_penalty,
            ignore_eos=config.ignore_eos,
            token_healing=config.token_healing,
            stop_at_line_end=config.segment_boundary == "line",
        )

    @property
    def sessions(self) -> dict[int, MemberSession]:
        """The open sessions by member index."""
        return self.calls.sessions

    # -- the loop ---------------------------------------------------------------------------
    def events(self) -> Iterator[StreamEvent]:
        """Run the request: one event per committed segment (held back while it may end in a
        stop string), then a last one carrying the result."""
        started = time.perf_counter()
        first_segment: float | None = None
        cfg = self.config
        emitted = 0  # characters of the answer already streamed
        announced = 0  # segments already carried by an event
        finish: FinishReason = "length"
        try:
            self.open_sessions()
            weights = self.initial_weights()
            self.commit_forced_start()
            trusted, reason = choose_trusted(self.members, weights, self.learned, cfg.trusted_member)
            self.trust = TrustedMember(trusted, cfg, tools=bool(self.tools))
            self.trusted = Trusted(self.members[trusted].name if trusted is not None else None, reason)
            exit_rule = self.model_exit() if cfg.model_exit else None
            k = 0
            lone = 0  # rounds in a row with one member left: nothing to vote on
            while not self.cancelled.is_set():
                remaining = cfg.max_new_tokens - self.completion_tokens()
                if remaining <= 0 or k >= cfg.max_new_tokens + 8 or not self.fits_context(cfg.segment_len):
                    break
                k += 1
                t0 = time.perf_counter()
                lone = lone + 1 if len(self.calls.active()) == 1 else 0
                length = cfg.segment_len * min(2 ** max(lone - 1, 0), LONE_SEGMENT_GROWTH)
                length = length if length == cfg.segment_len or self.fits_context(length) else cfg.segment_len
                step = self.round(k, min(length, remaining), weights, exit_rule)
                if step is None:  # no drafter proposed anything
                    break
                segment, weights, ended = step
                ended = self.extend_answer(segment) or ended
                self.broadcast(segment.text, k, final=ended)
                segment.seconds = time.perf_counter() - t0
                self.segments.append(segment)
                if first_segment is None:
                    first_segment = time.perf_counter() - started
                if ended:
                    finish = "stop"
                    break
                safe = len(self.text) - stop_holdback(self.text, cfg.stop)
                if safe > emitted or segment.text:
                    yield StreamEvent(delta=self.text[emitted:safe], segment=segment)
                    emitted = max(emitted, safe)
                    announced = len(self.segments)
            result = self.result(finish, started, first_segment)
            if self.learned is not None and cfg.hedge:
                self.learned.observe_result(self.segments)
            last = self.segments[-1] if len(self.segments) > announced else None
            # the answer is whole: free the sessions (and cache their prefixes) before handing it
            # over, so that a consumer that stops at the last event leaves nothing open
            self.calls.close()
            yield StreamEvent(delta=self.text[emitted:], segment=last, done=True, result=result)
        finally:
            self.calls.close()

    def round(
        self, k: int, max_tokens: int, weights: dict[int, float], exit_rule: ModelExit | None
    ) -> tuple[Segment, dict[int, float], bool] | None:
        """Round ``k``: draft, verify, normalize, Hedge and vote (steps 1–5). Returns the winning
        segment (not yet committed), the verifier weights for the next round, and whether the
        winner ended its turn; ``None`` when no drafter proposed anything."""
        drafting = self.drafters(k)
        drafts = self.draft(drafting, max_tokens, k)
        owners, candidates = self.candidates(drafting, drafts)
        if not candidates:
            self.avoid = ()
            return None
        verifiers, raw, normalized = self.verify(candidates, k)
        weights = {i: w for i, w in weights.items() if i in self.sessions}
        vote = self.vote(k, normalized, verifiers, owners, candidates, weights)
        winner = vote.winner
        if self.config.trusted_veto and raw:
            winner = self.trust.veto(winner, owners, verifiers, candidates, raw)
        copied = self.copied(candidates)
        winner = self.copy_guard.pick(winner, vote.combined, copied)
        avoided, cut = self.avoid, self.copy_cut(candidates[winner], copied)
        if cut is not None and cut[0] == 0:  # the winner copies from its first word
            if len(avoided) < COPY_REDRAFTS:  # draft the round again
                self.avoid = (*avoided, cut[1])
                return self.round(k, max_tokens, weights, exit_rule)
            cut = None  # the vote stands
        self.avoid = (cut[1],) if cut is not None else ()  # for the next round's drafts
        if exit_rule is not None and drafting.solo is None:  # an unvoted round is no evidence for exit
            combined = {owners[n]: vote.combined[n] for n in range(len(owners))}
            texts = {owners[n]: (c.text, c.ended) for n, c in enumerate(candidates)}
            self.exited.update(exit_rule.update(k, drafting.members, combined, texts))
        kept = candidates[winner].text[: cut[0]] if cut is not None else candidates[winner].text
        segment = Segment(
            index=k,
            text=kept,
            winner=candidates[winner].member,
            winner_index=winner,
            candidates=candidates,
            drafters=[self.members[i].name for i in drafting.members],
            verifiers=[self.members[i].name for i in verifiers] if normalized else [],
            raw_scores=raw,
            normalized=normalized,
            weights=vote.row_weights if normalized else [],
            combined=vote.combined,
            rewards=vote.rewards,
            learning_rate=vote.learning_rate,
            copied=copied,
            avoided=list(avoided),
            cut_before=cut[1] if cut is not None else "",
        )
        return segment, vote.weights, candidates[winner].ended and cut is None

    def copy_cut(self, winner: Candidate, copied: Sequence[int]) -> tuple[int, str] | None:
        """Where the winner starts to copy an earlier answer, when every candidate copies, in prose
        (not inside code or math), and ``copy_break`` is on: the length of its head that copies
        nothing yet, and the word that completes the copy."""
        if not self.config.copy_break or len(self.members) < 2 or copied or not self.guarded([winner]):
            return None
        cut = self.copy_guard.cut(self.text, winner.text)
        return None if cut is None or in_code_or_math(self.text + winner.text[: cut[0]]) else cut

    def guarded(self, candidates: Sequence[Candidate]) -> bool:
        """Whether the copy guard looks at this round: there are earlier answers to copy, and no
        candidate is in a tool call (an agent may rightly call again)."""
        in_call = (call_in_progress(self.text + c.text) or opens_call(self.text + c.text) for c in candidates)
        return self.copy_guard.active and not (self.tools and any(in_call))

    def copied(self, candidates: Sequence[Candidate]) -> list[int]:
        """The candidates that repeat an earlier answer (``copy_guard_words``; a lone candidate
        that does is listed too). Tool calls are not guarded: an agent may rightly call again."""
        if not self.guarded(candidates):
            return []
        if len(candidates) == 1:
            return [0] if self.copy_guard.copies(self.text, candidates[0].text) else []
        return self.copy_guard.flag(self.text, [c.text for c in candidates])

    # -- step 1: draft ------------------------------------------------------------------------
    def drafters(self, k: int) -> Drafting:
        """Who drafts round ``k``: every drafter Model Exit has not stopped (all of them again
        when it has stopped every one), or the trusted member alone."""
        active = self.calls.active()
        available = [i for i in active if self.members[i].can_draft and i not in self.exited]
        if not available:  # every remaining drafter exited: bring them back rather than stall
            self.exited.clear()
            available = [i for i in active if self.members[i].can_draft]
        solo = self.trust.solo_drafter(k, available, active, self.text)
        return Drafting(
            [solo] if solo is not None else available, solo, self.trust.decides_call_opening(k, self.text), available
        )

    def draft(self, drafting: Drafting, max_tokens: int, k: int) -> dict[int, Draft]:
        """Every drafter's draft (step 1). When the trusted member drafting alone fails, the
        others draft instead; when every draft repeats an earlier answer while some drafters sat
        the round out (the trusted member drafted alone, or Model Exit stopped them), they draft
        too (``copy_guard_words``); when the trusted member opens a tool call in a round that
        decides the opening, the others draft too (``unanimous_tool_calls``). ``drafting`` is
        updated to who drafted."""
        drafts = self.draft_each(drafting.members, max_tokens, k)
        self.calls.require_drafter()
        if drafting.solo is not None and not drafts:  # the trusted member was excluded: the others draft
            drafting.solo = None
            drafting.members = [i for i in drafting.available if i in self.sessions]
            drafts = self.draft_each(drafting.members, max_tokens, k)
            self.calls.require_drafter()
        solo = drafting.solo
        sat_out = [i for i in self.calls.active() if self.members[i].can_draft and i not in drafts]
        if sat_out and self.all_copy(drafts):
            # every draft repeats an earlier answer while some drafters sat this round out (the
            # trusted member drafted alone, or Model Exit stopped them): they draft, and the round is voted
            drafting.solo = None
            drafts.update(self.draft_each(sat_out, max_tokens, k))
            drafting.members = [i for i in self.calls.active() if i in drafts]
        elif drafting.decides_opening and solo is not None and solo in drafts and opens_call(drafts[solo].text):
            # the trusted member would call: whether the answer does is up to the others' openings too
            others = [i for i in drafting.available if i != solo and i in self.sessions]
            drafts.update(self.draft_each(others, max_tokens, k))
            self.calls.require_drafter()
            drafting.members = [i for i in drafting.available if i in drafts]
        for i, d in drafts.items():
            self.usage[i].drafted_tokens += d.tokens
            self.usage[i].reused_tokens += d.reused
            self.usage[i].rounds_drafted += 1
        return drafts

    def all_copy(self, drafts: Mapping[int, Draft]) -> bool:
        """Every non-empty draft repeats an earlier answer (``copy_guard_words``)."""
        texts = [d.text for d in drafts.values() if d.text]
        return bool(texts) and all(self.copied([Candidate("", text, False)]) for text in texts)

    def draft_each(self, drafting: list[int], max_tokens: int, k: int) -> dict[int, Draft]:
        """The drafts of ``drafting``. Drafters that would run one after another anyway (one
        device) take turns cheapest first, each shown the candidates drafted before it
        (``reuse_other_drafts``); otherwise they draft concurrently, without them."""
        cfg = self.config
        members = self.members
        sampling = replace(self.sampling, avoid_words=self.avoid) if self.avoid else self.sampling
        if not cfg.reuse_other_drafts or len(drafting) < 2 or self.calls.pool.concurrent(drafting):
            return self.calls.call("draft", drafting, lambda i: self.sessions[i].draft(max_tokens, sampling), k)
        drafts: dict[int, Draft] = {}
        for i in sorted(drafting, key=lambda i: (draft_cost(members[i]), i)):
            hints = [Candidate(members[j].name, d.text, d.ended, d.tokens) for j, d in drafts.items() if d.text]

            def draft_one(i: int, hints: list[Candidate] = hints) -> Draft:
                return self.sessions[i].draft(max_tokens, sampling, hints=hints, score_eos=cfg.vote_on_stop)

            drafts.update(self.calls.call("draft", [i], draft_one, k))
        return {i: drafts[i] for i in drafting if i in drafts}

    def candidates(self, drafting: Drafting, drafts: Mapping[int, Draft]) -> tuple[list[int], list[Candidate]]:
        """The round's candidates and who drafted each: the non-empty drafts, cut at the first
        line end (``segment_boundary="line"``), kept to what the constraint accepts, and, in a
        round that decides the opening, to the openings ``unanimous_tool_calls`` allows."""
        owners = [i for i in drafting.members if i in drafts and (drafts[i].text or drafts[i].ended)]
        if not owners:
            return [], []
        candidates = [
            Candidate(self.members[i].name, drafts[i].text, drafts[i].ended, drafts[i].tokens) for i in owners
        ]
        if self.config.segment_boundary == "line":  # a drafter that ran past its first line end is cut there
            candidates = [to_line_end(c) for c in candidates]
        if self.constraint is not None:
            owners, candidates = constrain(self.constraint, self.text, owners, candidates, self.vote_choice)
        if drafting.decides_opening:
            owners, candidates = unanimous_call_opening(owners, candidates, drafting.solo)
        return owners, candidates

    # -- step 2: verify -----------------------------------------------------------------------
    def verify(self, candidates: list[Candidate], k: int) -> tuple[list[int], list[list[float]], list[list[float]]]:
        """Every verifier scores every distinct candidate (step 2), and each row is normalized
        over the candidates (step 3). Returns the verifiers that answered, their raw rows and
        their normalized rows (all empty when there is nothing to vote on)."""
        verifiers = [i for i in self.calls.active() if self.members[i].can_verify]
        if len(candidates) < 2 or not verifiers:
            return verifiers, [], []
        scored_cands, copies, index = distinct(candidates)
        cfg = self.config

        def score_one(i: int) -> list[CandidateScore]:
            row = self.sessions[i].score(scored_cands, score_eos=cfg.vote_on_stop)
            if len(row) != len(scored_cands):
                raise MemberError(self.members[i].name, "scoring", f"{len(row)} scores for {len(scored_cands)}")
            row_values(row, cfg.scoring)  # unusable rows fail here, so the member is retried/excluded
            return row

        scored = self.calls.call("score", verifiers, score_one, k)
        verifiers = [i for i in verifiers if i in scored]
        raw, normalized = score_rows([scored[i] for i in verifiers], copies, index, cfg)
        return verifiers, raw, normalized

    # -- steps 4-5: Hedge, vote (step 3 is in verify) ------------------------------------------
    def vote(
        self,
        k: int,
        normalized: list[list[float]],
        verifiers: list[int],
        owners: list[int],
        candidates: list[Candidate],
        weights: dict[int, float],
    ) -> Vote:
        """Hedge-update the verifier weights and take the weighted vote (steps 4–5)."""
        learned = self.learned is not None
        return tally(normalized, verifiers, owners, candidates, weights, self.config, k, learned=learned)

    def vote_choice(self, choices: list[str]) -> str:
        """The continuation the verifiers score best (uniform verifier weights; ties → the first one): a
        constraint's listed options when no candidate fits, or which tool a forced call names."""
        verifiers = [i for i in self.calls.active() if self.members[i].can_verify]
        if len(choices) == 1 or not verifiers:
            return choices[0]
        cands = [Candidate("", c, False) for c in choices]
        scored = self.calls.call("score", verifiers, lambda i: self.sessions[i].score(cands, score_eos=False), 0)
        rows: list[list[float]] = []
        for i in verifiers:
            if i not in scored or len(scored[i]) != len(cands):
                continue
            values, is_distribution = row_values(scored[i], self.config.scoring)
            rows.append(values if is_distribution else normalize_row(values, "softmax"))
        if not rows:
            return choices[0]
        return choices[argmax_first(combine(rows, [1.0 / len(rows)] * len(rows)))]

    # -- steps 6-7: broadcast, stop -----------------------------------------------------------
    def broadcast(self, text: str, k: int, *, final: bool) -> None:
        """Every member appends the winner to its committed answer (step 6). On the final
        segment they only count its tokens: nobody continues from it."""
        if not text:
            return
        self.calls.call("commit", self.calls.active(), lambda i: self.sessions[i].commit(text, final=final), k)
        if not final:
            self.calls.require_drafter()

    def extend_answer(self, segment: Segment) -> bool:
        """Append the winner to the answer (step 6), cut before the first stop string (step 7);
        whether the answer ends here: a stop string, or a constraint's whole document (a JSON
        answer's closed object)."""
        old_len = len(self.text)
        self.text += segment.text
        stop_at = find_stop(self.text, self.config.stop, old_len)
        if stop_at is not None:
            self.text = self.text[:stop_at]
            segment.text = self.text[old_len:]
            return True
        return self.constraint is not None and self.constraint.complete(self.text)

    # -- the request's start and end ----------------------------------------------------------
    def open_sessions(self) -> None:
        """Open every member's session before any model work: opening only renders, encodes and
        checks the context window (local members prefill on first use), so a prompt that does not
        fit one member raises :class:`ContextWindowError` before any member has spent time on it.
        Members the learned member weights gate (``min_share``) sit the request out, reported at
        stage ``gate``."""
        base_seed = self.config.seed

        scores = sum(1 for m in self.members if m.can_draft) >= 2  # a vote needs two candidates

        def open_one(i: int) -> MemberSession:
            seed = None if base_seed is None else base_seed + 1_000_003 * i
            return self.members[i].open(SessionRequest(self.messages, self.tools, seed, scores))

        share = gated(self.members, self.learned)
        for i in sorted(share):
            assert self.learned is not None
            reason = f"learned weight share {share[i]:.4f} is below min_share {self.learned.min_share:g}"
            self.calls.excluded.append(Exclusion(self.members[i].name, "gate", reason, 0))
        opened = self.calls.call("open", [i for i in range(len(self.members)) if i not in share], open_one, 0)
        self.sessions.update(opened)
        self.calls.require_drafter()
        for i, s in self.sessions.items():
            self.usage[i].prompt_tokens = s.prompt_tokens

    def initial_weights(self) -> dict[int, float]:
        """The verifier weights at the start: from the member weights learned across requests,
        or uniform (the paper)."""
        verifiers = [i for i in self.calls.active() if self.members[i].can_verify]
        if not verifiers:
            return {}
        if self.learned is not None:
            start = self.learned.start([self.members[i].name for i in verifiers])
            return dict(zip(verifiers, start, strict=True))
        return {i: 1.0 / len(verifiers) for i in verifiers}

    def commit_forced_start(self) -> None:
        """Commit the answer's forced start (a tool call's opening, a JSON object's), then the
        continuation of it the verifiers vote for (which tool a forced call names)."""
        if self.prefill:
            self.text = self.prefill
            self.broadcast(self.prefill, 0, final=False)
        if self.prefill_choices:
            choice = self.vote_choice(self.prefill_choices)
            self.text += choice
            self.broadcast(choice, 0, final=False)

    def model_exit(self) -> ModelExit:
        """Model Exit's state for this request (it never stops the trusted member when
        ``model_exit_keeps_trusted``)."""
        cfg = self.config
        return ModelExit(
            cfg.model_exit_temperature,
            cfg.model_exit_entropy_ratio,
            cfg.model_exit_min_prob,
            cfg.model_exit_min_rounds,
            keep=self.trust.index if cfg.model_exit_keeps_trusted else None,
            agreement_rounds=cfg.model_exit_agreement_rounds,
        )

    def completion_tokens(self) -> int:
        """The answer's length so far, in the first active member's tokens."""
        return self.sessions[self.calls.active()[0]].completion_tokens if self.sessions else 0

    def fits_context(self, extra: int) -> bool:
        """Whether ``extra`` more tokens fit every member's context window."""
        for i, s in self.sessions.items():
            window = self.members[i].context_window
            if window and s.prompt_tokens + s.completion_tokens + extra + 2 > window:
                return False
        return True

    def result(self, finish: FinishReason, started: float, first_segment: float | None) -> GenerationResult:
        """The request's result: the answer, its rounds and every member's usage."""
        for i, s in self.sessions.items():
            self.usage[i].completion_tokens = s.completion_tokens
            if isinstance(s, CachingSession):
                self.usage[i].cached_tokens = s.cached_tokens
                self.usage[i].prefilled_tokens = s.prefilled_tokens
            if isinstance(s, ServerSession):
                self.usage[i].server = s.server_trace()
        ref = next((u for i, u in enumerate(self.usage) if i in self.sessions), self.usage[0])
        return GenerationResult(
            text=self.text,
            finish_reason=finish,
            usage=Usage(ref.prompt_tokens, ref.completion_tokens, list(self.usage)),
            segments=self.segments,
            members=[m.name for m in self.members],
            excluded=list(self.calls.excluded),
            seconds=time.perf_counter() - started,
            first_segment_seconds=first_segment,
            config=self.config.to_dict(),
            trusted=self.trusted,
        )
