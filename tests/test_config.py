"""Config validation: every bad value is a ConfigError naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from specem_core import ConfigError, SpecEMConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("segment_len", 0),
        ("segment_len", 2.5),
        ("segment_len", True),
        ("max_new_tokens", -1),
        ("model_exit_agreement_rounds", -1),
        ("model_exit_agreement_rounds", 1.5),
        ("trusted_opening_rounds", -1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("scoring", "mean_prob"),
        ("normalization", "rank"),
        ("hedge_decay", "linear"),
        ("model_exit_min_prob", 1.0),
        ("model_exit_entropy_ratio", 2.0),
        ("normalization_temperature", 0),
        ("seed", "seven"),
        ("stop", ("",)),
        ("stop", ("ok", "\ud800")),  # a lone surrogate: not valid Unicode
        ("member_retries", -1),
        ("model_exit", "yes"),  # a truthy string is not a switch
        ("hedge", 0),
        ("reproduce_paper", "false"),
        ("parallel", 1),
    ],
)
def test_bad_values_raise_config_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        SpecEMConfig(**{field: value})


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="segment_len"):
        SpecEMConfig(segment_len=0)


def test_replace_validates_and_rejects_unknown_fields() -> None:
    cfg = SpecEMConfig()
    assert cfg.replace(segment_len=5).segment_len == 5
    assert cfg.replace(segment_len=None) is cfg
    with pytest.raises(ConfigError, match="unknown SpecEM option"):
        cfg.replace(segmentlen=5)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        cfg.replace(max_new_tokens=0)


def test_stop_accepts_a_single_string_or_a_list() -> None:
    assert SpecEMConfig(stop="END").stop == ("END",)  # type: ignore[arg-type]
    assert SpecEMConfig().replace(stop=["a", "b"]).stop == ("a", "b")


def test_reproduce_paper_forces_the_authors_formulas() -> None:
    cfg = SpecEMConfig(reproduce_paper=True, scoring="mean_logprob", vote_on_stop=True, hedge_decay="sqrt")
    assert cfg.scoring == "mean_logit"
    assert cfg.normalization == "sum"
    assert cfg.nonpositive_rule == "raw"
    assert cfg.hedge_decay == "inverse"
    assert cfg.vote_on_stop is False
    assert cfg.model_exit is False


def test_to_dict_is_plain_json() -> None:
    import dataclasses
    import json

    cfg = SpecEMConfig(
        stop=("x", "END"),
        segment_len=4,
        seed=7,
        temperature=0.5,
        normalization="softmax",
        parallel=False,
    )
    d = cfg.to_dict()
    # every field is present, and nothing else
    assert set(d) == {f.name for f in dataclasses.fields(SpecEMConfig)}
    assert isinstance(d["stop"], list)
    assert d["stop"] == ["x", "END"]
    # plain JSON: a json round trip gives the same dict back (a tuple would come back a list)
    loaded = json.loads(json.dumps(d))
    assert loaded == d
    # and it rebuilds the same configuration
    rebuilt = SpecEMConfig(**loaded)
    assert rebuilt == cfg
    assert rebuilt.stop == ("x", "END")


def test_a_lone_surrogate_in_a_per_request_stop_string_is_a_config_error() -> None:
    """Stop strings are configuration: given per request they fail as they do in the config."""
    from scripted import ScriptedMember

    from specem_core import InputError, SpecEM

    engine = SpecEM([ScriptedMember("a", drafts=[("hi", True)])])
    for call in (
        lambda: engine.generate("q", stop=["ok", "x\ud800"]),
        lambda: list(engine.stream("q", stop="x\ud800")),
    ):
        with pytest.raises(ConfigError, match=r"^stop string \d \('x\\ud800'\) contains a lone surrogate") as info:
            call()
        assert not isinstance(info.value, InputError)
