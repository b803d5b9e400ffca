"""How each member of a preset opens its answer to BFCL cases: with a tool call, or in words.

    python benchmarks/bfcl_openings.py --bfcl-limit 100                   # quality's members, first 100
    python benchmarks/bfcl_openings.py --bfcl-start 100 --bfcl-limit 100 --out /tmp/held_out.json
    python benchmarks/bfcl_openings.py --preset fast --bfcl irrelevance --bfcl-limit 20
    python benchmarks/bfcl_openings.py --ids simple_python_58 irrelevance_18 --score  # how each scores each
    python benchmarks/bfcl_openings.py --fit-question --out /tmp/fit.json      # does a tool fit? asked

Each member alone drafts the first segment of its answer (``--segment-len`` tokens, greedy), with
the case's tools rendered as the preset's engine renders them (``tool_choice="auto"``), and the
record says whether that opening starts a call (:func:`specem_core.tools.opens_call`). This is the
evidence ``SpecEMConfig.unanimous_tool_calls`` was chosen on: where the 1.5B opens with a call and
the 0.5B in words, the answer opens in words (docs/reports/quality.md, "Agents and tool calls").
With ``--fit-question`` each member is also asked, in a separate prompt, whether one of the
case's functions does what the user asked (:data:`FIT_QUESTION`), and the record keeps its
log-odds of "Yes" over "No": a signal tried for deciding the opening where members disagree, and
not adopted (docs/reports/quality.md, "Agents and tool calls"). A case the whole answer needs (its
grade) is ``benchmarks/agents.py --only bfcl``. Writes
``benchmarks/results/bfcl_openings.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from agents import BFCL_DIR, BFCL_FILES, bfcl_tools, code_version, load_bfcl  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bfcl_openings.json"

FIT_QUESTION = (
    "A user asked:\n\n{question}\n\nThe available functions are:\n\n{functions}\n\n"
    "Does one of these functions do what the user asked, so that calling it answers the request? Answer yes or no."
)
"""The question ``--fit-question`` asks each member, as the only user message (no tools)."""


def fit_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """:data:`FIT_QUESTION` for one case: the user's messages, and one line per function
    (``name(parameter: type, ...): description``)."""
    lines = []
    for tool in tools:
        function = tool["function"]
        properties = (function.get("parameters") or {}).get("properties") or {}
        parameters = ", ".join(f"{name}: {schema.get('type', 'any')}" for name, schema in properties.items())
        lines.append(f"- {function['name']}({parameters}): {function.get('description', '')}")
    question = "\n".join(str(m["content"]) for m in messages if m["role"] == "user")
    return FIT_QUESTION.format(question=question, functions="\n".join(lines))


def fit_log_odds(member: Any, prompt: str) -> float:
    """The member's log-probability of answering "Yes" minus that of "No" (each its mean over
    the answer's tokens, as the vote scores a candidate)."""
    from specem_core.backends.base import SessionRequest
    from specem_core.types import Candidate

    session = member.open(SessionRequest([{"role": "user", "content": prompt}], None, None))
    try:
        yes, no = session.score([Candidate("", "Yes", False), Candidate("", "No", False)], score_eos=False)
    finally:
        session.close()
    return round(yes.mean_logprob - no.mean_logprob, 3)


