"""One request's state on a server member: the prompt in the member's own format, the committed
answer, the requests in flight; drafting in the member's draft mode and scoring in its verify mode
(exact echo log-probs, or the judge: :mod:`specem_core.backends.http.judge_scoring`)."""

from __future__ import annotations

import math
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from specem_core.backends.base import MemberSession, SamplingParams, SessionRequest
from specem_core.backends.http.alignment import (
    EchoAlignment,
    EchoLogprobs,
    align_echo,
    near_tie,
    parse_echo_logprobs,
    span_logprobs,
    top_token,
)
from specem_core.backends.http.client import Inflight, gather, log, run_async, run_sync
from specem_core.backends.http.continuation import CONTINUE_PROMPT, continuation_anchor, splice_continuation
from specem_core.backends.http.errors import (
    AlignmentError,
    CapabilityError,
    HTTPMemberError,
    RequestCancelledError,
    ServerResponseError,
)
from specem_core.backends.http.interface import ServerMember
from specem_core.backends.http.judge_scoring import judge_scores
from specem_core.backends.http.probe import CACHE_PATHS, ScorePath, VerifyMode, root_url
from specem_core.backends.http.responses import chat_content, first_choice
from specem_core.backends.http.token_scoring import (
    DraftTokens,
    ScoreCounts,
    TokenScorer,
    cached_tokens,
    draft_tokens,
    llama_server_draft_tokens,
    prompt_tokens,
    token_list,
)
from specem_core.backends.http.tokenizer import TemplateOnly, avoided_bias
from specem_core.chat_format import PLAIN_TURN_STOPS
from specem_core.errors import ContextWindowError
from specem_core.scoring import softmax
from specem_core.types import Candidate, CandidateScore, Draft

T = TypeVar("T")

REFUSED = frozenset({403, 404, 405, 501})
"""Statuses that say a scoring path is not offered (not that a request failed)."""


