"""The one declaration of the options a user sets, and everything the surfaces build from it.

An option is declared once, as a :class:`~specem_core.config.SpecEMConfig` field with its
docstring (the options a user tunes: :data:`specem_core.config.USER_OPTIONS`; the study's:
:class:`~specem_core.config.StudyOptions`), and named on the surfaces by one table
(:data:`specem_core.vocabulary.ALIASES`). From that, this module generates:

- :data:`CONFIG_OPTIONS`: each option a user tunes as the surfaces take it (name, type, docs,
  other accepted spellings);
- :class:`EnsembleFields`: the pydantic fields of ``ChatSpecEM`` and ``SpecEMLLM`` (the options
  above, plus the ones that choose the ensemble), with their docs, and the one place that turns
  them into an engine (:meth:`EnsembleFields.assemble_engine`) and into a request's config
  (:meth:`EnsembleFields.config_overrides`);
- :func:`add_config_flags` / :func:`flag_values`: the CLI's flags, one per option a user tunes;
- :func:`parse_set_items`: the CLI's ``--set FIELD=VALUE`` for every option;
- :func:`request_field_definitions`: the server's ``specem`` request object.

Adding an option is adding a field (with its docstring) to ``SpecEMConfig``: every surface takes
it from there, and ``tests/test_options.py`` checks that each one reaches the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, SecretStr, create_model

from specem_core.config import RENAMED, USER_OPTIONS, SpecEMConfig, current_names, option_docs, option_types
from specem_core.errors import ConfigError
from specem_core.presets import Preset, config_of
from specem_core.vocabulary import ALIASES, SURFACE_NAMES, check_known, config_fields

if TYPE_CHECKING:
    from specem_core.engine import SpecEM


@dataclass(frozen=True)
class ConfigOption:
    """One option a user tunes, as every surface takes it."""

    field: str
    """The :class:`~specem_core.config.SpecEMConfig` field it sets."""
    name: str
    """Its name on the surfaces (a class field, a ``--flag``, a keyword argument)."""
    annotation: Any
    """The type a surface takes (``None`` included: not given, the preset's value)."""
    doc: str
    """Its meaning: the field's docstring in ``specem_core/config.py``."""
    spellings: tuple[str, ...]
    """Other names accepted for it (the field's own name, :data:`specem_core.vocabulary.ALIASES`)."""

    @property
    def summary(self) -> str:
        """The first paragraph of :attr:`doc`, on one line."""
        return " ".join(self.doc.split("\n\n")[0].split())

    @property
    def flags(self) -> tuple[str, ...]:
        """The CLI's flags: ``--name``, then the other spellings."""
        return tuple("--" + n.replace("_", "-") for n in (self.name, *self.spellings))


def _surface_type(field_name: str) -> Any:
    kind = option_types()[field_name]
    if field_name == "stop":
        return list[str] | None
    return kind | None if type(None) not in typing.get_args(kind) else kind


def _config_options() -> tuple[ConfigOption, ...]:
    """:data:`CONFIG_OPTIONS` (the docs are read from ``config.py``'s source)."""
    docs = option_docs()
    out = []
    for field_name in USER_OPTIONS:
        name = SURFACE_NAMES.get(field_name, field_name)
        spellings = tuple(
            dict.fromkeys(
                [*([field_name] if name != field_name else []), *(a for a, f in ALIASES.items() if f == field_name)]
            )
        )
        spellings = tuple(s for s in spellings if s != name)
        out.append(ConfigOption(field_name, name, _surface_type(field_name), docs.get(field_name, ""), spellings))
    return tuple(out)


CONFIG_OPTIONS: tuple[ConfigOption, ...] = _config_options()
"""Every option a user tunes (:data:`specem_core.config.USER_OPTIONS`), as the surfaces take it."""

_BY_NAME = {option.name: option for option in CONFIG_OPTIONS}
SPELLINGS: dict[str, str] = {s: option.name for option in CONFIG_OPTIONS for s in option.spellings}
"""Another accepted spelling -> the surfaces' name (``max_new_tokens`` -> ``max_tokens``)."""
OLD_NAMES: dict[str, str] = {old: new for old, new in RENAMED.items() if new in USER_OPTIONS}
"""Names of 0.1 of the options a user tunes (``faithful``, ``eos_voting``, …): accepted with a
``FutureWarning`` until 0.3."""
FIXED_PER_INSTANCE = frozenset({"members", "preset", "model", "engine", "engine_options", "backend", "member_kwargs"})
"""Arguments that choose the ensemble: set on the instance, never per call."""


# -- the adapters' fields --------------------------------------------------------------------------
class _EnsembleFieldsBase(BaseModel):
    """The fields that choose the ensemble, shared by ``ChatSpecEM`` and ``SpecEMLLM``."""

    preset: str | None = Field(
        default=None,
        description=(
            "A named, measured configuration (``quality``, ``fast``, ``paper``: see ``specem presets``): its "
            "members, settings and member-weights prior. ``None`` with no ``members``: the default preset. The "
            "other fields override the preset's."
        ),
    )
    members: list[Any] | None = Field(
        default=None,
        description=(
            "The ensemble: packaged model names (``smollm2``, ``qwen2.5-coder``, ``gemma3``), local "
            "directories, ``.gguf`` files, Hugging Face ids, servers (``openai:URL#model``) or ready "
            "``specem_core.Member`` objects. ``None``: the preset's members."
        ),
    )
    backend: Literal["auto", "transformers", "llamacpp"] | None = Field(
        default=None,
        description=(
            "Backend of the members given by name: ``llamacpp`` (GGUF in process, the CPU default when "
            "llama-cpp-python is installed), ``transformers``, or ``None``/``auto``."
        ),
    )
    member_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra arguments of ``specem_core.registry.load_member`` (``device``, ``dtype``, ``n_ctx``, …).",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description=(
            "The API key of the members that are servers (``openai:`` / ``judge:`` specs); local members have "
            "none. Never shown in repr, logs or errors."
        ),
    )
    member_weights: Any = Field(
        default=None,
        description=(
            "Member weights learned across requests: a ``specem_core.weights.MemberWeights`` or the path of its "
            "JSON state file (loaded if it exists, created from the preset's prior otherwise, saved after each "
            "request); ``False``: none (the paper's per-request weights). ``None``: the preset's prior (none for "
            "members of your own)."
        ),
    )
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Any ``SpecEMConfig`` option, the study's (``specem_core.config.StudyOptions``) included, for every "
            "request; the fields of their own win over it. Every option and its meaning: the configuration guide."
        ),
    )
    timeout: float | None = Field(
        default=None,
        gt=0.0,
        description=(
            "Seconds a request may take; checked as each segment is committed (``TimeoutError``). Can also be "
            "given per call."
        ),
    )

    def assemble_engine(self, preset: Preset | None) -> SpecEM:
        """The engine these fields describe, through the one assembly every surface uses
        (:func:`specem_core.presets.plan`); the settings go per request
        (:meth:`config_overrides`): the engine carries the preset's and its prior."""
        from specem_core.engine import SpecEM

        return SpecEM.from_preset(
            preset,
            members=self.members,
            member_weights=self.member_weights,
            backend=self.backend,
            member_kwargs=self.member_kwargs,
            api_key=self.api_key,
        )

    def config_overrides(
        self, call: Mapping[str, Any], *, where: str, ignored: Iterable[str] = (), extra: Iterable[str] = ()
    ) -> dict[str, Any]:
        """The :class:`~specem_core.config.SpecEMConfig` overrides of one request:
        ``engine_options``, then the fields, then the per-call arguments (``call``, without the
        ``ignored`` ones; ``extra``: the surface's own per-call names, for the error's suggestions).

        Raises:
            ConfigError: an unknown name (with the closest ones), or an argument that chooses the
                ensemble given per call.
        """
        out = config_fields(self.engine_options, where=f"{where} engine_options")
        out.update(config_fields({o.name: getattr(self, o.name) for o in CONFIG_OPTIONS}, where=where))
        skip = set(ignored)
        given: dict[str, Any] = {}
        for key, value in call.items():
            if key in skip:
                continue
            if key in FIXED_PER_INSTANCE:
                raise ConfigError(
                    f"{where}: {key} chooses the ensemble and is set on the instance, not per call ({where}({key}=...))"
                )
            given[key] = value
        out.update(config_fields(given, where=f"{where} call", extra=[*extra, *skip]))
        return out

    def check_config(self, preset: Preset | None, *, where: str) -> None:
        """Every setting checked now, with the option's name, not at the first request.

        Raises:
            ConfigError: an unknown option or an invalid value.
        """
        config_of(preset, **self.config_overrides({}, where=where))