def openings(
    members: list[Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    segment_len: int,
    score: bool = False,
) -> dict[str, dict[str, Any]]:
    """Each member's greedy opening to one request, and whether it starts a call; with ``score``,
    each member's score of every member's opening (``scores[drafter]``: mean logit, mean
    log-probability and tokens, as the vote would see them)."""
    from specem_core.backends.base import SamplingParams, SessionRequest
    from specem_core.tools import OutputPlan, opens_call
    from specem_core.types import Candidate, validate_messages

    plan = OutputPlan.build(tools, "auto")
    assert plan is not None
    prepared = plan.prepare_messages(validate_messages(messages))
    out: dict[str, dict[str, Any]] = {}
    sessions = []
    try:
        for member in members:
            started = time.perf_counter()
            session = member.open(SessionRequest(prepared, plan.tools, None))
            sessions.append(session)
            draft = session.draft(segment_len, SamplingParams())
            out[member.name] = {
                "text": draft.text,
                "call": opens_call(draft.text),
                "ended": draft.ended,
                "seconds": round(time.perf_counter() - started, 2),
            }
        if score:
            candidates = [Candidate(name, o["text"], o["ended"]) for name, o in out.items()]
            for member, session in zip(members, sessions, strict=True):
                scored = session.score(candidates, score_eos=False)
                out[member.name]["scores"] = {
                    c.member: {"mean_logit": s.mean_logit, "mean_logprob": s.mean_logprob, "tokens": s.n_tokens}
                    for c, s in zip(candidates, scored, strict=True)
                }
    finally:
        for session in sessions:
            session.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="quality")
    parser.add_argument("--members", nargs="+", default=None, help="packaged model names instead of the preset's")
    parser.add_argument("--bfcl", nargs="+", default=["irrelevance", "simple", "multiple"], choices=list(BFCL_FILES))
    parser.add_argument("--bfcl-dir", type=Path, default=BFCL_DIR)
    parser.add_argument("--bfcl-start", type=int, default=0)
    parser.add_argument("--bfcl-limit", type=int, default=None)
    parser.add_argument("--segment-len", type=int, default=None, help="default: the preset's")
    parser.add_argument("--ids", nargs="+", default=None, help="only these cases (ids as in the BFCL files)")
    parser.add_argument(
        "--score", action="store_true", help="every member also scores every member's opening, as the vote would"
    )
    parser.add_argument(
        "--fit-question",
        action="store_true",
        help="also ask each member whether one of the tools does what the user asked (log-odds of Yes over No)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from specem_core import SpecEM

    overrides: dict[str, Any] = {"members": args.members} if args.members else {}
    engine = SpecEM.from_preset(args.preset, backend="llamacpp", **overrides)
    segment_len = args.segment_len or engine.config.segment_len
    settings = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "segment_len": segment_len,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "code": code_version(),
    }
    if args.ids:
        known = {case["id"] for category in args.bfcl for case, _ in load_bfcl(args.bfcl_dir, category, None)}
        if unknown := sorted(set(args.ids) - known):
            parser.error(f"--ids: no such case in {', '.join(args.bfcl)} (from --bfcl-dir): {', '.join(unknown)}")
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for category in args.bfcl:
        for case, _ in load_bfcl(args.bfcl_dir, category, args.bfcl_limit, args.bfcl_start):
            if args.ids and case["id"] not in args.ids:
                continue
            tools = bfcl_tools(case["function"])
            opened = openings(engine.members, case["question"][0], tools, segment_len, args.score)
            if args.fit_question:
                prompt = fit_prompt(case["question"][0], tools)
                for member in engine.members:
                    opened[member.name]["fit_log_odds"] = fit_log_odds(member, prompt)
            records.append({"category": category, "id": case["id"], "openings": opened})
            shown = {name: (o["call"], o.get("fit_log_odds")) for name, o in opened.items()}
            print(category, case["id"], shown, flush=True)
    summary = []
    for category in args.bfcl:
        rows = [r for r in records if r["category"] == category]
        calls = Counter(tuple(o["call"] for o in r["openings"].values()) for r in rows)
        names = list(rows[0]["openings"]) if rows else []
        summary.append(
            {
                "category": category,
                "cases": len(rows),
                "calls": {name: sum(r["openings"][name]["call"] for r in rows) for name in names},
                "members": names,
                "patterns": {"".join("C" if c else "w" for c in k): n for k, n in sorted(calls.items())},
            }
        )
    result = {
        "settings": settings,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for line in summary:
        print(json.dumps(line))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
