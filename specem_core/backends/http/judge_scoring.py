"""The judge verify mode's round (``verify_mode="judge"``): one chat request per candidate order,
label probabilities averaged per candidate, candidates that address the judge flagged. The prompt,
the options and how an answer is read are :mod:`specem_core.backends.http.judge_prompt`'s."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from specem_core.backends.http.client import gather, log
from specem_core.backends.http.errors import HTTPMemberError, ServerResponseError
from specem_core.backends.http.interface import ServerMember
from specem_core.backends.http.judge_prompt import (
    LABELS,
    addresses_judge,
    judge_messages,
    judge_orders,
    label_probabilities,
    nonce,
)
from specem_core.backends.http.responses import chat_top_logprobs
from specem_core.types import Candidate, CandidateScore


async def judge_scores(
    member: ServerMember,
    messages: Sequence[Mapping[str, Any]],
    committed: str,
    candidates: Sequence[Candidate],
    score_eos: bool,
    round_index: int,
) -> list[CandidateScore]:
    """One judge row over ``candidates`` (see :mod:`specem_core.backends.http.judge_prompt`)."""
    n = len(candidates)
    if n == 1:
        return [CandidateScore(mean_logprob=0.0, probability=1.0)]
    if n > len(LABELS):
        raise HTTPMemberError(f"a judge can compare at most {len(LABELS)} candidates, got {n}")
    options = member.judge_options
    seed = None if options.seed is None else options.seed + round_index
    orders = judge_orders(n, options.permutations, random.Random(seed))
    tag = nonce([committed, *(c.text for c in candidates)])

    async def ask(order: list[int]) -> list[float] | None:
        shown = [(candidates[i].text, candidates[i].ended and score_eos) for i in order]
        payload = member.body(
            messages=judge_messages(messages, committed, shown, nonce=tag, options=options),
            max_tokens=1,
            logprobs=True,
            top_logprobs=options.top_logprobs,
            **member.greedy_body(),
        )
        answer = await member.client.post("/chat/completions", payload)
        alternatives = chat_top_logprobs(answer)
        if alternatives is None:
            raise ServerResponseError("the judge's answer carries no logprobs")
        member.stats.judge_calls += 1
        probs = label_probabilities(alternatives, n)
        if probs is None:
            member.stats.judge_abstentions += 1
            log.info("%s: judge answer put no mass on any label; abstaining for this order", member.name)
            return None
        by_candidate = [0.0] * n
        for label_index, cand_index in enumerate(order):
            by_candidate[cand_index] = probs[label_index]
        return by_candidate

    rows = [r for r in await gather([ask(o) for o in orders]) if r is not None]
    avg = [sum(r[i] for r in rows) / len(rows) for i in range(n)] if rows else [1.0 / n] * n
    if options.flag_injections:
        flagged = [addresses_judge(c.text) for c in candidates]
        if any(flagged) and not all(flagged):
            member.stats.flagged_candidates += sum(flagged)
            log.info("%s: %d candidate(s) addressed the judge and forfeit its vote", member.name, sum(flagged))
            avg = [0.0 if f else p for p, f in zip(avg, flagged, strict=True)]
    total = sum(avg)
    probs = [p / total for p in avg] if total > 0 else [1.0 / n] * n
    return [CandidateScore(mean_logprob=math.log(max(p, 1e-12)), probability=p) for p in probs]
