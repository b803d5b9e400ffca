"""benchmarks/quality.py end to end on tiny random members: run (resumable JSONL), score, report, plot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from sandbox_guard import needs_sandbox
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
EVAL = Path(__file__).resolve().parent / "data" / "eval"
"""The first rows of each evaluation set and the IFEval scorer, committed (``tests/data/eval/README.md``):
these tests never read ``../shared/eval``, so they run, and never skip, in a fresh clone."""


def load_quality(monkeypatch: pytest.MonkeyPatch, eval_dir: Path, results: Path) -> Any:
    module = load_script("benchmarks/quality.py", "quality_under_test")
    # the study's settings live in its parts (benchmarks/quality_study/): patch them there
    monkeypatch.setattr(module.tasks, "EVAL_DIR", eval_dir)
    monkeypatch.setattr(module.tasks, "RESULTS", results)
    monkeypatch.setattr(module.tasks, "TASKS", {"ifeval": 6, "arc": 4, "gsm8k": 8, "humaneval": 8})
    return module


@pytest.fixture
def quality(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for name in ("ifeval_score.py", "ifeval_dev.jsonl", "arc_easy_dev.jsonl", "gsm8k_dev.jsonl", "humaneval.jsonl"):
        assert (EVAL / name).is_file(), f"{EVAL / name} is missing: the tests' evaluation rows are committed there"
        shutil.copy(EVAL / name, eval_dir)
    module = load_quality(monkeypatch, eval_dir, tmp_path / "results")

    import tiny

    from specem_core import SpecEM, SpecEMConfig
    from specem_core.weights import MemberWeights

    def build_engine(name: str, task: str = "", fold: int | None = None) -> Any:
        members = {"smollm2": [tiny.member("llama", name="smol")], "qwen": [tiny.member("qwen2", name="qwen")]}
        chosen = members.get(name, [tiny.member("llama", name="smol"), tiny.member("qwen2", name="qwen")])
        spec = module.configs.CONFIGS[name]
        weights = MemberWeights(**spec["weights"]) if "weights" in spec else None
        return SpecEM(chosen, SpecEMConfig(**spec["config"]), member_weights=weights)

    monkeypatch.setattr(module.runner, "build_engine", build_engine)
    return module


def test_run_is_resumable_and_report_compares_on_shared_prompts(quality: Any) -> None:
    quality.run("ifeval", ["smollm2", "paper"], limit=None, seed=0)
    quality.run("ifeval", ["seg5"], limit=2, seed=0)
    path = quality.tasks.RESULTS / "ifeval" / "paper.jsonl"
    first = path.read_text()
    quality.run("ifeval", ["paper"], limit=None, seed=0)  # nothing left to do: nothing appended
    assert path.read_text() == first
    recs = [json.loads(line) for line in first.splitlines()]
    assert len(recs) == 3
    assert {"key", "response", "seconds", "rounds", "drafters_per_round", "wins", "gated", "trace"} <= set(recs[0])
    assert recs[0]["trace"][0]["winner"] in ("smol", "qwen")

    quality.run("arc", ["qwen"], limit=None, seed=0)
    text = quality.report()
    assert "IFEval (6 new tokens): all 3 prompts" in text
    assert "first 2 prompts, every configuration" in text  # seg5 ran on 2: all compared on those 2
    assert "| seg5 | 2 |" in text
    assert "ARC-Easy (4 new tokens): all 3 prompts" in text
    assert (quality.tasks.RESULTS / "summary.md").read_text().strip() == text.strip()
    assert (quality.tasks.RESULTS / "quality.png").stat().st_size > 1000

    quality.run("arc", ["paper"], limit=None, seed=0)
    analysis = quality.analyze("qwen")
    row = next(line for line in analysis.splitlines() if line.startswith("| arc | paper |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "3"  # n: the prompts both answered
    assert cells[3] == "qwen"
    assert int(cells[6]) + int(cells[7]) <= 3
    assert 0.0 <= float(cells[8]) <= 1.0  # sign test p
    best = quality.analyze()  # against the best member alone on each task
    assert "| arc | paper | 3 |" in best
    assert (quality.tasks.RESULTS / "analysis_vs_qwen.md").exists()
    against_smol = quality.analyze("smollm2")
    assert "| ifeval | paper | 3 | smollm2 |" in against_smol
    instr = next(line for line in against_smol.splitlines() if line.startswith("| ifeval (instr. loose) | paper |"))
    cells = [c.strip() for c in instr.strip("|").split("|")]
    assert cells[2].endswith(" instr.")
    assert int(cells[2].split()[0]) >= 3  # every instruction of the 3 prompts, paired
    assert 0.0 <= float(cells[8]) <= 1.0
    replay = quality.explain("ifeval", "paper")
    assert "ranks its own candidate first" in replay
    assert "| recorded |" in replay
    assert "Leave-self-out picks the paper vote's candidate in" in replay


def test_gsm8k_runs_score_the_last_number_and_keep_learned_weights(
    quality: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    configs = dict(quality.configs.CONFIGS)
    configs["learned"] = {"members": ["smollm2", "qwen2.5-coder"], "config": {}, "weights": {"learning_rate": 1.0}}
    monkeypatch.setattr(quality.configs, "CONFIGS", configs)
    quality.run("gsm8k", ["learned", "qwen"], limit=2, seed=0)
    recs = quality.records("gsm8k", "learned")
    assert len(recs) == 2
    assert set(recs[-1]["weights_after"]) == {"smol", "qwen"}
    saved = json.loads((quality.tasks.RESULTS / "gsm8k" / "learned.weights.json").read_text())
    assert saved["format"] == "specem-member-weights/1"
    assert saved["requests"] <= 2
    figures = quality.measure("gsm8k", recs)
    assert figures["n"] == 2
    assert 0.0 <= figures["accuracy"] <= 100.0
    text = quality.report()
    assert "GSM8K dev (8 new tokens): first 2 prompts, every configuration" in text
    assert "| learned | 2 |" in text


@needs_sandbox
def test_humaneval_answers_are_graded_in_the_sandbox_as_they_are_recorded(quality: Any) -> None:
    quality.run("humaneval", ["qwen", "paper"], limit=2, seed=0)
    recs = quality.records("humaneval", "paper")
    assert [r["key"] for r in recs] == ["HumanEval/0", "HumanEval/1"]
    for r in recs:  # random tiny members write no working code: each graded, none passes
        assert r["passed"] is False
        assert r["error_kind"] in quality.tasks.KINDS_OF_GRADE
        assert r["grade_seconds"] >= 0
    figures = quality.measure("humaneval", recs)
    assert figures["pass_at_1"] == 0.0
    text = quality.report()
    assert "HumanEval (8 new tokens, graded in a sandbox): all 3 prompts" not in text  # only 2 of 3 ran
    assert "| paper | 2 | 0.0 |" in text
    summary = json.loads((quality.tasks.RESULTS / "summary.json").read_text())
    assert summary["humaneval"]["paper"]["pass_at_1"] == 0.0


@needs_sandbox
def test_right_answers_count_as_right_and_wrong_ones_as_wrong(quality: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Known answers through the whole study (engine, records, HumanEval graded in the sandbox,
    GSM8K by its final number, figures, report): one right and one wrong answer per task must come
    out as 50 %. A grader that fails every program, or a score stuck at 0 (what the random tiny
    members above produce anyway), fails here."""
    from scripted import ScriptedMember

    from specem_core import SpecEM, SpecEMConfig

    tasks = quality.tasks
    monkeypatch.setattr(tasks, "TASKS", {**tasks.TASKS, "humaneval": 512, "gsm8k": 64})
    configs = dict(quality.configs.CONFIGS)
    configs["key"] = {"members": ["smollm2"], "config": {}}
    monkeypatch.setattr(quality.configs, "CONFIGS", configs)
    code, maths = tasks.load_rows("humaneval", 2), tasks.load_rows("gsm8k", 2)
    wrong_number = float(maths[1]["final"].replace(",", "")) + 1
    answers = {
        tasks.prompt_of("humaneval", code[0])[1]: f"```python\n{code[0]['prompt']}{code[0]['canonical_solution']}\n```",
        tasks.prompt_of("humaneval", code[1])[1]: f"```python\n{code[1]['prompt']}    return []\n```",
        tasks.prompt_of("gsm8k", maths[0])[1]: f"Adding it up, the answer is\n{maths[0]['final']}",
        tasks.prompt_of("gsm8k", maths[1])[1]: f"Adding it up, the answer is\n{wrong_number:g}",
    }

    class AnswerKey(ScriptedMember):
        """Answers each prompt with its key's text in one draft."""

        def open(self, request: Any) -> Any:
            self.drafts = [(answers[request.messages[-1]["content"]], True)]
            return super().open(request)

    def build_engine(name: str, task: str = "", fold: int | None = None) -> Any:
        return SpecEM([AnswerKey("key")], SpecEMConfig())

    monkeypatch.setattr(quality.runner, "build_engine", build_engine)
    quality.run("humaneval", ["key"], limit=2, seed=0)
    recs = quality.records("humaneval", "key")
    assert [r["response"] for r in recs] == list(answers.values())[:2]  # the engine passed the answers on
    assert [(r["passed"], r["error_kind"]) for r in recs] == [(True, "passed"), (False, "failed")]
    assert quality.measure("humaneval", recs)["pass_at_1"] == 50.0
    quality.run("gsm8k", ["key"], limit=2, seed=0)
    assert quality.measure("gsm8k", quality.records("gsm8k", "key"))["accuracy"] == 50.0
    text = quality.report()
    assert "| key | 2 | 50.0 |" in text  # HumanEval pass@1 and GSM8K accuracy, each 1 of 2
    summary = json.loads((tasks.RESULTS / "summary.json").read_text())
    assert summary["humaneval"]["key"]["pass_at_1"] == 50.0


