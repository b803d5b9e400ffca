"""What a server member's session and its judge scoring need of the member: :class:`ServerMember`
(a protocol, so that both sit below :mod:`specem_core.backends.http.member`, which builds
sessions), and the counters a member keeps (:class:`MemberStats`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specem_core.backends.base import SamplingParams
from specem_core.backends.http.client import OpenAIClient
from specem_core.backends.http.judge_prompt import JudgeOptions
from specem_core.backends.http.probe import DraftMode, ServerCapabilities, VerifyMode
from specem_core.chat_format import ChatFormat


@dataclass
class MemberStats:
    """Counters of one member (all requests)."""

    drafts: int = 0
    scored_candidates: int = 0
    inexact_tokens: int = 0
    """Tokens of a shifted server's echo that were missing from the previous slot's top-k."""
    judge_calls: int = 0
    judge_abstentions: int = 0
    """Judge answers that put no mass on any label (the row became uniform)."""
    flagged_candidates: int = 0
    """Candidates whose text addressed the judge (they forfeit that judge's vote)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per stage (draft / score)."""


class ServerMember(Protocol):
    """The member a session drafts and scores for (:class:`~specem_core.backends.http.member.OpenAIHTTPMember`)."""

    name: str
    client: OpenAIClient
    tokenizer: Any
    chat: ChatFormat | None
    end_of_turn: str | None
    top_logprobs: int
    strict_scoring: bool
    judge_options: JudgeOptions
    stats: MemberStats

    @property
    def modes(self) -> tuple[DraftMode, VerifyMode | None]: ...

    @property
    def context_window(self) -> int | None: ...

    @property
    def capabilities(self) -> ServerCapabilities | None: ...

    def sampling_body(self, sampling: SamplingParams, seed: int | None) -> dict[str, Any]: ...

    def greedy_body(self) -> dict[str, Any]: ...

    def body(self, **fields: Any) -> dict[str, Any]: ...

    def render_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> str: ...

    def chat_messages(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[dict[str, Any]]: ...
