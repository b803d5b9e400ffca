"""The study's configurations (``CONFIGS``: members alone, SpecEM settings, the shipped presets)
and their member-weight priors: calibrated on the other task, cross-fitted on the other half of
the same task, or a preset's shipped prior (``write_prior``, from the members-alone runs).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import tasks
from .tasks import load_rows, measure, passes, prompt_of, records

Q15, Q05, SMOL = "llamacpp:qwen2.5-coder-1.5b", "llamacpp:qwen2.5-coder", "llamacpp:smollm2"
V2: dict[str, Any] = {
    "normalization": "softmax",
    "model_exit": True,
    "model_exit_temperature": 0.2,
    "model_exit_keeps_trusted": False,  # v2/v3 ran before it existed (now on by default): off reproduces them
}
V4: dict[str, Any] = {**V2, "model_exit_keeps_trusted": True}  # (the default now)
V4_WEIGHTS: dict[str, Any] = {"prior": "crossfit", "learning_rate": 1.0, "min_share": 0.1}
V5: dict[str, Any] = {**V4, "model_exit_agreement_rounds": 2}
CONFIGS: dict[str, dict[str, Any]] = {
    # members alone: a one-member engine is plain greedy decoding with the member's own template
    "smollm2": {"members": ["smollm2"], "config": {}},
    "qwen": {"members": ["qwen2.5-coder"], "config": {}},
    # (the first default pair, SmolLM2 + Qwen-0.5B under the library defaults, is the `paper` preset:
    # it comes from presets.py below, under that name)
    "faithful": {"members": ["smollm2", "qwen2.5-coder"], "config": {"reproduce_paper": True}},
    "logprob": {"members": ["smollm2", "qwen2.5-coder"], "config": {"scoring": "mean_logprob"}},
    "softmax": {"members": ["smollm2", "qwen2.5-coder"], "config": {"normalization": "softmax"}},
    "no-hedge": {"members": ["smollm2", "qwen2.5-coder"], "config": {"hedge": False}},
    "seg5": {"members": ["smollm2", "qwen2.5-coder"], "config": {"segment_len": 5}},
    "seg20": {"members": ["smollm2", "qwen2.5-coder"], "config": {"segment_len": 20}},
    "exit": {"members": ["smollm2", "qwen2.5-coder"], "config": {"model_exit": True}},
    "3-members": {"members": ["smollm2", "qwen2.5-coder"], "verifiers": ["gemma3"], "config": {}},
    "healing": {"members": ["smollm2", "qwen2.5-coder"], "config": {"token_healing": True}},
    # diagnosis: both draft, only Qwen votes (is the weaker member's vote what costs quality?)
    "qwen-votes": {"members": ["qwen2.5-coder"], "draft_only": ["smollm2"], "config": {}},
    # quality v2 (issue 13): three members on llama.cpp, one of them 1.5B
    "1.5b": {"members": [Q15], "config": {}},
    "0.5b": {"members": [Q05], "config": {}},
    "smol": {"members": [SMOL], "config": {}},
    "trio-paper": {"members": [Q15, Q05, SMOL], "config": {}},
    # v2: scale-free rows (softmax), weights from a prior calibrated on the other task and learned
    # across requests, Model Exit sharp enough to act on softmax-scale votes
    "trio-v2": {"members": [Q15, Q05, SMOL], "config": V2, "weights": {"prior": "calibrated", "learning_rate": 1.0}},
    "pair-v2": {"members": [Q15, Q05], "config": V2, "weights": {"prior": "calibrated", "learning_rate": 1.0}},
    # v3: trio-v2 plus a gate: a member whose learned share falls below 0.1 sits requests out
    # (0.1 from trio-v2's trajectories: SmolLM2 ends at 0.004 on IFEval and 0.03 on GSM8K, the
    # Qwen members never below 0.35)
    "trio-v3": {
        "members": [Q15, Q05, SMOL],
        "config": V2,
        "weights": {"prior": "calibrated", "learning_rate": 1.0, "min_share": 0.1},
    },
    # v4: trio-v3 with the prior from each member's score alone on the other half of the same
    # task (labelled calibration, cross-fitted: no answer is served by a prior measured on it;
    # trio-v3's prior came from the other task and rated SmolLM2 0.24 on GSM8K), and Model Exit
    # never stops the member the weights trust most (trio-v3 lost 6 problems where exit had
    # stopped the 1.5B and the 0.5B answered alone)
    "trio-v4": {"members": [Q15, Q05, SMOL], "config": V4, "weights": V4_WEIGHTS},
    # goal 1's other half for v4: the pair without SmolLM2 (IFEval is where SmolLM2 is not gated)
    "pair-v4": {"members": [Q15, Q05], "config": V4, "weights": V4_WEIGHTS},
    # v5: trio-v4 plus exit by agreement: a drafter that drafted the trusted member's text two
    # rounds running stops (trio-v4's 0.5B drafted 46% of GSM8K rounds; in half of those its
    # candidate was the 1.5B's, and a replay of the traces put this rule at about 1.25x the 1.5B)
    "trio-v5": {"members": [Q15, Q05, SMOL], "config": V5, "weights": V4_WEIGHTS},
    # trio-v5 scored by mean log-probability instead of mean raw logit (trio-v5's IFEval rounds:
    # under raw logits a member's own greedy opening that follows a format instruction, e.g. all
    # lowercase, can lose to a weaker member's generic opening that even the 1.5B's logits rate
    # higher). Rejected: run before v6's exit rule, it scored below trio-v5 (README "Quality" v6)
    "trio-v5-logprob": {
        "members": [Q15, Q05, SMOL],
        "config": {**V5, "scoring": "mean_logprob"},
        "weights": V4_WEIGHTS,
    },
    # v6: trio-v5's settings, run after Model Exit's trusted member came to be chosen by the prior
    # first, the model size next and learned weights last (trio-v5 chose by starting weight: on
    # IFEval prompts 61-120 the Qwen priors tie, the votes taught the weights to trust the 0.5B,
    # and exit stopped the 1.5B in 32 of those 60 answers, where the ensemble lost 14 instructions
    # and gained 9). On GSM8K and IFEval prompts 1-60 both rules keep the 1.5B in every request.
    "trio-v6": {"members": [Q15, Q05, SMOL], "config": V5, "weights": V4_WEIGHTS},
    # goal 1's other half for v6: trio-v6 without SmolLM2
    "pair-v6": {"members": [Q15, Q05], "config": V5, "weights": V4_WEIGHTS},
    # v7: trio-v6 with the opening (first segment) drafted by the trusted member alone, no vote
    # (trio-v6 lost 8 change_case instructions against the 1.5B and gained 1; in 7 of the 8 a
    # weaker member's generic opening had won round 1 over the 1.5B's compliant one)
    "trio-v7": {"members": [Q15, Q05, SMOL], "config": {**V5, "trusted_opening_rounds": 1}, "weights": V4_WEIGHTS},
    # trio-v7 with the prior kept fixed (learning_rate 0): does learning from votes help? (on ARC
    # it hurt trio-v6, whose weights drifted to SmolLM2; on IFEval trio-v7's moved to the 1.5B)
    "trio-v7-fixed": {
        "members": [Q15, Q05, SMOL],
        "config": {**V5, "trusted_opening_rounds": 1},
        "weights": {**V4_WEIGHTS, "learning_rate": 0.0},
    },
    # goal 1's other half for v7 (the recommended configuration): trio-v7 without SmolLM2
    "pair-v7": {"members": [Q15, Q05], "config": {**V5, "trusted_opening_rounds": 1}, "weights": V4_WEIGHTS},
    # quality v3 (code, issue 33): the two coder members under the paper's settings (no prior, no
    # exit), beside the `quality` preset (the same pair, v7 settings and its shipped prior)
    "pair-paper": {"members": [Q15, Q05], "config": {}},
    # the `quality` preset as first shipped, with speculative drafting on the other member's
    # candidates (reuse_other_drafts, the library default) and a one-segment opening: the hint rows come
    # from batched passes and Qwen's packaged kernels are not batch-invariant, so answers the 1.5B won
    # outright still differed from its text alone (29 of 164 on HumanEval); the preset now turns hints off
    "quality-hints": {
        "members": [Q15, Q05],
        "preset": "quality",
        "config": {"reuse_other_drafts": True, "trusted_opening_rounds": 1, "trusted_veto": False},
    },
    # quality v3's code setting: `pair-paper` with segments that end at line ends (at most 16 tokens:
    # most lines of a HumanEval solution fit), so the vote compares whole lines of code (under the
    # `quality` preset's rules the 0.5B never won a HumanEval round: nothing for a vote to change)
    "pair-lines": {"members": [Q15, Q05], "config": {"segment_boundary": "line", "segment_len": 16}},
    # the `quality` preset with the one-segment opening it shipped with before the two-segment one:
    # on GSM8K 8 of its 13 lost answers (against the 1.5B alone) and 2 of its 11 gained ones began
    # where the 0.5B won the first voted round, the round that picks the solution's method
    "quality-open1": {
        "members": [Q15, Q05],
        "preset": "quality",
        "config": {"trusted_opening_rounds": 1, "trusted_veto": False},
    },
    # the `quality` preset before issue 48: two-segment opening, the vote alone decides (named
    # `quality` until issue 64). The preset now adds the trusted veto, and the study runs it as
    # `quality` itself (below; named `quality-veto` until issue 64): the 0.5B's candidate is committed
    # only when the 1.5B itself scores it at least as high as its own draft, since on held-out GSM8K
    # the 0.5B's wins right after the opening set the method of every lost answer read
    "quality-no-veto": {
        "members": [Q15, Q05],
        "preset": "quality",
        "config": {"trusted_opening_rounds": 2, "trusted_veto": False},
    },
    # issue 69's single-turn check: the `fast` preset with the copy guard off, run beside `fast`
    # itself on GSM8K and IFEval (the guard only acts on follow-ups; the two must answer alike)
    "fast-no-copy-guard": {"members": [Q05, SMOL], "preset": "fast", "config": {"copy_guard_words": 0}},
}
"""Configuration name -> members and settings. A name never belongs to a preset unless the
configuration is that preset: the shipped presets are added under their own names from
``specem_core.presets`` (``_preset_configs``), never written out here a second time."""


def _preset_configs() -> dict[str, dict[str, Any]]:
    """The shipped presets (``specem_core.presets``) as configurations of the study, under their
    own names: members and settings come from the preset (no second copy here), the prior from
    its package data, learned across the run's requests as a served engine learns."""
    from specem_core.presets import PRESETS

    out = {}
    for name, preset in PRESETS.items():
        specs = [ALONE_BY_NAME.get(m, m) for m in preset.members]
        out[name] = {"members": specs, "config": dict(preset.config), "preset": name}
    return out


