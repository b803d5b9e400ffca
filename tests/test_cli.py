"""``specem`` CLI: streaming, --json, and one-line errors with a non-zero exit."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import pytest

from specem_integrations.cli import main


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    import tiny

    root = tmp_path_factory.mktemp("models")
    out = []
    for name, build in (("llama", tiny.tiny_llama), ("qwen2", tiny.tiny_qwen2)):
        model, tok = build()
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out.append(str(root / name))
    return out


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specem_integrations.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["chat", ""], "the prompt is empty"),
        (["chat", "hi", "--segment-len", "0"], "segment_len must be an integer >= 1"),
        (["chat", "hi", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
        (["chat", "hi", "--model", "nosuchmodel"], "unknown model 'nosuchmodel'"),
        (["chat", "hi", "--model", "./missing/model.gguf"], "no such model file or directory"),
        (["chat", "hi", "--model", ""], "empty model name"),
        (["models", "pull", "nosuch"], "unknown packaged model"),
        (["chat", "hi", "--preset", "nosuch"], "unknown preset 'nosuch': use one of quality, fast, paper"),
        (["chat", "hi", "--api-key-env", "KEY"], "the members' key is --member-api-key-env"),
        (["calibrate", "x.jsonl", "--out", "w.json", "--api-key-env", "KEY"], "--member-api-key-env"),
        (["chat", "hi", "--weights", "w.json", "--no-weights"], "--member-weights and --no-member-weights contradict"),
        (["chat", "hi", "--model", "smollm2", "--min-share", "0.2"], "--min-share needs member weights"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args: list[str], message: str) -> None:
    proc = _run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_prompt_longer_than_a_context_window(tiny_dirs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["chat", "word " * 700, "--model", tiny_dirs[0], "--model", tiny_dirs[1]])
    err = capsys.readouterr().err
    assert code == 2
    assert "context window is 512" in err


def test_chat_streams_text_and_reports(tiny_dirs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["chat", "Hello!", "--model", tiny_dirs[0], "--model", tiny_dirs[1], "--max-new-tokens", "12"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.strip()
    assert "segments" in captured.err
    assert "wins:" in captured.err


def test_chat_json_has_the_trace(tiny_dirs: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["chat", "Hello!", "--model", tiny_dirs[0], "--model", tiny_dirs[1], "--max-new-tokens", "12", "--json"]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["finish_reason"] in ("stop", "length")
    seg = data["segments"][0]
    assert {"text", "winner", "candidates", "raw_scores", "normalized", "weights", "drafters"} <= set(seg)
    assert data["usage"]["per_member"][1]["member"] == "qwen2"


def test_models_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} >= {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"}


@pytest.mark.slow
def test_end_to_end_on_the_real_default_preset() -> None:
    proc = _run("chat", "What is the capital of France? Answer in one sentence.", "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert "preset: quality (qwen2.5-coder-1.5b-instruct, qwen2.5-coder-0.5b-instruct)" in proc.stderr
    proc = _run("chat", "Name one primary colour.", "--max-new-tokens", "16", "--json", "--reproduce-paper")
    data = json.loads(proc.stdout)
    assert data["members"] == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    assert data["text"]
    assert data["config"]["reproduce_paper"] is True
    assert data["config"]["trusted_opening_rounds"] == 0  # reproduce_paper overrides the preset's setting
    proc = _run("chat", "Name one primary colour.", "--preset", "fast", "--max-tokens", "16", "--json")
    data = json.loads(proc.stdout)
    assert data["members"] == ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]
    assert (data["config"]["trusted_opening_rounds"], data["config"]["normalization"]) == (2, "softmax")


def test_switches_map_to_config_fields() -> None:
    from specem_integrations.cli import _config, _parser

    argv = ["chat", "hi", "--set", "token_healing=true", "--model-exit", "--no-hedge", "--segment-len", "5"]
    config = _config(_parser().parse_args(argv), None)
    assert (config.token_healing, config.model_exit, config.hedge, config.segment_len) == (True, True, False, 5)
    assert _config(_parser().parse_args(["chat", "hi"]), None).token_healing is False
    assert _config(_parser().parse_args(["chat", "hi", "--max-new-tokens", "7"]), None).max_new_tokens == 7
    assert _config(_parser().parse_args(["chat", "hi", "--member-retries", "3"]), None).member_retries == 3


def test_study_options_have_no_flag_of_their_own_and_old_flags_still_work() -> None:
    """``--token-healing`` (a study option: ``--set``) and ``--faithful`` (0.1's ``--reproduce-paper``)
    are hidden and still work, with a warning naming the way to say it now."""
    from specem_integrations.cli import _config, _parser

    assert "--token-healing" not in _parser().format_help()
    with pytest.warns(FutureWarning, match="--set token_healing=true"):
        assert _config(_parser().parse_args(["chat", "hi", "--token-healing"]), None).token_healing is True
    with pytest.warns(FutureWarning, match="--reproduce-paper"):
        assert _config(_parser().parse_args(["chat", "hi", "--faithful"]), None).reproduce_paper is True


def test_the_preset_sets_the_defaults_and_options_override_it() -> None:
    from specem_core.presets import get_preset
    from specem_integrations.cli import _parser, _resolve

    ensemble = _resolve(_parser().parse_args(["chat", "hi"]), io.StringIO())
    assert ensemble.preset is get_preset("quality")  # no --model: the default preset
    config = ensemble.config
    assert (config.trusted_opening_rounds, config.normalization, config.model_exit) == (2, "softmax", True)
    assert ensemble.member_weights is not None
    assert set(ensemble.member_weights.prior) == set(get_preset("quality").members)
    args = _parser().parse_args(["chat", "hi", "--no-model-exit", "--set", "trusted_opening_rounds=0"])
    config = _resolve(args, io.StringIO()).config
    assert (config.model_exit, config.trusted_opening_rounds, config.normalization) == (False, 0, "softmax")
    ensemble = _resolve(_parser().parse_args(["chat", "hi", "--model", "smollm2"]), io.StringIO())  # your own
    assert (ensemble.preset, ensemble.member_weights, ensemble.config.normalization) == (None, None, "sum")
    ensemble = _resolve(_parser().parse_args(["serve", "--preset", "fast", "--model", "smollm2"]), io.StringIO())
    assert ensemble.preset is get_preset("fast")
    assert ensemble.member_weights is None  # --model replaces the members: the preset's prior names others


def test_presets_command_lists_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["quality", "fast", "paper"]
    assert [r["default"] for r in rows] == [True, False, False]
    for row in rows:
        assert {"name", "default", "members", "config", "results"} <= set(row)
        for figures in row["results"].values():
            assert {"n", "best_member"} <= set(figures)
    assert rows[0]["prior"]["examples"] == 320
    assert "45 against 50" in rows[0]["held_out"]
    assert rows[1]["held_out"] is None
    assert main(["presets"]) == 0
    text = capsys.readouterr().out
    assert "quality (default):" in text
    # the default's check on data this project never saw, in one line beside its out-of-fold figures
    assert sum(line.startswith("    held out: gsm8k test (n=100") for line in text.splitlines()) == 1
    assert "members: qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct" in text


def test_the_cli_guide_shows_what_specem_presets_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/guides/cli.md pastes the output of ``specem presets``: it must be today's output."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "cli.md").read_text()
    shown = guide.split("## `specem presets`\n\n```text\n", 1)[1].split("```\n", 1)[0]
    assert main(["presets"]) == 0
    assert shown == capsys.readouterr().out, "rerun `specem presets` and paste its output into docs/guides/cli.md"


def test_chat_learns_weights_in_a_state_file(
    tiny_dirs: list[str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "weights.json"
    args = ["chat", "Hello!", "--model", tiny_dirs[0], "--model", tiny_dirs[1], "--max-new-tokens", "12"]
    capsys.readouterr()
    assert main([*args, "--weights", str(path), "--json"]) == 0
    # The two tiny members (Llama and Qwen2 architectures, different tokenizers, fixed seeds) draft
    # different text in greedy mode, so the first round's vote is contested and something is learned.
    segments = json.loads(capsys.readouterr().out)["segments"]
    assert any(len({c["text"] for c in seg["candidates"]}) > 1 for seg in segments)
    state = json.loads(path.read_text())
    assert state["format"] == "specem-member-weights/1"
    assert state["requests"] == 1
    assert set(state["cumulative"]) == {"llama", "qwen2"}
    assert state["counts"] == {"llama": 1, "qwen2": 1}
    assert main([*args, "--weights", str(path)]) == 0
    state = json.loads(path.read_text())
    assert state["requests"] == 2  # the second run loaded the file and added to it
    assert set(state["cumulative"]) == {"llama", "qwen2"}
    assert state["counts"] == {"llama": 2, "qwen2": 2}
    capsys.readouterr()
    assert main([*args, "--weights", str(tmp_path / "missing-dir" / "w.json")]) == 2
    assert "cannot write member-weights file" in capsys.readouterr().err
    path.write_text("not json")
    assert main([*args, "--weights", str(path)]) == 2
    assert "cannot read member-weights file" in capsys.readouterr().err
    assert main([*args, "--min-share", "0.2"]) == 2
    assert "--min-share needs member weights" in capsys.readouterr().err
    gated = tmp_path / "gated.json"
    gated.write_text(json.dumps({"format": "specem-member-weights/1", "prior": {"llama": 1.0, "qwen2": 1.0}}))
    assert main([*args, "--weights", str(gated), "--min-share", "1.5"]) == 2
    assert "min_share must be a number in [0, 1)" in capsys.readouterr().err
    assert main([*args, "--weights", str(gated), "--min-share", "0.2", "--json"]) == 0
    assert json.loads(gated.read_text())["min_share"] == 0.2
    assert json.loads(capsys.readouterr().out)["excluded"] == []  # two members at 1/2 each: nobody gated


def test_chat_keeps_its_answer_when_the_state_file_cannot_be_saved(
    tiny_dirs: list[str], tmp_path: Any, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Saving the learned weights after the answer fails (a directory stands where the state's
    temporary file goes): the answer is printed, the exit code is 0, a warning names the file."""
    import logging
    import os

    path = tmp_path / "weights.json"
    args = ["chat", "Hello!", "--model", tiny_dirs[0], "--model", tiny_dirs[1], "--max-new-tokens", "12"]
    assert main([*args, "--weights", str(path), "--json"]) == 0  # creates and teaches the file
    saved = path.read_text()
    capsys.readouterr()
    (tmp_path / f"weights.json.{os.getpid()}.tmp").mkdir()  # main() runs in this process
    with caplog.at_level(logging.WARNING, logger="specem.weights"):
        code = main([*args, "--weights", str(path), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["text"]
    assert path.read_text() == saved
    assert f"could not save the member weights to {path}" in caplog.text


def test_set_maps_any_config_field() -> None:
    from specem_integrations.cli import _config, _parser

    sets = [
        "normalization=softmax",
        "model_exit_temperature=0.2",
        "model_exit_agreement_rounds=2",
        "reuse_other_drafts=off",
    ]
    sets += ['stop=["\\n\\n", "END"]', "seed=none", "parallel=auto", "leave_self_out=true"]
    args = _parser().parse_args(["chat", "hi", "--model-exit", *(x for item in sets for x in ("--set", item))])
    config = _config(args, None)
    assert (config.normalization, config.model_exit_temperature, config.model_exit_agreement_rounds) == (
        "softmax",
        0.2,
        2,
    )
    assert (config.model_exit, config.reuse_other_drafts, config.stop) == (True, False, ("\n\n", "END"))
    assert (config.seed, config.parallel, config.leave_self_out) == (None, None, True)
    assert _config(_parser().parse_args(["serve", "--set", "stop=###", "--segment-len", "4"]), None).stop == ("###",)
    assert _config(_parser().parse_args(["chat", "hi", "--seed", "5", "--set", "seed=none"]), None).seed is None


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("nosuch=1", "--set: unknown SpecEM option 'nosuch'"),
        ("model_exit=maybe", "--set model_exit: cannot read 'maybe' (expected true or false)"),
        ("model_exit_temperature=warm", "--set model_exit_temperature: cannot read 'warm'"),
        ("segment_len=2.5", "--set segment_len: cannot read '2.5'"),
        ("normalization=max", "normalization must be one of sum, softmax; got 'max'"),
        ("segment_len", "--set expects FIELD=VALUE, got 'segment_len'"),
    ],
)
def test_set_rejects_unknown_fields_and_bad_values(item: str, message: str) -> None:
    proc = _run("chat", "hi", "--set", item)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_calibrate_writes_a_prior_the_chat_command_loads(
    tiny_dirs: list[str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from specem_core.weights import MemberWeights

    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"q": q, "final": "4"}) for q in ("2 + 2?", "1 + 3?", "8 / 2?")) + "\n")
    out, records = tmp_path / "weights.json", tmp_path / "records.jsonl"
    args = ["calibrate", str(data), "--model", tiny_dirs[0], "--model", tiny_dirs[1], "--out", str(out)]
    args += ["--prompt-template", "{q}\\nAnswer with a number.", "--answer-field", "final", "--grader", "number"]
    args += ["--max-new-tokens", "6", "--records", str(records), "--min-share", "0.1", "--limit", "2"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "member" in captured.out
    assert f"wrote {out} (2 examples, grader number)" in captured.out
    assert "qwen2: 2/2" in captured.err
    assert "sign test p = " in captured.out
    weights = MemberWeights.load(out)
    assert set(weights.prior) == {"llama", "qwen2"}
    assert weights.min_share == 0.1
    assert all(1.0 <= p <= 101.0 for p in weights.prior.values())
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [(r["member"], r["example"]) for r in lines] == [("llama", 0), ("llama", 1), ("qwen2", 0), ("qwen2", 1)]
    assert all(r["grade"] in (0.0, 1.0) and isinstance(r["reply"], str) for r in lines)
    # the file it wrote is what --weights reads
    chat = ["chat", "Hello!", "--model", tiny_dirs[0], "--model", tiny_dirs[1], "--max-new-tokens", "6"]
    assert main([*chat, "--weights", str(out), "--json"]) == 0
    capsys.readouterr()
    # never overwrites learned state without --force; bad options fail before any model loads
    assert main(args) == 2
    assert "exists (it may hold learned weights); pass --force" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    capsys.readouterr()
    for extra, message in (
        (["--limit", "0"], "--limit must be at least 1"),
        (["--min-share", "2"], "min_share must be a number in [0, 1)"),
        (["--answer-field", "answer"], "line 1: no 'answer' field"),
        (["--set", "hedge=perhaps"], "--set hedge: cannot read 'perhaps'"),
    ):
        assert main([*args, "--force", *extra]) == 2
        assert message in capsys.readouterr().err


def test_local_member_options_reach_the_members_and_misplaced_ones_are_refused(tiny_dirs: list[str]) -> None:
    """``--no-prefix-cache`` / ``--prefix-cache-tokens`` reach a local member; ``--n-ctx`` is refused
    with the reason for a transformers member and for a server member (no silent no-op)."""
    import io

    from specem_core import ConfigError
    from specem_integrations.cli import _engine, _parser, _resolve

    options = ["--backend", "transformers", "--no-prefix-cache", "--prefix-cache-tokens", "512"]
    args = _parser().parse_args(["chat", "hi", "--model", tiny_dirs[0], *options])
    engine = _engine(_resolve(args, io.StringIO()))
    (member,) = engine.members
    assert (member.prefix_cache, member.prefixes.budget_tokens) == (False, 512)
    args = _parser().parse_args(["chat", "hi", "--model", tiny_dirs[0], "--backend", "transformers"])
    engine = _engine(_resolve(args, io.StringIO()))  # the same weights again: the default options, not the last ones
    assert engine.members[0].prefix_cache is True
    for model, named in ((tiny_dirs[0], "transformers member"), ("openai:http://127.0.0.1:9/v1#m", "server member")):
        args = _parser().parse_args(["chat", "hi", "--model", model, "--backend", "transformers", "--n-ctx", "64"])
        with pytest.raises(ConfigError, match=f"n_ctx set for {named}"):
            _engine(_resolve(args, io.StringIO()))
        for flag in ("history-invariant", "continuous-batching"):
            args = _parser().parse_args(["chat", "hi", "--model", model, "--backend", "transformers", f"--{flag}"])
            with pytest.raises(ConfigError, match=f"{flag.replace('-', '_')} set for {named}"):
                _engine(_resolve(args, io.StringIO()))


def test_history_invariant_reaches_a_llama_cpp_member() -> None:
    import io

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from specem_integrations.cli import _engine, _parser, _resolve

    args = _parser().parse_args(["chat", "hi", "--model", "llamacpp:smollm2", "--history-invariant"])
    (member,) = _engine(_resolve(args, io.StringIO())).members
    assert member.model.history_invariant is True
    assert member.model.shared is None


def test_continuous_batching_reaches_a_llama_cpp_member() -> None:
    import io

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from specem_integrations.cli import _engine, _parser, _resolve

    flags = ["--continuous-batching", "--max-concurrency", "3", "--n-ctx", "1024"]
    args = _parser().parse_args(["serve", "--model", "llamacpp:smollm2", *flags])
    (member,) = _engine(_resolve(args, io.StringIO())).members
    assert member.model.continuous_batching is True
    assert member.model.shared is not None
    assert member.model.shared.slots == member.model.max_contexts == 3  # a slot per request served at once
    assert member.model.shared.n_ctx == 3 * 1024


def test_the_start_up_line_says_which_member_is_trusted_and_why() -> None:
    from scripted import ScriptedMember

    from specem_core import SpecEM
    from specem_integrations.cli import _trusted_line

    members = [ScriptedMember("big"), ScriptedMember("small")]
    assert _trusted_line(SpecEM(members, trusted_member="big")) == "trusted member: big (named by trusted_member)"
    assert _trusted_line(SpecEM(members)).startswith("trusted member: none (no member weights and no trusted_member")
