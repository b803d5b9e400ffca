"""Data that crosses the engine's public API: messages in, results, traces and events out."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from specem_core.errors import InputError

Message = Mapping[str, Any]
"""A chat message in the OpenAI / HF chat-template shape: ``{"role": "user", "content": "..."}``."""

FinishReason = Literal["stop", "length", "tool_calls"]
"""``tool_calls``: the answer is one or more parsed tool calls (see :mod:`specem_core.tools`)."""

_ROLES = ("system", "developer", "user", "assistant", "tool")


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check a conversation and return plain-dict copies (the caller's list is never mutated).

    Accepts a bare string as a single user message.

    Raises:
        InputError: empty conversation, unknown role, text that is not valid Unicode (a lone
            surrogate anywhere in a message), non-text content, or an empty prompt.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, Sequence) or isinstance(messages, bytes):
        raise InputError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise InputError("messages is empty: give at least one user message")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InputError(f"message {i} must be a mapping with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in _ROLES:
            raise InputError(f"message {i} has unknown role {role!r}; expected one of {', '.join(_ROLES)}")
        for key, value in m.items():  # content, list-of-parts content, tool_calls, name, ...
            check_unicode(value, f"message {i} {key}")
        content = m.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InputError(
                f"message {i} ({role}) has content of type {type(content).__name__}; only text is supported"
            )
        msg = dict(m)
        msg["content"] = content
        out.append(msg)
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise InputError("the prompt is empty: every message has empty content")
    return out


def check_unicode(value: object, where: str, *, error: type[ValueError] = InputError) -> None:
    """Raise ``error`` when a string in ``value`` (a string, or mappings and lists of them) holds a
    lone surrogate: such text is not valid Unicode and no tokenizer can encode it.

    ``where`` names the value in the message (``"message 0 content"``); nested values get their
    path appended (``"message 1 tool_calls[0].function.arguments"``). Invalid UTF-8 bytes in
    command-line arguments arrive as lone surrogates U+DC80..U+DCFF.

    Raises:
        InputError: (or ``error``) the first lone surrogate found.
    """
    _check_unicode(value, where, error, 0, set())


def _check_unicode(value: object, where: str, error: type[ValueError], depth: int, seen: set[int]) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(value[exc.start])
            # Python decodes undecodable bytes (command-line arguments, surrogateescape) to U+DC80..U+DCFF
            byte = f" (byte 0x{code - 0xDC00:02X} of input that is not UTF-8?)" if 0xDC80 <= code <= 0xDCFF else ""
            raise error(
                f"{where} contains a lone surrogate (U+{code:04X}) at character {exc.start}, "
                f"which is not valid Unicode{byte}"
            ) from None
    elif depth >= 32 or id(value) in seen:  # deeper structures are not messages; cycles are not text
        return
    elif isinstance(value, Mapping):
        seen.add(id(value))
        for key, item in value.items():
            if isinstance(key, str):
                _check_unicode(key, f"{where} key {key!r}", error, depth + 1, seen)
            _check_unicode(item, f"{where}.{key}", error, depth + 1, seen)
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        seen.add(id(value))
        for n, item in enumerate(value):
            _check_unicode(item, f"{where}[{n}]", error, depth + 1, seen)


@dataclass(frozen=True)
class Candidate:
    """One drafted segment offered for the vote."""

    member: str
    """Name of the member that drafted it."""
    text: str
    """The segment as text (candidates travel between tokenizers as text)."""
    ended: bool
    """The drafter ended its turn right after this text (EOS / end-of-turn token)."""
    tokens: int = 0
    """How many tokens the drafter generated for it."""


@dataclass(frozen=True)
class CandidateScore:
    """A verifier's score of one candidate.

    Token-level verifiers fill ``mean_logit`` and ``mean_logprob``; judge-style verifiers (which
    see only top-logprobs of a generated label) fill ``probability`` instead, already normalized
    over the candidates.
    """

    mean_logit: float | None = None
    """Mean raw logit of the candidate's tokens under this verifier (token-level verifiers)."""
    mean_logprob: float | None = None
    """Mean log-probability of the candidate's tokens under this verifier (token-level verifiers)."""
    n_tokens: int = 0
    """How many of the verifier's own tokens the candidate took (the means are over these)."""
    probability: float | None = None
    """The candidate's probability among the round's candidates as this verifier sees them (judges;
    HTTP members scoring by log-probs fill it too)."""


@dataclass(frozen=True)
class Draft:
    """What a member returns from :meth:`MemberSession.draft`."""

    text: str
    """The drafted segment as text."""
    ended: bool
    """The member ended its turn right after this text (EOS / end-of-turn token)."""
    tokens: int
    """How many tokens the member generated for it."""
    reused: int = 0
    """Of ``tokens``, those taken from an earlier candidate's scored rows (no decode step of
    their own: speculative drafting on the round's hints)."""