ALONE_BY_NAME = {
    "qwen2.5-coder-1.5b-instruct": Q15,
    "qwen2.5-coder-0.5b-instruct": Q05,
    "smollm2-135m-instruct": SMOL,
}
"""Packaged model name -> the spec the study runs it under (llama.cpp)."""


def _with_presets(configs: dict[str, dict[str, Any]]) -> None:
    """Add the shipped presets to ``configs`` under their own names; a hand-written configuration
    named like a preset would hide it (or be hidden), so that is an error."""
    presets = _preset_configs()
    clash = sorted(set(configs) & set(presets))
    if clash:
        raise RuntimeError(
            f"study configuration(s) {', '.join(clash)} share a name with a preset: name them apart "
            "(the preset itself comes from specem_core.presets)"
        )
    configs.update(presets)


_with_presets(CONFIGS)


CALIBRATION = {"gsm8k": ("ifeval", "prompt_level_strict"), "ifeval": ("gsm8k", "accuracy")}
"""Task -> (task whose members-alone results give the weight prior, its metric): a prior never
comes from the prompts it is evaluated on."""
SCORE_METRIC = {"ifeval": "prompt_level_strict"}
"""Task -> the score a same-task (cross-fitted) prior is made of (``accuracy`` for the others)."""
ALONE = {Q15: "1.5b", Q05: "0.5b", SMOL: "smol"}
"""Member spec -> the configuration that runs it alone."""


