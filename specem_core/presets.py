"""Named presets: measured SpecEM configurations (members, settings and a member-weights prior).

A preset is what the quality study recommends, packaged so that one name gives the whole thing on
every surface: ``SpecEM.from_preset("quality")``, ``ChatSpecEM(preset="quality")``,
``SpecEMLLM(preset="quality")``, ``specem chat --preset quality``, ``specem serve --preset quality``.
``specem presets`` lists them with what they measured.

Each preset holds
- its members (packaged model names, which resolve on any backend: see :mod:`specem_core.registry`);
- the :class:`~specem_core.config.SpecEMConfig` fields it changes;
- optionally a member-weights prior shipped as package data (``specem_core/data/priors/NAME.json``,
  the format ``specem calibrate`` writes), measured on labelled examples with each member alone;
- the results it measured (``specem_core/data/preset_results.json``, written from
  ``benchmarks/results/quality/summary.json`` by ``python benchmarks/quality.py presets``).

Explicit arguments override the preset's: config fields replace the preset's fields; ``members``
replaces its members (and then drops its prior, which names the preset's members only, unless
``weights`` is given too); ``weights`` replaces its prior (``False``: no member weights).

Example:
    >>> from specem_core.presets import get_preset
    >>> get_preset("quality").members
    ('qwen2.5-coder-1.5b-instruct', 'qwen2.5-coder-0.5b-instruct')
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING, Any

from specem_core.config import SpecEMConfig, renamed_argument
from specem_core.errors import ConfigError

if TYPE_CHECKING:
    from specem_core.backends.base import Member
    from specem_core.weights import MemberWeights

_RECOMMENDED: dict[str, Any] = {
    # the quality study's recommended settings; why each one, and what it measured:
    # docs/reports/quality.md ("The shipped presets", "Lessons learned")
    "normalization": "softmax",  # scale-free rows: the weights decide the vote
    "model_exit": True,
    "model_exit_temperature": 0.2,
    "model_exit_keeps_trusted": True,  # exit never stops the member the prior trusts
    "model_exit_agreement_rounds": 2,  # and stops a drafter that keeps agreeing with it
    "trusted_opening_rounds": 2,  # the trusted member writes the opening (where a method is set)
    "reuse_other_drafts": False,  # drafts decoded as each member alone decodes them
}


@dataclass(frozen=True)
class Preset:
    """A named, measured configuration."""

    name: str
    """What surfaces call it (``preset="quality"``, ``--preset quality``)."""
    description: str
    """One line: its members, its settings and what it measured (``specem presets`` prints it)."""
    members: tuple[str, ...]
    """Member specs (packaged model names), in tie-break order."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """:class:`SpecEMConfig` fields the preset sets (the others keep their defaults)."""
    prior: str | None = None
    """Name of the member-weights prior shipped as package data (``data/priors/<prior>.json``);
    ``None``: no member weights (the paper's per-request rule)."""

    def spec(self) -> SpecEMConfig:
        """The preset's :class:`SpecEMConfig` (validated)."""
        return SpecEMConfig(**dict(self.config))

    def weights(self) -> MemberWeights | None:
        """Deprecated (until 0.3): :meth:`member_weights`."""
        warnings.warn(
            "Preset.weights() is now Preset.member_weights(); the old name stops working in 0.3",
            FutureWarning,
            stacklevel=2,
        )
        return self.member_weights()

    def member_weights(self) -> MemberWeights | None:
        """A fresh :class:`~specem_core.weights.MemberWeights` with the shipped prior (``None``
        without one). Each call gives a new object: what one engine learns stays its own.

        Raises:
            ConfigError: the prior file is missing or not a member-weights file.
        """
        if self.prior is None:
            return None
        from specem_core.weights import MemberWeights

        data = _read_json(f"priors/{self.prior}.json", what=f"the prior of preset {self.name!r}")
        weights = MemberWeights.from_dict(data)
        missing = sorted(set(self.members) - set(weights.prior))
        if missing:
            raise ConfigError(f"the prior of preset {self.name!r} has no entry for member(s) {', '.join(missing)}")
        return weights

    def calibration(self) -> dict[str, Any]:
        """Where the shipped prior comes from (data sets, examples, scores); ``{}`` without one."""
        if self.prior is None:
            return {}
        data = _read_json(f"priors/{self.prior}.json", what=f"the prior of preset {self.name!r}")
        return dict(data.get("calibration") or {})

    def results(self) -> dict[str, dict[str, Any]]:
        """What the preset's setting measured on each dev set, in sample: ``{task: {metric: value,
        "n": n, "best_member": value, ...}}``."""
        table = _read_json("preset_results.json", what="the presets' measured results")
        return {task: dict(v) for task, v in (table.get(self.name) or {}).items() if task != "out_of_fold"}

    def out_of_fold(self) -> dict[str, Any]:
        """The figure to trust: the preset's setting chosen among candidates on k-1 folds of the dev
        sets and graded on the fold it never saw, put together over the folds (``{"k": k,
        "candidates": [...], "chosen_on_all_folds": name, task: {"score", "reference", "gained",
        "lost", "sign_test_p", "ci95"}}``); ``{}`` where the protocol was not run. How:
        docs/reports/quality.md, "Choosing the default out of sample"."""
        table = _read_json("preset_results.json", what="the presets' measured results")
        return dict((table.get(self.name) or {}).get("out_of_fold") or {})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON, as ``specem presets --json`` prints it."""
        return {
            "name": self.name,
            "default": self.name == DEFAULT_PRESET,
            "description": self.description,
            "members": list(self.members),
            "config": dict(self.config),
            "prior": self.calibration() or None,
            "results": self.results(),
            "out_of_fold": self.out_of_fold() or None,
            "held_out": HELD_OUT.get(self.name),
        }


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="quality",
            description="Qwen2.5-Coder-1.5B + 0.5B with the preset settings and the trusted veto (the 0.5B's "
            "segment is committed only when the 1.5B scores it at least as high as its own draft), chosen out of "
            "fold on the dev sets; the 1.5B writes the tool calls it starts; a prior measured on labelled dev examples",
            members=("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
            # the 1.5B writes the tool calls it starts (SpecEMConfig.trusted_tool_calls): chosen on the
            # first 100 BFCL cases of each category, reported on the next ones (docs/reports/quality.md)
            # SpecEMConfig.unanimous_tool_calls stays off: chosen on the first 100 BFCL cases, out of sample it
            # missed calls on questions a tool was given for (below the 1.5B alone on simple and multiple)
            config={**_RECOMMENDED, "trusted_veto": True, "trusted_tool_calls": True},
            prior="quality",
        ),
        Preset(
            name="fast",
            description="Qwen2.5-Coder-0.5B + SmolLM2-135M with the recommended settings and a measured prior: "
            "small and quick; no gain over the 0.5B alone (out of fold the protocol chooses the 0.5B alone)",
            members=("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"),
            config=_RECOMMENDED,
            prior="fast",
        ),
        Preset(
            name="paper",
            description="SmolLM2-135M + Qwen2.5-Coder-0.5B under the paper's settings (sum-normalized logits, "
            "per-request Hedge, no Model Exit): the first default; below its better member on IFEval dev at 64 "
            "tokens (22.5 against 25.8)",
            members=("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"),
        ),
    )
}
"""Every preset by name."""

DEFAULT_PRESET = "quality"
"""What ``specem chat``, ``specem serve``, ``ChatSpecEM()``, ``SpecEMLLM()`` and
:func:`~specem_core.engine.default_engine` run with no members given: the ensemble whose rule was
chosen out of fold on IFEval dev (120 prompts) and GSM8K dev (200 problems), level with its best
member alone within noise (above it out of fold on the dev sets, below it on held-out GSM8K test
problems: :data:`HELD_OUT`; docs/reports/quality.md, "Summary"). Its figures are package data
(:meth:`Preset.out_of_fold`, :meth:`Preset.results`, ``specem presets``), not repeated here."""

HELD_OUT: dict[str, str] = {
    "quality": "gsm8k test (n=100, never shown to this project; measured for issue #65, records not in "
    "this repository): 45 against 50 for 1.5b alone (+5 / -10, p=0.30, 95% CI -13 to +3 points); "
    "with the out-of-fold gsm8k figures, +16 / -15 over 300 problems: level within noise",
}
"""Checks of a preset on data this project never saw, made outside its records, one line per
preset (``specem presets`` prints it under the out-of-fold figures)."""


def preset_names() -> list[str]:
    """The presets' names, the default first."""
    return [DEFAULT_PRESET, *(n for n in PRESETS if n != DEFAULT_PRESET)]


def get_preset(name: str | Preset | None = None) -> Preset:
    """The preset called ``name`` (``None``: the default).

    Raises:
        ConfigError: no preset has that name (the message lists them).
    """
    if isinstance(name, Preset):
        return name
    if name is None:
        return PRESETS[DEFAULT_PRESET]
    if not isinstance(name, str):
        raise ConfigError(f"a preset is named by a string; got {type(name).__name__}")
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: use one of {', '.join(preset_names())}")
    return PRESETS[key]


def check_model_name(model: str | None, preset: str | None, *, where: str) -> None:
    """``model=`` in the LangChain and LlamaIndex classes names a preset (the same as ``preset=``);
    anything else is an error, never a silent label.

    Raises:
        ConfigError: ``model`` names no preset, or another preset than ``preset``.
    """
    if model is None:
        return
    if model.strip().lower() not in PRESETS:
        raise ConfigError(
            f"{where}: model={model!r} is not a preset ({', '.join(preset_names())}); "
            "give the ensemble's models as members=[...]"
        )
    if preset is not None and preset.strip().lower() != model.strip().lower():
        raise ConfigError(f"{where}: model={model!r} and preset={preset!r} disagree")


def preset_members(
    name: str | Preset | None = None,
    *,
    backend: str | None = None,
    device: str | None = None,
    **member_kwargs: Any,
) -> list[Member]:
    """The preset's members, loaded (``backend``, ``device`` and other keyword arguments go to
    :func:`specem_core.registry.load_member`)."""
    return load_members(get_preset(name).members, backend=backend, device=device, member_kwargs=member_kwargs)


def default_members(**kwargs: Any) -> list[Member]:
    """The default preset's members (keyword arguments, ``backend=`` included, go to
    :func:`specem_core.registry.load_member`)."""
    return preset_members(DEFAULT_PRESET, **kwargs)


def resolve(name: str | Preset | None, *, members_given: bool) -> Preset | None:
    """The preset a surface runs: ``name``'s; with no name, the default preset when no members
    are given, else none (the members under :class:`SpecEMConfig`'s defaults). Every entry point
    (CLI, Python, LangChain, LlamaIndex, server) decides with this one rule.

    Raises:
        ConfigError: an unknown preset name.
    """
    if name is None:
        return None if members_given else get_preset(None)
    return get_preset(name)


def config_of(preset: Preset | None, **config: Any) -> SpecEMConfig:
    """The preset's :class:`SpecEMConfig` with ``config`` fields over it (``None`` values ignored).

    Raises:
        ConfigError: an unknown field or an invalid value.
    """
    base = preset.spec() if preset is not None else SpecEMConfig()
    return base.replace(**config)


@dataclass(frozen=True)
class EngineParts:
    """What an engine is made of (:func:`assemble`): :class:`~specem_core.engine.SpecEM` takes
    ``members``, ``config`` and ``weights``."""

    members: list[Member]
    """Loaded, in tie-break order (the verify-only ones last)."""
    config: SpecEMConfig
    """The preset's configuration with the explicit arguments over it (validated)."""
    member_weights: MemberWeights | None
    """The member weights (``None``: the paper's per-request rule)."""
    preset: Preset | None
    """The preset they come from (``None``: members of your own under the library defaults)."""

    @property
    def weights(self) -> MemberWeights | None:
        """Deprecated (until 0.3): :attr:`member_weights`."""
        warnings.warn(
            "EngineParts.weights is now EngineParts.member_weights; the old name stops working in 0.3",
            FutureWarning,
            stacklevel=2,
        )
        return self.member_weights


@dataclass(frozen=True)
class EnsemblePlan:
    r"""An engine decided but not loaded (:func:`plan`): every argument checked, no model read.

    A surface plans first (so that a bad option fails before any model loads, or before a server
    binds its port), reports what it decided (the preset, the configuration), then
    :meth:`load`\ s it."""

    preset: Preset | None
    """The preset (``None``: members of your own under the library defaults)."""
    config: SpecEMConfig
    """The preset's configuration with the explicit arguments over it (validated)."""
    member_weights: MemberWeights | None
    """The member weights the engine starts with (``None``: the paper's per-request rule)."""
    members: tuple[Any, ...]
    """Member specs or :class:`Member` objects, in tie-break order (the preset's by default)."""
    verifiers: tuple[Any, ...] = ()
    """Verify-only members (specs are loaded with ``can_draft=False``), after the others."""
    backend: str | None = None
    """How members given by name load (:func:`specem_core.registry.load_member`)."""
    device: str | None = None
    """The device of local members given by name."""
    member_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Other :func:`~specem_core.registry.load_member` arguments."""
    api_key: Any = field(default=None, repr=False)
    """The server members' API key (never shown in ``repr``)."""

    def load(self) -> EngineParts:
        """Load the members (:func:`load_members`): the parts :class:`~specem_core.engine.SpecEM` takes."""
        loaded = load_members(
            self.members,
            verifiers=self.verifiers,
            backend=self.backend,
            device=self.device,
            member_kwargs=self.member_kwargs,
            api_key=self.api_key,
        )
        return EngineParts(loaded, self.config, self.member_weights, self.preset)


def plan(
    name: str | Preset | None = None,
    *,
    members: Sequence[Member | str | os.PathLike[str]] | None = None,
    verifiers: Sequence[Member | str | os.PathLike[str]] = (),
    member_weights: MemberWeights | str | os.PathLike[str] | bool | None = None,
    min_share: float | None = None,
    config: SpecEMConfig | None = None,
    backend: str | None = None,
    device: str | None = None,
    member_kwargs: Mapping[str, Any] | None = None,
    api_key: Any = None,
    weights: MemberWeights | str | os.PathLike[str] | bool | None = None,
    **fields: Any,
) -> EnsemblePlan:
    """The one assembly of an engine from a preset, with explicit arguments overriding it, checked
    and decided but not loaded (:meth:`EnsemblePlan.load` loads it). Every surface goes through
    it: :meth:`SpecEM.from_preset <specem_core.engine.SpecEM.from_preset>` (the LangChain and
    LlamaIndex classes), the CLI's ``chat``, ``serve`` and ``calibrate``.

    Args:
        name: the preset; ``None``: the default preset, or none at all when ``members`` is given
            (:func:`resolve`).
        members: replace the preset's members (specs or :class:`Member` objects); the preset's
            prior is then dropped unless ``member_weights`` is given.
        verifiers: members that only verify (specs are loaded with ``can_draft=False``), after
            the others.
        member_weights, min_share: the member weights (:func:`member_weights`); ``weights`` is
            the old name of ``member_weights`` (accepted with a ``FutureWarning`` until 0.3).
        config: the whole configuration instead of the preset's settings (``fields`` still apply
            over it).
        backend, device, member_kwargs: how members given by name are loaded
            (:func:`specem_core.registry.load_member`).
        api_key: the API key (a ``str`` or pydantic ``SecretStr``) of the members that are
            servers (``openai:`` / ``judge:`` specs); local members have none.
        **fields: :class:`SpecEMConfig` fields, over the preset's (``None`` values are ignored).

    Raises:
        ConfigError: an unknown preset or config field, an invalid value, or ``members=[]``.
    """
    if members is not None and not members:
        raise ConfigError("members is empty: give at least one member, or None for the preset's")
    preset = resolve(name, members_given=members is not None)
    spec = config.replace(**fields) if config is not None else config_of(preset, **fields)
    given = renamed_argument(member_weights, weights, where="plan", new="member_weights", old="weights")
    chosen = _member_weights(preset, members_given=members is not None, weights=given, min_share=min_share)
    specs: Sequence[Any] = preset.members if members is None and preset is not None else members or ()
    return EnsemblePlan(
        preset,
        spec,
        chosen,
        tuple(specs),
        tuple(verifiers),
        backend,
        device,
        dict(member_kwargs or {}),
        api_key,
    )


def assemble(name: str | Preset | None = None, **arguments: Any) -> EngineParts:
    """:func:`plan`, then :meth:`~EnsemblePlan.load`: the parts of an engine, loaded (arguments
    as for :func:`plan`).

    Raises:
        ConfigError: as :func:`plan`.
    """
    return plan(name, **arguments).load()


def member_weights(
    preset: Preset | None,
    *,
    members_given: bool = False,
    weights: MemberWeights | str | os.PathLike[str] | bool | None = None,
    min_share: float | None = None,
) -> MemberWeights | None:
    """The member weights an engine starts with.

    Args:
        preset: whose shipped prior applies (only to its own members: not when ``members_given``).
        weights: ``None`` / ``True``: the preset's prior (a fresh copy); ``False``: none; a
            ``MemberWeights``; or the path of a state file, loaded when it exists, else created
            from the preset's prior and its learning options.
        min_share: the gate (``MemberWeights.min_share``) over the chosen weights' own.

    Raises:
        ConfigError: ``min_share`` without member weights, an invalid ``min_share``, or a state
            file that cannot be read or written.
    """
    from specem_core.weights import MemberWeights

    prior = preset.member_weights() if preset is not None and not members_given else None
    options = {} if min_share is None else {"min_share": min_share}
    chosen: MemberWeights | None
    if weights is None or weights is True:
        chosen = prior
        if chosen is not None and min_share is not None:
            chosen.min_share = MemberWeights({}, min_share=min_share).min_share
    elif weights is False:
        chosen = None
    elif isinstance(weights, MemberWeights):
        chosen = weights
        if min_share is not None:
            chosen.min_share = MemberWeights({}, min_share=min_share).min_share
    elif prior is None or os.path.exists(weights):
        chosen = MemberWeights.open(weights, None, **options)
    else:  # a new state file starts from the preset's prior
        chosen = MemberWeights.open(weights, prior.prior, **{**_options(prior), **options})
    if chosen is None and min_share is not None:
        raise ConfigError("min_share needs member weights (a weights file or object, or a preset with a prior)")
    return chosen


_member_weights = member_weights  # ``plan``'s parameter of that name shadows the function


def load_members(
    specs: Sequence[Member | str | os.PathLike[str]],
    *,
    verifiers: Sequence[Member | str | os.PathLike[str]] = (),
    backend: str | None = None,
    device: str | None = None,
    member_kwargs: Mapping[str, Any] | None = None,
    api_key: Any = None,
) -> list[Member]:
    """Members from specs (ready :class:`Member` objects pass through), then the verify-only ones
    (``can_draft=False``); arguments as for :func:`assemble`."""
    from specem_core.registry import HTTP_PREFIXES, load_member

    options: dict[str, Any] = {"backend": backend, "device": device, **dict(member_kwargs or {})}

    def load(member: Any, **role: Any) -> Any:
        if not isinstance(member, str | os.PathLike):
            return member  # a ready member
        name = os.fspath(member)
        if api_key is not None and name.strip().startswith(HTTP_PREFIXES):
            return load_member(name, **options, **role, api_key=api_key)
        return load_member(name, **options, **role)

    return [load(m) for m in specs] + [load(v, can_draft=False) for v in verifiers]


def _options(weights: MemberWeights | None) -> dict[str, float]:
    """The learning options of a shipped prior, for a state file started from it."""
    if weights is None:
        return {}
    return {
        "learning_rate": weights.learning_rate,
        "max_log_ratio": weights.max_log_ratio,
        "min_share": weights.min_share,
    }


def _data_dir() -> Traversable:
    """Where the package data lives (``specem_core/data``; a zip import works too)."""
    return resources.files("specem_core").joinpath("data")


def _read_json(relative: str, *, what: str) -> dict[str, Any]:
    """A JSON object shipped in ``specem_core/data``.

    Raises:
        ConfigError: the file is missing or is not a JSON object (a broken install).
    """
    target = _data_dir().joinpath(*relative.split("/"))
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{what} is missing from the package (specem_core/data/{relative}): reinstall specem"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} cannot be read (specem_core/data/{relative}): {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} is not a JSON object (specem_core/data/{relative})")
    return data
