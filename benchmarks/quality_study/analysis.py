"""Analyses of the recorded runs: paired gains and losses against a member alone (``analyze``),
replays of the recorded rounds (``explain``, ``drafting``, ``prior_replay``), and how many
labelled examples a prior needs (``calibration_size``, ``calibration_check``)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specem_core.calibration import sign_test

from . import configs, tasks
from .configs import ALONE, Q05, Q15, SMOL, crossfitted, fold_keys, state_path
from .report import _short
from .tasks import arc_letter, ifeval_instruction_passes, load_rows, passes, prompt_of, records


def bootstrap_ci(diffs: Sequence[int], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean paired difference (in points)."""
    if not diffs:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(100 * sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def analyze(against: str | None = None) -> str:
    """Per configuration and task, paired against one member alone (default: the member alone
    that scores best on that configuration's prompts): per-prompt gains and losses, a sign test and a
    bootstrap CI of the difference, how often candidates were all the same (nothing to choose),
    how close the votes were, and who won."""
    lines = [
        "| task | configuration | n | vs | score | theirs | gains | losses | sign test p | 95% CI of diff "
        "| same answer | rounds with one distinct candidate | median vote margin | share of wins |",
        "|" + "---|" * 14,
    ]
    alone = [name for name, spec in configs.CONFIGS.items() if len(spec["members"]) == 1 and not spec.get("draft_only")]
    for task in ("gsm8k", "ifeval", "arc", "humaneval"):
        available = {name: records(task, name) for name in configs.CONFIGS}
        available = {name: recs for name, recs in available.items() if recs}
        if not available:
            continue
        pass_of = {name: passes(task, recs) for name, recs in available.items()}
        singles = [n for n in alone if n in pass_of]
        for name, recs in available.items():
            keys_all = {str(r["key"]) for r in recs}
            ref = against
            if ref is None:  # the best member alone on this configuration's prompts
                if name in singles:
                    continue
                covering = [n for n in singles if keys_all <= set(pass_of[n])]
                if not covering:
                    continue
                ref = max(covering, key=lambda n: sum(pass_of[n][k] for k in keys_all))
            if ref not in available or name == ref or configs.CONFIGS[name] == configs.CONFIGS[ref]:
                continue
            base = {str(r["key"]): r for r in available[ref]}
            theirs = pass_of[ref]
            recs = [r for r in recs if str(r["key"]) in base]
            if not recs:
                continue
            ours = pass_of[name]
            keys = [str(r["key"]) for r in recs]
            gains = sum(ours[k] and not theirs[k] for k in keys)
            losses = sum(theirs[k] and not ours[k] for k in keys)
            low, high = bootstrap_ci([int(ours[k]) - int(theirs[k]) for k in keys])
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
            total = max(sum(wins.values()), 1)
            ordered = sorted(wins.items(), key=lambda x: -x[1])
            share = ", ".join(f"{_short(m)} {100 * v / total:.0f}%" for m, v in ordered)
            cells = [
                task, name, str(len(recs)), ref + _build_note(recs, [base[k] for k in keys]),
                f"{100 * sum(ours[k] for k in keys) / len(keys):.1f}",
                f"{100 * sum(theirs[k] for k in keys) / len(keys):.1f}",
                str(gains), str(losses), f"{sign_test(gains, losses):.2f}", f"[{low:+.1f}, {high:+.1f}]",
                f"{100 * same / len(recs):.0f}%",
                f"{100 * one / len(rounds):.0f}%" if rounds else "–",
                f"{margins[len(margins) // 2]:.3f}" if margins else "–",
                share if len(wins) > 1 else "–",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
            if task == "ifeval":  # the goal names instruction-level loose too: paired per instruction
                lines.append(_instruction_row(name, ref, recs, available[ref]))
    text = "\n".join(lines)
    (tasks.RESULTS / ("analysis.md" if against is None else f"analysis_vs_{against}.md")).write_text(text + "\n")
    return text


def _build_note(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """Nothing when both sides were answered on one llama.cpp build (``runner.llama_cpp_build``);
    otherwise a warning for the table: greedy answers differ between builds (near ties)."""
    builds = {r.get("build") for r in ours} | {r.get("build") for r in theirs}
    if None in builds:
        return " (build not recorded)"
    return "" if len(builds) == 1 else " (different builds)"


def _instruction_row(name: str, ref: str, recs: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
    """IFEval instruction-level loose, paired instruction by instruction (an analysis table row)."""
    keys = {str(r["key"]) for r in recs}
    ours = ifeval_instruction_passes(recs)
    theirs = {k: v for k, v in ifeval_instruction_passes(base).items() if k.split("/")[0] in keys}
    units = [k for k in theirs if k in ours]
    gains = sum(ours[k] and not theirs[k] for k in units)
    losses = sum(theirs[k] and not ours[k] for k in units)
    low, high = bootstrap_ci([int(ours[k]) - int(theirs[k]) for k in units])
    cells = [
        "ifeval (instr. loose)", name, f"{len(units)} instr.", ref,
        f"{100 * sum(ours[k] for k in units) / len(units):.1f}",
        f"{100 * sum(theirs[k] for k in units) / len(units):.1f}",
        str(gains), str(losses), f"{sign_test(gains, losses):.2f}", f"[{low:+.1f}, {high:+.1f}]",
        "–", "–", "–", "–",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def explain(task: str, name: str) -> str:
    """Replay the recorded rounds of one configuration: how often each verifier ranks its own
    candidate first (self-preference), whose candidate each vote rule would pick on the same
    candidates and scores (paper vote, leave-self-out, one verifier alone), and the vote margins."""
    from specem_core.scoring import argmax_first, combine, combine_leave_self_out, normalize_row
    from specem_core.types import Candidate

    recs = records(task, name)
    rounds = [t for r in recs for t in r.get("trace", []) if t.get("raw") and t["distinct"] > 1]
    if not rounds:
        return f"{task}/{name}: no contested round recorded"
    self_top: dict[str, list[int]] = {}
    picks: dict[str, dict[str, int]] = {}
    agree = 0  # rounds where leave-self-out picks the paper vote's candidate text
    for t in rounds:
        owners_by_name = [c[0] for c in t["candidates"]]
        texts = [(c[1], c[2]) for c in t["candidates"]]
        members = list(dict.fromkeys(t["verifiers"] + owners_by_name))
        index = {m: n for n, m in enumerate(members)}
        verifiers = [index[v] for v in t["verifiers"]]
        owners = [index[o] for o in owners_by_name]
        cands = [Candidate(o, x, e) for o, (x, e) in zip(owners_by_name, texts, strict=True)]
        normalized = [normalize_row(row, "sum") for row in t["raw"]]
        for v, row in zip(t["verifiers"], t["raw"], strict=True):
            own = [n for n, o in enumerate(owners_by_name) if o == v]
            if own and len(set(texts)) > 1:
                top = argmax_first(row)
                self_top.setdefault(v, []).append(int(texts[top] == texts[own[0]]))
        uniform = [1.0 / len(verifiers)] * len(verifiers)
        paper = argmax_first(combine(normalized, uniform))
        leave = argmax_first(combine_leave_self_out(normalized, uniform, verifiers, owners, cands))
        agree += texts[paper] == texts[leave]
        rules = {
            "recorded": t["winner"],
            "paper vote (uniform)": owners_by_name[paper],
            "leave-self-out (uniform)": owners_by_name[leave],
        }
        for v, row in zip(t["verifiers"], t["raw"], strict=True):
            rules[f"{_short(v)} alone"] = owners_by_name[argmax_first(row)]
        for rule, owner in rules.items():
            bucket = picks.setdefault(rule, {})
            bucket[owner] = bucket.get(owner, 0) + 1
    lines = [f"### {task} / {name}: {len(rounds)} contested rounds over {len(recs)} answers", ""]
    lines.append("| verifier | ranks its own candidate first |")
    lines.append("|---|---|")
    for v, hits in self_top.items():
        lines.append(f"| {_short(v)} | {100 * sum(hits) / len(hits):.0f}% of {len(hits)} rounds |")
    owners_all = sorted({o for b in picks.values() for o in b})
    lines += [
        "",
        "| vote rule (same candidates and scores) | " + " | ".join(f"{_short(o)} wins" for o in owners_all) + " |",
    ]
    lines.append("|---|" + "---|" * len(owners_all))
    for rule, bucket in picks.items():
        cells = [f"{100 * bucket.get(o, 0) / len(rounds):.0f}%" for o in owners_all]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    lines += ["", f"Leave-self-out picks the paper vote's candidate in {100 * agree / len(rounds):.0f}% of the rounds."]
    return "\n".join(lines)


def drafting(task: str, name: str, against: str) -> str:
    """The answers of ``name`` grouped by the share of rounds in which ``against``'s member (a
    member alone) drafted, each group paired against that member alone: where Model Exit or the
    gate left the answer to the others, and what that cost or gained."""
    base = {str(r["key"]): r for r in records(task, against)}
    recs = [r for r in records(task, name) if str(r["key"]) in base and r.get("trace")]
    if not recs or not base:
        return f"{task}/{name}: no answers shared with {against}"
    member = next(iter(next(iter(base.values()))["wins"]))
    ours, theirs = passes(task, recs), passes(task, list(base.values()))
    groups: dict[str, list[str]] = {}
    for r in recs:
        share = sum(member in t["drafters"] for t in r["trace"]) / len(r["trace"])
        label = "≥ 90%" if share >= 0.9 else "50–90%" if share >= 0.5 else "< 50%"
        groups.setdefault(label, []).append(str(r["key"]))
    lines = [
        f"### {task} / {name}: answers by the share of rounds {_short(member)} drafted",
        "",
        f"| {_short(member)} drafted | answers | {name} | {against} alone | gained | lost |",
        "|---|---|---|---|---|---|",
    ]
    for label in ("≥ 90%", "50–90%", "< 50%"):
        keys = groups.get(label, [])
        lines.append(
            f"| {label} | {len(keys)} | {sum(ours[k] for k in keys)} | {sum(theirs[k] for k in keys)} "
            f"| {sum(ours[k] and not theirs[k] for k in keys)} | {sum(theirs[k] and not ours[k] for k in keys)} |"
        )
    return "\n".join(lines)


def prior_replay(task: str, name: str, against: str) -> str:
    """Round 1 of a cross-fitted configuration's multiple-choice records decided again, offline,
    under fixed weights (no learning across requests): the prior as served (``1 + score in %``)
    and a prior corrected for chance (``1 + 100 · max(0, (score − chance) / (100 − chance))``,
    chance = 100 / options, averaged over the calibrating half), both behind the configuration's
    ``min_share`` gate. The members' raw scores of the round-1 candidates are in the records, so a
    gated member's candidate and row simply drop out. A new winner's answer is known when its
    segment finished or names an option; otherwise later rounds would decide it (counted apart).
    Writes ``<task>/<name>.prior_replay.json`` (per question) and returns a Markdown table."""
    if task != "arc":
        raise SystemExit("prior-replay needs a multiple-choice task (arc): chance is 100 / options")
    spec = configs.CONFIGS[name]
    if not crossfitted(name) or spec["config"].get("normalization") != "softmax":
        raise SystemExit(f"prior-replay needs a cross-fitted configuration with softmax rows, not {name!r}")
    from specem_core.scoring import softmax
    from specem_core.weights import MemberWeights

    temperature = float(spec["config"].get("normalization_temperature", 1.0))
    min_share = float(spec["weights"].get("min_share", 0.0))
    rows = {row["id"]: row for row in load_rows(task, None)}
    recs = {str(r["key"]): r for r in records(task, name)}
    theirs = passes(task, records(task, against))

    def correct(key: str, text: str) -> bool:
        return arc_letter(text, rows[key]["choices"]["label"]) == rows[key]["answerKey"]

    out: dict[str, Any] = {"task": task, "configuration": name, "against": against, "modes": {}}
    lines = [
        f"Round 1 of `{name}` on {task} decided again under fixed weights (no learning), against `{against}`",
        "",
        "| prior | shares (fold 0 / fold 1) | same winner | new winner, answer known | new winner, "
        "answer unknown | accuracy (unknown counted wrong) | as recorded | gained / lost vs "
        f"`{against}` (known) | of the losses, the top-prior member preferred the winner itself |",
        "|" + "---|" * 9,
    ]
    recorded = 100 * sum(correct(k, r["response"]) for k, r in recs.items()) / max(len(recs), 1)
    for mode in ("served", "chance-corrected"):
        per_question: list[dict[str, Any]] = []
        shares_text = []
        for fold, keys in enumerate(fold_keys(task)):
            prior = dict(MemberWeights.load(state_path(task, name, fold)).prior)
            if mode == "chance-corrected":
                other = fold_keys(task)[1 - fold]
                chance = 100 * sum(1 / len(rows[k]["choices"]["label"]) for k in other) / len(other)
                prior = {m: 1 + 100 * max(0.0, (p - 1 - chance) / (100 - chance)) for m, p in prior.items()}
            total = sum(prior.values())
            kept = {m for m, p in prior.items() if p / total >= min_share}
            top = max(prior, key=lambda m: prior[m])
            weight = {m: prior[m] / sum(prior[k] for k in kept) for m in kept}
            shares_text.append(", ".join(f"{_short(m)} {p / total:.2f}" for m, p in prior.items()))
            for key in sorted(keys & recs.keys()):
                trace = recs[key]["trace"][0]
                cands = [(i, m, text, done) for i, (m, text, done) in enumerate(trace["candidates"]) if m in kept]
                combined = [0.0] * len(cands)
                rows_of = {v: [trace["raw"][j][i] for i, *_ in cands] for j, v in enumerate(trace["verifiers"])}
                for verifier, raw in rows_of.items():
                    if verifier in kept:
                        for c, share in enumerate(softmax(raw, temperature)):
                            combined[c] += weight[verifier] * share
                best = max(range(len(cands)), key=lambda c: combined[c])
                _, winner, text, done = cands[best]
                old = next(t for m, t, _ in trace["candidates"] if m == trace["winner"])
                entry: dict[str, Any] = {"key": key, "fold": fold, "winner": winner, "segment": text}
                if text == old:
                    entry.update(outcome="same", correct=correct(key, recs[key]["response"]))
                elif done or arc_letter(text, rows[key]["choices"]["label"]):
                    entry.update(outcome="known", correct=correct(key, text))
                else:
                    entry.update(outcome="unknown", correct=None)
                if top in rows_of and winner != top and top in [m for _, m, _, _ in cands]:
                    own = rows_of[top]
                    at_top = next(c for c, (_, m, _, _) in enumerate(cands) if m == top)
                    entry["top_preferred_winner"] = own[best] > own[at_top]
                per_question.append(entry)
        known = [e for e in per_question if e["correct"] is not None]
        gained = sum(e["correct"] and not theirs[e["key"]] for e in known)
        lost = [e for e in known if not e["correct"] and theirs[e["key"]]]
        own_pref = sum(bool(e.get("top_preferred_winner")) for e in lost)
        count = {o: sum(e["outcome"] == o for e in per_question) for o in ("same", "known", "unknown")}
        accuracy = 100 * sum(bool(e["correct"]) for e in per_question) / max(len(per_question), 1)
        out["modes"][mode] = {"shares": shares_text, "counts": count, "accuracy_unknown_wrong": accuracy,
                              "gained": gained, "lost": len(lost), "questions": per_question}  # fmt: skip
        lines.append(
            f"| {mode} | {' / '.join(shares_text)} | {count['same']} | {count['known']} | {count['unknown']} "
            f"| {accuracy:.1f} | {recorded:.1f} | {gained} / {len(lost)} | {own_pref} of {len(lost)} |"
        )
    (tasks.RESULTS / task / f"{name}.prior_replay.json").write_text(json.dumps(out, indent=1) + "\n")
    return "\n".join(lines)


def calibration_size(task: str, sizes: Sequence[int], draws: int = 10_000, seed: int = 0) -> str:
    """How many labelled examples a prior needs: draw calibration sets of each size from the
    members' recorded answers alone (all of the task), and count how often the prior trusts the
    member that is best on the whole set (exit's rule: the highest prior, among equal priors the
    larger model — here the 1.5B), and how often the set separates the top two (sign test)."""
    members = [Q15, Q05, SMOL]  # in size order: a tie goes to the earlier (larger) one
    grades = {m: passes(task, records(task, ALONE[m])) for m in members}
    keys = sorted(set.intersection(*(set(g) for g in grades.values())))
    if not keys:
        raise SystemExit(f"run {', '.join(ALONE[m] for m in members)} alone on {task} first")
    full = {m: sum(grades[m][k] for k in keys) for m in members}
    best = max(members, key=lambda m: full[m])  # max keeps the first (larger) among equals
    rng = random.Random(seed)
    rows = []
    for n in [*sorted(n for n in sizes if n < len(keys)), len(keys)]:
        trusted = separated = 0
        shares: dict[str, list[float]] = {m: [] for m in members}
        for _ in range(draws if n < len(keys) else 1):
            pick = rng.sample(keys, n)
            score = {m: 100 * sum(grades[m][k] for k in pick) / n for m in members}
            top = max(members, key=lambda m: score[m])
            second = max((m for m in members if m != top), key=lambda m: score[m])
            trusted += top == best
            better = sum(grades[top][k] and not grades[second][k] for k in pick)
            worse = sum(grades[second][k] and not grades[top][k] for k in pick)
            separated += sign_test(better, worse) < 0.05
            total = sum(1 + score[m] for m in members)
            for m in members:
                shares[m].append((1 + score[m]) / total)
        runs = draws if n < len(keys) else 1
        median = {ALONE[m]: sorted(v)[len(v) // 2] for m, v in shares.items()}
        rows.append({"n": n, "draws": runs, "trusts_best": trusted / runs, "separated": separated / runs, **median})
    out = tasks.RESULTS / task / "calibration_size.json"
    out.write_text(json.dumps({"task": task, "best": ALONE[best], "full_scores": {ALONE[m]: 100 * full[m] / len(keys)
                                for m in members}, "rows": rows}, indent=1) + "\n")  # fmt: skip
    lines = [
        f"{task}: best member on all {len(keys)} = {ALONE[best]} "
        + ", ".join(f"{ALONE[m]} {100 * full[m] / len(keys):.1f}" for m in members),
        "| examples | draws | prior trusts the best member | top two separated (p < 0.05) | median prior share "
        + " / ".join(ALONE[m] for m in members)
        + " |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['draws']} | {100 * r['trusts_best']:.0f}% | {100 * r['separated']:.0f}% | "
            + " / ".join(f"{r[ALONE[m]]:.2f}" for m in members)
            + " |"
        )
    return "\n".join(lines)


def calibration_check(task: str, path: Path) -> str:
    """Whether ``specem calibrate --records`` answered as the study's members-alone runs did:
    per member, how many replies equal the recorded ones character for character (the records'
    ``example`` indexes count from the top of the task's data file)."""
    rows = load_rows(task, None)
    names = {Q15: "qwen2.5-coder-1.5b-instruct", Q05: "qwen2.5-coder-0.5b-instruct", SMOL: "smollm2-135m-instruct"}
    calibrated = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    lines = []
    for spec, name in names.items():
        alone = {str(r["key"]): r["response"] for r in records(task, ALONE[spec])}
        mine = [r for r in calibrated if r["member"] == name]
        same = sum(alone.get(prompt_of(task, rows[r["example"]])[0]) == r["reply"] for r in mine)
        lines.append(f"{ALONE[spec]}: {same} of {len(mine)} replies identical to {task}/{ALONE[spec]}.jsonl")
    return "\n".join(lines)
