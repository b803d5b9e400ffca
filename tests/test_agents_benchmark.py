"""The agents benchmark's graders (``benchmarks/agents.py``), without models."""

from __future__ import annotations

from typing import Any

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


TIMES = "What is 12 times 7?"
TIMES_PLUS = "What is 12 times 7, plus 5? Use the tools."
QUENBY = "In which country is Quenby?"
FRANCE = "What is the capital of France?"


@pytest.mark.parametrize(
    ("answer", "text", "question"),
    [
        (84, "Not 84; it is 85.", TIMES),  # issue #63
        (84, "It isn't 84.", TIMES),
        (84, "12 times 7 is not 84.", TIMES),
        (84, "No, it is not 84.", TIMES),
        (84, "No, 84 is wrong.", TIMES),
        (84, "84? No.", TIMES),
        (84, "84? Not really.", TIMES),
        (84, "Is it 84? No, 85.", TIMES),
        (7, "A week doesn't have 7 days.", "How many days are in a week?"),
        ("Norland", "Quenby is not in Norland.", QUENBY),  # issue #63
        ("Norland", "No, not Norland.", QUENBY),
        ("Paris", "Error: No city named 'Paris' in the city table.", FRANCE),  # finals of the committed records
        ("Paris", "The capital of France is not 'Paris'.", FRANCE),
        ("Paris", 'The result is an error message indicating that the city "Paris" is not recognized.', FRANCE),
    ],
)
def test_grade_rejects_an_answer_that_denies_the_value(answer: float | str, text: str, question: str) -> None:
    assert not agents.grade(answer, text, question)


@pytest.mark.parametrize(
    ("answer", "text", "question"),
    [
        (84, "It is 84 or 85.", TIMES),
        (84, "Either 84 or 48.", TIMES),
        (84, "Somewhere between 80 and 90; I would say 84.", TIMES),
        (84, "Approximately 84 or 85.", TIMES),
        (84, "It is probably 84.", TIMES),
        ("Norland", "Quenby? Norland, or maybe Estria.", QUENBY),
        ("Tavia", "Larkspur is in either Tavia or Estria.", "Which country is Larkspur in?"),
        ("Norland", "Quenby lies between Norland and Estria.", QUENBY),
        ("Paris", "Probably Paris.", FRANCE),
    ],
)
def test_grade_rejects_a_hedged_answer(answer: float | str, text: str, question: str) -> None:
    assert not agents.grade(answer, text, question)


@pytest.mark.parametrize(
    ("answer", "text", "question"),
    [
        (84, "It is 83, 84 or 85.", TIMES),  # issue #63
        (84, "The result is 84. Actually, it is 85.", TIMES),
        (89, "The result is 84, or 89.", TIMES_PLUS),
        (48200, "The population of Velmora is 48,200 or 49,000.", "What is the population of Velmora?"),
        (8, "The answer to 100 minus 36, divided by 8.", "What is 100 minus 36, divided by 8?"),  # only operands
        # a misstated fact beside the asked one: the grader cannot tell it from a second answer
        (
            1250,
            "Ostrava Falls has a population of approximately 98,000 people and an elevation of 1250 meters.",
            "How high above sea level is Ostrava Falls, in meters?",
        ),
    ],
)
def test_grade_rejects_an_answer_that_offers_another_value(answer: float, text: str, question: str) -> None:
    assert not agents.grade(answer, text, question)


