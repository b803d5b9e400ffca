"""``specem`` CLI: streaming, --json, and one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from specem_core.cli import main


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
        [sys.executable, "-m", "specem_core.cli", *args], capture_output=True, text=True, timeout=600, check=False
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
def test_end_to_end_on_the_real_default_models(default_members: list[object]) -> None:
    proc = _run("chat", "What is the capital of France? Answer in one sentence.", "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Traceback" not in proc.stderr
    proc = _run("chat", "Name one primary colour.", "--max-new-tokens", "16", "--json", "--faithful")
    data = json.loads(proc.stdout)
    assert data["members"] == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    assert data["text"]
    assert data["config"]["faithful"] is True


def test_switches_map_to_config_fields() -> None:
    from specem_core.cli import _config, _parser

    args = _parser().parse_args(["chat", "hi", "--token-healing", "--model-exit", "--no-hedge", "--segment-len", "5"])
    config = _config(args)
    assert (config.token_healing, config.model_exit, config.hedge, config.segment_len) == (True, True, False, 5)
    assert _config(_parser().parse_args(["chat", "hi"])).token_healing is False


def test_chat_learns_weights_in_a_state_file(
    tiny_dirs: list[str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "weights.json"
    args = ["chat", "Hello!", "--model", tiny_dirs[0], "--model", tiny_dirs[1], "--max-new-tokens", "12"]
    assert main([*args, "--weights", str(path)]) == 0
    state = json.loads(path.read_text())
    assert state["format"] == "specem-member-weights/1"
    assert state["requests"] in (0, 1)  # 1 when the tiny random members' drafts differed (a contested vote)
    assert main([*args, "--weights", str(path)]) == 0
    assert json.loads(path.read_text())["requests"] >= state["requests"]
    capsys.readouterr()
    assert main([*args, "--weights", str(tmp_path / "missing-dir" / "w.json")]) == 2
    assert "cannot write member-weights file" in capsys.readouterr().err
    path.write_text("not json")
    assert main([*args, "--weights", str(path)]) == 2
    assert "cannot read member-weights file" in capsys.readouterr().err
    assert main([*args, "--min-share", "0.2"]) == 2
    assert "--min-share needs --weights" in capsys.readouterr().err
    gated = tmp_path / "gated.json"
    gated.write_text(json.dumps({"format": "specem-member-weights/1", "prior": {"a": 1.0, "b": 1.0}}))
    assert main([*args, "--weights", str(gated), "--min-share", "1.5"]) == 2
    assert "min_share must be a number in [0, 1)" in capsys.readouterr().err
    assert main([*args, "--weights", str(gated), "--min-share", "0.2", "--json"]) == 0
    assert json.loads(gated.read_text())["min_share"] == 0.2
    assert json.loads(capsys.readouterr().out)["excluded"] == []  # two members at 1/2 each: nobody gated
