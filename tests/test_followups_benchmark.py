"""The follow-ups benchmark's grading, copy check, conversations and out-of-fold choice
(``benchmarks/followups.py``): what its report rests on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import followups


def test_an_answer_is_right_when_it_holds_the_expected_word() -> None:
    assert followups.correct("It cost $1,230 in parts.", ["1230"])
    assert followups.correct("The bookshelf ships from Lima.", ["lima"])
    assert followups.correct("At 09:30.", ["09:30"])
    assert not followups.correct("3.5 hours", ["3"])  # a part of another number is not the number
    assert not followups.correct("E1234", ["E123"])
    assert not followups.correct("It took 13 hours.", ["3"])


def test_a_copy_is_a_run_only_an_earlier_answer_holds() -> None:
    earlier = ["The standing desk is shipped from Riga, and it has many units in stock today."]
    assert followups.copied_run("The standing desk is shipped from Riga.", earlier, ["How many are in stock?"])
    # the same words, when the user wrote them, are no copy
    assert not followups.copied_run(
        "The standing desk is shipped from Riga.", earlier, ["So the standing desk is shipped from Riga?"]
    )
    long = "one two three four five six seven eight nine ten eleven twelve"
    assert followups.copied_run(f"So: {long} again", [f"Before: {long}."], [])
    assert not followups.copied_run(f"So: {long[:-7]} again", [f"Before: {long}."], [])  # 11 words, not whole


def test_the_conversations_are_the_same_every_time_and_ask_something_new_each_turn() -> None:
    convs = followups.conversations()
    assert convs == followups.conversations()
    assert len(convs) >= 60
    assert all(3 <= len(c["turns"]) <= 5 for c in convs)
    for c in convs:
        questions = [q for q, _ in c["turns"]]
        assert len(set(questions)) == len(questions), c["id"]
        assert all(expected for _, expected in c["turns"])
    assert {c["kind"] for c in convs} == set(followups.KINDS)


def test_mt_bench_keeps_second_turns_that_ask_something_new() -> None:
    rows = followups.mtbench()
    ids = {int(r["id"].split("-")[1]) for r in rows}
    assert len(rows) == 60 - len(followups.MTBENCH_REWRITE)
    assert not ids & followups.MTBENCH_REWRITE
    assert all(len(r["turns"]) == 2 for r in rows)


def _write(folder: Path, config: str, guard: str, right: dict[int, bool]) -> None:
    lines = [
        {"id": f"policy-{i}", "turn": 2, "question": "q", "answer": "a", "correct": ok, "guard": guard}
        for i, ok in right.items()
    ]
    (folder / f"graded_{config}_g{guard}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_each_fold_is_reported_under_the_setting_the_other_fold_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(followups, "RESULTS", tmp_path)
    monkeypatch.setattr(followups, "conversations", lambda: [{"id": f"policy-{i}", "system": ""} for i in range(4)])
    for config in followups.ENSEMBLES:
        _write(tmp_path, config, "0", {0: True, 1: False, 2: True, 3: False})
        # guard 5 is better on odd conversations (fold 1), worse on even ones (fold 0)
        _write(tmp_path, config, "5", {0: False, 1: True, 2: False, 3: True})
        # with copy_break: the same answers, a larger change, so a tie goes to 5
        _write(tmp_path, config, "5b", {0: False, 1: True, 2: False, 3: True})
    chosen = followups.chosen_guards()
    assert chosen == {0: "5", 1: "0"}  # fold 0 is reported under what fold 1 chose, and the reverse
    records = followups.out_of_fold("graded", "paper", chosen)
    assert {k: r["guard"] for k, r in records.items()} == {
        ("policy-0", 2): "5",
        ("policy-1", 2): "0",
        ("policy-2", 2): "5",
        ("policy-3", 2): "0",
    }


def test_guard_settings_name_the_engine_options() -> None:
    assert followups.guard_options("0") == {"copy_guard_words": 0, "copy_break": False}
    assert followups.guard_options("5b") == {"copy_guard_words": 5, "copy_break": True}
    assert sorted(["5b", "8", "0", "5"], key=followups.change) == ["0", "8", "5", "5b"]
    with pytest.raises(SystemExit, match="--guard x"):
        followups.guard_options("x")


def test_copy_break_acts_counts_cuts_and_redrafts() -> None:
    """A cut carries its word into the next round's ``avoided``; only the words after it are redrafts."""
    rounds = [
        {"cut_before": "pump", "avoided": []},
        {"cut_before": "", "avoided": ["pump", "the"]},  # the carried word, then one redraft
        {"cut_before": "", "avoided": ["of"]},  # a redraft
    ]
    recs = {("policy-0", 2): {"rounds": rounds}, ("policy-1", 2): {"rounds": [{"cut_before": "", "avoided": []}]}}
    assert followups.copy_break_acts(recs) == "1 | 2 | 1"
    assert followups.copy_break_acts({("policy-0", 2): {"rounds": [{"copied": []}]}}) == "– | – | –"