@dataclass
class Segment:
    """Trace of one round: what was proposed, how it was scored, what was committed."""

    index: int
    """1-based round number."""
    text: str
    """Text committed this round (the winner's text, cut at a stop string or the length cap)."""
    winner: str
    """Name of the member whose candidate won."""
    winner_index: int
    """Index of the winning candidate in ``candidates``."""
    candidates: list[Candidate]
    """Every drafted segment of the round, in member order: the columns of the score matrices."""
    drafters: list[str]
    """Members that drafted this round (fewer than all once Model Exit removes some)."""
    verifiers: list[str]
    """Members whose rows are in the score matrices."""
    raw_scores: list[list[float]]
    """``raw_scores[j][i]``: verifier j's raw score (mean logit / log-prob / judge prob) of candidate i."""
    normalized: list[list[float]]
    """Row-normalized scores ŝ[j][i]."""
    weights: list[float]
    """Verifier weights used in this round's vote (after this round's Hedge update)."""
    combined: list[float]
    """S_i = Σ_j w_j ŝ[j][i]."""
    rewards: list[float] = field(default_factory=list)
    """Hedge rewards r_i per verifier (empty when Hedge is off)."""
    learning_rate: float = 0.0
    """η_k used this round (0 when Hedge is off)."""
    seconds: float = 0.0
    """Wall time of the round."""
    copied: list[int] = field(default_factory=list)
    """Candidates (indices in ``candidates``) that would make the answer repeat an earlier
    assistant turn (``copy_guard_words``); the winner is among the others."""
    avoided: list[str] = field(default_factory=list)
    """Words this round's drafts were not to start with (``copy_break``): the word a cut stopped
    before in the last round, and the words of this round's earlier drafts that copied from
    their first word (drafted again)."""
    cut_before: str = ""
    """When every candidate copied (``copy_break``): the word the winner was cut before, where
    its copy of an earlier answer would have been completed (``text`` is the winner's head)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view of the round, every field as named here (the trace's segments)."""
        return dataclasses.asdict(self)


@dataclass
class MemberUsage:
    """Token accounting of one member for one request."""

    member: str
    """The member's name."""
    prompt_tokens: int = 0
    """Prompt tokens in this member's own tokenizer and chat format."""
    completion_tokens: int = 0
    """The committed response in this member's tokens."""
    drafted_tokens: int = 0
    """Tokens this member generated while drafting (winning or not)."""
    reused_tokens: int = 0
    """Of ``drafted_tokens``, those that cost no decode step: this member's pick equalled an
    earlier candidate's token, whose scored row it continued from (``SpecEMConfig.reuse_other_drafts``)."""
    rounds_drafted: int = 0
    """Rounds in which this member drafted a candidate (Model Exit and the trusted opening lower it)."""
    cached_tokens: int = 0
    """Prompt tokens read from this member's prefix cache instead of prefilled (local members:
    the longest prefix a finished request left; see the Performance report)."""
    prefilled_tokens: int = 0
    """Tokens this member ran through its model to build the request's prefix (the prompt less
    ``cached_tokens``, and committed text it caught up with in one batch)."""
    server: dict[str, Any] | None = None
    """Server members only: how the member worked with its server during the request (its draft
    mode, scoring path, and the prompt tokens its drafts and verifications read from the server's
    cache; ``OpenAIHTTPSession.server_trace``)."""


