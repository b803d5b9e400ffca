"""Every knob of the SpecEM loop in one typed, validated, immutable object."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from specem_core.errors import ConfigError
from specem_core.types import check_unicode

Scoring = Literal["mean_logit", "mean_logprob"]
SegmentBoundary = Literal["tokens", "line"]
Normalization = Literal["sum", "softmax"]
NonPositiveRule = Literal["softmax", "raw"]
HedgeDecay = Literal["sqrt", "inverse"]
SelfVote = Literal["keep", "exclude"]

MAX_TEMPERATURE = 2.0
"""The highest drafting temperature any surface accepts (OpenAI's range is [0, 2]; above it the
members draft noise)."""

_FAITHFUL_OVERRIDES: dict[str, Any] = {
    "scoring": "mean_logit",
    "normalization": "sum",
    "nonpositive_rule": "raw",
    "hedge_decay": "inverse",
    "eos_voting": False,
    "model_exit": False,
    "token_healing": False,
    "self_vote": "keep",
    "trusted_opening_rounds": 0,
    "trusted_veto": False,
    "trusted_tool_calls": False,
    "unanimous_tool_calls": False,
    "segment_boundary": "tokens",
}


@dataclass(frozen=True, kw_only=True)
class SpecEMConfig:
    """Configuration of one SpecEM ensemble (SPEC §1).

    Per-request overrides go through :meth:`replace` (``engine.generate(msgs, max_new_tokens=64)``),
    which validates again. ``faithful=True`` reproduces the authors' decisions: it forces
    ``scoring="mean_logit"``, ``normalization="sum"`` with ``nonpositive_rule="raw"``,
    ``hedge_decay="inverse"``, ``eos_voting=False``, ``model_exit=False``, ``token_healing=False``,
    ``self_vote="keep"``, ``trusted_opening_rounds=0``, ``trusted_veto=False``,
    ``trusted_tool_calls=False``, ``unanimous_tool_calls=False`` and ``segment_boundary="tokens"``. Each production
    default that differs from the authors' code is one of those named options.

    Example:
        >>> SpecEMConfig(segment_len=5, max_new_tokens=64).segment_len
        5
    """

    segment_len: int = 10
    """Tokens each drafter proposes per round (L). The paper uses 10."""
    segment_boundary: SegmentBoundary = "tokens"
    """Where a draft ends besides ``segment_len``: ``"tokens"`` (the paper: only the length), or
    ``"line"``: also at its first line end (the newline and the whitespace right after it), so
    that candidates are whole lines (of code) and the vote compares like with like. A drafter
    stops there itself; the engine cuts any draft that runs past one (e.g. an HTTP member)."""
    max_new_tokens: int = 256
    """Cap on the response, counted in the first member's tokens."""
    temperature: float = 0.0
    """Drafting temperature in [0, 2] (OpenAI's range, the same on every surface); 0 means greedy
    (deterministic)."""
    top_p: float = 1.0
    """Nucleus sampling mass for drafting (ignored when greedy)."""
    top_k: int = 0
    """Top-k filter for drafting; 0 disables it."""
    repetition_penalty: float = 1.0
    """HF-style repetition penalty applied while drafting (1.0 = off)."""
    seed: int | None = None
    """Seed for sampled drafting; each member derives its own stream from it."""
    stop: tuple[str, ...] = ()
    """Stop strings; the response ends before the first one and never contains it."""
    ignore_eos: bool = False
    """Never end a turn before ``max_new_tokens`` (vLLM's field of that name; for benchmarks)."""
    token_healing: bool = False
    """Drafters back up over the last committed token and redraw it among the tokens that extend
    its text, so a segment boundary that splits a usual token (``"youtube." | "com"``) does not push
    the model off its own tokenization (local members with byte-level tokenizers)."""
    scoring: Scoring = "mean_logit"
    """``mean_logit``: mean raw pre-softmax logit (paper, faithful); ``mean_logprob``: mean log-prob."""
    normalization: Normalization = "sum"
    """Per-verifier normalization over candidates: ``sum`` (paper Eq. 3) or ``softmax``."""
    nonpositive_rule: NonPositiveRule = "softmax"
    """What ``sum`` does with a row that is not all positive: ``softmax`` over the row (our safe
    rule, default) or ``raw`` division by the sum as the authors' code does (0 when the sum is 0)."""
    softmax_temperature: float = 1.0
    """Temperature of the softmax normalization (also used by the safe rule)."""
    hedge: bool = True
    """Online Hedge weighting of verifiers; off means uniform weights."""
    hedge_eta0: float = 0.5
    """Base learning rate η0 (the authors' ``--learn_rate 5`` is 0.5)."""
    hedge_decay: HedgeDecay = "sqrt"
    """η_k = η0·sqrt(1/N)/sqrt(k) (``sqrt``, paper) or η0·sqrt(1/N)/k (``inverse``, authors' code)."""
    self_vote: SelfVote = "keep"
    """``keep``: every verifier votes on every candidate (paper). ``exclude``: leave-self-out, a
    verifier's vote does not count for its own candidate (each rates its own draft highest: it was
    drafted greedily under its own distribution)."""
    model_exit: bool = False
    """Model Exit (our design): stop drafting with members that keep losing."""
    exit_temperature: float = 1.0
    """τ in p = softmax(Q/τ) over cumulative scores Q."""
    exit_entropy_ratio: float = 0.5
    """γ: exit happens once H(p) < γ·ln(n_drafters)."""
    exit_min_prob: float = 0.1
    """ε: members with p_i < ε stop drafting (they keep verifying)."""
    exit_min_rounds: int = 3
    """k_min: no exit before this many rounds."""
    exit_keep_trusted: bool = True
    """Model Exit never stops the trusted drafter: the one with the highest prior in the engine's
    :class:`~specem_core.weights.MemberWeights` (e.g. accuracy alone on a labelled calibration
    set); among equal priors the larger model (``draft_cost``, where the backend knows it), then
    the higher learned weight. Votes measure likelihood, not correctness: without this, exit can
    stop the stronger member and leave the answer to a weaker one whose text is more predictable.
    What the weights learned comes from those same votes, so it only breaks the last tie
    (measured: docs/reports/quality.md, "Lessons learned"). No effect without member weights or
    when a tie remains; ``False`` lets votes alone decide."""
    exit_agreement_rounds: int = 0
    """Model Exit also stops a drafter whose candidate was the same text as that of the member exit
    keeps (the trusted one, ``exit_keep_trusted``; else the leader by votes) in this many
    consecutive rounds: while it agrees it changes no decision, and each of its drafts still costs
    a decode (what it saves and costs: docs/reports/quality.md). 0 (default): off."""
    trusted_opening_rounds: int = 0
    """The first this many rounds are drafted by the trusted member alone (the drafter
    ``exit_keep_trusted`` names: the highest prior in the member weights, then the larger model),
    and its draft is committed without a vote. The opening sets an answer's format (case, layout),
    and there a likelihood vote can prefer a weaker member's generic opening to the trusted
    member's compliant one. Where answers are one or two rounds long (a letter, a number) the
    opening is the answer, and a vote of weaker members can overrule the trusted one (measured:
    docs/reports/quality.md, "The held-out task"; the presets' setting:
    :mod:`specem_core.presets`). No effect without member weights or when a tie in the prior names
    no single member. 0 (default): off."""
    trusted_veto: bool = False
    """Another member's candidate is committed only when the trusted member (as in
    ``trusted_opening_rounds``) scores it at least as high as its own draft; otherwise the trusted
    member's draft is committed, whatever the vote. The ensemble then searches only among
    continuations the member the prior trusts agrees with: the weaker member can still win a
    round, but not against the trusted member's own judgement (what it measured, out of fold:
    docs/reports/quality.md, "Choosing the default out of sample"). No effect without member
    weights, when a tie in the prior names no single member, or in a round where the trusted
    member drafted or verified nothing. ``False`` (default): the vote alone decides.
    """
    trusted_tool_calls: bool = False
    """Once the answer has started a tool call (a ``<tool_call>`` tag, or call JSON, bare or
    fenced), the trusted member (as in ``trusted_opening_rounds``) writes the rest of that call
    alone and its drafts are committed without a vote, until the call is closed. A call's argument
    values are copied or converted from the request ("EUR", "-112.07", "Los Angeles, CA"), where
    a weaker member's wording can win a likelihood vote and break the call; the rounds also cost
    one draft instead of every member's drafts and scores (what it measured, chosen on one set of
    BFCL cases and reported on others: docs/reports/quality.md, "Agents and tool calls"). No
    effect without tools, without member weights, or when a tie in the prior names no single
    member. ``False`` (default): the vote decides inside calls too."""
    unanimous_tool_calls: bool = False
    """With tools offered and ``tool_choice="auto"``, an answer opens with a tool call only when
    every drafter's opening does: in the first round every drafter drafts (under
    ``trusted_opening_rounds``, the others only once the trusted member's opening starts a call),
    and when some openings are words and others start a call, the calls are dropped and the words
    go on (the trusted member's among them, else the vote's); an opening that repeats the
    prompt's tool listing (``<tools>``) counts as neither. Where no given tool fits the
    question, one member can open with a call where another answers in words; where a tool fits, an
    opening in words is rare, but a member may answer a question of fact from what it knows, and
    the call is lost. So no preset turns it on (what it measured, chosen on one set of BFCL cases
    and reported on others: docs/reports/quality.md, "Agents and tool calls"). Asking the others
    costs their drafts (and the prefill of a prompt they would not otherwise read, when every later
    round is the trusted member's alone). ``False`` (default): the opening is drafted and chosen as any other
    round."""
    eos_voting: bool = True
    """Verifiers also score each finished candidate's end-of-turn token, so stopping is voted."""
    draft_hints: bool = True
    """Members that share a device draft one after another, cheapest first, and each is shown the
    candidates drafted before it: it scores them in one forward pass (work its verification needs
    anyway) and, wherever its own pick equals a candidate's next token, continues from that
    candidate's row instead of a decode step (speculative decoding with the other members as
    drafters). Each draft is the one the member makes alone, so decisions do not change (also in
    ``faithful`` mode); only the work does — up to the kernels' numerics: where llama.cpp is not
    batch-invariant (the packaged Qwen2 and Gemma 3 quantization types; Q4_1 is invariant) a near
    tie can fall the other way, as it can when a session adopts a winner's scored rows. Off:
    drafters run in member order without hints."""
    faithful: bool = False
    """Reproduce the authors' formulas exactly (see the class docstring)."""
    member_retries: int = 1
    """Retries of a failing member call before the member is excluded from the request."""
    parallel: bool | None = None
    """Run members concurrently: ``None`` = only members on different devices or servers."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form metadata carried into results (not used by the loop)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.faithful:
            for name, value in _FAITHFUL_OVERRIDES.items():
                object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        _int_at_least("segment_len", self.segment_len, 1)
        _int_at_least("max_new_tokens", self.max_new_tokens, 1)
        _int_at_least("top_k", self.top_k, 0)
        _int_at_least("exit_min_rounds", self.exit_min_rounds, 1)
        _int_at_least("exit_agreement_rounds", self.exit_agreement_rounds, 0)
        _int_at_least("trusted_opening_rounds", self.trusted_opening_rounds, 0)
        _int_at_least("member_retries", self.member_retries, 0)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.parallel is not None and not isinstance(self.parallel, bool):
            raise ConfigError(f"parallel must be True, False or None, got {self.parallel!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an int or None, got {self.seed!r}")
        _finite_at_least("temperature", self.temperature, 0.0)
        if self.temperature > MAX_TEMPERATURE:
            raise ConfigError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature!r}")
        _finite_at_least("hedge_eta0", self.hedge_eta0, 0.0)
        _finite_at_least("repetition_penalty", self.repetition_penalty, 0.0, strict=True)
        _finite_at_least("softmax_temperature", self.softmax_temperature, 0.0, strict=True)
        _finite_at_least("exit_temperature", self.exit_temperature, 0.0, strict=True)
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= float(self.exit_entropy_ratio) <= 1.0):
            raise ConfigError(f"exit_entropy_ratio must be in [0, 1], got {self.exit_entropy_ratio!r}")
        if not (0.0 <= float(self.exit_min_prob) < 1.0):
            raise ConfigError(f"exit_min_prob must be in [0, 1), got {self.exit_min_prob!r}")
        _choice("scoring", self.scoring, ("mean_logit", "mean_logprob"))
        _choice("segment_boundary", self.segment_boundary, ("tokens", "line"))
        _choice("normalization", self.normalization, ("sum", "softmax"))
        _choice("nonpositive_rule", self.nonpositive_rule, ("softmax", "raw"))
        _choice("hedge_decay", self.hedge_decay, ("sqrt", "inverse"))
        _choice("self_vote", self.self_vote, ("keep", "exclude"))
        for n, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop strings must be non-empty strings, got {s!r}")
            check_unicode(s, f"stop string {n} ({s!r})", error=ConfigError)

    def replace(self, **overrides: Any) -> SpecEMConfig:
        """Return a validated copy with some fields changed; ``None`` values are ignored.

        Raises:
            ConfigError: an unknown field name or an invalid value.
        """
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown SpecEM option(s): {', '.join(unknown)}")
        changes = {k: v for k, v in overrides.items() if v is not None}
        if not changes:
            return self
        if "stop" in changes and isinstance(changes["stop"], Sequence):
            changes["stop"] = tuple(changes["stop"]) if not isinstance(changes["stop"], str) else (changes["stop"],)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view of the configuration."""
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        return out


_BOOL_FIELDS = (
    "ignore_eos",
    "token_healing",
    "hedge",
    "model_exit",
    "exit_keep_trusted",
    "trusted_veto",
    "trusted_tool_calls",
    "unanimous_tool_calls",
    "eos_voting",
    "draft_hints",
    "faithful",
)


def _int_at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def _finite_at_least(name: str, value: object, low: float, *, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < low or (strict and value == low):
        op = ">" if strict else ">="
        raise ConfigError(f"{name} must be {op} {low}, got {value!r}")


def _choice(name: str, value: object, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{name} must be one of {', '.join(options)}; got {value!r}")