def _field_definitions() -> dict[str, Any]:
    return {
        option.name: (option.annotation, Field(default=None, description=option.summary)) for option in CONFIG_OPTIONS
    }


if TYPE_CHECKING:  # the option fields are built at run time: a type checker sees them as Any

    class EnsembleFields(_EnsembleFieldsBase):
        def __getattr__(self, name: str) -> Any: ...

else:
    EnsembleFields = create_model(
        "EnsembleFields",
        __base__=_EnsembleFieldsBase,
        __module__=__name__,
        __doc__="The fields ``ChatSpecEM`` and ``SpecEMLLM`` share: the ensemble, and every option a user tunes.",
        **_field_definitions(),
    )
OPTION_FIELDS: tuple[str, ...] = tuple(option.name for option in CONFIG_OPTIONS)
"""The shared fields of the options a user tunes, named as the surfaces name them."""


def surface_arguments(values: Mapping[str, Any], *, where: str, known: Iterable[str]) -> dict[str, Any]:
    """A constructor's keyword arguments under the surface's names: other spellings
    (``max_new_tokens``, ``member_retries``, ``stop_sequences``) become the field they mean, names
    of 0.1 become today's (``FutureWarning``), and an unknown name fails with the closest ones.

    Raises:
        ConfigError: an unknown argument, or an option given under two spellings.
    """
    out = dict(values)
    if any(key in OLD_NAMES for key in out):
        renamed = current_names({k: out.pop(k) for k in list(out) if k in OLD_NAMES}, where=where)
        for key, value in renamed.items():
            if key in out:
                raise ConfigError(f"{where}: {key} given twice (as {key} and as its old name)")
            out[key] = value
    for spelling, name in SPELLINGS.items():  # the fields' own names among them (max_new_tokens)
        if spelling in out:
            if out.get(name) is not None:
                raise ConfigError(f"{where}: {name} given twice (as {name} and as {spelling})")
            out[name] = out.pop(spelling)
    check_known(out, [*known, *SPELLINGS], where=where)
    return out