def calibrated_prior(
    task: str, member_specs: Sequence[str], names: Sequence[str], keys: set[str] | None = None
) -> dict[str, float]:
    """Prior weight per member name: 1 + its score alone (in %) on a labelled calibration set:
    the other task (``CALIBRATION``), or with ``keys`` those prompts of this task (the other
    fold's, for a cross-fitted prior: never the prompts it serves)."""
    other, metric = CALIBRATION[task] if keys is None else (task, SCORE_METRIC.get(task, "accuracy"))
    prior = {}
    for spec, name in zip(member_specs, names, strict=True):
        recs = [r for r in records(other, ALONE[spec]) if keys is None or str(r["key"]) in keys]
        if not recs or (keys is not None and len(recs) < len(keys)):
            raise SystemExit(f"calibration needs {ALONE[spec]!r} run alone on all of {other} first")
        prior[name] = 1.0 + measure(other, recs)[metric]
    return prior


def fold_keys(task: str) -> list[set[str]]:
    """The task's prompts in two halves (data-set order): the two folds of a cross-fitted prior."""
    keys = [prompt_of(task, row)[0] for row in load_rows(task, None)]
    half = len(keys) // 2
    return [set(keys[:half]), set(keys[half:])]


def crossfitted(name: str) -> bool:
    """Whether the configuration's prior is cross-fitted (one engine per fold of the task)."""
    return bool(CONFIGS[name].get("weights", {}).get("prior") == "crossfit")


