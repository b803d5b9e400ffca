"""Presets: named, measured configurations, one way in on every surface, overrides over them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specem_core import SpecEM
from specem_core.errors import ConfigError
from specem_core.presets import (
    DEFAULT_PRESET,
    PRESETS,
    Preset,
    config_of,
    get_preset,
    preset_names,
    resolve,
)
from specem_core.weights import MemberWeights

ROOT = Path(__file__).resolve().parents[1]


def test_every_preset_ships_a_prior_for_exactly_its_members() -> None:
    for preset in PRESETS.values():
        preset.spec()  # the settings are valid
        weights = preset.member_weights()
        if preset.prior is None:
            assert weights is None
            continue
        assert weights is not None
        assert set(weights.prior) == set(preset.members)
        assert (weights.learning_rate, weights.min_share, weights.requests) == (1.0, 0.1, 0)
        calibration = preset.calibration()
        assert calibration["examples"] == sum(s["n"] for s in calibration["sets"].values()) == 320
        # the prior is 1 + each member's score alone, as `specem calibrate` writes it
        for member, score in calibration["scores"].items():
            assert weights.prior[member] == pytest.approx(1 + score, abs=0.01)
        assert preset.member_weights() is not weights  # a fresh state per engine: what one learns stays its own


def test_the_default_preset_trusts_its_strongest_member() -> None:
    preset = get_preset(None)
    assert preset.name == DEFAULT_PRESET == "quality"
    weights = preset.member_weights()
    assert weights is not None
    assert max(weights.prior, key=weights.prior.__getitem__) == preset.members[0] == "qwen2.5-coder-1.5b-instruct"
    assert preset_names()[0] == DEFAULT_PRESET


def test_the_presets_report_what_the_study_recorded() -> None:
    """What `specem presets` reports (package data written by `quality.py presets` from the study's
    records) agrees with benchmarks/results/quality/summary.json; the default is measured on all of
    IFEval dev and GSM8K dev, beside its best member alone on the same prompts."""
    results = get_preset(None).results()
    assert set(results) >= {"ifeval", "gsm8k"}
    assert results["ifeval"]["n"] == 120
    assert results["gsm8k"]["n"] == 200
    for figures in results.values():
        assert figures["best_member_config"] == "1.5b"
        assert 0.0 <= figures["p"] <= 1.0
    summary = json.loads((ROOT / "benchmarks" / "results" / "quality" / "summary.json").read_text())
    compared = 0
    for name, preset in PRESETS.items():
        for task, figures in preset.results().items():
            row = summary[task].get(name, {})
            if row.get("n") != figures["n"]:  # a partial run: summary.json keeps full-set rows
                continue
            metric = next(iter(figures))
            assert figures[metric] == pytest.approx(row[metric], abs=0.01)
            best = summary[task][figures["best_member_config"]]
            assert figures["best_member"] == pytest.approx(best[metric], abs=0.01)
            compared += 1
    assert compared >= 2


def test_unknown_presets_are_config_errors_listing_the_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'qualty': use one of quality, fast, paper"):
        get_preset("qualty")
    with pytest.raises(ConfigError, match="unknown preset"):
        SpecEM.from_preset("nope")
    with pytest.raises(ConfigError, match="named by a string"):
        get_preset(3)  # type: ignore[arg-type]
    assert get_preset(" Fast ") is PRESETS["fast"]


def test_a_missing_or_corrupt_prior_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import specem_core.presets as presets

    ghost = Preset("ghost", "no file", ("a", "b"), prior="ghost")
    with pytest.raises(ConfigError, match=r"the prior of preset 'ghost' is missing from the package.*reinstall"):
        ghost.member_weights()
    monkeypatch.setattr(presets, "_data_dir", lambda: tmp_path)
    (tmp_path / "priors").mkdir()
    (tmp_path / "priors" / "ghost.json").write_text("{not json")
    with pytest.raises(ConfigError, match="the prior of preset 'ghost' cannot be read"):
        ghost.member_weights()
    (tmp_path / "priors" / "ghost.json").write_text('["a list"]')
    with pytest.raises(ConfigError, match="is not a JSON object"):
        ghost.member_weights()
    (tmp_path / "priors" / "ghost.json").write_text('{"format": "something-else"}')
    with pytest.raises(ConfigError, match="not a SpecEM member-weights file"):
        ghost.member_weights()
    (tmp_path / "priors" / "ghost.json").write_text(json.dumps(MemberWeights({"a": 2.0}).to_dict()))
    with pytest.raises(ConfigError, match=r"has no entry for member\(s\) b"):
        ghost.member_weights()


def test_resolve_is_the_one_rule_of_every_surface() -> None:
    assert resolve(None, members_given=False) is PRESETS[DEFAULT_PRESET]
    assert resolve(None, members_given=True) is None
    assert resolve("fast", members_given=True) is PRESETS["fast"]
    assert config_of(None).normalization == "sum"  # members of your own: the library defaults
    assert config_of(PRESETS["quality"], segment_len=4, model_exit=False).model_exit is False


def test_explicit_arguments_override_the_presets(tiny_members: list[Any]) -> None:
    pair = tiny_members[:2]
    engine = SpecEM.from_preset("fast", members=pair, segment_len=3, model_exit=False)
    assert [m.name for m in engine.members] == ["llama", "qwen2"]
    assert (engine.config.segment_len, engine.config.model_exit) == (3, False)
    assert (engine.config.normalization, engine.config.trusted_opening_rounds) == ("softmax", 2)
    assert engine.member_weights is None  # the preset's prior names its own members only
    mine = MemberWeights({"llama": 3.0, "qwen2": 1.0})
    engine = SpecEM.from_preset("fast", members=pair, member_weights=mine, max_new_tokens=5)
    assert engine.member_weights is mine
    assert engine.config.max_new_tokens == 5
    with pytest.raises(ConfigError, match=r"unknown SpecEM option\(s\): segmnt_len"):
        SpecEM.from_preset("fast", members=pair, segmnt_len=3)
    with pytest.raises(ConfigError, match="segment_len must be an integer >= 1"):
        SpecEM.from_preset("fast", members=pair, segment_len=0)
    with pytest.raises(ConfigError, match="members is empty"):
        SpecEM.from_preset("fast", members=[])
    # no preset name with members of your own: the library defaults, no weights
    engine = SpecEM.from_preset(None, members=pair)
    assert (engine.config.normalization, engine.member_weights) == ("sum", None)


def test_a_prior_naming_no_member_is_an_error_not_a_silent_mean(tiny_members: list[Any]) -> None:
    with pytest.raises(ConfigError, match=r"names lama, not in this ensemble, and has no entry for llama"):
        SpecEM(tiny_members[:2], member_weights=MemberWeights({"lama": 2.0, "qwen2": 1.0}))
    # a state shared with a larger ensemble is fine: its extra entries name members absent here
    assert SpecEM(
        tiny_members[:2], member_weights=MemberWeights({"llama": 2.0, "qwen2": 1.0, "gemma3": 1.0})
    ).member_weights


def test_a_weights_file_of_a_preset_starts_from_its_prior(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scripted import ScriptedMember

    import specem_core.registry as registry

    monkeypatch.setattr(registry, "load_member", lambda spec, **kw: ScriptedMember(spec, [("Hi.", True)]))
    path = tmp_path / "w.json"
    engine = SpecEM.from_preset("fast", member_weights=str(path))
    assert engine.member_weights is not None
    assert engine.member_weights.path == path
    assert json.loads(path.read_text())["prior"] == PRESETS["fast"].member_weights().prior  # type: ignore[union-attr]
    assert engine.member_weights.min_share == 0.1
    again = SpecEM.from_preset("fast", member_weights=str(path))  # an existing file is loaded as it is
    assert again.member_weights is not None
    assert again.member_weights.prior == engine.member_weights.prior
    assert SpecEM.from_preset("fast", member_weights=False).member_weights is None
    assert [m.name for m in SpecEM.from_preset("fast").members] == list(PRESETS["fast"].members)


@pytest.mark.slow
def test_the_default_preset_loads_its_real_members_and_answers() -> None:
    from specem_core.models import find_packaged
    from specem_core.registry import default_backend

    engine = SpecEM.from_preset(max_new_tokens=16)
    assert [m.name for m in engine.members] == list(get_preset(None).members)
    # llama.cpp where no CUDA device is visible; with one, transformers for all but the llama.cpp-only 1.5B
    expected = [
        "LlamaCppMember" if default_backend() == "llamacpp" or not packaged.convertible else "TransformersMember"
        for packaged in (find_packaged(name) for name in get_preset(None).members)
        if packaged is not None
    ]
    assert [type(m).__name__ for m in engine.members] == expected
    assert engine.member_weights is not None
    assert set(engine.member_weights.prior) == set(get_preset(None).members)
    result = engine.generate("What is 17 + 25? Answer with the number only.")
    assert "42" in result.text
    assert result.segments[0].drafters == ["qwen2.5-coder-1.5b-instruct"]  # the trusted member's opening


def test_an_api_key_reaches_the_server_members_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from scripted import ScriptedMember

    import specem_core.registry as registry
    from specem_integrations.langchain import ChatSpecEM
    from specem_integrations.llamaindex import SpecEMLLM

    seen: dict[str, dict[str, Any]] = {}

    def fake_load(spec: str, **kwargs: Any) -> ScriptedMember:
        seen[spec] = kwargs
        return ScriptedMember(spec.rsplit("#", 1)[-1], [("Hi.", True)])

    monkeypatch.setattr(registry, "load_member", fake_load)
    members = ["openai:http://127.0.0.1:9/v1#served", "smollm2"]
    secret = "sk-test-NEVER-SHOWN-271828"
    for llm in (ChatSpecEM(members=members, api_key=secret), SpecEMLLM(members=members, api_key=secret)):
        seen.clear()
        engine = llm.get_engine() if isinstance(llm, ChatSpecEM) else llm.engine
        assert [m.name for m in engine.members] == ["served", "smollm2"]
        assert seen["openai:http://127.0.0.1:9/v1#served"]["api_key"].get_secret_value() == secret
        assert "api_key" not in seen["smollm2"]
        assert secret not in repr(llm)
        assert secret not in str(llm.model_dump())