def test_cost_times_several_configurations_side_by_side_against_one_member(quality: Any) -> None:
    text = quality.cost("gsm8k", ["paper", "seg5"], "qwen", limit=2)
    assert len(text.splitlines()) == 2
    for name in ("paper", "seg5"):
        out = json.loads((quality.tasks.RESULTS / "gsm8k" / f"cost_{name}_vs_qwen.json").read_text())
        assert out["measured_with"] == ["qwen", "paper", "seg5"]  # one run, alternating prompt by prompt
        assert out["prompts"] == 2
        assert [set(row) for row in out["rows"]] == [{"key", "qwen", name}] * 2
        expected = sum(r[name]["seconds"] for r in out["rows"]) / sum(r["qwen"]["seconds"] for r in out["rows"])
        assert out["ratio_per_answer"] == pytest.approx(expected)
        assert f"{name} {out['seconds_per_answer'][name]:.1f} s/answer" in text


def test_a_preset_name_in_the_study_is_that_preset_and_nothing_else(quality: Any) -> None:
    """The study runs each shipped preset under the preset's own name, with the preset's members
    and settings (taken from ``specem_core.presets``, not written out a second time), and no other
    configuration may take a preset's name: a reader of a row named ``quality`` reads the preset
    users run."""
    from specem_core.presets import PRESETS

    configs = quality.configs
    for name, preset in PRESETS.items():
        spec = configs.CONFIGS[name]
        assert spec["preset"] == name
        assert spec["config"] == dict(preset.config)
        assert spec["members"] == [configs.ALONE_BY_NAME[m] for m in preset.members]
    # the earlier rules of a preset name themselves apart (and say which preset they start from)
    assert configs.CONFIGS["quality-no-veto"]["preset"] == "quality"
    assert configs.CONFIGS["quality-no-veto"]["config"]["trusted_veto"] is False
    assert "quality-veto" not in configs.CONFIGS
    assert "default" not in configs.CONFIGS
    with pytest.raises(RuntimeError, match="quality share a name with a preset"):
        configs._with_presets({"quality": {"members": ["smollm2"], "config": {}}})
    # the presets' measured results are read from the records under the preset's own name
    assert configs._alone_configs(PRESETS["paper"]) == ["smollm2", "qwen"]
    assert configs._alone_configs(PRESETS["quality"]) == ["1.5b", "0.5b"]


