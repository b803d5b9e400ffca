"""The one small protocol every backend implements.

A :class:`Member` is a loaded model (shared by all requests, thread-safe). For each request the
engine opens a :class:`MemberSession`, which holds that request's state (KV cache, committed
text) and answers four calls per round: ``draft``, ``score``, ``commit`` and, at the end,
``close``. Candidates cross members as text, so members may use any tokenizer.

Optional features a backend may offer are declared protocols too, and read through them (never
by probing attribute names): :class:`CostedMember` (the relative cost of a drafted token),
:class:`ProbingMember` (a server member that asks its server what it offers),
:class:`BreakerMember` (a server member behind a circuit breaker),
:class:`SettlingMember` (background work to wait for at shutdown), :class:`BatchingMember`
(cross-request batching on one device), :class:`CachingSession` (prompt tokens read from a
prefix cache) and :class:`ServerSession` (how a session worked with its server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from specem_core.types import Candidate, CandidateScore, Draft

if TYPE_CHECKING:
    from specem_core.backends._batching import BatchStats


@dataclass(frozen=True)
class SamplingParams:
    """How a member samples its draft (fields as in vLLM's ``SamplingParams``)."""

    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    """Never pick an end-of-turn token."""
    token_healing: bool = False
    """Redraw the last committed token among those extending its text (see ``SpecEMConfig``)."""
    stop_at_line_end: bool = False
    """End the draft after the first token that contains a newline (``segment_boundary="line"``)."""
    avoid_words: tuple[str, ...] = ()
    """Words the draft's first word must not be (compared case-blind, as the copy guard compares
    words; ``copy_break``): words that would have continued a copy of an earlier answer. Local
    members refuse only the tokens that would start one of them as the first word; a server member
    biases their leading tokens away for the whole draft (its API has no per-position bias)."""


@dataclass(frozen=True)
class SessionRequest:
    """What a member needs to open a session for one request."""

    messages: Sequence[Mapping[str, Any]]
    """The validated conversation (OpenAI / HF chat-template dicts)."""
    tools: Sequence[Mapping[str, Any]] | None = None
    """OpenAI-style tool schemas to render through the member's chat template."""
    seed: int | None = None
    """Seed of this member's sampling stream (already offset per member by the engine)."""
    scores: bool = True
    """Whether this request may ask the member to score candidates: ``False`` where fewer than two
    members draft (a member alone), so that a server member need not learn how its server scores."""


@runtime_checkable
class MemberSession(Protocol):
    """Per-request state of one member."""

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in this member's tokens."""
        ...

    @property
    def completion_tokens(self) -> int:
        """Committed response length in this member's tokens."""
        ...

    def draft(
        self,
        max_tokens: int,
        sampling: SamplingParams,
        *,
        hints: Sequence[Candidate] = (),
        score_eos: bool = False,
    ) -> Draft:
        """Continue the prompt plus the committed response by up to ``max_tokens`` tokens.

        ``hints`` are this round's candidates drafted before this call (the engine passes them
        when members take turns on one device; ``score_eos`` is then the value the round's
        ``score`` call will get). A session may score them now, in one forward pass, and draft
        speculatively from them: wherever its own pick equals a hint's next token, it continues
        from the hint's forward row instead of a new decode step. The draft is the one it would
        have made without hints (up to batch-versus-single-step numerics); ``score`` then answers
        for the hints from that pass. A session
        that cannot use hints ignores them.
        """
        ...

    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Score every candidate as a continuation of the committed response.

        With ``score_eos`` a candidate that ended its turn is scored together with this
        member's own end-of-turn token, so that stopping is voted on.
        """
        ...

    def commit(self, text: str, *, final: bool = False) -> None:
        """Append the winning text to the committed response.

        ``final=True`` marks the last segment of the request: only the token accounting is
        updated (no member will continue from it, so no KV work is needed).
        """
        ...

    def close(self) -> None:
        """Release the request's state (KV cache)."""
        ...


@runtime_checkable
class Member(Protocol):
    """A loaded base model taking part in the ensemble."""

    name: str
    """Unique name within an ensemble (used in traces)."""
    can_draft: bool
    can_verify: bool

    @property
    def context_window(self) -> int | None:
        """Maximum tokens (prompt + response) this member accepts, if known."""
        ...

    @property
    def concurrency_key(self) -> str:
        """Members with different keys (devices, servers) may run at the same time."""
        ...

    def open(self, request: SessionRequest) -> MemberSession:
        """Start a request: render and encode the prompt and check that it fits; no model work
        (local members prefill on first use), so a too-long prompt fails before any member computes.

        Raises:
            ContextWindowError: the prompt does not fit.
        """
        ...


# -- optional features ---------------------------------------------------------------------------


@runtime_checkable
class CostedMember(Protocol):
    """A member that knows the relative cost of one drafted token (e.g. its weights' size): the
    engine lets the cheapest draft first on a shared device, and the trusted member is the
    larger one among equal priors."""

    @property
    def draft_cost(self) -> float:
        """Relative cost of one drafted token (only the order between members matters)."""
        ...


@runtime_checkable
class ProbingMember(Protocol):
    """A member on a server that learns what the server offers (scoring paths, a chat template)
    before its first request; probing at start-up says what it lacks then, not mid-request."""

    def probe(self, *, scoring: bool = True) -> object:
        """Ask the server what it offers (cached: later calls return the first answer);
        ``scoring=False`` asks only what drafting needs (an ensemble whose members never vote)."""
        ...


class Breaker(Protocol):
    """What a circuit breaker shows of itself (:class:`~specem_core.backends.http.client.CircuitBreaker`)."""

    @property
    def key(self) -> str:
        """The server it guards (scheme, host and port)."""
        ...

    @property
    def state(self) -> str:
        """``closed``, ``half_open`` or ``open``."""
        ...

    @property
    def opened(self) -> int:
        """Times it opened."""
        ...

    @property
    def rejected(self) -> int:
        """Calls refused at once while it was open."""
        ...


@runtime_checkable
class BreakerMember(Protocol):
    """A member on a server whose calls go through a circuit breaker (shared by every member of
    that server): its state is what a server's metrics show."""

    @property
    def breaker(self) -> Breaker:
        """The circuit breaker of this member's server."""
        ...


Verification = Literal["exact", "judge", "none"]
"""How a member verifies: ``exact`` (its model's own log-probs or logits of the candidate's
tokens), ``judge`` (an approximate preference read from a chat answer's top log-probs), ``none``
(it drafts only)."""


@runtime_checkable
class VerificationMember(Protocol):
    """A member whose way of verifying is decided at run time (a server member: from what its
    server offers), so that a surface can say when it is not exact."""

    @property
    def verification(self) -> Verification | None:
        """How it verifies (``None``: not decided yet: its server was not probed)."""
        ...


@runtime_checkable
class SettlingMember(Protocol):
    """A member that does work in the background after a request (llama.cpp: prefix-cache copies)."""

    def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the background work is done."""
        ...


@runtime_checkable
class BatchingMember(Protocol):
    """A member whose concurrent requests share forward passes on its device."""

    request_batch_size: int
    """At most this many concurrent requests' steps share a pass (1: no batching)."""

    @property
    def batch_stats(self) -> BatchStats | None:
        """What the device queue did so far, or ``None`` when batching is off."""
        ...


@runtime_checkable
class CachingSession(Protocol):
    """A session whose prompt may be read from a prefix cache instead of prefilled."""

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens read from a cache instead of computed."""
        ...

    @property
    def prefilled_tokens(self) -> int:
        """Tokens run through the model to build this request's prefix."""
        ...


@runtime_checkable
class ServerSession(Protocol):
    """A session of a member on a server, which says how it worked with its server (the trace's
    ``MemberUsage.server``)."""

    def server_trace(self) -> dict[str, Any]:
        """Its draft mode, scoring path, and the prompt tokens the server read from its cache."""
        ...


def draft_cost(member: Member) -> float:
    """``member``'s relative cost of one drafted token (:class:`CostedMember`); 0 for a member
    that does not say, which keeps the member order."""
    return float(member.draft_cost) if isinstance(member, CostedMember) else 0.0
