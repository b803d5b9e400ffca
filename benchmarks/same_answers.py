"""The same-answers check of a refactor: greedy text and traces on a fixed set, before and after.

A refactor that claims "no behaviour change" runs this on the commit before it and on its own
tree, then compares the two records: every answer's text, finish reason, tool calls, exclusions,
per-member token counts and every round's candidates, scores, weights and winner must be equal
(the configuration dict is left out: option names may change).

The set covers the loop's paths on tiny random models built in-process (the paper's rules, the
authors' exact mode, Model Exit with the trusted member, the trusted opening, veto and tool calls,
leave-self-out, line segments, token healing, speculative drafting, stop strings, tools, JSON
output, streaming and async) and, with ``--real``, the shipped presets on the packaged GGUF models
(llama.cpp).

Usage::

    python benchmarks/same_answers.py --out /tmp/before.json            # on the old tree
    python benchmarks/same_answers.py --out /tmp/after.json             # on the new tree
    python benchmarks/same_answers.py --compare /tmp/before.json /tmp/after.json

``--real`` adds the presets (a few minutes on 2 cores); ``--smoke`` runs two tiny cases.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/tiny.py: the tiny random members

PROMPTS = [
    "The capital of France is",
    "Hello world! how are you today?",
    "def add(a, b):",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
RECOMMENDED = {
    "normalization": "softmax",
    "model_exit": True,
    "model_exit_temperature": 0.2,
    "model_exit_agreement_rounds": 2,
    "trusted_opening_rounds": 2,
    "reuse_other_drafts": False,
}
TINY_CASES: dict[str, dict[str, Any]] = {
    "paper": {},
    "reproduce-paper": {"config": {"reproduce_paper": True}},
    "logprob-softmax": {"config": {"scoring": "mean_logprob", "normalization": "softmax"}},
    "no-hedge-no-stop-vote": {"config": {"hedge": False, "vote_on_stop": False}},
    "leave-self-out": {"config": {"leave_self_out": True}},
    "exit": {"config": {"model_exit": True, "model_exit_min_rounds": 1, "model_exit_temperature": 0.2}},
    "recommended": {"config": RECOMMENDED, "prior": True},
    "veto": {"config": {**RECOMMENDED, "trusted_veto": True}, "prior": True},
    "no-keep-trusted": {"config": {**RECOMMENDED, "model_exit_keeps_trusted": False}, "prior": True},
    "lines": {"config": {"segment_boundary": "line", "segment_len": 6}},
    "healing": {"config": {"token_healing": True}},
    "speculative": {"config": {"reuse_other_drafts": True}},
    "no-speculative": {"config": {"reuse_other_drafts": False}},
    "stop": {"config": {"stop": ["e"]}},
    "ignore-eos": {"config": {"ignore_eos": True}},
    "three-members": {"verifier": True},
    "gate": {"config": RECOMMENDED, "prior": True, "min_share": 0.4},
    "tools-auto": {"tools": True, "config": {**RECOMMENDED, "trusted_tool_calls": True}, "prior": True},
    "tools-unanimous": {"tools": True, "config": {**RECOMMENDED, "unanimous_tool_calls": True}, "prior": True},
    "tools-required": {"tools": True, "tool_choice": "required"},
    "json": {"response_format": {"type": "json_object"}},
    "stream": {"mode": "stream", "config": RECOMMENDED, "prior": True},
    "astream": {"mode": "astream", "config": {"reproduce_paper": True}},
}
REAL_CASES: dict[str, dict[str, Any]] = {
    "preset-quality": {"preset": "quality"},
    "preset-fast": {"preset": "fast"},
    "preset-paper": {"preset": "paper"},
    "preset-quality-tools": {"preset": "quality", "tools": True},
}
OLD_NAMES = {
    "reproduce_paper": "faithful",
    "vote_on_stop": "eos_voting",
    "reuse_other_drafts": "draft_hints",
    "model_exit_temperature": "exit_temperature",
    "model_exit_min_rounds": "exit_min_rounds",
    "model_exit_keeps_trusted": "exit_keep_trusted",
    "model_exit_agreement_rounds": "exit_agreement_rounds",
}
"""New option name -> its name before the refactor of #64 (so the script runs on both trees)."""


