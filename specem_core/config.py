"""Every option of the SpecEM loop in one typed, validated, immutable object.

:class:`SpecEMConfig` holds the options a user tunes, each with a one-line meaning; the
configuration guide (``docs/guides/configuration.md``) explains them. The options that exist for
the quality study's A/B rows and for reproducing the paper's details are declared apart, on
:class:`StudyOptions`: they are fields of :class:`SpecEMConfig` too (one flat namespace, so every
surface takes them the same way), but users leave them at their defaults.

Options renamed in 0.2 (:data:`RENAMED`) are still accepted, with a ``FutureWarning``, until 0.3.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from specem_core.errors import ConfigError
from specem_core.types import check_unicode

Scoring = Literal["mean_logit", "mean_logprob"]
SegmentBoundary = Literal["tokens", "line"]
Normalization = Literal["sum", "softmax"]
NonPositiveRule = Literal["softmax", "raw"]
HedgeDecay = Literal["sqrt", "inverse"]

MAX_TEMPERATURE = 2.0
"""The highest drafting temperature any surface accepts (OpenAI's range is [0, 2]; above it the
members draft noise)."""

_PAPER_RULES: dict[str, Any] = {
    "scoring": "mean_logit",
    "normalization": "sum",
    "nonpositive_rule": "raw",
    "hedge_decay": "inverse",
    "vote_on_stop": False,
    "model_exit": False,
    "token_healing": False,
    "leave_self_out": False,
    "trusted_opening_rounds": 0,
    "trusted_veto": False,
    "trusted_tool_calls": False,
    "unanimous_tool_calls": False,
    "segment_boundary": "tokens",
    "copy_guard_words": 0,
    "copy_break": False,
}
"""What ``reproduce_paper=True`` forces: the authors' decisions."""


@dataclass(frozen=True, kw_only=True)
class StudyOptions:
    """Options of the quality study's A/B rows and of the paper's details; the defaults are what
    the library does, and users leave them there.

    They are fields of :class:`SpecEMConfig` (``SpecEMConfig(leave_self_out=True)``,
    ``--set hedge_eta0=0.3``), declared here apart from the options a user tunes. What each one
    measured: ``docs/reports/quality.md``.
    """

    ignore_eos: bool = False
    """Never end a turn before ``max_new_tokens`` (vLLM's field of that name): fixed-length
    answers for speed benchmarks."""
    token_healing: bool = False
    """Drafters back up over the last committed token and redraw it among the tokens that extend
    its text, so that a segment boundary that splits a usual token (``"youtube." | "com"``) does
    not push the model off its own tokenization (local members with byte-level tokenizers)."""
    nonpositive_rule: NonPositiveRule = "softmax"
    """What ``normalization="sum"`` does with a row that is not all positive: ``softmax`` over the
    row (our safe rule) or ``raw`` division by the sum, as the authors' code does (0 when the sum
    is 0)."""
    normalization_temperature: float = 1.0
    """Temperature of the softmax normalization (also of the safe rule above)."""
    hedge_eta0: float = 0.5
    """Hedge's base learning rate η0 (the authors' ``--learn_rate 5`` is 0.5)."""
    hedge_decay: HedgeDecay = "sqrt"
    """η_k = η0·sqrt(1/N)/sqrt(k) (``sqrt``, the paper) or η0·sqrt(1/N)/k (``inverse``, the
    authors' code)."""
    leave_self_out: bool = False
    """A verifier's vote does not count for its own candidate (each member rates its own greedy
    draft highest). ``False``: every verifier votes on every candidate (the paper)."""
    model_exit_entropy_ratio: float = 0.5
    """Model Exit's γ: exit happens once the entropy of p falls below γ·ln(drafters)."""
    model_exit_min_prob: float = 0.1
    """Model Exit's ε: drafters with p_i < ε stop drafting (they keep verifying)."""
    model_exit_min_rounds: int = 3
    """Model Exit's k_min: no exit before this many rounds."""
    model_exit_keeps_trusted: bool = True
    """Model Exit never stops the trusted member (see ``trusted_opening_rounds``); ``False`` lets
    the votes alone decide, as the study's v2 and v3 rows ran."""