@pytest.mark.parametrize(
    ("reply", "final", "correct"),
    [
        ("3 + 4 = 7\nThe answer is 7.", "7", True),
        ("Total: $1,250.", "1250", True),
        ("So she has 2.50 left", "2.5", True),
        ("12 apples, minus 5 is 7, so 7 ... wait 8", "7", False),
        ("no numbers here", "3", False),
        ("The balance is -40", "-40", True),
    ],
)
def test_gsm8k_last_number(quality: Any, reply: str, final: str, correct: bool) -> None:
    assert quality.gsm8k_correct(reply, final) is correct


def test_sign_test_and_bootstrap(quality: Any) -> None:
    assert quality.sign_test(0, 0) == 1.0
    assert quality.sign_test(5, 5) == 1.0
    assert quality.sign_test(10, 0) == pytest.approx(2 / 1024)
    low, high = quality.bootstrap_ci([1] * 10 + [0] * 30)
    assert 0 < low < 25 < high < 50


@pytest.mark.parametrize(
    ("reply", "labels", "expected"),
    [
        ("B", "ABCD", "B"),
        ("B. Which organisms consume algae?", "ABCD", "B"),
        ("The answer is C.", "ABCD", "C"),
        ("(D) the moon", "ABCD", "D"),
        ("3", "1234", "3"),
        ("Answer: 2", "1234", "2"),
        ("To determine which factor matters, consider", "ABCD", None),
    ],
)
def test_arc_letter(quality: Any, reply: str, labels: str, expected: str | None) -> None:
    assert quality.arc_letter(reply, list(labels)) == expected