async def render_on_server(
    member: ServerMember, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> tuple[str, int]:
    """The prompt text the server's own chat template makes of ``messages`` and its token count
    (vLLM: ``/tokenize`` with messages, then ``/detokenize``; llama-server: ``/apply-template``,
    then ``/tokenize``)."""
    root = root_url(member.base_url)
    caps = member.capabilities
    if caps is not None and caps.server == "llama.cpp":
        rendered = await member.client.post(
            f"{root}/apply-template", {"messages": member.chat_messages(messages, tools)}
        )
        prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
        if not isinstance(prompt, str):
            raise ServerResponseError("apply-template answer has no prompt text")
        counted = await member.client.post(f"{root}/tokenize", {"content": prompt, "add_special": True})
        return prompt, len(token_list(counted))
    model = {"model": member.model} if member.model is not None else {}
    body: dict[str, Any] = {**model, "messages": member.chat_messages(messages, tools), "add_generation_prompt": True}
    ids = token_list(await member.client.post(f"{root}/tokenize", body))
    text = (await member.client.post(f"{root}/detokenize", {**model, "tokens": ids})).get("prompt")
    if not isinstance(text, str):
        raise ServerResponseError("detokenize answer has no prompt text")
    return text, len(ids)


class OpenAIHTTPSession(MemberSession):
    """One request's state: the prompt, the committed text, the in-flight requests."""

    def __init__(self, member: ServerMember, request: SessionRequest) -> None:
        self._m = member
        self._request = request
        self.draft_mode = member.draft_mode_in_use
        self.verify_mode: VerifyMode | None = None
        """How this session verifies; known once the server was asked how it scores (``None``
        before, and for the judge's absence)."""
        self.score_path: ScorePath | None = None
        """How this session scores (``None``: the judge, no verification, or not known yet)."""
        self._score_counts = ScoreCounts()
        self._scorer: TokenScorer | None = None
        self._verify_known = False
        self._own_draft: DraftTokens | None = None
        """The last draft's tokens and raw log-probs (vLLM, llama-server), which score it without a request."""
        known, verify_mode = member.known_verify_mode
        if known:
            self._use_verify_mode(verify_mode)
        self._messages = [dict(m) for m in request.messages]
        self._tools = list(request.tools) if request.tools else None
        server_count: int | None = None
        if member.prompt_source == "server":
            self._prompt, server_count = run_sync(render_on_server(member, self._messages, self._tools))
        else:
            self._prompt = member.render_prompt(self._messages, self._tools)
        self._draft_prompt_tokens = 0
        self._draft_cached_tokens: int | None = None
        self._first_cached: int | None = None
        """Of the prompt, what the server read from its cache on the request's first draft (the
        prefix a previous request left; later calls re-read the growing answer too)."""
        self._text = ""
        self._seed = request.seed
        self._round = 0
        self._inflight = Inflight()
        self._closed = False
        self._offset_shift: int | None = None
        self._chars_per_token = 4.0
        self._drafted_chars = 0
        self._drafted_tokens = 0
        tok = member.tokenizer
        self._exact_counts = tok is not None and not isinstance(tok, TemplateOnly) and member.chat is not None
        if server_count is not None:
            self._prompt_tokens = server_count
        else:
            self._prompt_tokens = self._count(self._prompt) if self._exact_counts else self._estimate(self._prompt)
        self._completion_tokens = 0
        window = member.context_window
        if window and self._prompt_tokens + 2 > window:
            raise ContextWindowError(
                f"the prompt is about {self._prompt_tokens} tokens for member {member.name!r}, "
                f"whose context window is {window}"
            )

    def _use_verify_mode(self, verify_mode: VerifyMode | None) -> None:
        """Verify in ``verify_mode`` from now on (on the member's scoring path)."""
        m = self._m
        self.verify_mode = verify_mode
        self.score_path = m.score_path if verify_mode == "logprobs" else None
        self._scorer = None
        if self.score_path in CACHE_PATHS:
            self._scorer = TokenScorer(m, self.score_path, m.add_special_tokens, self._score_counts)
            self._scorer.draft = self._own_draft
        self._verify_known = True

    def _scores_from_draft(self, sampling: SamplingParams) -> bool:
        """Whether a draft should carry its tokens' log-probs, which then score it: on vLLM's paths
        (greedy: vLLM may report log-probs after its sampling steps) and on llama-server's forced
        path (its log-probs are the logits' before sampling). Before the server was asked how it
        scores (the probe runs beside the first draft), a vLLM member that may verify asks for them
        anyway: they cost vLLM nothing."""
        if not self._verify_known:
            known, mode = self._m.known_verify_mode
            if known:
                self._use_verify_mode(mode)
        scorer = self._scorer
        if self._verify_known:
            if scorer is not None and scorer.llama_server:
                return True
            return scorer is not None and scorer.path in ("prompt_tail", "next_token") and _greedy(sampling)
        caps = self._m.capabilities
        vllm = caps is not None and caps.server == "vllm" and caps.tokenize == "vllm"
        return self._request.scores and vllm and _greedy(sampling)

    # -- token accounting -------------------------------------------------------------------
    def _count(self, text: str) -> int:
        return len(self._m.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def _estimate(self, text: str) -> int:
        return math.ceil(len(text) / self._chars_per_token) if text else 0

    @property
    def prompt(self) -> str:
        """The prompt text this member drafts and scores on (its own template, the server's
        rendering, or the plain format)."""
        return self._prompt

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in this member's tokens (exact with a local tokenizer, else reported by
        the server after the first draft, else estimated)."""
        return self._prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """Committed response length in this member's tokens (exact with a local tokenizer)."""
        return self._completion_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the server read from its prefix cache when this request began (its first
        call that reported it; at most the prompt), as local members count theirs: the trace's
        ``server`` entry has every call's. 0 where the server does not report it (llama.cpp
        servers)."""
        first = self._first_cached
        if first is None and self._score_counts.per_request:
            first = next((c for _, c in self._score_counts.per_request if c is not None), None)
        return min(first or 0, self._prompt_tokens)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the server computed, over this request's requests, where it reports its
        cache (0 otherwise)."""
        if self._draft_cached_tokens is None:
            return 0
        counts = self._score_counts
        scoring = counts.prompt_tokens - (counts.cached_tokens or 0) if counts.cached_tokens is not None else 0
        return self._draft_prompt_tokens - self._draft_cached_tokens + scoring

    def server_trace(self) -> dict[str, Any]:
        """How this member worked with its server during the request (the trace's ``server``):
        its modes, scoring path, and what the server read from its prefix cache."""
        m = self._m
        counts = self._score_counts
        caps = m.capabilities
        return {
            "server": caps.server if caps is not None else None,
            "prompt": m.prompt_source,
            "draft": self.draft_mode,
            "verify": self.verify_mode,
            "verification": m.verification,
            "score_path": self.score_path,
            "draft_prompt_tokens": self._draft_prompt_tokens,
            "draft_cached_tokens": self._draft_cached_tokens,
            "score_requests": counts.requests,
            "score_prompt_tokens": counts.prompt_tokens,
            "score_cached_tokens": counts.cached_tokens,
            "scored_from_draft": counts.from_draft,
            "echo_fallbacks": counts.echo_fallbacks,
            "tail_fallbacks": counts.tail_fallbacks,
        }

    # -- protocol ---------------------------------------------------------------------------
    def draft(
        self,
        max_tokens: int,
        sampling: SamplingParams,
        *,
        hints: Sequence[Candidate] = (),
        score_eos: bool = False,
    ) -> Draft:
        """Continue ``prompt + committed`` by up to ``max_tokens`` tokens (one HTTP request; the
        server drafts on its own, so ``hints`` are not used)."""
        return self._sync(self.adraft_core(max_tokens, sampling))

    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Score every candidate (concurrent requests): exact log-probs, or the judge."""
        return self._sync(self.ascore_core(candidates, score_eos=score_eos))

    def commit(self, text: str, *, final: bool = False) -> None:
        """Append the winner to the committed text (no request: servers are stateless)."""
        self._text += text
        if text and self._scorer is not None:
            self._scorer.new_round()
        if self._exact_counts:
            self._completion_tokens = self._count(self._text)
        else:
            self._completion_tokens = self._estimate(self._text)

    def close(self) -> None:
        """Cancel whatever is still in flight."""
        self._closed = True
        self.cancel()

    def cancel(self) -> None:
        """Cancel the in-flight requests of this session (their callers get :class:`RequestCancelledError`)."""
        self._inflight.cancel()

    async def adraft(self, max_tokens: int, sampling: SamplingParams) -> Draft:
        """Async :meth:`draft` (from any event loop)."""
        return await run_async(self._open(self.adraft_core(max_tokens, sampling)), track=self._inflight)

    async def ascore(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Async :meth:`score` (from any event loop)."""
        return await run_async(self._open(self.ascore_core(candidates, score_eos=score_eos)), track=self._inflight)

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        return run_sync(self._open(coro), track=self._inflight)

    def _open(self, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """``coro``, refused when the session is closed: a closed session sends no request, from
        the sync calls and the async ones alike."""
        if self._closed:
            coro.close()
            raise RequestCancelledError("the session is closed")
        return coro

    # -- drafting ---------------------------------------------------------------------------
    async def adraft_core(self, max_tokens: int, sampling: SamplingParams) -> Draft:
        """Drafting on the background loop."""
        started = time.perf_counter()
        self._round += 1
        m = self._m
        seed = None if self._seed is None else self._seed + self._round
        params = m.sampling_body(sampling, seed)
        if bias := avoided_bias(m.tokenizer, sampling.avoid_words):  # copy_break: for the whole draft
            params["logit_bias"] = {**params.get("logit_bias", {}), **bias}
        if self.draft_mode == "completions":
            plain = m.prompt_source == "plain"
            stops = list(PLAIN_TURN_STOPS) if plain else ([m.end_of_turn] if m.end_of_turn else [])
            base = self._prompt + self._text
            payload = m.body(prompt=base, max_tokens=max_tokens, **params, **m.completion_fields())
            if stops:
                payload["stop"] = stops
            # the draft's own tokens and raw log-probs score it (vLLM's paths, llama-server's forced path)
            own = self._scores_from_draft(sampling)
            llama_server = own and self._scorer is not None and self._scorer.llama_server
            if llama_server:  # each token's id and log-prob before sampling (any sampling)
                payload.update(logprobs=1)
            elif own:
                payload.update(logprobs=0, return_token_ids=True)
            answer = await m.client.post("/completions", payload)
            choice = first_choice(answer)
            text = choice.get("text")
            if not isinstance(text, str):
                raise ServerResponseError("completion has no text")
            if llama_server and self._scorer is not None:
                self._own_draft = llama_server_draft_tokens(base, await self._scorer.tokenize(base), choice)
            else:
                self._own_draft = draft_tokens(base, choice) if own else None
            if self._scorer is not None:
                self._scorer.draft = self._own_draft
        elif self.draft_mode == "chat_prefill":
            msgs = self._m.chat_messages(self._messages, self._tools)
            extra: dict[str, Any] = {}
            if self._text:
                msgs.append({"role": "assistant", "content": self._text})
                extra = {"continue_final_message": True, "add_generation_prompt": False}
            payload = m.body(messages=msgs, max_tokens=max_tokens, **params, **extra)
            answer = await m.client.post("/chat/completions", payload)
            choice = first_choice(answer)
            text = chat_content(answer)
        else:
            msgs = self._m.chat_messages(self._messages, self._tools)
            anchor = ""
            budget = max_tokens
            if self._text:
                anchor = continuation_anchor(self._text)
                msgs.append({"role": "assistant", "content": self._text})
                msgs.append({"role": "user", "content": CONTINUE_PROMPT.format(partial=self._text, anchor=anchor)})
                budget = max_tokens + max(2, len(anchor) // 3 + 2)
            answer = await m.client.post("/chat/completions", m.body(messages=msgs, max_tokens=budget, **params))
            choice = first_choice(answer)
            text = splice_continuation(self._text, chat_content(answer), anchor)
        finish = choice.get("finish_reason")
        ended = finish == "stop"
        text = text.rstrip("\ufffd")
        self._draft_prompt_tokens += prompt_tokens(answer) or 0
        cached = cached_tokens(answer)
        if cached is not None:
            if self._first_cached is None:
                self._first_cached = cached
            self._draft_cached_tokens = (self._draft_cached_tokens or 0) + cached
            m.stats.draft_cached_tokens += cached
        m.stats.draft_prompt_tokens += prompt_tokens(answer) or 0
        usage = answer.get("usage") if isinstance(answer, dict) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(tokens, int) or tokens < 0:
            tokens = max(1, self._estimate(text)) if text else 0
        if (
            self.draft_mode == "completions"
            and not self._text
            and isinstance(usage, dict)
            and not self._exact_counts
            and m.prompt_source != "server"  # the server counted it when it rendered the prompt
        ):
            reported = usage.get("prompt_tokens")
            if isinstance(reported, int) and reported > 0:
                self._prompt_tokens = reported
        if text and tokens:
            self._drafted_chars += len(text)
            self._drafted_tokens += tokens
            self._chars_per_token = max(1.0, self._drafted_chars / self._drafted_tokens)
        m.stats.drafts += 1
        m.stats.seconds["draft"] = m.stats.seconds.get("draft", 0.0) + time.perf_counter() - started
        return Draft(text=text, ended=ended, tokens=tokens)

    # -- verification -----------------------------------------------------------------------
    async def ascore_core(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Scoring on the background loop."""
        started = time.perf_counter()
        try:
            if not candidates:
                return []
            if not self._verify_known:  # the first scoring: ask the server how it scores, once per member
                self._use_verify_mode(await self._m.averify_mode())
            if self.verify_mode == "judge":
                return await judge_scores(self._m, self._messages, self._text, candidates, score_eos, self._round)
            if self.verify_mode != "logprobs":
                raise CapabilityError(f"{self._m.name} cannot verify")
            try:
                scored = await gather([self._score_one(c, score_eos) for c in candidates])
            except HTTPMemberError as exc:
                if exc.status not in REFUSED or not self._m.probe_was_cached:
                    raise
                # the path the cached probe named is gone (a server restarted with other flags)
                again = await self._m.reprobe_scoring()
                self._use_verify_mode(again)
                if again == "judge":
                    return await judge_scores(self._m, self._messages, self._text, candidates, score_eos, self._round)
                if again != "logprobs":
                    raise CapabilityError(f"{self._m.name} cannot verify") from exc
                scored = await gather([self._score_one(c, score_eos) for c in candidates])
            known = [s[0] for s in scored if s is not None]
            neutral = sum(known) / len(known) if known else 0.0
            means = [(s[0], s[1]) if s is not None else (neutral, 0) for s in scored]
            probs = softmax([mean for mean, _ in means])
            self._m.stats.scored_candidates += len(candidates)
            return [
                CandidateScore(mean_logit=None, mean_logprob=mean, n_tokens=n, probability=p)
                for (mean, n), p in zip(means, probs, strict=True)
            ]
        finally:
            stats = self._m.stats.seconds
            stats["score"] = stats.get("score", 0.0) + time.perf_counter() - started

    async def _score_one(self, cand: Candidate, score_eos: bool) -> tuple[float, int] | None:
        """Mean log-prob and token count of one candidate; ``None`` when there is nothing to score
        (an empty finished candidate and no known end-of-turn token): it gets the row's mean."""
        m = self._m
        with_eos = cand.ended and (score_eos or not cand.text) and m.end_of_turn is not None
        if not cand.text and not with_eos:
            return None
        scorer = self._scorer
        if scorer is None:
            return await self._score_echo(cand, with_eos)
        if with_eos and scorer.path == "forced" and not scorer.llama_server:
            return await self._score_forced_eos(cand, scorer)  # llama-cpp-python never lists a generated end of turn
        scored = await scorer.score(self._prompt + self._text, cand.text, m.end_of_turn if with_eos else None)
        if scored is not None:
            return scored
        if scorer.llama_server:  # no echo to hand it to: scored as the row's mean, and counted
            self._unscorable(cand)
            return None
        self._score_counts.echo_fallbacks += 1
        m.stats.echo_fallbacks += 1
        return await self._score_echo(cand, with_eos)

    def _unscorable(self, cand: Candidate) -> None:
        """A candidate llama-server cannot force (special-token text, a character split over
        tokens) and cannot echo: it gets the row's mean (``member.stats.inexact_tokens``), or the
        member raises with ``strict_scoring``."""
        m = self._m
        if m.strict_scoring:
            raise AlignmentError(f"{m.name}: the candidate {cand.text[:40]!r} cannot be forced on this server")
        m.stats.inexact_tokens += 1
        if m.stats.inexact_tokens == 1:
            log.warning(
                "%s: a candidate this server cannot force (special-token text, or a character split over "
                "tokens) and cannot echo is scored as the row's mean (member.stats.inexact_tokens)",
                m.name,
            )

    async def _score_forced_eos(self, cand: Candidate, scorer: TokenScorer) -> tuple[float, int] | None:
        """An ended candidate on the ``forced`` path: the echo where it is aligned (it lists the end
        of turn), else the text's tokens and the end of turn counted unknown (as a shifted echo)."""
        m = self._m
        caps = m.capabilities
        if caps is not None and caps.echo_shift == 0 and "echo" in caps.score_paths:
            self._score_counts.echo_fallbacks += 1
            m.stats.echo_fallbacks += 1
            return await self._score_echo(cand, with_eos=True)
        if m.strict_scoring:
            raise AlignmentError("the end-of-turn log-prob is unknown on this server (no aligned echo)")
        m.stats.inexact_tokens += 1
        if m.stats.inexact_tokens == 1:  # once per member: every finished candidate repeats it
            log.warning(
                "%s: end-of-turn log-prob unknown on this server (it lists no generated end of turn and its "
                "echo is not aligned); finished candidates are scored on their text (member.stats.inexact_tokens)",
                m.name,
            )
        if not cand.text:
            return None
        return await scorer.score(self._prompt + self._text, cand.text, None)

    async def _score_echo(self, cand: Candidate, with_eos: bool) -> tuple[float, int] | None:
        """The echo path: ``prompt + R + candidate [+ end of turn]`` with ``echo`` and ``logprobs``."""
        m = self._m
        caps = m.capabilities
        assert caps is not None
        if caps.echo_shift is None:
            raise CapabilityError(f"{m.name}: the server's echo log-probs are not usable")
        base = self._prompt + self._text
        sent = base + cand.text + (m.end_of_turn or "" if with_eos else "")
        text_end = len(base) + len(cand.text)
        max_tokens = 0 if caps.max_tokens_zero == "zero" else 1
        k = max(1, m.top_logprobs if caps.echo_shift == 1 else 1)
        payload = m.body(
            prompt=sent, max_tokens=max_tokens, echo=True, logprobs=k, **m.greedy_body(), **m.completion_fields()
        )
        answer = await m.client.post("/completions", payload)
        self._score_counts.add(answer, m.stats)
        echo = parse_echo_logprobs(answer)
        if not echo.text.startswith(sent):
            raise AlignmentError("the echoed text differs from the prompt that was sent")
        # Validate from the start of the answer (for an empty answer: the prompt's last character).
        region_start = min(len(self._prompt), max(0, text_end - 1))
        alignment = align_echo(
            sent,
            echo,
            region_start=region_start,
            text_end=text_end,
            eot_text=m.end_of_turn if with_eos else None,
            max_generated=max_tokens,
            known_shift=self._offset_shift,
        )
        self._offset_shift = alignment.offset_shift
        span = span_logprobs(
            echo,
            alignment,
            span_start=len(base),
            span_end=text_end,
            with_eos=with_eos,
            eot_text=m.end_of_turn,
            shift=caps.echo_shift,
        )
        self._check_greedy(echo, alignment, sent, caps.echo_shift, with_eos)
        if span.missing:
            if m.strict_scoring:
                raise AlignmentError(f"{span.missing} token(s) missing from the server's top_logprobs")
            m.stats.inexact_tokens += span.missing
            log.warning(
                "%s: %d token(s) not in the previous slot's top-%d; scored with that slot's lowest listed log-prob",
                m.name,
                span.missing,
                k,
            )
        if span.eos_unknown:
            if m.strict_scoring:
                raise AlignmentError("the end-of-turn log-prob is unknown on this (shifted) server")
            m.stats.inexact_tokens += 1
            log.warning("%s: end-of-turn log-prob unknown on a shifted server; scored the text only", m.name)
        if not span.logprobs:
            return None
        return sum(span.logprobs) / len(span.logprobs), len(span.logprobs)

    def _check_greedy(
        self, echo: EchoLogprobs, alignment: EchoAlignment, sent: str, shift: int, with_eos: bool
    ) -> None:
        """The server's own greedy token must be the top-1 of the slot the probe says predicts it."""
        generated = echo.text[len(sent) :]
        if not generated or not alignment.text_entries:
            return
        last_prompt = alignment.next_entry if with_eos else alignment.text_entries[-1]
        if last_prompt is None:
            return
        if shift == 0:
            slot = last_prompt + 1
            if slot >= len(echo.tokens):  # an aligned echo lists the generated token after the prompt
                raise AlignmentError(
                    "the echo does not list the generated token: the server pairs tokens and log-probs "
                    "differently than the probe found"
                )
            if echo.tokens[slot] != generated:
                return
            expected = echo.tokens[slot]
        else:
            slot = last_prompt
            expected = generated
        top = echo.top_logprobs[slot]
        predicted = top_token(top)
        if predicted is not None and predicted != expected and not near_tie(top):
            raise AlignmentError(
                f"the server's greedy token {expected!r} is not the top-1 ({predicted!r}) of the slot that "
                "the probed alignment says predicts it; the echo alignment changed"
            )


def _greedy(sampling: SamplingParams) -> bool:
    """A draft whose reported log-probs are the model's own whatever the server's log-prob mode."""
    return (
        sampling.temperature == 0.0
        and sampling.repetition_penalty == 1.0
        and not sampling.ignore_eos
        and not sampling.avoid_words
    )