def state_path(task: str, name: str, fold: int | None = None) -> Path:
    """Where a configuration's learned member weights are kept (per fold for a cross-fitted prior)."""
    return tasks.RESULTS / task / (f"{name}.weights.json" if fold is None else f"{name}.fold{fold}.weights.json")


PRIOR_SETS = {"ifeval": "prompt_level_strict", "gsm8k": "accuracy"}
"""The labelled dev sets a preset's shipped prior is measured on, and the grade of each."""
PACKAGE_DATA = tasks.ROOT / "specem_core" / "data"


def _alone_configs(preset: Any) -> list[str]:
    """The study's members-alone configurations of a preset's members."""
    if preset.name == "paper":  # the first default pair (v1) was run alone under these names
        return ["smollm2", "qwen"]
    return [ALONE[ALONE_BY_NAME[m]] for m in preset.members]


def write_prior(name: str) -> str:
    """The preset's member-weights prior, as ``specem calibrate`` makes it (each member alone,
    graded; prior = 1 + score in %), from the study's members-alone answers to every prompt of
    IFEval dev (prompt-level strict) and GSM8K dev (the final number), pooled; written to
    ``specem_core/data/priors/<name>.json`` with where it came from."""
    from specem_core.calibration import Calibration, MemberScore
    from specem_core.presets import get_preset

    preset = get_preset(name)
    if preset.prior is None:
        raise SystemExit(f"preset {name!r} ships no prior")
    scores, grades = {}, []
    for member, config in zip(preset.members, _alone_configs(preset), strict=True):
        examples, seconds, passed = 0, 0.0, 0
        for task in PRIOR_SETS:
            recs = records(task, config)
            if len(recs) < len(load_rows(task, None)):
                raise SystemExit(f"the prior needs {config!r} run alone on all of {task} first")
            ok = passes(task, recs)
            for r in recs:
                grade = float(ok[str(r["key"])])
                grades.append({"example": f"{task}/{r['key']}", "member": member, "grade": grade})
                passed += int(grade)
            examples += len(recs)
            seconds += sum(r["seconds"] for r in recs)
        scores[member] = MemberScore(member, 100 * passed / examples, examples, seconds=seconds)
    calibration = Calibration(scores, grades)
    state = calibration.member_weights(learning_rate=1.0, min_share=0.1).to_dict()
    best, second = calibration.best, calibration.runner_up
    sets = {task: {"metric": metric, "n": len(load_rows(task, None))} for task, metric in PRIOR_SETS.items()}
    state["calibration"] = {
        "method": "each member alone, greedy, graded; prior = 1 + score in % (as specem calibrate)",
        "sets": sets,
        "examples": sum(s["n"] for s in sets.values()),
        "scores": {m: round(s.score, 2) for m, s in scores.items()},
        "command": f"python benchmarks/quality.py prior {name}",
    }
    if second is not None:
        better, worse, p = calibration.paired(best, second)
        state["calibration"]["best_vs_runner_up"] = {"best": best, "better": better, "worse": worse, "p": round(p, 4)}
    del state["history"]
    target = PACKAGE_DATA / "priors" / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(state, indent=1) + "\n")
    shown = ", ".join(f"{m} {v:.1f}" for m, v in calibration.prior.items())
    return f"wrote {target.relative_to(tasks.ROOT)}: prior {shown} ({state['calibration']['examples']} examples)"