def test_crossfit_prior_comes_from_the_members_alone_on_the_other_half(quality: Any) -> None:
    rows = quality.load_rows("gsm8k", None)
    keys = [quality.prompt_of("gsm8k", r)[0] for r in rows]
    first, second = quality.fold_keys("gsm8k")
    assert (first, second) == ({keys[0]}, set(keys[1:]))
    (quality.tasks.RESULTS / "gsm8k").mkdir(parents=True)

    def alone(name: str, right: bool, upto: int) -> None:
        recs = [
            {"key": k, "response": f"so {r['final'] if right else 'none'}", "seconds": 1.0, "drafters_per_round": 1.0,
             "wins": {}, "finish_reason": "stop"}
            for k, r in zip(keys[:upto], rows[:upto], strict=True)
        ]  # fmt: skip
        (quality.tasks.RESULTS / "gsm8k" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    alone("1.5b", True, 3)
    alone("0.5b", False, 3)
    alone("smol", True, 1)  # right on the first half only: that half serves, it does not calibrate
    specs = [quality.Q15, quality.Q05, quality.SMOL]
    with pytest.raises(SystemExit, match="'smol' run alone on all of gsm8k"):
        quality.calibrated_prior("gsm8k", specs, ["big", "small", "tiny"], keys=second)
    alone("smol", False, 3)
    assert quality.calibrated_prior("gsm8k", specs, ["big", "small", "tiny"], keys=second) == {
        "big": 101.0,
        "small": 1.0,
        "tiny": 1.0,
    }
    assert quality.state_path("gsm8k", "trio-v4", 1).name == "trio-v4.fold1.weights.json"


def test_drafting_groups_answers_by_how_long_the_best_member_drafted(quality: Any) -> None:
    rows = quality.load_rows("gsm8k", None)
    (quality.tasks.RESULTS / "gsm8k").mkdir(parents=True)

    def write(name: str, answers: list[tuple[bool, list[list[str]]]]) -> None:
        recs = [
            {"key": row["id"], "response": f"so {row['final'] if right else 'none'}", "seconds": 1.0,
             "drafters_per_round": 1.0, "wins": {"big": 1}, "finish_reason": "stop",
             "trace": [{"drafters": d} for d in drafters]}
            for row, (right, drafters) in zip(rows, answers, strict=True)
        ]  # fmt: skip
        (quality.tasks.RESULTS / "gsm8k" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    write("1.5b", [(True, [["big"]]), (True, [["big"]]), (False, [["big"]])])
    # answer 1: the big member drafted throughout and the ensemble kept its answer; answer 2: it
    # exited after one of three rounds and the answer was lost; answer 3: it drafted two of three
    # rounds and the ensemble found the answer the big member alone missed
    both, small, big = ["big", "s"], ["s"], ["big"]
    write("trio-v4", [(True, [both] * 3), (False, [both, small, small]), (True, [big, big, small])])
    table = quality.drafting("gsm8k", "trio-v4", "1.5b")
    assert "| ≥ 90% | 1 | 1 | 1 | 0 | 0 |" in table
    assert "| 50–90% | 1 | 1 | 0 | 1 | 0 |" in table
    assert "| < 50% | 1 | 0 | 1 | 0 | 1 |" in table


def test_calibration_size_counts_how_often_a_small_set_trusts_the_best_member(quality: Any) -> None:
    rows = quality.load_rows("gsm8k", None)
    keys = [quality.prompt_of("gsm8k", r)[0] for r in rows]
    (quality.tasks.RESULTS / "gsm8k").mkdir(parents=True)

    def alone(name: str, right: list[bool]) -> None:
        recs = [
            {"key": k, "response": f"so {r['final'] if ok else 'none'}", "seconds": 1.0, "finish_reason": "stop"}
            for k, r, ok in zip(keys, rows, right, strict=True)
        ]
        (quality.tasks.RESULTS / "gsm8k" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    with pytest.raises(SystemExit, match="alone on gsm8k first"):
        quality.calibration_size("gsm8k", [1, 2])
    alone("1.5b", [True, True, False])
    alone("0.5b", [False, False, True])
    alone("smol", [False, False, False])
    text = quality.calibration_size("gsm8k", [1, 2], draws=3000)
    data = json.loads((quality.tasks.RESULTS / "gsm8k" / "calibration_size.json").read_text())
    assert data["best"] == "1.5b"
    by_n = {r["n"]: r for r in data["rows"]}
    # one example: the 1.5B is right on 2 of 3 (trusted), on the third the 0.5B is first
    assert by_n[1]["trusts_best"] == pytest.approx(2 / 3, abs=0.04)
    # two examples: only the draw {2nd, 3rd} ties them, and a tie goes to the larger member
    assert by_n[2]["trusts_best"] == 1.0
    # the prior is 1 + score in %: (1 + 66.7) : (1 + 33.3) : 1
    shares = {"1.5b": (1 + 200 / 3) / 103, "0.5b": (1 + 100 / 3) / 103, "smol": 1 / 103}
    assert by_n[3] == pytest.approx({"n": 3, "draws": 1, "trusts_best": 1.0, "separated": 0.0, **shares})
    assert "| 3 | 1 | 100% | 0% | 0.66 / 0.33 / 0.01 |" in text

    calibrated = quality.tasks.RESULTS / "calibration.jsonl"
    replies = [f"so {rows[0]['final']}", "so none", "so none"]  # the second differs from the 1.5B's recorded one
    calibrated.write_text(
        "".join(
            json.dumps({"example": i, "member": "qwen2.5-coder-1.5b-instruct", "reply": reply}) + "\n"
            for i, reply in enumerate(replies)
        )
    )
    assert quality.calibration_check("gsm8k", calibrated).splitlines() == [
        "1.5b: 2 of 3 replies identical to gsm8k/1.5b.jsonl",
        "0.5b: 0 of 0 replies identical to gsm8k/0.5b.jsonl",
        "smol: 0 of 0 replies identical to gsm8k/smol.jsonl",
    ]


def test_prior_replay_decides_round_one_again_under_a_fixed_prior(quality: Any) -> None:
    from specem_core.weights import MemberWeights

    rows = quality.load_rows("arc", None)
    keys = [r["id"] for r in rows]  # answers A, C, A; folds: {first} and {second, third}
    (quality.tasks.RESULTS / "arc").mkdir(parents=True)
    for fold in (0, 1):  # scores 50, 25 (chance on four options) and 26, as 1 + score in %
        prior = {"big": 51.0, "small": 26.0, "tiny": 27.0}
        MemberWeights(prior, min_share=0.1).save(quality.state_path("arc", "trio-v6", fold))

    def answer(key: str, cands: list[tuple[str, str, bool]], raw: list[list[float]], winner: str) -> dict[str, Any]:
        response = next(text for member, text, _ in cands if member == winner)
        trace = {"winner": winner, "candidates": cands, "verifiers": ["big", "small", "tiny"], "raw": raw}
        return {"key": key, "response": response, "seconds": 1.0, "finish_reason": "stop", "trace": [trace]}

    recs = [
        # the two weak members' peaked rows outvote the big member's flat one for a wrong option
        answer(keys[0], [("big", "A", True), ("small", "B", True), ("tiny", "C. television", True)],
               [[1, 0, 0.9], [0, 0, 20], [0, 0, 20]], "tiny"),
        answer(keys[1], [("big", "C", True), ("small", "A", True), ("tiny", "D", True)],
               [[5, 0, 0], [5, 0, 0], [5, 0, 0]], "big"),
        # the big member's unfinished opening names no option; the small member's right one wins
        answer(keys[2], [("big", "The correct", False), ("small", "A", True), ("tiny", "D", True)],
               [[0, 1, 0], [0, 20, 0], [0, 0, 5]], "small"),
    ]  # fmt: skip
    (quality.tasks.RESULTS / "arc" / "trio-v6.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    alone = [{"key": k, "response": reply, "seconds": 1.0} for k, reply in zip(keys, ["A", "C", "B"], strict=True)]
    (quality.tasks.RESULTS / "arc" / "1.5b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alone))

    table = quality.prior_replay("arc", "trio-v6", "1.5b")
    data = json.loads((quality.tasks.RESULTS / "arc" / "trio-v6.prior_replay.json").read_text())
    served, corrected = data["modes"]["served"], data["modes"]["chance-corrected"]
    # as served (shares 0.49 / 0.25 / 0.26) the vote comes out as recorded: one lost, one gained
    assert served["counts"] == {"same": 3, "known": 0, "unknown": 0}
    assert (served["gained"], served["lost"]) == (1, 1)
    assert served["accuracy_unknown_wrong"] == pytest.approx(200 / 3)
    # corrected for chance (1 + 33.3 : 1 : 1 + 1.3) both weak members fall below min_share: the big
    # member's "A" now answers the first question, and its open "The correct" leaves the third unknown
    assert corrected["counts"] == {"same": 1, "known": 1, "unknown": 1}
    assert {q["key"]: (q["outcome"], q["correct"]) for q in corrected["questions"]} == {
        keys[0]: ("known", True), keys[1]: ("same", True), keys[2]: ("unknown", None),
    }  # fmt: skip
    assert (corrected["gained"], corrected["lost"]) == (0, 0)
    assert "| served | big 0.49, small 0.25, tiny 0.26 / big 0.49, small 0.25, tiny 0.26 | 3 | 0 | 0 | 66.7 |" in table
    assert "| chance-corrected | big 0.91, small 0.03, tiny 0.06" in table

    with pytest.raises(SystemExit, match="multiple-choice"):
        quality.prior_replay("gsm8k", "trio-v6", "1.5b")
    with pytest.raises(SystemExit, match="cross-fitted"):
        quality.prior_replay("arc", "trio-paper", "1.5b")


def test_select_chooses_on_the_other_folds_and_reports_on_the_held_out_one(quality: Any) -> None:
    """Three folds of one prompt each. By net gain, ``good`` (a gain on two folds, a loss on the
    third) is chosen where its loss is outside the selection folds, not where it is all they see.
    The out-of-fold figure (+0 / -1 on GSM8K) is below its in-sample one (+1 / -1): what choosing on
    the reporting data hides."""
    tasks = quality.tasks
    outcomes = {  # per task, right (True) or wrong on the three prompts, in data-set order
        "ref": {"gsm8k": [True, False, True], "arc": [True, False, True]},
        "good": {"gsm8k": [True, True, False], "arc": [True, True, True]},
        "bad": {"gsm8k": [False, False, False], "arc": [False, False, False]},
    }
    for task in ("gsm8k", "arc"):
        (tasks.RESULTS / task).mkdir(parents=True, exist_ok=True)
        rows = quality.load_rows(task, None)
        for name, by_task in outcomes.items():
            recs = []
            for row, right in zip(rows, by_task[task], strict=True):
                key = quality.prompt_of(task, row)[0]
                if task == "gsm8k":
                    response = f"so {row['final'] if right else 'none'}"
                else:
                    wrong = next(label for label in row["choices"]["label"] if label != row["answerKey"])
                    response = row["answerKey"] if right else wrong
                recs.append({"key": key, "response": response})
            (tasks.RESULTS / task / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    result = quality.selection.select(["ref", "good", "bad"], "ref", 3, ("gsm8k", "arc"), criterion="net")
    assert [f["chosen"] for f in result["folds"]] == ["good", "ref", "good"]
    oof = result["out_of_fold"]
    assert (oof["gsm8k"]["gained"], oof["gsm8k"]["lost"], oof["arc"]["gained"], oof["arc"]["lost"]) == (0, 1, 0, 0)
    in_sample = result["in_sample"]["good"]
    assert (in_sample["gsm8k"]["gained"], in_sample["gsm8k"]["lost"], in_sample["arc"]["gained"]) == (1, 1, 1)
    assert result["chosen_on_all_folds"] == "good"
    text = quality.selection.write(result, "selection_test.json")
    assert "| 1 | ref |" in text
    written = json.loads((tasks.RESULTS / "folds.json").read_text())
    assert written["folds"]["gsm8k"] == [[quality.prompt_of("gsm8k", r)[0]] for r in quality.load_rows("gsm8k", None)]
    # the default criterion is a one-sided lower bound: on two prompts a flip each way costs more
    # than it gains, so the reference (no flips) is chosen on every fold
    cautious = quality.selection.select(["ref", "good", "bad"], "ref", 3, ("gsm8k", "arc"))
    assert [f["chosen"] for f in cautious["folds"]] == ["ref", "ref", "ref"]
    assert cautious["criterion"] == "lower-bound"
    with pytest.raises(SystemExit, match="'missing' has no record"):
        quality.selection.select(["ref", "missing"], "ref", 3, ("gsm8k", "arc"))