@dataclass(frozen=True, kw_only=True)
class SpecEMConfig(StudyOptions):
    """Configuration of one SpecEM ensemble (SPEC §1): the options a user tunes, plus the study's
    (:class:`StudyOptions`).

    Per-request overrides go through :meth:`replace` (``engine.generate(msgs, max_new_tokens=64)``),
    which validates again. Every option, its meaning and what it measured:
    ``docs/guides/configuration.md``.

    Example:
        >>> SpecEMConfig(segment_len=5, max_new_tokens=64).segment_len
        5
    """

    # -- the answer -----------------------------------------------------------------------------
    max_new_tokens: int = 256
    """Cap on the answer, counted in the first member's tokens (``max_tokens`` on the surfaces)."""
    temperature: float = 0.0
    """Drafting temperature in [0, 2]; 0 is greedy (deterministic)."""
    top_p: float = 1.0
    """Nucleus sampling mass while drafting (ignored when greedy)."""
    top_k: int = 0
    """Top-k filter while drafting; 0 disables it."""
    repetition_penalty: float = 1.0
    """HF-style repetition penalty while drafting (1.0 = off)."""
    seed: int | None = None
    """Seed of sampled drafting; each member derives its own stream from it."""
    stop: tuple[str, ...] = ()
    """Stop strings: the answer ends before the first one and never contains it."""

    # -- the round ------------------------------------------------------------------------------
    segment_len: int = 10
    """Tokens each drafter proposes per round (the paper's L = 10); a member left alone, with
    nothing to vote on, drafts segments that double up to four times this."""
    segment_boundary: SegmentBoundary = "tokens"
    """``"line"``: a draft also ends at its first line end, so candidates are whole lines of code."""
    scoring: Scoring = "mean_logit"
    """How a verifier scores a candidate: mean raw logit (the paper) or ``mean_logprob``."""
    normalization: Normalization = "sum"
    """How a verifier's scores are normalized over the candidates: ``sum`` (Eq. 3) or ``softmax``."""
    hedge: bool = True
    """Learn verifier weights within a request (Hedge); ``False``: uniform weights."""
    vote_on_stop: bool = True
    """Verifiers also score each finished candidate's end-of-turn token, so stopping is voted."""
    copy_guard_words: int = 5
    """A candidate that makes the answer repeat a run of this many words of an earlier assistant
    turn (a run no other message holds) wins only when every candidate does; 0 turns the guard off
    (:mod:`specem_core.copies`; the value was chosen out of fold: docs/reports/quality.md, "Follow-ups")."""
    copy_break: bool = True
    """When every candidate copies (``copy_guard_words``), in prose, commit the winner only up to
    the word that completes the copy and have the next drafts start with another word
    (:mod:`specem_core.copies`; measured: docs/reports/quality.md, "Follow-ups")."""
    reuse_other_drafts: bool = True
    """Members on one device draft in turn and continue from earlier candidates where their own
    pick agrees (speculative drafting: less work, the same drafts up to the kernels' numerics)."""

    # -- Model Exit and the trusted member ------------------------------------------------------
    model_exit: bool = False
    """Model Exit (our design): members that keep losing stop drafting."""
    model_exit_temperature: float = 1.0
    """Model Exit's τ in p = softmax(Q/τ) over the members' cumulative scores Q."""
    model_exit_agreement_rounds: int = 0
    """Model Exit also stops a drafter whose candidate equalled the kept member's this many rounds
    running (0: off)."""
    trusted_member: str | None = None
    """The member the trusted member's rules trust, by name; ``None``: the drafter with the highest
    prior in the member weights (none without member weights)."""
    trusted_opening_rounds: int = 0
    """The first N rounds are drafted by the trusted member (see ``trusted_member``) alone, unvoted."""
    trusted_veto: bool = False
    """Another member's segment wins only if the trusted member scores it at least as high as its
    own draft."""
    trusted_tool_calls: bool = False
    """Once the answer starts a tool call, the trusted member writes the rest of the call alone."""
    unanimous_tool_calls: bool = False
    """With tools and ``tool_choice="auto"``, the answer opens with a call only when every
    drafter's opening does (fewer needless calls, some missed ones)."""

    # -- modes and running ----------------------------------------------------------------------
    reproduce_paper: bool = False
    """Reproduce the authors' decisions exactly (forces the paper's rule on every option that has one)."""
    member_retries: int = 1
    """Retries of a failing member call before the member is excluded from the request."""
    parallel: bool | None = None
    """Run members concurrently; ``None``: only members on different devices or servers."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.reproduce_paper:
            for name, value in _PAPER_RULES.items():
                object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        _int_at_least("segment_len", self.segment_len, 1)
        _int_at_least("max_new_tokens", self.max_new_tokens, 1)
        _int_at_least("top_k", self.top_k, 0)
        _int_at_least("model_exit_min_rounds", self.model_exit_min_rounds, 1)
        _int_at_least("model_exit_agreement_rounds", self.model_exit_agreement_rounds, 0)
        _int_at_least("trusted_opening_rounds", self.trusted_opening_rounds, 0)
        _int_at_least("member_retries", self.member_retries, 0)
        _int_at_least("copy_guard_words", self.copy_guard_words, 0)
        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ConfigError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
        if self.parallel is not None and not isinstance(self.parallel, bool):
            raise ConfigError(f"parallel must be True, False or None, got {self.parallel!r}")
        if self.trusted_member is not None and (not isinstance(self.trusted_member, str) or not self.trusted_member):
            raise ConfigError(f"trusted_member must be a member's name or None, got {self.trusted_member!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an int or None, got {self.seed!r}")
        _finite_at_least("temperature", self.temperature, 0.0)
        if self.temperature > MAX_TEMPERATURE:
            raise ConfigError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature!r}")
        _finite_at_least("hedge_eta0", self.hedge_eta0, 0.0)
        _finite_at_least("repetition_penalty", self.repetition_penalty, 0.0, strict=True)
        _finite_at_least("normalization_temperature", self.normalization_temperature, 0.0, strict=True)
        _finite_at_least("model_exit_temperature", self.model_exit_temperature, 0.0, strict=True)
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= float(self.model_exit_entropy_ratio) <= 1.0):
            raise ConfigError(f"model_exit_entropy_ratio must be in [0, 1], got {self.model_exit_entropy_ratio!r}")
        if not (0.0 <= float(self.model_exit_min_prob) < 1.0):
            raise ConfigError(f"model_exit_min_prob must be in [0, 1), got {self.model_exit_min_prob!r}")
        _choice("scoring", self.scoring, ("mean_logit", "mean_logprob"))
        _choice("segment_boundary", self.segment_boundary, ("tokens", "line"))
        _choice("normalization", self.normalization, ("sum", "softmax"))
        _choice("nonpositive_rule", self.nonpositive_rule, ("softmax", "raw"))
        _choice("hedge_decay", self.hedge_decay, ("sqrt", "inverse"))
        for n, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop strings must be non-empty strings, got {s!r}")
            check_unicode(s, f"stop string {n} ({s!r})", error=ConfigError)

    def replace(self, **overrides: Any) -> SpecEMConfig:
        """Return a validated copy with some fields changed; ``None`` values are ignored.

        Raises:
            ConfigError: an unknown field name or an invalid value.
        """
        overrides = current_names(overrides, where="SpecEMConfig.replace")
        unknown = sorted(set(overrides) - set(OPTIONS))
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


STUDY_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StudyOptions))
"""The study's options (:class:`StudyOptions`), in declaration order."""
USER_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SpecEMConfig) if f.name not in STUDY_OPTIONS)
"""The options a user tunes (:class:`SpecEMConfig`'s own fields), in declaration order: the
fields the LangChain and LlamaIndex classes take by name; every surface takes all of
:data:`OPTIONS`."""
OPTIONS: tuple[str, ...] = USER_OPTIONS + STUDY_OPTIONS
"""Every :class:`SpecEMConfig` field."""

