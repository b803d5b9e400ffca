"""One name per concept on every surface: aliases land on the field they mean, and an unknown or
misspelled argument fails loudly everywhere (never dropped)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from specem_core import SpecEM, SpecEMConfig
from specem_core.errors import ConfigError
from specem_core.vocabulary import config_fields


def _tiny_engine() -> SpecEM:
    from scripted import ScriptedMember

    return SpecEM([ScriptedMember("a", [("Hi.", True)]), ScriptedMember("b", [("Hi.", True)])])


def _chat_model(**kwargs: Any) -> Any:
    from specem_integrations.langchain import ChatSpecEM

    return ChatSpecEM(**kwargs)


def _llamaindex_llm(**kwargs: Any) -> Any:
    from specem_integrations.llamaindex import SpecEMLLM

    return SpecEMLLM(**kwargs)


def _server_request(**specem: Any) -> Any:
    from specem_integrations.server._protocol import build_call, parse_request

    return build_call(
        parse_request({"messages": [{"role": "user", "content": "hi"}], "specem": specem}), SpecEMConfig()
    )


def _cli(*args: str) -> Any:
    proc = subprocess.run(
        [sys.executable, "-m", "specem_integrations.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise ValueError(proc.stderr.strip())
    return proc


MISSPELT: list[tuple[str, Callable[[], Any], str]] = [
    ("SpecEMConfig", lambda: SpecEMConfig(segmnt_len=4), "segmnt_len"),  # type: ignore[call-arg]
    ("SpecEM", lambda: SpecEM(_tiny_engine().members, segmnt_len=4), "segmnt_len"),
    (
        "SpecEM.from_preset",
        lambda: SpecEM.from_preset("fast", members=_tiny_engine().members, max_tokns=4),
        "max_tokns",
    ),
    ("SpecEM.generate", lambda: _tiny_engine().generate("hi", segmnt_len=4), "segmnt_len"),
    ("ChatSpecEM", lambda: _chat_model(max_new_token=4), "max_new_token"),
    ("ChatSpecEM engine_options", lambda: _chat_model(engine_options={"exit_temprature": 0.2}), "exit_temprature"),
    ("ChatSpecEM model", lambda: _chat_model(model="smollm2"), "is not a preset"),
    ("ChatSpecEM preset", lambda: _chat_model(preset="qualty"), "unknown preset"),
    ("ChatSpecEM call", lambda: _chat_model(engine=_tiny_engine()).invoke("hi", max_tokns=4), "max_tokns"),
    ("ChatSpecEM call members", lambda: _chat_model(engine=_tiny_engine()).invoke("hi", members=["x"]), "per call"),
    ("SpecEMLLM", lambda: _llamaindex_llm(max_tokns=64), "max_tokns"),
    ("SpecEMLLM engine_options", lambda: _llamaindex_llm(engine_options={"hedg": False}), "hedg"),
    ("SpecEMLLM model", lambda: _llamaindex_llm(model="gpt-4o"), "is not a preset"),
    ("SpecEMLLM call", lambda: _llamaindex_llm(engine=_tiny_engine()).complete("hi", top_pp=0.5), "top_pp"),
    ("SpecEMLLM call preset", lambda: _llamaindex_llm(engine=_tiny_engine()).complete("hi", preset="fast"), "per call"),
    ("server specem object", lambda: _server_request(segmnt_len=4), "segmnt_len"),
    ("CLI chat option", lambda: _cli("chat", "hi", "--segmnt-len", "4"), "unrecognized arguments: --segmnt-len"),
    ("CLI preset", lambda: _cli("chat", "hi", "--preset", "qualty"), "unknown preset 'qualty'"),
    ("CLI --set", lambda: _cli("chat", "hi", "--set", "segmnt_len=4"), "unknown SpecEM option 'segmnt_len'"),
]


@pytest.mark.parametrize(("surface", "call", "named"), MISSPELT, ids=[m[0] for m in MISSPELT])
def test_a_misspelt_argument_fails_loudly_on_every_surface(surface: str, call: Callable[[], Any], named: str) -> None:
    from specem_integrations.server._errors import APIError  # the server's 400

    with pytest.raises((ValueError, TypeError, APIError)) as caught:
        call()
    assert named in str(caught.value), f"{surface}: {caught.value}"


def test_suggestions_name_the_closest_field() -> None:
    with pytest.raises(ConfigError, match=r"unknown option 'max_tokns'; did you mean max_tokens"):
        config_fields({"max_tokns": 4}, where="here")


def test_aliases_reach_the_same_field_on_every_surface() -> None:
    from specem_integrations.langchain import ChatSpecEM
    from specem_integrations.llamaindex import SpecEMLLM

    assert config_fields({"max_tokens": 4, "max_retries": 2}, where="x") == {"max_new_tokens": 4, "member_retries": 2}
    with pytest.raises(ConfigError, match="max_new_tokens given twice"):
        config_fields({"max_tokens": 4, "max_new_tokens": 5}, where="x")
    # LangChain and LlamaIndex say max_tokens; the engine's spelling is accepted and lands there
    assert ChatSpecEM(max_new_tokens=64).max_tokens == 64
    assert ChatSpecEM(member_retries=3).max_retries == 3
    assert SpecEMLLM(max_new_tokens=64).max_tokens == 64
    assert SpecEMLLM(model_name="fast").model == "fast"
    with pytest.raises(ValueError, match="given twice"):
        ChatSpecEM(max_tokens=1, max_new_tokens=2)
    # and they reach the engine as its field
    llm = ChatSpecEM(engine=_tiny_engine(), max_new_tokens=7, max_retries=0)
    assert llm._overrides({}, None)["max_new_tokens"] == 7
    assert llm._overrides({"max_tokens": 3, "max_retries": 2}, None) == {
        "max_new_tokens": 3,
        "member_retries": 2,
    }
    index_llm = SpecEMLLM(engine=_tiny_engine(), max_tokens=5, top_p=0.9, seed=3, hedge=False, model_exit=True)
    overrides = index_llm._config_overrides({"member_retries": 4})
    assert overrides == {"max_new_tokens": 5, "top_p": 0.9, "seed": 3, "hedge": False, "model_exit": True,
                         "member_retries": 4}  # fmt: skip
    call = _server_request(trusted_opening_rounds=1, normalization="softmax", model_exit_agreement_rounds=2)
    assert call.overrides == {"trusted_opening_rounds": 1, "normalization": "softmax", "model_exit_agreement_rounds": 2}


def test_per_call_timeout_and_retries(tiny_members: list[Any]) -> None:
    """What the README says can be given per call can be: timeout and max_retries too."""
    from specem_integrations.langchain import ChatSpecEM
    from specem_integrations.llamaindex import SpecEMLLM

    engine = SpecEM(tiny_members[:2], SpecEMConfig(max_new_tokens=48, segment_len=2, vote_on_stop=False))
    with pytest.raises(TimeoutError, match=r"timeout=1e-06s"):
        ChatSpecEM(engine=engine).invoke("Hello", timeout=1e-6, max_retries=0)
    with pytest.raises(TimeoutError, match=r"timeout=1e-06s"):
        SpecEMLLM(engine=engine).complete("Hello", timeout=1e-6)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        ChatSpecEM(engine=engine).invoke("Hello", timeout=-1)
    assert ChatSpecEM(engine=engine).invoke("Hello", timeout=120, max_tokens=4).content


def _flaky_engine() -> SpecEM:
    """Two scripted members; ``flaky``'s first draft of every request fails, its second works.
    The engine's own setting retries three times, so only a per-call value can change that."""
    from scripted import ScriptedMember, ScriptedSession

    class FailsFirstDraft(ScriptedSession):
        failed = False

        def draft(self, *args: Any, **kwargs: Any) -> Any:
            if not self.failed:
                self.failed = True
                raise ConnectionError("flaky: first draft refused")
            return super().draft(*args, **kwargs)

    class Flaky(ScriptedMember):
        def open(self, request: Any) -> Any:
            self.calls.append("open")
            return FailsFirstDraft(self, request)

    members = [Flaky("flaky", drafts=[("Hello there.", True)]), ScriptedMember("steady", drafts=[("Hi.", True)])]
    return SpecEM(members, SpecEMConfig(max_new_tokens=8, member_retries=3))


def test_per_call_max_retries_decides_whether_a_failing_member_is_dropped() -> None:
    from specem_integrations.langchain import ChatSpecEM
    from specem_integrations.llamaindex import SpecEMLLM

    def dropped(trace: dict[str, Any]) -> list[tuple[str, str]]:
        return [(e["member"], e["stage"]) for e in trace["excluded"]]

    llm = ChatSpecEM(engine=_flaky_engine())
    assert dropped(llm.invoke("Hello").response_metadata["specem"]) == []  # the engine's 3 retries
    assert dropped(llm.invoke("Hello", max_retries=0).response_metadata["specem"]) == [("flaky", "draft")]
    assert dropped(llm.invoke("Hello", max_retries=1).response_metadata["specem"]) == []
    index_llm = SpecEMLLM(engine=_flaky_engine())
    assert dropped(index_llm.complete("Hello").raw) == []
    assert dropped(index_llm.complete("Hello", max_retries=0).raw) == [("flaky", "draft")]
    assert dropped(index_llm.complete("Hello", max_retries=1).raw) == []
