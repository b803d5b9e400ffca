"""Running configurations: their engines, the resumable runs (one JSONL record per prompt, each
round traced), and side-by-side timing against a member alone (``cost``)."""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from . import configs, tasks
from .configs import calibrated_prior, crossfitted, fold_keys, state_path
from .tasks import answered, grade_humaneval, load_rows, prompt_of


def build_engine(name: str, task: str = "", fold: int | None = None) -> Any:
    """The configuration's engine; ``fold``: which half of the task a cross-fitted prior serves
    (its prior comes from the other half, and its learned state is kept apart)."""
    from specem_core import SpecEM, SpecEMConfig
    from specem_core.registry import load_member
    from specem_core.weights import MemberWeights

    spec = configs.CONFIGS[name]
    if "preset" in spec:
        from specem_core.presets import PRESETS

        saved = state_path(task, name, fold)
        overrides = {k: v for k, v in spec["config"].items() if PRESETS[spec["preset"]].config.get(k) != v}
        return SpecEM.from_preset(
            spec["preset"],
            backend="llamacpp",
            member_weights=MemberWeights.load(saved) if saved.exists() else None,
            **overrides,
        )
    members = [load_member(m) for m in spec["members"]]
    members += [load_member(v, can_draft=False) for v in spec.get("verifiers", [])]
    members += [load_member(d, can_verify=False) for d in spec.get("draft_only", [])]
    weights = None
    if "weights" in spec:
        options = dict(spec["weights"])
        prior = options.pop("prior", None)
        names = [m.name for m in members[: len(spec["members"])]]
        if prior == "crossfit":
            prior = calibrated_prior(task, spec["members"], names, keys=fold_keys(task)[1 - (fold or 0)])
        elif prior == "calibrated":
            prior = calibrated_prior(task, spec["members"], names)
        saved = state_path(task, name, fold)
        weights = MemberWeights.load(saved) if saved.exists() else MemberWeights(prior, **options)
    return SpecEM(members, SpecEMConfig(**spec["config"]), member_weights=weights)


def progress(items: list[Any], desc: str) -> Iterator[Any]:
    try:
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        yield from items


def run(task: str, configs: list[str], limit: int | None, seed: int) -> None:
    # ``configs``: configuration names (in here the parameter hides the module ``configs``)
    rows = load_rows(task, limit)
    for name in configs:
        out = tasks.RESULTS / task / f"{name}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        done = answered(out)
        todo = [r for r in rows if prompt_of(task, r)[0] not in done]
        if not todo:
            continue
        if crossfitted(name):  # one engine per fold
            for n, fold in enumerate(fold_keys(task)):
                part = [r for r in todo if prompt_of(task, r)[0] in fold]
                if part:
                    run_part(task, name, part, build_engine(name, task, fold=n), seed, fold=n)
        else:
            run_part(task, name, todo, build_engine(name, task), seed)


def run_part(task: str, name: str, todo: list[dict[str, Any]], engine: Any, seed: int, fold: int | None = None) -> None:
    """Answer ``todo`` with ``engine``, one record per prompt appended to the configuration's file."""
    with (tasks.RESULTS / task / f"{name}.jsonl").open("a") as fh:
        for row in progress(todo, f"{task}/{name}"):
            key, prompt = prompt_of(task, row)
            start = time.perf_counter()
            result = engine.generate([{"role": "user", "content": prompt}], seed=seed, **generation_options(task))
            record = {
                "key": int(key) if task == "ifeval" else key,
                "response": result.text,
                "seconds": time.perf_counter() - start,
                "rounds": len(result.segments),
                "drafters_per_round": sum(result.members_per_round) / max(len(result.segments), 1),
                "wins": result.wins,
                "finish_reason": result.finish_reason,
                "gated": [e.member for e in result.excluded if e.stage == "gate"],
                "trace": [trace_round(seg) for seg in result.segments],
            }
            record["build"] = llama_cpp_build()
            if task == "humaneval":  # graded now, in the sandbox: the record says how the code ended
                record.update(grade_humaneval(row, result.text))
            if engine.member_weights is not None:  # learned across requests: keep them with the answers
                record["weights_after"] = engine.member_weights.current()
                engine.member_weights.save(state_path(task, name, fold))
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            fh.flush()


