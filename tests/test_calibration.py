"""Calibration: each member alone on a labelled set, graded; the prior the quality study used."""

from __future__ import annotations

import json
from typing import Any

import pytest
from scripted import ScriptedMember

from specem_core import ConfigError, InputError, MemberWeights, SpecEM, SpecEMConfig
from specem_core.calibration import GRADERS, calibrate, choice_letter, last_number, load_examples

PROMPTS = ["Hello!", "Name a colour.", "What is two plus two?"]


@pytest.mark.parametrize(
    ("grader", "reply", "expected", "right"),
    [
        ("number", "3 + 4 = 7, so the total is $1,250.", "1250", True),
        ("number", "The answer is 12.5", 12.5, True),
        ("number", "It is 12 apples.", "13", False),
        ("number", "No idea.", "3", False),
        ("number", "so 18 - 20 = -2", "-2", True),
        ("choice", "The answer is B.", "b", True),
        ("choice", "(C) because plants need light", "B", False),
        ("choice", "B", "B", True),
        ("exact", "  Paris. ", "paris", True),
        ("exact", "Paris is the capital", "Paris", False),
        ("contains", "I think it is Paris, France.", "paris", True),
        ("contains", "Lyon", "Paris", False),
        ("contains", "anything", "", False),  # an empty expectation matches nothing, not everything
    ],
)
def test_built_in_graders(grader: str, reply: str, expected: Any, right: bool) -> None:
    assert GRADERS[grader](reply, expected) is right


def test_grader_helpers_and_bad_expectations() -> None:
    assert last_number("from 1,000 to 2,500.75 dollars") == 2500.75
    assert last_number("none") is None
    assert choice_letter("answer: d", ("A", "B", "C", "D")) == "D"
    assert choice_letter("nothing here") is None
    with pytest.raises(InputError, match="expected answer 'seven' is not a number"):
        GRADERS["number"]("7", "seven")
    with pytest.raises(InputError, match="expected answer is empty"):
        GRADERS["choice"]("A", " ")


def _alone(member: Any, prompt: str, **config: Any) -> str:
    return SpecEM([member], SpecEMConfig(**config)).generate(prompt).text


def test_each_member_is_graded_on_its_own_reply(tiny_members: list[Any]) -> None:
    llama, qwen2 = tiny_members[0], tiny_members[1]
    # the expected answers are the llama member's own greedy replies: it must score 100, and the
    # qwen2 member exactly the share of prompts where its own reply happens to be the same
    expected = [_alone(llama, p, max_new_tokens=8) for p in PROMPTS]
    theirs = [_alone(qwen2, p, max_new_tokens=8) for p in PROMPTS]
    examples = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, expected, strict=True)]
    seen: list[tuple[str, int, int]] = []
    result = calibrate(
        [llama, qwen2], examples, "exact", max_new_tokens=8, progress=lambda m, d, t: seen.append((m, d, t))
    )
    assert list(result.scores) == ["llama", "qwen2"]
    assert result.scores["llama"].score == 100.0
    same = sum(GRADERS["exact"](t, e) for t, e in zip(theirs, expected, strict=True))
    assert result.scores["qwen2"].score == pytest.approx(100.0 * same / len(PROMPTS))
    assert result.prior == {"llama": 101.0, "qwen2": 1.0 + result.scores["qwen2"].score}
    assert result.best == "llama"
    assert [r["reply"] for r in result.records if r["member"] == "qwen2"] == theirs
    assert all(s.errors == 0 and s.examples == 3 and s.seconds > 0 for s in result.scores.values())
    assert seen[-1] == ("qwen2", 3, 3)
    assert len(seen) == 6
    weights = result.member_weights(min_share=0.1)
    assert isinstance(weights, MemberWeights)
    assert (weights.prior, weights.min_share) == (result.prior, 0.1)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["prior"] == result.prior
    assert len(data["records"]) == 6


def test_partial_credit_from_a_callable_grader(tiny_members: list[Any]) -> None:
    examples = [{"prompt": p, "answer": 0.25} for p in PROMPTS]
    result = calibrate(tiny_members[:1], examples, lambda reply, expected: expected, max_new_tokens=4)
    assert result.scores["llama"].score == pytest.approx(25.0)
    with pytest.raises(ConfigError, match=r"grader returned 2 for member 'llama' on example 0"):
        calibrate(tiny_members[:1], examples, lambda reply, expected: 2, max_new_tokens=4)


