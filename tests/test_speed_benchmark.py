"""benchmarks/speed.py's per-call time split (f) on real members: tiny random transformers models
(their calls overlap: members draft side by side) and the packaged SmolLM2 GGUF twice on llama.cpp
(members take turns: the calls add up to the answer's time)."""

from __future__ import annotations

from typing import Any

import pytest
from script_loader import load_script
from tiny import member

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def speed() -> Any:
    return load_script("benchmarks/speed.py", "speed_under_test")


def _generate(speed: Any, members: list[Any]) -> tuple[Any, Any]:
    from specem_core import SpecEM, SpecEMConfig

    times = speed.CallTimes(members)
    engine = SpecEM(members, SpecEMConfig(segment_len=4, ignore_eos=True), observers=[times])
    engine.generate(MESSAGES, max_new_tokens=4)  # counted, then forgotten by reset()
    times.reset()
    result = engine.generate(MESSAGES, max_new_tokens=16)
    return times, result


def _check_counts(times: Any, result: Any, members: list[Any]) -> None:
    rounds = len(result.segments)
    assert rounds >= 2
    for m in members:
        calls, seconds = times.calls[m.name], times.seconds[m.name]
        assert calls == {"draft": rounds, "score": rounds, "commit": rounds}
        assert all(v > 0 for v in seconds.values())
        assert "open" not in vars(m)  # told by the engine: the member itself is not wrapped


def test_overlapping_calls_are_flagged_on_transformers(speed: Any) -> None:
    members = [member("llama", name="a"), member("qwen2", name="b")]
    times, result = _generate(speed, members)
    _check_counts(times, result, members)
    assert times.overlapped  # one device, side by side: the wall times overlap
    assert speed.block_costs(members[0], MESSAGES, 4) is None  # llama.cpp kernels only


def test_calls_add_up_to_the_answer_on_llama_cpp(speed: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    from specem_core.errors import ModelNotFoundError
    from specem_core.registry import load_member

    try:
        members = [load_member("llamacpp:smollm2", name="s1"), load_member("llamacpp:smollm2", name="s2")]
    except ModelNotFoundError as exc:  # the GGUF package is not installed
        pytest.skip(f"smollm2 GGUF unavailable: {exc}")
    times, result = _generate(speed, members)
    _check_counts(times, result, members)
    assert not times.overlapped  # llama.cpp members take turns (draft hints)
    spent = sum(sum(times.seconds[m.name].values()) for m in members)
    assert spent <= result.seconds
    assert spent > 0.5 * result.seconds  # model work is most of an answer

    cost = speed.block_costs(members[0], MESSAGES, 6, repeats=2)
    assert cost["block"] == 6
    assert 0 < cost["step_ms"] < cost["block_ms"]  # six positions cost more than one
    assert cost["block_no_rows_ms"] > 0
    assert members[0].model.contexts_in_use == 0  # the context went back to the pool

    row = {
        "tokens": 16,
        "ensemble_tokens": result.usage.completion_tokens,
        "ensemble_s": result.seconds,
        "plain_s": {"s1": 0.1, "s2": 0.1},
        "floor_s": 0.2,
        "ratio_vs_floor": result.seconds / 0.2,
        "s_per_token": 0.01,
        "tokens_per_s": 100.0,
        "first_segment_s": 0.05,
        "call_seconds": times.seconds,
        "calls": times.calls,
        "calls_overlapped": times.overlapped,
        "usage": [vars(u) for u in result.usage.per_member],
    }
    speed.report({"backend": "llamacpp", "members": ["s1", "s2"], "rows": [row], "naive": None, "growth": 1.0}, 4)
    out = capsys.readouterr().out
    assert "(f) where an answer's time goes [llamacpp]" in out
    assert "| 16 | s1 | 0.10 |" in out
    assert "(engine: vote, text, stops)" in out
    assert "side by side" not in out