RENAMED: dict[str, str] = {
    "faithful": "reproduce_paper",
    "eos_voting": "vote_on_stop",
    "draft_hints": "reuse_other_drafts",
    "self_vote": "leave_self_out",
    "softmax_temperature": "normalization_temperature",
    "exit_temperature": "model_exit_temperature",
    "exit_entropy_ratio": "model_exit_entropy_ratio",
    "exit_min_prob": "model_exit_min_prob",
    "exit_min_rounds": "model_exit_min_rounds",
    "exit_keep_trusted": "model_exit_keeps_trusted",
    "exit_agreement_rounds": "model_exit_agreement_rounds",
}
"""Option names of 0.1 -> their names since 0.2; the old ones are accepted with a
``FutureWarning`` until 0.3."""
REMOVED: dict[str, str] = {"extra": "it was never read: keep your metadata beside the result"}
"""Options of 0.1 that are gone, with why; accepted (and ignored) with a ``FutureWarning`` until 0.3."""


@functools.cache
def option_docs() -> dict[str, str]:
    """Each option's docstring, as written under its field here (read from this module's source;
    ``{}`` where the source is not installed): every surface documents an option with it."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(inspect.getmodule(option_docs)))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name not in ("StudyOptions", "SpecEMConfig"):
            continue
        for field_node, doc in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(field_node, ast.AnnAssign)
                and isinstance(field_node.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                docs[field_node.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def option_types() -> dict[str, Any]:
    """Each option's type (``Literal[...]`` for the choices), resolved from the annotations."""
    import typing

    hints = typing.get_type_hints(SpecEMConfig)
    return {name: hints[name] for name in OPTIONS}


