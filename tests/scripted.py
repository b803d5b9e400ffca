"""Scripted members for the engine's control-flow tests (EOS, stop strings, ties, failures).

They follow the Member protocol exactly but decide drafts and scores from a script, so a test
can state the expected decision. Real-model behaviour is tested with tiny transformers models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specem_core import Candidate, CandidateScore, Draft, SamplingParams, SessionRequest


@dataclass
class ScriptedMember:
    name: str
    drafts: list[tuple[str, bool]] = field(default_factory=list)
    """Round k returns drafts[k-1] (the last one repeats)."""
    scorer: Callable[[str, Candidate], float] = lambda committed, c: float(len(c.text) + 1)
    can_draft: bool = True
    can_verify: bool = True
    context_window: int | None = None
    concurrency_key: str = "scripted"
    fail_on: set[str] = field(default_factory=set)
    """Stages (open/draft/score/commit) that raise."""
    errors: dict[str, BaseException] = field(default_factory=dict)
    """What a stage in ``fail_on`` raises, instead of that stage's default error."""
    calls: list[str] = field(default_factory=list)
    draft_cost: float = 0.0
    hints_seen: list[list[str]] = field(default_factory=list)
    """The texts of the hints each draft call was shown."""
    avoiding: dict[str, tuple[str, bool]] = field(default_factory=dict)
    """The draft a round returns when its first word may not be this one (``copy_break``)."""
    avoided_seen: list[tuple[str, ...]] = field(default_factory=list)
    """The ``avoid_words`` of each draft call."""

    def open(self, request: SessionRequest) -> ScriptedSession:
        self.calls.append("open")
        if "open" in self.fail_on:
            raise self.errors.get("open") or RuntimeError(f"{self.name} cannot open")
        return ScriptedSession(self, request)


class ScriptedSession:
    def __init__(self, member: ScriptedMember, request: SessionRequest) -> None:
        self.member = member
        self.request = request
        self.text = ""
        self.round = 0
        self.final = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(str(m.get("content", "")).split()) for m in self.request.messages)

    @property
    def completion_tokens(self) -> int:
        return len(self.text.split())

    def draft(
        self,
        max_tokens: int,
        sampling: SamplingParams,
        *,
        hints: Sequence[Candidate] = (),
        score_eos: bool = False,
    ) -> Draft:
        self.member.calls.append("draft")
        self.member.hints_seen.append([h.text for h in hints])
        if "draft" in self.member.fail_on:
            raise self.member.errors.get("draft") or TimeoutError(f"{self.member.name} timed out")
        self.member.avoided_seen.append(sampling.avoid_words)
        avoided = [w for w in sampling.avoid_words if w in self.member.avoiding]
        if avoided:  # a redraft of the same round, or the round after a cut
            return self._draft(*self.member.avoiding[avoided[-1]])
        self.round += 1
        text, ended = self.member.drafts[min(self.round, len(self.member.drafts)) - 1]
        return self._draft(text, ended)

    @staticmethod
    def _draft(text: str, ended: bool) -> Draft:
        return Draft(text=text, ended=ended, tokens=len(text.split()))

    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        self.member.calls.append("score")
        if "score" in self.member.fail_on:
            raise self.member.errors.get("score") or ConnectionError(f"{self.member.name} refused")
        values = [self.member.scorer(self.text, c) for c in candidates]
        return [CandidateScore(mean_logit=v, mean_logprob=v - 100.0, n_tokens=1) for v in values]

    def commit(self, text: str, *, final: bool = False) -> None:
        self.member.calls.append("commit")
        if "commit" in self.member.fail_on:
            raise self.member.errors.get("commit") or RuntimeError("commit failed")
        self.text += text
        self.final = final

    def close(self) -> None:
        self.member.calls.append("close")
