"""What a server member's session, its judge scoring and the probe's requests need of the member:
:class:`ServerMember` (a protocol, so that they sit below :mod:`specem_core.backends.http.member`,
which builds sessions and probes), and the counters a member keeps (:class:`MemberStats`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specem_core.backends.base import SamplingParams, Verification
from specem_core.backends.http.client import OpenAIClient
from specem_core.backends.http.judge_prompt import JudgeOptions
from specem_core.backends.http.probe import DraftMode, PromptSource, ScorePath, ServerCapabilities, VerifyMode
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
    score_requests: int = 0
    """Requests sent to score candidates (every path)."""
    score_prompt_tokens: int = 0
    """Prompt tokens of those requests, as the server counted them."""
    score_cached_tokens: int = 0
    """Of those, read from the server's prefix cache (only where the server reports it)."""
    draft_prompt_tokens: int = 0
    draft_cached_tokens: int = 0
    """The same for drafts."""
    echo_fallbacks: int = 0
    """Candidates a cache-reading path handed to the echo path (see ``token_scoring``)."""
    tail_fallbacks: int = 0
    """Candidates the ``prompt_tail`` path handed to the ``next_token`` path (an answer vLLM could
    not write; see ``token_scoring``)."""


class ServerMember(Protocol):
    """The member a session drafts and scores for (:class:`~specem_core.backends.http.member.OpenAIHTTPMember`)."""

    name: str
    model: str | None
    base_url: str
    client: OpenAIClient
    draft_mode: DraftMode
    verify_mode: VerifyMode
    tokenizer: Any
    chat: ChatFormat | None
    end_of_turn: str | None
    top_logprobs: int
    strict_scoring: bool
    judge_options: JudgeOptions
    stats: MemberStats
    score_path: ScorePath | None
    prompt_source: PromptSource

    @property
    def draft_mode_in_use(self) -> DraftMode: ...

    @property
    def known_verify_mode(self) -> tuple[bool, VerifyMode | None]: ...

    @property
    def probe_was_cached(self) -> bool: ...

    async def averify_mode(self) -> VerifyMode | None: ...

    async def reprobe_scoring(self) -> VerifyMode | None: ...

    @property
    def add_special_tokens(self) -> bool: ...

    def completion_fields(self) -> dict[str, Any]: ...

    @property
    def context_window(self) -> int | None: ...

    @property
    def capabilities(self) -> ServerCapabilities | None: ...

    @property
    def verification(self) -> Verification | None: ...

    def sampling_body(self, sampling: SamplingParams, seed: int | None) -> dict[str, Any]: ...

    def greedy_body(self) -> dict[str, Any]: ...

    def body(self, **fields: Any) -> dict[str, Any]: ...

    def prompt_source_for(self, caps: ServerCapabilities) -> PromptSource: ...

    def render_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> str: ...

    def chat_messages(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[dict[str, Any]]: ...
