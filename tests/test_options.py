"""Every option reaches the engine from every surface, under today's names and (with a warning,
until 0.3) under its 0.1 name; the surfaces' field lists are derived from ``SpecEMConfig``.

A value that is not the default is sent through each surface -- ``SpecEMConfig`` itself, the CLI's
``--set``, the server's request, ``ChatSpecEM`` and ``SpecEMLLM`` (as fields for the options a user
tunes, in ``engine_options`` for every option) -- and the configuration each surface hands the
engine must hold it. A new option that some surface does not take fails here.
"""

from __future__ import annotations

import dataclasses
import io
import typing
import warnings
from typing import Any

import pytest

from specem_core import SpecEMConfig
from specem_core.config import OPTIONS, RENAMED, STUDY_OPTIONS, USER_OPTIONS, StudyOptions, option_docs, option_types
from specem_core.errors import ConfigError
from specem_core.vocabulary import ALIASES

_SPECIAL: dict[str, Any] = {
    "stop": ("END",),
    "seed": 7,
    "parallel": False,
    "temperature": 0.5,
    "top_p": 0.5,
    "model_exit_entropy_ratio": 0.25,
    "model_exit_min_prob": 0.3,
    "trusted_member": "a",  # the scripted members are a and b
}


def other_value(name: str) -> Any:
    """A valid value of option ``name`` that is not its default."""
    if name in _SPECIAL:
        return _SPECIAL[name]
    default = SpecEMConfig.__dataclass_fields__[name].default
    kind = option_types()[name]
    if typing.get_origin(kind) is typing.Literal:
        return next(choice for choice in typing.get_args(kind) if choice != default)
    if kind is bool:
        return not default
    if kind is int:
        return default + 2
    if kind is float:
        return default * 2 if default else 0.5
    raise AssertionError(f"no test value for {name} ({kind})")


SURFACE_NAME = {field: alias for alias, field in ALIASES.items() if alias in ("max_tokens", "max_retries")}
"""The LangChain / LlamaIndex / server spelling of the options that have one."""


def test_the_tiers_split_every_option_once() -> None:
    assert set(USER_OPTIONS) | set(STUDY_OPTIONS) == {f.name for f in dataclasses.fields(SpecEMConfig)}
    assert not set(USER_OPTIONS) & set(STUDY_OPTIONS)
    assert tuple(f.name for f in dataclasses.fields(StudyOptions)) == STUDY_OPTIONS
    assert set(option_docs()) == set(OPTIONS)  # every option is documented where it is declared


def test_every_user_option_has_a_one_line_meaning() -> None:
    """The options a user tunes read at a glance: the meaning fits in a few lines; the study's
    history belongs in the reports."""
    long = {name: doc for name, doc in option_docs().items() if name in USER_OPTIONS and len(doc.splitlines()) > 3}
    assert not long


def scripted_members() -> list[Any]:
    """Ready members that answer at once: the engine runs a real request with them, and its
    result says the configuration the request ran with (``GenerationResult.config``)."""
    from scripted import ScriptedMember

    return [ScriptedMember("a", drafts=[("Paris", True)]), ScriptedMember("b", drafts=[("Lyon", True)])]


def ran_with(result: Any, name: str) -> Any:
    """The value of option ``name`` in the configuration a request ran with."""
    value = result.config[name]
    return tuple(value) if isinstance(value, list) else value


def short(name: str) -> dict[str, Any]:
    """A short answer cap for the run (unless the option under test is the cap itself)."""
    return {} if name == "max_new_tokens" else {"max_new_tokens": 4}


@pytest.mark.parametrize("name", OPTIONS)
def test_the_cli_runs_the_engine_with_every_option(name: str) -> None:
    """``--set`` for every option, and a flag of its own for every option a user tunes: the
    engine ``specem chat`` builds (its plan, through the one assembly) holds the value."""
    from specem_integrations._options import option, parse_set_items
    from specem_integrations.cli import _parser, _resolve

    value = other_value(name)
    raw = value[0] if isinstance(value, tuple) else str(value).lower() if isinstance(value, bool) else value
    assert getattr(SpecEMConfig().replace(**parse_set_items([f"{name}={raw}"])), name) == value
    argv = ["chat", "hi", "--model", "smollm2", "--set", f"{name}={raw}"]
    assert getattr(_resolve(_parser().parse_args(argv), io.StringIO()).config, name) == value
    if name in USER_OPTIONS:
        flag = option(SURFACE_NAME.get(name, name)).flags[0]
        given = [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(raw)]
        args = _parser().parse_args(["chat", "hi", "--model", "smollm2", *given])
        assert getattr(_resolve(args, io.StringIO()).config, name) == value


