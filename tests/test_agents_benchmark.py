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