@functools.cache
def llama_cpp_build() -> str:
    """The llama.cpp build the records were made with (version and CPU features): greedy answers
    are reproducible on one build only (near ties fall differently on AVX2 and AVX512 kernels), so
    a paired comparison should be between records of the same build."""
    try:
        import llama_cpp
    except ImportError:
        return "none"
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    features = [f.split("=")[0].split(":")[-1].strip() for f in info.split("|") if f.strip().endswith("= 1")]
    return f"llama-cpp-python {llama_cpp.__version__}: " + " ".join(features)


def generation_options(task: str) -> dict[str, Any]:
    """The per-request options every configuration answers a task's prompts with."""
    options: dict[str, Any] = {"max_new_tokens": tasks.TASKS[task]}
    if task in tasks.STOP:
        options["stop"] = list(tasks.STOP[task])
    return options


def trace_round(seg: Any) -> dict[str, Any]:
    """One round as recorded: who drafted what, every verifier's raw scores, weights, the vote."""
    return {
        "winner": seg.winner,
        "drafters": seg.drafters,
        "distinct": len({c.text for c in seg.candidates}),
        "candidates": [[c.member, c.text, c.ended] for c in seg.candidates],
        "verifiers": seg.verifiers,
        "raw": [[round(x, 4) for x in row] for row in seg.raw_scores],
        "combined": [round(x, 4) for x in seg.combined],
        "weights": [round(x, 4) for x in seg.weights],
    }


def cost(task: str, names: Sequence[str], against: str, limit: int, seed: int = 0) -> str:
    """Time per answer of one or more configurations against one member alone, side by side in one
    process (alternating prompt by prompt, so all see the same machine), on the first ``limit``
    prompts; one ``cost_<config>_vs_<member>.json`` per configuration. A configuration starts from
    the weights its quality run learned (``build_engine`` reads that file, the first fold's for a
    cross-fitted prior; a timing run never writes it)."""
    engines = {c: build_engine(c, task, fold=0 if crossfitted(c) else None) for c in (against, *names)}
    rows = []
    for row in load_rows(task, limit):
        key, prompt = prompt_of(task, row)
        entry: dict[str, Any] = {"key": key}
        for config, engine in engines.items():
            start = time.perf_counter()
            result = engine.generate([{"role": "user", "content": prompt}], seed=seed, **generation_options(task))
            entry[config] = {
                "seconds": time.perf_counter() - start,
                "tokens": result.usage.completion_tokens,
                "drafters_per_round": sum(result.members_per_round) / max(len(result.segments), 1),
            }
        rows.append(entry)
        print(key, {c: round(entry[c]["seconds"], 1) for c in engines}, file=sys.stderr)
    total = {c: sum(r[c]["seconds"] for r in rows) for c in engines}
    tokens = {c: sum(r[c]["tokens"] for r in rows) for c in engines}
    lines = []
    (tasks.RESULTS / task).mkdir(parents=True, exist_ok=True)
    for name in names:
        out = {
            "task": task,
            "configuration": name,
            "against": against,
            "measured_with": list(engines),
            "prompts": len(rows),
            "seconds_per_answer": {c: total[c] / len(rows) for c in (against, name)},
            "seconds_per_token": {c: total[c] / max(tokens[c], 1) for c in (against, name)},
            "ratio_per_answer": total[name] / total[against],
            "ratio_per_token": (total[name] / max(tokens[name], 1)) / (total[against] / max(tokens[against], 1)),
            "rows": [{"key": r["key"], against: r[against], name: r[name]} for r in rows],
        }
        (tasks.RESULTS / task / f"cost_{name}_vs_{against}.json").write_text(json.dumps(out, indent=1) + "\n")
        lines.append(
            f"{task}, first {len(rows)} prompts: {name} {out['seconds_per_answer'][name]:.1f} s/answer, "
            f"{against} alone {out['seconds_per_answer'][against]:.1f} s/answer: ratio {out['ratio_per_answer']:.2f} "
            f"per answer, {out['ratio_per_token']:.2f} per committed token"
        )
    return "\n".join(lines)
