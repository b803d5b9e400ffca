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

**Determinism** (``--determinism``): does a request get the answer it gets alone, whatever ran before
it or beside it in the process? A fixed set of requests on a preset (llama.cpp members): RAG
questions over one shared ~500-token document, their follow-ups (the history holds the reference's
own first answers, so every schedule asks the same messages) and short one-line prompts. The
reference runs each request alone: the members' prefix caches are emptied before it, which leaves
what a new process has. Then the same requests in order, in reverse order, and all at once
(``--clients`` threads) in one process, each setting of the llama.cpp members (``default``: the
prefix cache as shipped; ``invariant``: ``history_invariant=True``; ``continuous``:
``continuous_batching=True``, the concurrent requests sharing decode calls); per schedule, how many answers
equal the reference and the wall time::

    python benchmarks/same_answers.py --determinism --preset quality --max-tokens 48 \
        --out benchmarks/results/determinism/quality.json
    python benchmarks/same_answers.py --determinism --members smollm2 --smoke   # seconds
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


# -- determinism: order, history, concurrency ------------------------------------------------------
DOCUMENT = " ".join(
    f"Site {n}: the {part} was checked on day {n + 2}; {finding}."
    for n, (part, finding) in enumerate(
        [
            ("north pump", "its seal leaked and was replaced"),
            ("boiler", "the pressure stayed within limits"),
            ("east valve", "it sticks below five degrees"),
            ("roof fan", "one blade was cracked"),
            ("air filter", "it was clogged and swapped"),
            ("heat sensor", "its readings drift by two degrees"),
            ("supply pipe", "rust was found near a joint"),
            ("lift motor", "the bearings were noisy"),
            ("backup generator", "it started in nine seconds"),
            ("west tank", "the level gauge was stuck"),
            ("fire door", "the closer was too slow"),
            ("water heater", "the anode was worn"),
        ]
        * 2
    )
)
QUESTIONS = [
    "Which part leaked?",
    "What was wrong with the roof fan?",
    "When was the boiler checked?",
    "Which parts were replaced or swapped?",
    "How fast did the backup generator start?",
]
FOLLOW_UPS = [
    "And the lift motor?",
    "Which site was that?",
    "Was anything replaced there?",
    "Which of them was checked last?",
    "Is that fast enough for a hospital?",
]
ONE_LINERS = [
    "Explain why the sky is blue.",
    "Give advice to someone learning to cook.",
    "Write a haiku about rain.",
    "What is a prime number?",
]


def _messages(question: str, history: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
    system = {"role": "system", "content": f"Answer from this report.\n\n{DOCUMENT}"}
    return [system, *(history or []), {"role": "user", "content": question}]


SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "invariant": {"history_invariant": True},
    "continuous": {"continuous_batching": True},
    "continuous-invariant": {"continuous_batching": True, "history_invariant": True},
}
"""The llama.cpp members' options of each ``--settings`` name."""


def _llama_cpp_models(engine: Any) -> list[Any]:
    models = {id(m.model): m.model for m in engine.members if hasattr(getattr(m, "model", None), "clear_prefix_cache")}
    return list(models.values())


def determinism(preset: str, members: list[str] | None, setting: str, clients: int, max_tokens: int) -> dict[str, Any]:
    """The schedules of one preset and member setting (see the module docstring)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from specem_core import SpecEM

    member_kwargs = SETTINGS[setting]
    if members:
        engine = SpecEM.from_preset(
            None, members=members, backend="llamacpp", max_new_tokens=max_tokens, member_kwargs=member_kwargs
        )
        preset = "+".join(members)
    else:
        engine = SpecEM.from_preset(preset, max_new_tokens=max_tokens, member_kwargs=member_kwargs)
    models = _llama_cpp_models(engine)

    def ask(messages: list[dict[str, str]]) -> str:
        return str(engine.generate(messages).text)

    def alone(messages: list[dict[str, str]]) -> str:
        for model in models:
            model.clear_prefix_cache()
        return ask(messages)

    requests: list[list[dict[str, str]]] = []
    reference: list[str] = []
    started = time.perf_counter()
    for question, follow_up in zip(QUESTIONS, FOLLOW_UPS, strict=True):
        first = _messages(question)
        first_answer = alone(first)
        second = _messages(follow_up, [first[-1], {"role": "assistant", "content": first_answer}])
        requests += [first, second]
        reference += [first_answer, alone(second)]
    for line in ONE_LINERS:
        requests.append([{"role": "user", "content": line}])
        reference.append(alone(requests[-1]))
    out: dict[str, Any] = {
        "preset": preset,
        "setting": setting,
        "requests": len(requests),
        "reference_seconds": round(time.perf_counter() - started, 1),
        "reference": reference,
        "schedules": {},
    }
    order = list(range(len(requests)))
    for name in ("in_order", "reversed", "concurrent"):
        started = time.perf_counter()
        if name == "concurrent":
            with ThreadPoolExecutor(clients) as pool:
                answers = list(pool.map(lambda n: ask(requests[n]), order))
        else:
            sequence = order if name == "in_order" else order[::-1]
            got = {n: ask(requests[n]) for n in sequence}
            answers = [got[n] for n in order]
        differ = [n for n in order if answers[n] != reference[n]]
        out["schedules"][name] = {
            "equal": len(order) - len(differ),
            "differ": differ,
            "seconds": round(time.perf_counter() - started, 1),
            "answers": answers,
        }
        print(f"{preset} {setting} {name}: {len(order) - len(differ)}/{len(order)} equal to alone", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--real", action="store_true", help="also the shipped presets on the packaged models")
    parser.add_argument("--smoke", action="store_true", help="two tiny cases, one prompt")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--determinism", action="store_true", help="order, history and concurrency (see above)")
    parser.add_argument("--preset", default="quality", help="--determinism: the preset")
    parser.add_argument("--members", nargs="+", help="--determinism: these members (llama.cpp) instead of a preset")
    parser.add_argument("--settings", nargs="+", default=["default", "invariant"], choices=list(SETTINGS))
    parser.add_argument("--clients", type=int, default=8, help="--determinism: threads of the concurrent schedule")
    parser.add_argument("--max-tokens", type=int, default=32, help="--determinism: tokens an answer")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.determinism:
        if args.smoke:
            global QUESTIONS, FOLLOW_UPS, ONE_LINERS
            QUESTIONS, FOLLOW_UPS, ONE_LINERS = QUESTIONS[:1], FOLLOW_UPS[:1], ONE_LINERS[:1]
            args.max_tokens, args.clients = 4, 2
        results = [determinism(args.preset, args.members, s, args.clients, args.max_tokens) for s in args.settings]
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            print(f"wrote {args.out}")
        return 0
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
