"""The agents benchmark's graders (``benchmarks/agents.py``), without models."""

from __future__ import annotations

import pytest
from script_loader import load_script

agents = load_script("benchmarks/agents.py", "agents_benchmark")


@pytest.mark.parametrize(
    ("text", "passes"),
    [
        ("The result of 100 minus 36, divided by 8 is 2.7777777777777777.", False),  # only the operand is 8
        ("The result of 100 minus 36, divided by 8 is approximately 2.78.", False),
        ("100 minus 36 is 64; divided by 8 that is 8.", True),
        ("It is 8.", True),
        ("8", True),
        ("64 divided by 8 is 8.0.", True),
        ("The tools returned 64.", False),
        ("", False),
    ],
)
def test_grade_does_not_pass_an_answer_on_a_number_it_restates_from_the_question(text: str, passes: bool) -> None:
    assert agents.grade(8, text, "What is 100 minus 36, divided by 8?") is passes


def test_grade_reads_numbers_with_separators_and_words_without_case() -> None:
    assert agents.grade(5535, "5,535 is 123 times 45.", "What is 123 times 45?")
    assert agents.grade(42.16, "26.2 miles is about 42.2 km.", "How many km is 26.2 miles?")
    assert not agents.grade(42.16, "26.2 miles is about 26.2 miles.", "How many km is 26.2 miles?")
    assert agents.grade("Norland", "Quenby is in norland.", "Which country is Quenby in?")


def test_regrade_grades_the_records_again_from_their_final_answers() -> None:
    task = next(t for t in agents.TASKS if t["id"] == "arith-n-12")
    records = [
        {"task": "arith-n-12", "final": "…divided by 8 is 2.78.", "ok": True, "limit": False, "error": None},
        {"task": "arith-n-12", "final": "It is 8.", "ok": True, "limit": False, "error": None},
        {"task": "arith-n-12", "final": "It is 8.", "ok": True, "limit": True, "error": "GraphRecursionError"},
    ]
    assert task["answer"] == 8
    assert agents.regrade(records) == 2
    assert [r["ok"] for r in records] == [False, True, False]


def test_order_tasks_keeps_file_order_or_shuffles_the_same_way_for_a_seed() -> None:
    tasks = agents.TASKS
    assert agents.order_tasks(tasks, None) == tasks
    first, again, other = (agents.order_tasks(tasks, seed) for seed in (1, 1, 2))
    assert first == again
    assert first != tasks
    assert first != other
    assert sorted(t["id"] for t in first) == sorted(t["id"] for t in tasks)
    assert [t["id"] for t in tasks][:2] == ["arith-1-00", "arith-1-01"]  # the input is not shuffled in place


_BFCL_FUNCTION = {
    "name": "math.area",
    "parameters": {
        "type": "dict",
        "properties": {"radius": {"type": "float"}, "units": {"type": "string"}},
        "required": ["radius"],
    },
}


@pytest.mark.parametrize(
    ("category", "calls", "ok", "why"),
    [
        ("simple", [{"name": "math_area", "arguments": {"radius": 3}}], True, ""),  # an int for a float
        ("simple", [{"name": "math_area", "arguments": {"radius": 3, "units": "C M"}}], True, ""),
        ("simple", [{"name": "math_area", "arguments": {"units": "cm"}}], False, "missing radius"),
        ("simple", [{"name": "math_area", "arguments": {"radius": 4}}], False, "value of radius: 4"),
        ("simple", [{"name": "area", "arguments": {"radius": 3}}], False, "wrong function area"),
        ("simple", [], False, "0 calls"),
        ("live_simple", [{"name": "math_area", "arguments": {"radius": 3.0}}], True, ""),
        ("irrelevance", [], True, ""),
        ("live_irrelevance", [], True, ""),
        ("live_irrelevance", [{"name": "math_area", "arguments": {"radius": 3}}], False, "made a call"),
    ],
)
def test_bfcl_grade_checks_the_call_as_the_leaderboard_does(category, calls, ok, why) -> None:
    truth = [{"math.area": {"radius": [3.0], "units": ["cm", ""]}}]
    assert agents.bfcl_grade(category, [_BFCL_FUNCTION], truth, calls) == (ok, why)


@pytest.mark.parametrize("answers_beside", [True, False])
def test_load_bfcl_takes_every_nth_case_and_finds_the_answers_either_way(tmp_path, answers_beside) -> None:
    import json

    name = agents.BFCL_FILES["live_simple"]
    (tmp_path / name).write_text("".join(json.dumps({"id": f"c{i}", "question": [[]]}) + "\n" for i in range(10)))
    answers = "".join(json.dumps({"id": f"c{i}", "ground_truth": [i]}) + "\n" for i in range(10))
    if answers_beside:
        (tmp_path / f"possible_answer_{name}").write_text(answers)
    else:
        (tmp_path / "possible_answer").mkdir()
        (tmp_path / "possible_answer" / name).write_text(answers)
    loaded = agents.load_bfcl(tmp_path, "live_simple", limit=3, start=1, step=3)
    assert [(case["id"], truth) for case, truth in loaded] == [("c1", [1]), ("c4", [4]), ("c7", [7])]
    assert [c["id"] for c, _ in agents.load_bfcl(tmp_path, "live_simple", limit=None, start=8)] == ["c8", "c9"]