def test_a_failing_member_is_graded_wrong_and_reported(tiny_members: list[Any]) -> None:
    broken = ScriptedMember("broken", drafts=[("x", True)], fail_on={"draft"})
    examples = [{"prompt": "Hello!", "answer": "x"}, {"prompt": "word " * 700, "answer": "x"}]
    result = calibrate([broken, tiny_members[1]], examples, "contains", max_new_tokens=4)
    assert result.scores["broken"].errors == 2
    assert result.scores["broken"].score == 0.0
    # the tiny qwen2 has a 512-token window: the long prompt is its error, the short one is not
    assert result.scores["qwen2"].errors == 1
    failed = [r for r in result.records if r["member"] == "qwen2" and "error" in r]
    assert failed[0]["example"] == 1
    assert "ContextWindowError" in failed[0]["error"]
    assert failed[0]["reply"] is None
    assert failed[0]["grade"] == 0.0


@pytest.mark.parametrize(
    ("examples", "grade", "message"),
    [
        ([], "exact", "the calibration set is empty"),
        ([{"prompt": "hi"}], "exact", "example 0: no 'answer' field"),
        ([{"prompt": "hi", "answer": 1}, {"answer": 1}], "exact", "example 1: needs a non-empty 'prompt'"),
        ([{"messages": [], "answer": 1}], "exact", "'messages' must be a non-empty list"),
        (["just text"], "exact", "example 0: expected a mapping"),
        ([{"prompt": "hi", "answer": 3}, {"prompt": "hi", "answer": "three"}], "number", "example 1: grader 'number'"),
        ([{"prompt": "hi", "answer": ""}], "choice", "example 0: grader 'choice': the expected answer is empty"),
    ],
)
def test_bad_calibration_sets(tiny_members: list[Any], examples: list[Any], grade: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        calibrate(tiny_members[:1], examples, grade)


def test_bad_graders_and_members(tiny_members: list[Any]) -> None:
    examples = [{"prompt": "hi", "answer": "x"}]
    with pytest.raises(ConfigError, match="unknown grader 'fuzzy'"):
        calibrate(tiny_members[:1], examples, "fuzzy")
    verifier = ScriptedMember("judge", can_draft=False)
    with pytest.raises(ConfigError, match="member 'judge' cannot draft"):
        calibrate([verifier], examples)
    with pytest.raises(ConfigError, match="at least one member"):
        calibrate([], examples)
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1"):
        calibrate(tiny_members[:1], examples, max_new_tokens=0)


def test_load_examples(tmp_path: Any) -> None:
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": "2 + 2?", "final": "4"}, {"question": "3 + 4?", "final": "7"}, {"question": "x", "final": "1"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    examples = load_examples(str(path), prompt_template="{question}\nAnswer with a number.", answer_field="final")
    assert examples[0]["prompt"] == "2 + 2?\nAnswer with a number."
    assert examples[0]["answer"] == "4"
    assert len(load_examples(str(path), prompt_template="{question}", answer_field="final", limit=2)) == 2
    with pytest.raises(InputError, match="line 1: no 'answer' field"):
        load_examples(str(path), prompt_template="{question}")
    with pytest.raises(InputError, match="line 1: the prompt template names field 'q'"):
        load_examples(str(path), prompt_template="{q}", answer_field="final")
    with pytest.raises(InputError, match="cannot read calibration file"):
        load_examples(str(tmp_path / "missing.jsonl"))
    path.write_text('{"prompt": "a", "answer": 1}\nnot json\n')
    with pytest.raises(InputError, match="line 2: not JSON"):
        load_examples(str(path))
    path.write_text("[1, 2]\n")
    with pytest.raises(InputError, match="line 1: expected a JSON object"):
        load_examples(str(path))


def test_paired_comparison_says_whether_the_set_separates_two_members() -> None:
    from specem_core.calibration import Calibration, MemberScore, sign_test

    grades = {"big": [1, 1, 1, 1, 1, 1, 1, 1, 0, 1], "small": [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]}
    records = [{"member": m, "example": i, "grade": float(g)} for m, gs in grades.items() for i, g in enumerate(gs)]
    scores = {m: MemberScore(m, 100.0 * sum(gs) / len(gs), len(gs)) for m, gs in grades.items()}
    calibration = Calibration(scores, records)
    assert (calibration.best, calibration.runner_up) == ("big", "small")
    better, worse, p = calibration.paired("big", "small")
    assert (better, worse) == (8, 1)
    assert p == pytest.approx(sign_test(8, 1)) == pytest.approx(20 / 512)
    assert calibration.paired("small", "big")[:2] == (1, 8)
    assert sign_test(0, 0) == 1.0
    with pytest.raises(ConfigError, match="no member 'other'"):
        calibration.paired("big", "other")
    assert Calibration({"solo": MemberScore("solo", 50.0, 2)}).runner_up is None