def _config(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` in the names this tree's SpecEMConfig knows."""
    from specem_core import SpecEMConfig

    fields = set(SpecEMConfig.__dataclass_fields__)
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key in fields:
            out[key] = value
        elif key == "leave_self_out":
            out["self_vote"] = "exclude" if value else "keep"
        else:
            out[OLD_NAMES[key]] = value
    return out


def _tiny_members(verifier: bool) -> list[Any]:
    import tiny

    members = [tiny.member("llama", name="smol"), tiny.member("qwen2", name="qwen")]
    if verifier:
        members.append(tiny.member("gemma3", name="gemma", can_draft=False))
    return members


def _record(result: Any, deltas: list[str] | None = None) -> dict[str, Any]:
    segments = []
    for s in result.segments:
        d = s.to_dict()
        d.pop("seconds", None)
        segments.append(d)
    usage = [dataclasses.asdict(u) for u in result.usage.per_member]
    out: dict[str, Any] = {
        "text": result.text,
        "finish_reason": result.finish_reason,
        "tool_calls": [(c.name, c.arguments) for c in result.tool_calls],  # ids are random
        "excluded": [dataclasses.asdict(e) for e in result.excluded],
        "usage": usage,
        "segments": segments,
    }
    if deltas is not None:
        out["deltas"] = deltas
    return out


def _run(engine: Any, prompt: str, case: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if case.get("tools"):
        kwargs["tools"] = TOOLS
        prompt = "What is the weather in Paris? " + prompt
    if case.get("tool_choice"):
        kwargs["tool_choice"] = case["tool_choice"]
    if case.get("response_format"):
        kwargs["response_format"] = case["response_format"]
    messages = [{"role": "user", "content": prompt}]
    mode = case.get("mode", "generate")
    if mode == "stream":
        deltas, result = [], None
        for event in engine.stream(messages, **kwargs):
            deltas.append(event.delta)
            result = event.result if event.done else result
        return _record(result, deltas)
    if mode == "astream":

        async def collect() -> tuple[list[str], Any]:
            deltas, result = [], None
            async for event in engine.astream(messages, **kwargs):
                deltas.append(event.delta)
                result = event.result if event.done else result
            return deltas, result

        deltas, result = asyncio.run(collect())
        return _record(result, deltas)
    return _record(engine.generate(messages, **kwargs))


def run(cases: dict[str, dict[str, Any]], real: bool) -> dict[str, Any]:
    from specem_core import MemberWeights, SpecEM, SpecEMConfig

    records: dict[str, Any] = {}
    for name, case in cases.items():
        for n, prompt in enumerate(PROMPTS):
            if real:
                engine = SpecEM.from_preset(case["preset"], max_new_tokens=40)
            else:
                weights = None
                if case.get("prior"):
                    weights = MemberWeights({"smol": 2.0, "qwen": 1.0}, min_share=case.get("min_share", 0.0))
                config = SpecEMConfig(**_config({"max_new_tokens": 24, "segment_len": 4, **case.get("config", {})}))
                engine = SpecEM(_tiny_members(bool(case.get("verifier"))), config, member_weights=weights)
            records[f"{name}/{n}"] = _run(engine, prompt, case)
            print(f"{name}/{n}: {records[f'{name}/{n}']['text']!r}", flush=True)
    return records


def _without_nulls(value: Any) -> Any:
    """The record without fields whose value is ``null``: a field added since the older record
    (``usage.per_member[].server``, null for local members) is not a change of behaviour."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def compare(before: Path, after: Path) -> int:
    old, new = (_without_nulls(json.loads(path.read_text())) for path in (before, after))
    differ = [key for key in old if old[key] != new.get(key)]
    missing = sorted(set(old) ^ set(new))
    print(f"{len(old)} answers before, {len(new)} after; {len(differ)} differ; {len(missing)} only on one side")
    for key in differ[:20]:
        print(f"  {key}:\n    before {json.dumps(old[key])[:400]}\n    after  {json.dumps(new.get(key))[:400]}")
    for key in missing:
        print(f"  only on one side: {key}")
    return 1 if differ or missing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--real", action="store_true", help="also the shipped presets on the packaged models")
    parser.add_argument("--smoke", action="store_true", help="two tiny cases, one prompt")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    warnings.simplefilter("ignore", FutureWarning)  # old option names, on the new tree
    if args.smoke:
        global PROMPTS
        PROMPTS = PROMPTS[:1]
        records = run({k: TINY_CASES[k] for k in ("paper", "recommended")}, real=False)
    else:
        records = run(TINY_CASES, real=False)
        if args.real:
            records.update(run(REAL_CASES, real=True))
    if args.out:
        args.out.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out} ({len(records)} answers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
