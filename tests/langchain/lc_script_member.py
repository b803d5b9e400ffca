"""A member that follows a script chosen from the request: deterministic LangChain flows.

``FollowScript(name, script)`` drafts the next characters of ``script(request)`` after the
committed text (one "token" is 4 characters) and ends with its last piece. As a verifier it
scores a candidate high when it follows its own script and low otherwise, so an ensemble of
script followers reproduces the script of whichever member the vote favours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specem_core import Candidate, CandidateScore, Draft, SamplingParams, SessionRequest

CHARS_PER_TOKEN = 4
Script = Callable[[SessionRequest], str]


def fixed(text: str) -> Script:
    return lambda _request: text


@dataclass
class FollowScript:
    name: str
    script: Script
    confidence: float = 2.0
    """Score given to candidates that follow this member's script (others get 1.0)."""
    can_draft: bool = True
    can_verify: bool = True
    context_window: int | None = None
    concurrency_key: str = "script"
    requests: list[SessionRequest] = field(default_factory=list)

    def open(self, request: SessionRequest) -> FollowSession:
        self.requests.append(request)
        return FollowSession(self, request)


class FollowSession:
    def __init__(self, member: FollowScript, request: SessionRequest) -> None:
        self.member = member
        self.target = member.script(request)
        self.request = request
        self.text = ""

    @property
    def prompt_tokens(self) -> int:
        chars = sum(len(str(m.get("content") or "")) for m in self.request.messages)
        return max(1, chars // CHARS_PER_TOKEN)

    @property
    def completion_tokens(self) -> int:
        return -(-len(self.text) // CHARS_PER_TOKEN)

    def draft(
        self,
        max_tokens: int,
        sampling: SamplingParams,
        *,
        hints: Sequence[Candidate] = (),
        score_eos: bool = False,
    ) -> Draft:
        if self.target.startswith(self.text):
            rest = self.target[len(self.text) :]
            piece = rest[: max_tokens * CHARS_PER_TOKEN]
            return Draft(piece, ended=len(piece) == len(rest), tokens=max(1, len(piece) // CHARS_PER_TOKEN))
        return Draft(" (off script)", ended=True, tokens=3)

    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        out = []
        for c in candidates:
            follows = self.target.startswith(self.text + c.text)
            value = self.member.confidence if follows else 1.0
            out.append(CandidateScore(mean_logit=value, mean_logprob=value - 3.0, n_tokens=1))
        return out

    def commit(self, text: str, *, final: bool = False) -> None:
        self.text += text

    def close(self) -> None:
        pass


def last_role(request: SessionRequest) -> str:
    return str(request.messages[-1].get("role"))


def has_tools(request: SessionRequest) -> bool:
    return bool(request.tools)


def tool_names(request: SessionRequest) -> list[str]:
    return [t["function"]["name"] for t in request.tools or []]


def first_user_text(request: SessionRequest) -> str:
    return next(str(m.get("content")) for m in request.messages if m.get("role") == "user")


def message_roles(request: SessionRequest) -> list[Any]:
    return [m.get("role") for m in request.messages]