@pytest.mark.parametrize(
    ("answer", "text", "question"),
    [
        # finals of the committed records (benchmarks/results/agents*.json, agent_replays*.json)
        (84, "12 multiplied by 7 equals 84.", TIMES),
        (623, "623 is the sum of 348 and 275.", "What is 348 plus 275?"),
        (11.0231, "5 kg is approximately 11.0231 pounds.", "How many pounds is 5 kg?"),
        (11.3562, "There are 11.3562 liters in 3 gallons.", "How many liters are 3 gallons?"),
        (
            3280.84,
            'The function "convert_units" with arguments {"value": 1000, "from_unit": "m", "to_unit": "feet"} '
            "returns 3280.8399 feet.",
            "How many feet is 1000 m?",
        ),
        (
            15650,
            "The population of Dunmere is 15650, located in Norland, with an elevation of 620 meters and "
            "founded in 1390.",
            "What is the population of Dunmere?",
        ),
        (1604, "The result is: \n\n301000\n\nThe city of Larkspur was founded in 1604.", "When was Larkspur founded?"),
        (
            89,
            "Let's break it down step by step:\n\n1. Multiply 12 by 7:\n   \\[\n   12 \\times 7 = 84\n   \\]\n\n"
            "2. Add 5 to the result:\n   \\[\n   84 + 5 = 89\n   \\",
            TIMES_PLUS,
        ),
        (
            "Tavia",
            "The city of Larkspur is located in Tavia, with a population of 301,000.",
            "Which country is Larkspur in?",
        ),
        # worked answers: the steps are operands of a further operation
        (89, "12 times 7 is 84, plus 5 is 89.", TIMES_PLUS),
        (89, "The answer is 89, which is 84 + 5.", TIMES_PLUS),
        (126, "(15 + 27) × 3 = 42 × 3 = 126", "What is (15 plus 27) times 3?"),
        (80, "13 + 29 = 42; 42 * 2 = 84; 84 - 4 = 80.", "Add 13 and 29, then multiply the sum by 2, then subtract 4."),
        (417, "24 times 17 is 408, and adding 9 gives 417.", "How many pens are in 17 boxes of 24 plus 9 loose pens?"),
        # facts of the cities the question names
        (63850, "48,200 + 15,650 = 63,850", "What is the combined population of Velmora and Dunmere?"),
        (
            255,
            "Quenby was founded in 1542 and Velmora in 1287: 255 years later.",
            "How many years after Velmora was Quenby founded?",
        ),
        (
            4101.05,
            "Ostrava Falls is 1250 meters high, or about 4101 feet.",
            "What is the elevation of Ostrava Falls in feet?",
        ),
        # a denied other value, and a denial before the answer
        (84, "It is 84, not 85.", TIMES),
        (84, "Is it 85? No, 84.", TIMES),
        (84, "It is 84. Really.", TIMES),
        ("Norland", "Quenby is not in Estria but in Norland.", QUENBY),
    ],
)
def test_grade_accepts_the_right_answers_models_write(answer: float | str, text: str, question: str) -> None:
    assert agents.grade(answer, text, question)


def test_grade_wants_the_final_value_not_a_step() -> None:
    assert not agents.grade(89, "12 times 7 is 84.", TIMES_PLUS)
    assert not agents.grade(89, "12 times 7 is 84, plus 5", TIMES_PLUS)
    assert not agents.grade(63850, "The result is 15650.", "What is the combined population of Velmora and Dunmere?")


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


def _record(task: str, final: str, ok: bool, **cell: Any) -> dict[str, Any]:
    return {"task": task, "final": final, "ok": ok, "limit": False, "error": None, **cell}


def test_regrade_agents_file_recomputes_verdicts_and_summaries_and_names_what_moved() -> None:
    cell = {"row": "quality", "framework": "langgraph", "system": False, "raw_call": False}
    cell |= {"tool_calls": 1, "steps": 2, "seconds": 1.0}
    records = [
        _record("lookup-27", "Quenby is not in Norland.", True, **cell),
        _record("lookup-27", "Quenby is in Norland.", True, **cell),
    ]
    result = {"agents": {"summary": agents.summarize_tasks(records), "records": records}}
    assert result["agents"]["summary"][0]["success"] == 1.0
    moved = agents.regrade_agents_file(result, "agents.json")
    assert moved == [
        "agents.json record 0: lookup-27 (quality, langgraph, system off) True -> False: 'Quenby is not in Norland.'"
    ]
    assert result["agents"]["summary"][0]["success"] == 0.5
    # an A/B replay's records (agents_answering_wording.json): no limit or error fields, a summary per wording
    wording = {
        "summary": {"fast": {"A": "2/2"}},
        "records": [
            {"wording": "A", "row": "fast", "task": "arith-1-00", "final": "It is 83, 84 or 85.", "ok": True},
            {"wording": "A", "row": "fast", "task": "arith-1-00", "final": "The result is 84.", "ok": True},
        ],
    }
    assert agents.regrade_agents_file(wording, "w.json") == [
        "w.json record 0: arith-1-00 (fast, wording A) True -> False: 'It is 83, 84 or 85.'"
    ]
    assert wording["summary"] == {"fast": {"A": "1/2"}}


def test_agent_replays_regrade_grades_the_recorded_finals_against_each_replays_answer() -> None:
    replays = load_script("benchmarks/agent_replays.py", "agent_replays_benchmark")
    assert replays.REPLAY_ANSWERS["create-agent-two-steps"] == 89
    assert replays.REPLAY_ANSWERS["function-agent-two-steps"] == 126
    records = [
        {"replay": "create-agent-two-steps", "question": "What is 12 times 7, plus 5?", "final": "Not 89.", "ok": True},
        {
            "replay": "chat-repeat",
            "question": "What is 12 times 7?",
            "final": "12 multiplied by 7 equals 84.",
            "ok": True,
        },
    ]
    assert replays.regrade(records, "r.json") == ["r.json record 0: create-agent-two-steps True -> False: 'Not 89.'"]
    assert [r["ok"] for r in records] == [False, True]


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