@dataclass
class Usage:
    """Token usage of a request; the headline counts are in the first member's tokens."""

    prompt_tokens: int
    """Prompt tokens in the first member's tokenizer and chat format."""
    completion_tokens: int
    """The committed answer in the first member's tokens."""
    per_member: list[MemberUsage]
    """Every member's own counts, in member order."""

    @property
    def total_tokens(self) -> int:
        """prompt + completion tokens of the first member."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens read from the members' prefix caches, summed over members (OpenAI's
        ``usage.prompt_tokens_details.cached_tokens``; per member in :attr:`per_member`)."""
        return sum(u.cached_tokens for u in self.per_member)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view."""
        d = dataclasses.asdict(self)
        d["total_tokens"] = self.total_tokens
        d["cached_tokens"] = self.cached_tokens
        return d


@dataclass(frozen=True)
class Exclusion:
    """A member dropped from a request after failing (and its retries), or kept out of it by the
    learned weights (stage ``gate``, round 0: ``MemberWeights.min_share``)."""

    member: str
    """The member's name."""
    stage: str
    """``open``, ``draft``, ``score``, ``commit`` or ``gate``."""
    error: str
    """What went wrong, in one line: the error's type and message (for ``gate``: its weight share
    against ``min_share``)."""
    round: int
    """The round in which it was dropped (0: while the request's sessions were opened)."""


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from the committed text (arguments checked against the tool's schema)."""

    id: str
    """``call_<hex>``, unique per call."""
    name: str
    """The name of the tool called (one of the tools given)."""
    arguments: dict[str, Any]
    """Arguments coerced with the tool's JSON schema (``"7"`` becomes ``7`` for an integer)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view."""
        return {"id": self.id, "name": self.name, "arguments": dict(self.arguments)}


@dataclass(frozen=True)
class InvalidToolCall:
    """A tool call the model started but that does not parse or does not fit the tool's schema."""

    id: str
    """``call_<hex>``, unique per call."""
    name: str | None
    """The tool name as the model wrote it (``None`` when none could be read)."""
    arguments: str | None
    """The raw argument text as the model wrote it."""
    error: str
    """Why it is invalid, in one line."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Trusted:
    """The trusted member of a request (``trusted_member``, else the highest prior in the member
    weights, else none) and why."""

    member: str | None
    """Its name; ``None``: no member is trusted (the trusted member's rules do nothing)."""
    reason: str
    """Why: ``named by trusted_member``, ``the highest prior in the member weights: …``, or why
    none is."""


@dataclass
class GenerationResult:
    """The answer of one request plus everything needed to see how it was made."""

    text: str
    """The committed answer, as the members wrote it (tool-call markup included; see ``content``)."""
    finish_reason: FinishReason
    """Why the answer ended: ``stop`` (end of turn or a stop string), ``length`` (``max_new_tokens``)
    or ``tool_calls``."""
    usage: Usage
    """Token counts: the headline ones in the first member's tokens, and every member's own."""
    segments: list[Segment]
    """The trace of every round, in order (one committed segment each)."""
    members: list[str]
    """The members' names, in tie-break order."""
    excluded: list[Exclusion] = field(default_factory=list)
    """Members dropped from this request after failing, or kept out of it by the gate."""
    seconds: float = 0.0
    """Wall time of the whole request."""
    first_segment_seconds: float | None = None
    """Time from the request to the first committed segment."""
    config: dict[str, Any] = field(default_factory=dict)
    """The configuration this request ran with (``SpecEMConfig`` fields, request overrides applied)."""
    trusted: Trusted | None = None
    """Which member the trusted member's rules trusted in this request, and why."""
    content: str | None = None
    """The answer without tool-call markup (equal to ``text`` when no tools were given)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Tool calls parsed from ``text`` (only when tools were given)."""
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)
    """Tool calls that were started but could not be parsed or validated."""

    def __post_init__(self) -> None:
        if self.content is None:
            self.content = self.text

    @property
    def members_per_round(self) -> list[int]:
        """How many members drafted in each round (Model Exit lowers it)."""
        return [len(s.drafters) for s in self.segments]

    @property
    def wins(self) -> dict[str, int]:
        """Rounds won per member."""
        counts = dict.fromkeys(self.members, 0)
        for s in self.segments:
            counts[s.winner] = counts.get(s.winner, 0) + 1
        return counts

    def trace(self) -> dict[str, Any]:
        """How the answer was made, as plain JSON: usage per member, members, rounds drafted and
        won, exclusions, timing and every round (:meth:`Segment.to_dict`). The one serialization
        of the trace: :meth:`to_dict`, ``specem serve``'s ``specem`` object, ChatSpecEM's
        ``response_metadata["specem"]`` and SpecEMLLM's ``additional_kwargs`` all use it."""
        return {
            "usage": self.usage.to_dict(),
            "members": list(self.members),
            "members_per_round": self.members_per_round,
            "wins": self.wins,
            "excluded": [dataclasses.asdict(e) for e in self.excluded],
            "seconds": self.seconds,
            "first_segment_seconds": self.first_segment_seconds,
            **({"trusted": dataclasses.asdict(self.trusted)} if self.trusted is not None else {}),
            "segments": [s.to_dict() for s in self.segments],
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view: the answer, its tool calls and the :meth:`trace` (``specem chat --json``)."""
        trace = self.trace()
        segments = trace.pop("segments")
        return {
            "text": self.text,
            "content": self.content,
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "invalid_tool_calls": [c.to_dict() for c in self.invalid_tool_calls],
            "finish_reason": self.finish_reason,
            **trace,
            "config": self.config,
            "segments": segments,
        }


@dataclass
class StreamEvent:
    """One committed segment, emitted as soon as it is committed.

    ``delta`` is the text that became safe to show: usually the segment's text, minus any tail
    held back because it could be the start of a stop string (released with a later event).
    When tools are given, ``delta`` carries only answer text: tool-call markup is held back and
    the parsed calls arrive in the final ``result``.
    The last event has ``done=True`` and carries the full ``result``.
    """

    delta: str
    """Text that became safe to show with this event (may be empty)."""
    segment: Segment | None
    """The round just committed (``None`` on a last event that commits nothing new)."""
    done: bool = False
    """This is the last event of the request."""
    result: GenerationResult | None = None
    """The whole answer and its trace, on the last event only."""
