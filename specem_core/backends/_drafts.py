"""What the local backends share about drafts and scores (transformers and llama.cpp sessions).

A session keeps the draft it made this round so that scoring its own candidate costs nothing: the
raw logit and log-prob of every picked token were recorded while drafting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specem_core.types import Candidate, CandidateScore


@dataclass
class DraftState:
    """A session's draft of the current round."""

    ids: list[int]
    token_scores: list[tuple[float, float]]
    """(raw logit, log-prob) of each drafted token, as the drafter saw them."""
    eos_score: tuple[float, float] | None
    ended: bool
    text: str
    fed: int
    """How many of ``ids`` are in the cache (all but the last, unless the draft ended)."""
    canonical: bool
    """False when the text was cut (turn-stop string, incomplete character) or healed."""

    def own_score(
        self, cand: Candidate, *, resp_len: int, lcp: int, new_ids: Sequence[int], with_eos: bool
    ) -> CandidateScore | None:
        """The candidate's score from the recorded token scores when it is exactly this draft
        (same text, same canonical tokens after the committed ids), else None."""
        if (
            self.canonical
            and self.text == cand.text
            and self.ended == cand.ended
            and lcp == resp_len
            and list(new_ids) == self.ids
            and (not with_eos or self.eos_score is not None)
        ):
            own = list(self.token_scores) + ([self.eos_score] if with_eos and self.eos_score else [])
            return mean_score(own)
        return None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def mean_score(scores: Sequence[tuple[float, float]]) -> CandidateScore:
    """Mean raw logit and mean log-prob of ``(raw, log-prob)`` pairs."""
    if not scores:
        return CandidateScore(mean_logit=0.0, mean_logprob=0.0, n_tokens=0)
    return CandidateScore(
        mean_logit=sum(s[0] for s in scores) / len(scores),
        mean_logprob=sum(s[1] for s in scores) / len(scores),
        n_tokens=len(scores),
    )


Pending = tuple[int, str, list[int], int, bool]
"""A candidate to score in a forward pass: (index, text, committed+text ids, common prefix with the
committed ids, whether its end-of-turn token is scored too)."""


def plan_scores(
    candidates: Sequence[Candidate],
    *,
    encode: Callable[[str], list[int]],
    committed_text: str,
    committed_ids: Sequence[int],
    draft: DraftState | None,
    score_eos: bool,
) -> tuple[list[CandidateScore | None], list[Pending]]:
    """Which candidates need a forward pass: a session's own draft is scored from its recorded
    token scores; every other candidate is re-encoded together with the committed text (text is
    the source of truth) and listed as pending."""
    out: list[CandidateScore | None] = [None] * len(candidates)
    pending: list[Pending] = []
    for n, cand in enumerate(candidates):
        full = encode(committed_text + cand.text)
        lcp = common_prefix(committed_ids, full)
        new_ids = full[lcp:]
        with_eos = cand.ended and (score_eos or not new_ids)
        own = (
            draft.own_score(cand, resp_len=len(committed_ids), lcp=lcp, new_ids=new_ids, with_eos=with_eos)
            if draft
            else None
        )
        if own is not None:
            out[n] = own
            continue
        if not new_ids and not with_eos:
            with_eos = True  # nothing to score but the end of turn
        pending.append((n, cand.text, full, lcp, with_eos))
    return out, pending