def _self_vote_value(value: Any) -> Any:
    """``self_vote="keep"/"exclude"`` (0.1) as ``leave_self_out``."""
    if value in ("keep", "exclude"):
        return value == "exclude"
    if value is None:
        return None
    raise ConfigError(f"self_vote must be one of keep, exclude; got {value!r}")


def current_names(options: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """``options`` with the names of 0.1 (:data:`RENAMED`) turned into today's, warning once per
    name (``FutureWarning``); removed options (:data:`REMOVED`) are dropped with a warning.

    Raises:
        ConfigError: an option given under both its old and its new name.
    """
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key in REMOVED:
            warnings.warn(
                f"{where}: the option {key!r} is removed ({REMOVED[key]}); it is ignored, and refused from 0.3",
                FutureWarning,
                stacklevel=3,
            )
            continue
        new = RENAMED.get(key)
        if new is None:
            out[key] = value
            continue
        warnings.warn(
            f"{where}: the option {key!r} is now called {new!r}; the old name stops working in 0.3",
            FutureWarning,
            stacklevel=3,
        )
        if new in options:
            raise ConfigError(f"{where}: {new} given twice (as {new} and as its old name {key})")
        out[new] = _self_vote_value(value) if key == "self_vote" else value
    return out


def renamed_argument(new_value: Any, old_value: Any, *, where: str, new: str, old: str) -> Any:
    """The value of an argument renamed in 0.2 (``weights=`` -> ``member_weights=``): the new
    name's, else the old name's with a ``FutureWarning`` (the old name works until 0.3).

    Raises:
        ConfigError: the argument given under both names.
    """
    if old_value is None:
        return new_value
    warnings.warn(
        f"{where}: the argument {old!r} is now called {new!r}; the old name stops working in 0.3",
        FutureWarning,
        stacklevel=3,
    )
    if new_value is not None:
        raise ConfigError(f"{where}: {new} given twice (as {new} and as its old name {old})")
    return old_value


def _accepts_old_names(cls: type[SpecEMConfig]) -> type[SpecEMConfig]:
    """``SpecEMConfig(faithful=True)`` (a name of 0.1) still works, with a warning."""
    init: Callable[..., None] = cls.__init__

    @functools.wraps(init)
    def __init__(self: SpecEMConfig, **options: Any) -> None:
        init(self, **current_names(options, where="SpecEMConfig"))

    setattr(cls, "__init__", __init__)  # noqa: B010  (assigning a method: mypy refuses the plain form)
    return cls


_accepts_old_names(SpecEMConfig)


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


def cache_dir() -> Path:
    """Where SpecEM keeps what it converted or learned on this machine (converted models, probe
    results): ``$SPECEM_HOME``, else ``$XDG_CACHE_HOME/specem``, else ``~/.cache/specem``."""
    if os.environ.get("SPECEM_HOME"):
        return Path(os.environ["SPECEM_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specem"
