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


_DICT_FUNCTION = {
    "name": "set_mode",
    "parameters": {
        "type": "dict",
        "properties": {
            "body": {"type": "dict", "properties": {}},
            "rules": {"type": "array", "items": {"type": "dict"}},
        },
        "required": ["body"],
    },
}
_DICT_TRUTH = [
    {
        "set_mode": {
            "body": [{"mode": ["AIR_CLEAN"], "power_save": ["", False]}],
            "rules": ["", [{"field": ["age"], "value": ["25", 25]}]],
        }
    }
]


@pytest.mark.parametrize(
    ("arguments", "ok", "why"),
    [
        ({"body": {"mode": "air clean"}}, True, ""),  # a key with "" among its values may be left out
        ({"body": {"mode": "AIR_CLEAN", "power_save": False}}, True, ""),
        (
            {"body": {"mode": "AIR_CLEAN", "power_save": True}},
            False,
            "value of body: {'mode': 'AIR_CLEAN', 'power_save': True}",
        ),
        ({"body": {"mode": "AIR_CLEAN", "fan": 1}}, False, "value of body: {'mode': 'AIR_CLEAN', 'fan': 1}"),
        ({"body": {"power_save": False}}, False, "value of body: {'power_save': False}"),
        ({"body": {"mode": "AIR_CLEAN"}, "rules": [{"field": "age", "value": 25}]}, True, ""),
        ({"body": {"mode": "AIR_CLEAN"}, "rules": [{"field": "age", "value": 25}] * 2}, False, None),
        ({"body": "AIR_CLEAN"}, False, "type of body"),
    ],
)
def test_bfcl_grade_reads_dict_arguments_key_by_key(arguments, ok, why) -> None:
    grade = agents.bfcl_grade(
        "live_simple", [_DICT_FUNCTION], _DICT_TRUTH, [{"name": "set_mode", "arguments": arguments}]
    )
    assert grade[0] is ok
    if why is not None:
        assert grade[1] == why


def test_regrade_bfcl_grades_recorded_calls_again_and_leaves_failed_requests(tmp_path) -> None:
    import json

    name = agents.BFCL_FILES["live_simple"]
    (tmp_path / name).write_text(json.dumps({"id": "d0", "question": [[]], "function": [_DICT_FUNCTION]}) + "\n")
    (tmp_path / f"possible_answer_{name}").write_text(json.dumps({"id": "d0", "ground_truth": _DICT_TRUTH}) + "\n")
    right = [{"name": "set_mode", "arguments": {"body": {"mode": "AIR_CLEAN"}}}]
    records = [
        {"category": "live_simple", "id": "d0", "ok": False, "why": "value of body: {...}", "calls": right},
        {"category": "live_simple", "id": "d0", "ok": False, "why": "TimeoutError: ", "calls": []},
        {"category": "live_simple", "id": "d0", "ok": False, "why": "", "error": True, "calls": []},
        {"category": "live_simple", "id": "d0", "ok": False, "why": "0 calls", "calls": None},  # none recorded
        {"category": "simple", "id": "x", "ok": False, "why": "0 calls", "calls": right},  # its file is not there
    ]
    assert agents.regrade_bfcl(records, tmp_path) == 1
    assert [(r["ok"], r["why"]) for r in records] == [
        (True, ""),
        (False, "TimeoutError: "),
        (False, ""),
        (False, "0 calls"),
        (False, "0 calls"),
    ]