# -- the CLI -------------------------------------------------------------------------------------
def _help(option: ConfigOption, serving: bool) -> str:
    text = option.summary.replace("``", "").replace("%", "%%")
    if serving and option.field == "max_new_tokens":
        text += " A request's max_tokens wins."
    return text


def add_config_flags(parser: argparse.ArgumentParser, *, serving: bool = False) -> None:
    """One flag per option a user tunes (:data:`CONFIG_OPTIONS`; ``dest`` is the surfaces' name,
    default ``None``: the preset's value), then ``--set`` for any option."""
    group = parser.add_argument_group("ensemble settings (default: the preset's; --set FIELD=VALUE for any option)")
    for option in CONFIG_OPTIONS:
        base = typing.get_args(option.annotation)[0] if typing.get_origin(option.annotation) else option.annotation
        kwargs: dict[str, Any] = {"dest": option.name, "default": None, "help": _help(option, serving)}
        if option.field == "stop":
            group.add_argument(*option.flags, action="append", metavar="TEXT", **kwargs)
        elif base is bool:
            group.add_argument(*option.flags, action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(base) is Literal:
            group.add_argument(*option.flags, choices=list(typing.get_args(base)), **kwargs)
        elif base in (int, float):
            group.add_argument(*option.flags, type=base, metavar="N" if base is int else "X", **kwargs)
        elif base is str:
            group.add_argument(*option.flags, metavar="NAME", **kwargs)
        else:  # pragma: no cover - a new kind of option: declare how the CLI reads it here
            raise TypeError(f"no CLI flag for {option.name} ({option.annotation})")
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        dest="set_options",
        help="any SpecEMConfig field (repeatable), the study's included, e.g. --set normalization=softmax "
        "--set hedge_eta0=0.3; applied after the other options",
    )


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options given as flags, as :class:`~specem_core.config.SpecEMConfig` fields."""
    given = {option.name: getattr(args, option.name, None) for option in CONFIG_OPTIONS}
    return config_fields(given, where="specem")


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_set_items(items: Sequence[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` items as typed :class:`~specem_core.config.SpecEMConfig` fields
    (any option, the study's included; ``none`` unsets an optional one).

    Raises:
        ConfigError: not ``FIELD=VALUE``, an unknown field, or a value of the wrong type.
    """
    raw_values: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or not name:
            raise ConfigError(f"--set expects FIELD=VALUE, got {item!r}")
        raw_values[name] = raw
    types = option_types()
    out: dict[str, Any] = {}
    for name, raw in current_names(raw_values, where="--set").items():  # 0.1's names, with a warning
        if name not in types:
            raise ConfigError(f"--set: unknown SpecEM option {name!r}")
        out[name] = raw if not isinstance(raw, str) else _parse_value(name, types[name], raw)
    return out


def _parse_value(name: str, kind: Any, raw: str) -> Any:
    args = typing.get_args(kind)
    optional = type(None) in args
    if optional and raw.lower() in ("none", "null", "auto"):
        return None
    base = next((a for a in args if a is not type(None)), kind) if optional else kind
    try:
        if name == "stop":  # one string, or a JSON list of them
            return tuple(json.loads(raw)) if raw.startswith("[") else (raw,)
        if base is bool:
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError("expected true or false")
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"--set {name}: cannot read {raw!r} ({exc})") from None
    return raw  # the choices: SpecEMConfig validates them, naming the allowed values


def with_set_items(config: SpecEMConfig, items: Sequence[str]) -> SpecEMConfig:
    """``config`` (a :class:`~specem_core.config.SpecEMConfig`) with the ``--set`` items applied
    last (``none`` really unsets, e.g. a seed); validated again."""
    return dataclasses.replace(config, **parse_set_items(items)) if items else config


# -- the server's request object -------------------------------------------------------------------
def request_field_definitions(names: Iterable[str]) -> dict[str, Any]:
    """Pydantic field definitions of the :class:`~specem_core.config.SpecEMConfig` fields
    ``names`` (any option, under its field name, typed as the config types it, ``None``: the
    server's value), for ``create_model``: the server's ``specem`` request object."""
    docs, types = option_docs(), option_types()
    return {name: (types[name] | None, Field(default=None, description=docs.get(name))) for name in names}


def member_spec_text(member: Any) -> str:
    """How a member given to an adapter is named before it loads."""
    return os.fspath(member) if isinstance(member, str | os.PathLike) else str(member.name)


def option(name: str) -> ConfigOption:
    """The option a surface names ``name``.

    Raises:
        KeyError: no such option.
    """
    return _BY_NAME[name]