@pytest.mark.parametrize("name", OPTIONS)
def test_the_server_runs_the_engine_with_every_option(name: str) -> None:
    from specem_core import SpecEM
    from specem_integrations.server._protocol import REQUEST_FIELDS, build_call, parse_request

    value = other_value(name)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if name in REQUEST_FIELDS:
        body["specem"] = {name: value}
    elif name == "parallel":
        pytest.skip("parallel is the server's own choice (how it runs its members), not a request's")
    else:  # an OpenAI top-level field
        top = {"max_new_tokens": "max_tokens", "stop": "stop"}.get(name, name)
        body[top] = list(value) if isinstance(value, tuple) else value
    engine = SpecEM(scripted_members(), SpecEMConfig(**short(name)))
    call = build_call(parse_request(body), engine.config)
    result = engine.generate(call.messages, **call.kwargs, **call.overrides)  # as the server calls it
    assert ran_with(result, name) == value


@pytest.mark.parametrize("name", OPTIONS)
def test_chat_specem_runs_the_engine_with_every_option(name: str) -> None:
    from langchain_core.messages import HumanMessage

    from specem_integrations.langchain import ChatSpecEM

    value = other_value(name)
    given = list(value) if isinstance(value, tuple) else value
    surfaces = [ChatSpecEM(members=scripted_members(), engine_options={**short(name), name: given})]
    if name in USER_OPTIONS:  # a field of its own
        fields = {SURFACE_NAME.get(name, name): given, "engine_options": short(name)}
        surfaces.append(ChatSpecEM(members=scripted_members(), **fields))
    for llm in surfaces:
        events = list(llm._events([HumanMessage("hi")], None, {}))
        assert ran_with(events[-1].result, name) == value


@pytest.mark.parametrize("name", OPTIONS)
def test_specem_llm_runs_the_engine_with_every_option(name: str) -> None:
    from llama_index.core.base.llms.types import ChatMessage

    from specem_integrations.llamaindex import SpecEMLLM

    value = other_value(name)
    given = list(value) if isinstance(value, tuple) else value
    surfaces = [SpecEMLLM(members=scripted_members(), engine_options={**short(name), name: given})]
    if name in USER_OPTIONS:
        fields = {SURFACE_NAME.get(name, name): given, "engine_options": short(name)}
        surfaces.append(SpecEMLLM(members=scripted_members(), **fields))
    for llm in surfaces:
        response = llm.chat([ChatMessage(role="user", content="hi")])
        assert ran_with(type("R", (), {"config": response.raw["config"]})(), name) == value


def test_the_adapters_have_a_field_for_every_user_option_and_no_other() -> None:
    from specem_integrations.langchain import ChatSpecEM
    from specem_integrations.llamaindex import SpecEMLLM

    for cls in (ChatSpecEM, SpecEMLLM):
        fields = set(cls.model_fields)
        assert {SURFACE_NAME.get(n, n) for n in USER_OPTIONS} <= fields, cls.__name__
        assert not set(STUDY_OPTIONS) & fields, cls.__name__  # study options go in engine_options


# -- names of 0.1 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_an_old_name_still_works_with_a_warning(old: str, new: str) -> None:
    from specem_integrations._options import parse_set_items
    from specem_integrations.server._protocol import build_call, parse_request

    value = other_value(new)
    old_value = {True: "exclude", False: "keep"}[value] if old == "self_vote" else value
    with pytest.warns(FutureWarning, match=f"'{old}' is now called '{new}'"):
        assert getattr(SpecEMConfig(**{old: old_value}), new) == value
    with pytest.warns(FutureWarning, match=old):
        assert getattr(SpecEMConfig().replace(**{old: old_value}), new) == value
    with pytest.warns(FutureWarning, match=old):
        assert parse_set_items([f"{old}={str(old_value).lower()}"]) == {new: value}
    body = {"messages": [{"role": "user", "content": "hi"}], "specem": {old: old_value}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the server logs it instead of warning in the request
        call = build_call(parse_request(body), SpecEMConfig())
    assert call.overrides[new] == value


def test_an_option_under_both_names_is_an_error() -> None:
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="given twice"):
        SpecEMConfig(faithful=True, reproduce_paper=True)


@pytest.mark.parametrize(("old", "new"), sorted((o, n) for o, n in RENAMED.items() if n in USER_OPTIONS))
def test_old_adapter_fields_still_work_with_a_warning(old: str, new: str) -> None:
    """Every renamed option that is an adapter field: its 0.1 name still sets it, with a warning."""
    from specem_integrations.langchain import ChatSpecEM
    from specem_integrations.llamaindex import SpecEMLLM

    value = other_value(new)
    with pytest.warns(FutureWarning, match=f"'{old}' is now called '{new}'"):
        chat = ChatSpecEM(members=["smollm2"], **{old: value})
    assert chat._overrides({}, None)[new] == value
    with pytest.warns(FutureWarning, match=f"'{old}' is now called '{new}'"):
        llm = SpecEMLLM(members=["smollm2"], **{old: value})
    assert llm._config_overrides({})[new] == value


def test_the_removed_extra_is_ignored_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="'extra' is removed"):
        config = SpecEMConfig(extra={"run": 1})
    assert "extra" not in config.to_dict()
