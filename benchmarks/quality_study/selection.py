"""Choosing a preset's setting out of sample (issue 48): k folds over the dev sets, a setting chosen
on the other folds, reported on the fold it never saw.

The protocol, as ``python benchmarks/quality.py select`` runs it:

1. Each task's prompts (GSM8K dev 200, IFEval dev 120) are dealt into ``k`` folds by their position
   in the data set (position ``i`` goes to fold ``i mod k``); the folds are written to
   ``benchmarks/results/quality/folds.json`` and never change with the candidates.
2. For each fold ``f``, every candidate is graded on the *other* folds of every task against the
   reference (the best member alone), per task, by the criterion (:data:`CRITERIA`): by default a
   one-sided lower bound of the paired difference, (gained - lost - 1.645·√(gained + lost)) /
   prompts, because the goal is one-sided ("at or above the best member"): a rule that flips many
   answers both ways pays for its spread, one that changes little pays little. The candidate whose
   worst task ranks highest is chosen (then the higher mean net gain; then the earlier candidate in
   the list, so list the cheaper or simpler ones first).
3. The chosen candidate's answers on fold ``f`` are the out-of-fold answers of that fold. Put
   together over the folds they give one answer per prompt, none chosen on itself: that is the
   figure to report (per task: score, gained / lost against the reference, sign-test p, bootstrap
   95% interval of the paired difference).
4. The setting to ship is the one chosen on all folds together; its expected result is the
   out-of-fold figure, not its own score on the data it was chosen on.

Only the selection is out of sample: each candidate's answers are its recorded ones (a fixed rule
run on every prompt). A candidate that itself was tuned by reading these records (the two-segment
opening of ``quality``) enters as one more candidate; what that reading was worth is the gap between
its in-sample score and the protocol's out-of-fold one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from specem_core.calibration import sign_test

from . import tasks
from .analysis import bootstrap_ci
from .tasks import load_rows, passes, prompt_of, records

Z_ONE_SIDED = 1.645
"""z of a one-sided 95% bound."""
SELECTION_TASKS = ("gsm8k", "ifeval")
"""The dev sets a preset's setting is chosen on (the prior's sets, ``configs.PRIOR_SETS``)."""
FOLDS_FILE = "folds.json"


def folds(k: int, task_names: Sequence[str] = SELECTION_TASKS) -> dict[str, list[list[str]]]:
    """Per task, ``k`` lists of prompt keys: position ``i`` in the data set goes to fold ``i mod k``."""
    if k < 2:
        raise SystemExit(f"--folds must be at least 2, got {k}")
    out: dict[str, list[list[str]]] = {}
    for task in task_names:
        keys = [prompt_of(task, row)[0] for row in load_rows(task, None)]
        out[task] = [keys[f::k] for f in range(k)]
    return out


def _grades(task: str, name: str, keys: Sequence[str]) -> dict[str, bool]:
    wanted = set(keys)
    recs = [r for r in records(task, name) if str(r["key"]) in wanted]
    graded = passes(task, recs)
    missing = [key for key in keys if key not in graded]
    if missing:
        raise SystemExit(f"{name!r} has no record for {len(missing)} of {task}'s {len(keys)} prompts: run it first")
    return graded


def net_gain(ours: dict[str, bool], theirs: dict[str, bool], keys: Sequence[str]) -> float:
    """(gained - lost) / prompts on ``keys``: the paired difference in points / 100."""
    gained = sum(ours[k] and not theirs[k] for k in keys)
    lost = sum(theirs[k] and not ours[k] for k in keys)
    return (gained - lost) / len(keys) if keys else 0.0


def lower_bound(ours: dict[str, bool], theirs: dict[str, bool], keys: Sequence[str], z: float = Z_ONE_SIDED) -> float:
    """A one-sided lower bound of the paired difference: (gained - lost - z·√(gained + lost)) /
    prompts (the normal approximation of the sign statistic). A rule that changes few answers
    pays little; one whose gains and losses are many and balanced pays for its spread."""
    gained = sum(ours[k] and not theirs[k] for k in keys)
    lost = sum(theirs[k] and not ours[k] for k in keys)
    return (gained - lost - z * math.sqrt(gained + lost)) / len(keys) if keys else 0.0


CRITERIA = ("lower-bound", "net")
"""How candidates are ranked on the selection folds, per task, then by the worst task:
``lower-bound`` (default; the goal is one-sided, "at or above the best member") or ``net``."""


def choose(
    grades: dict[str, dict[str, dict[str, bool]]],
    reference: str,
    candidates: Sequence[str],
    keys: dict[str, Sequence[str]],
    criterion: str = "lower-bound",
) -> tuple[str, dict[str, tuple[float, float]]]:
    """The candidate whose worst task ranks highest against ``reference`` on ``keys`` (per task,
    by ``criterion``; then the mean net gain; then the earlier candidate), with each candidate's
    (worst task's criterion, mean net gain)."""
    rank = lower_bound if criterion == "lower-bound" else net_gain
    ranking: dict[str, tuple[float, float]] = {}
    for name in candidates:
        worst = min(rank(grades[task][name], grades[task][reference], keys[task]) for task in keys)
        gains = [net_gain(grades[task][name], grades[task][reference], keys[task]) for task in keys]
        ranking[name] = (worst, sum(gains) / len(gains))
    best = max(candidates, key=lambda n: (ranking[n], -candidates.index(n)))
    return best, ranking


def paired(ours: dict[str, bool], theirs: dict[str, bool], keys: Sequence[str]) -> dict[str, Any]:
    """Score, the reference's score, gained / lost, sign-test p and the bootstrap 95% interval."""
    diffs = [int(ours[k]) - int(theirs[k]) for k in keys]
    gained, lost = diffs.count(1), diffs.count(-1)
    low, high = bootstrap_ci(diffs)
    return {
        "n": len(keys),
        "score": round(100 * sum(ours[k] for k in keys) / len(keys), 1),
        "reference": round(100 * sum(theirs[k] for k in keys) / len(keys), 1),
        "gained": gained,
        "lost": lost,
        "sign_test_p": round(sign_test(gained, lost), 3),
        "ci95": [round(low, 1), round(high, 1)],
    }


def select(
    candidates: Sequence[str],
    reference: str,
    k: int,
    task_names: Sequence[str] = SELECTION_TASKS,
    criterion: str = "lower-bound",
) -> dict[str, Any]:
    """Run the protocol (module docstring) over ``candidates`` (recorded on every prompt of every
    task); the result as :func:`write` keeps it."""
    assignment = folds(k, task_names)
    everything = {task: [key for fold in fs for key in fold] for task, fs in assignment.items()}
    names = list(dict.fromkeys([reference, *candidates]))
    grades = {task: {n: _grades(task, n, everything[task]) for n in names} for task in assignment}
    per_fold = []
    out_of_fold: dict[str, dict[str, bool]] = {task: {} for task in assignment}
    for f in range(k):
        train = {task: [key for g, fold in enumerate(fs) if g != f for key in fold] for task, fs in assignment.items()}
        chosen, ranking = choose(grades, reference, candidates, train, criterion)
        for task, fs in assignment.items():
            out_of_fold[task].update({key: grades[task][chosen][key] for key in fs[f]})
        per_fold.append(
            {
                "fold": f,
                "chosen": chosen,
                "ranking": {n: [round(100 * v, 2) for v in r] for n, r in ranking.items()},
            }
        )
    shipped, ranking_all = choose(grades, reference, candidates, everything, criterion)
    return {
        "protocol": "k folds by position (i mod k); chosen on the other folds by the worst task's criterion "
        "against the reference, then the mean net gain, then the earlier candidate; reported on the fold it never saw",
        "criterion": criterion,
        "k": k,
        "tasks": list(task_names),
        "reference": reference,
        "candidates": list(candidates),
        "folds": per_fold,
        "out_of_fold": {
            task: paired(out_of_fold[task], grades[task][reference], everything[task]) for task in assignment
        },
        "in_sample": {
            n: {task: paired(grades[task][n], grades[task][reference], everything[task]) for task in assignment}
            for n in candidates
        },
        "chosen_on_all_folds": shipped,
        "ranking_all_folds": {n: [round(100 * v, 2) for v in r] for n, r in ranking_all.items()},
    }


def write(result: dict[str, Any], name: str = "selection.json") -> str:
    """Write the folds (once per ``k``) and a selection result under ``benchmarks/results/quality``."""
    folds_path = tasks.RESULTS / FOLDS_FILE
    assignment = folds(result["k"], result["tasks"])
    folds_path.write_text(json.dumps({"k": result["k"], "folds": assignment}, indent=1) + "\n")
    (tasks.RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    return render(result)


def render(result: dict[str, Any]) -> str:
    """The selection as Markdown: per fold what was chosen, the out-of-fold figure, each candidate in sample."""
    lines = [
        f"{result['k']} folds; criterion: {result['criterion']}; reference: {result['reference']}; "
        f"candidates: {', '.join(result['candidates'])}",
        "",
        "| fold | chosen on the other folds |",
        "|---|---|",
        *(f"| {f['fold']} | {f['chosen']} |" for f in result["folds"]),
        "",
        "| | task | n | score | reference | gained | lost | sign-test p | 95% CI of diff (points) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def row(label: str, task: str, p: dict[str, Any]) -> str:
        ci = f"{p['ci95'][0]:+.1f} to {p['ci95'][1]:+.1f}"
        return (
            f"| {label} | {task} | {p['n']} | {p['score']:.1f} | {p['reference']:.1f} | {p['gained']} | {p['lost']} "
            f"| {p['sign_test_p']:.3f} | {ci} |"
        )

    for task, p in result["out_of_fold"].items():
        lines.append(row("**out of fold (the protocol)**", task, p))
    for name, by_task in result["in_sample"].items():
        for task, p in by_task.items():
            lines.append(row(f"{name}, in sample", task, p))
    lines.append("")
    lines.append(f"Chosen on all folds (the setting to ship): **{result['chosen_on_all_folds']}**")
    return "\n".join(lines)
