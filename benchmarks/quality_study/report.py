"""Reports of the recorded runs: the Markdown tables (``summary.md``/``summary.json``), the learned
weights, the plot, and the presets' measured results (package data)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specem_core.calibration import sign_test

from . import configs, tasks
from .configs import _alone_configs
from .tasks import IFEVAL_KEYS, first_rows, load_rows, measure, passes, records


def _cell(value: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def table(task: str, figures: dict[str, dict[str, float]]) -> str:
    if task == "ifeval":
        head = "| configuration | n | prompt strict | prompt loose | instr. strict | instr. loose "
        keys: tuple[str, ...] = IFEVAL_KEYS
    elif task == "gsm8k":
        head = "| configuration | n | accuracy | cut at the cap "
        keys = ("accuracy", "cut")
    elif task == "humaneval":
        head = "| configuration | n | pass@1 | cut at the cap "
        keys = ("pass_at_1", "cut")
    else:
        head = "| configuration | n | accuracy | no letter named "
        keys = ("accuracy", "no_letter")
    head += "| s / prompt | drafters / round | share of wins |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, f in figures.items():
        shares = [(k.split(":", 1)[1], v) for k, v in f.items() if k.startswith("wins:")]
        ordered = sorted(shares, key=lambda x: -x[1])
        share = ", ".join(f"{_short(m)} {v:.0f}%" for m, v in ordered) if len(shares) > 1 else "–"
        cells = [name, str(int(f["n"]))] + [_cell(f.get(k)) for k in keys]
        cells += [_cell(f.get("seconds")), _cell(f.get("drafters"), "{:.2f}"), share]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(member: str) -> str:
    """Short member names for tables: qwen2.5-coder-1.5b-instruct -> 1.5b, smollm2-135m-instruct -> smol."""
    if member.startswith("smollm2"):
        return "smol"
    m = re.search(r"(\d+(?:\.\d+)?b)-instruct$", member)
    return m.group(1) if m else member


def report() -> str:
    """Markdown tables: every configuration on the prompts it shares with the others, and full-set rows."""
    sections = []
    figures_for_plot: dict[str, dict[str, dict[str, float]]] = {}
    for task, title in (
        ("gsm8k", f"GSM8K dev ({tasks.TASKS['gsm8k']} new tokens)"),
        ("ifeval", f"IFEval ({tasks.TASKS['ifeval']} new tokens)"),
        ("arc", f"ARC-Easy ({tasks.TASKS['arc']} new tokens)"),
        ("humaneval", f"HumanEval ({tasks.TASKS['humaneval']} new tokens, graded in a sandbox)"),
    ):
        all_recs = {name: records(task, name) for name in configs.CONFIGS}
        all_recs = {name: recs for name, recs in all_recs.items() if recs}
        if not all_recs:
            continue
        full = len(load_rows(task, None))
        complete = {name: recs for name, recs in all_recs.items() if len(recs) >= full}
        if complete:
            figs = {name: measure(task, recs) for name, recs in complete.items()}
            sections.append(f"### {title}: all {full} prompts\n\n" + table(task, figs))
            compare = paired(task, complete)
            figures_for_plot[task] = {name: {**f, **compare(name)} for name, f in figs.items()}
        # one table per run length: the configurations that ran at least the first n prompts
        lengths = sorted({len(recs) for recs in all_recs.values() if len(recs) < full}, reverse=True)
        for n in lengths:
            group = {name: recs for name, recs in all_recs.items() if len(recs) >= n}
            if len(group) < 2 and n != lengths[-1]:
                continue
            figs = {name: measure(task, first_rows(task, recs, n)) for name, recs in group.items()}
            who = "every configuration" if len(group) == len(all_recs) else "the configurations that ran them"
            sections.append(f"### {title}: first {n} prompts, {who}\n\n" + table(task, figs))
            figures_for_plot.setdefault(task, figs)
            figures_for_plot.setdefault(task + "-subset", figs)
    learned = weights_table()
    if learned:
        sections.append(learned)
    text = "\n\n".join(sections)
    tasks.RESULTS.mkdir(parents=True, exist_ok=True)
    (tasks.RESULTS / "summary.md").write_text(text + "\n")
    (tasks.RESULTS / "summary.json").write_text(json.dumps(figures_for_plot, indent=1) + "\n")
    plot(figures_for_plot)
    return text


def weights_table() -> str:
    """Where the weights learned across requests started (the prior), where they ended, and after
    how many requests they stopped moving by more than 0.02."""
    from specem_core.weights import MemberWeights

    lines = []
    for task in tasks.TASKS:
        for path in sorted((tasks.RESULTS / task).glob("*.weights.json")) if (tasks.RESULTS / task).is_dir() else []:
            state = MemberWeights.load(path)
            names = sorted(state.current())
            prior = MemberWeights(state.prior, learning_rate=0.0).start(names)
            final = state.current()
            cells = [
                task,
                path.name.removesuffix(".weights.json"),
                ", ".join(f"{_short(n)} {w:.2f}" for n, w in zip(names, prior, strict=True)),
                ", ".join(f"{_short(n)} {final[n]:.2f}" for n in names),
                str(state.requests),
                str(state.settled_after() or "–"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = "| task | configuration | prior weights | learned weights | requests with a vote | settled after |"
    return "### Verifier weights learned across requests\n\n" + "\n".join([head, "|---|---|---|---|---|---|", *lines])


_PANEL_TITLES = {
    "gsm8k": "GSM8K dev",
    "gsm8k-subset": "GSM8K dev, the prompts every configuration ran",
    "ifeval": "IFEval dev, prompt strict",
    "arc": "ARC-Easy validation (held out)",
    "humaneval": "HumanEval, pass@1",
}


def plot(figures: dict[str, dict[str, dict[str, float]]]) -> None:
    """The headline metric of every configuration, one panel per set stacked in a column (skipped
    without matplotlib): horizontal bars labelled with their value, members alone in grey, the
    shipped presets' configurations in orange, and a dashed line at the best member alone. Sized to
    stay readable at the docs' content width (about 700 px)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from specem_core.presets import PRESETS

    panels = [(k, v) for k, v in figures.items() if v]
    if not panels:
        return
    alone = {n for n, spec in configs.CONFIGS.items() if len(spec["members"]) == 1}
    # the shipped presets' configurations (a preset's records may carry an older study name)
    shipped = {getattr(p, "study_name", None) or p.name for p in PRESETS.values()}
    colours = {"alone": "#9a9a9a", "shipped": "#e07b39", "study": "#3b6fb6"}
    bar_in, panel_in, legend_in = 0.21, 0.75, 0.35  # inches per bar, per panel (title, axis), legend
    heights = [len(figs) * bar_in + panel_in for _, figs in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(7.2, sum(heights) + legend_in),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, (task, figs) in zip(axes[:, 0], panels, strict=True):
        metric = HEADLINE.get(task.split("-")[0], "accuracy")  # gsm8k-subset: accuracy; humaneval: pass@1
        names = list(figs)
        values = [figs[n].get(metric, 0.0) for n in names]
        kinds = ["alone" if n in alone else "shipped" if n in shipped else "study" for n in names]
        colors = [colours[k] for k in kinds]
        rows = range(len(names))
        ax.barh(rows, values, color=colors, height=0.7)
        ax.set_yticks(list(rows), names, fontsize=9)
        ax.invert_yaxis()  # the study's order, top to bottom
        for row, value in zip(rows, values, strict=True):
            ax.text(value + 0.5, row, f"{value:.1f}", va="center", fontsize=8)
        best = max((n for n in names if n in alone), key=lambda n: figs[n].get(metric, 0.0), default=None)
        if best is not None:
            ax.axvline(figs[best].get(metric, 0.0), color="#444444", linestyle="--", linewidth=0.8)
        n = int(next(iter(figs.values()))["n"])
        reference = f"; dashed: {best} alone" if best is not None else ""
        ax.set_title(f"{_PANEL_TITLES.get(task, task)} (n = {n}), %{reference}", fontsize=10, loc="left")
        ax.set_xlim(0, max(values) * 1.12 + 1)
        ax.tick_params(axis="x", labelsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    labels = {"alone": "a member alone", "shipped": "a shipped preset's setting", "study": "a study configuration"}
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in labels]
    fig.legend(handles, list(labels.values()), loc="upper center", ncol=3, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - legend_in / (sum(heights) + legend_in)))
    fig.savefig(tasks.RESULTS / "quality.png", dpi=120)
    plt.close(fig)


HEADLINE = {"ifeval": "prompt_level_strict", "gsm8k": "accuracy", "arc": "accuracy", "humaneval": "pass_at_1"}


def paired(task: str, complete: dict[str, list[dict[str, Any]]]) -> Callable[[str], dict[str, Any]]:
    """For a configuration's name, its paired comparison with the best member alone on the same
    (whole) set: ``vs``, ``gained`` / ``lost`` (prompts exactly one of the two got right) and the
    sign test's ``p``; ``{}`` for a member alone. The best member is found once per set."""
    alone = [n for n, spec in configs.CONFIGS.items() if len(spec["members"]) == 1 and not spec.get("draft_only")]
    singles = {n: passes(task, complete[n]) for n in alone if n in complete}
    best = max(singles, key=lambda n: sum(singles[n].values())) if singles else None

    def compare(name: str) -> dict[str, Any]:
        if best is None or name in alone:
            return {}
        ours, theirs = passes(task, complete[name]), singles[best]
        gained = sum(ours[k] and not theirs[k] for k in ours)
        lost = sum(theirs[k] and not ours[k] for k in ours)
        return {"vs": best, "gained": gained, "lost": lost, "p": round(sign_test(gained, lost), 4)}

    return compare


def preset_results() -> str:
    """Every preset's records beside its best member alone on the same prompts (paired gained /
    lost prompts, sign-test p) and, where a side-by-side ``cost`` run exists, its time against that
    member; written to ``specem_core/data/preset_results.json`` (what ``specem presets`` shows) and
    as the table between the ``preset-results`` markers of README.md and docs/reports/quality.md."""
    from specem_core.presets import PRESETS

    table: dict[str, dict[str, Any]] = {}
    lines = []
    for name, preset in PRESETS.items():
        out: dict[str, Any] = {}
        for task, metric in HEADLINE.items():
            recs = records(task, name)
            n = len(recs)
            mine = first_rows(task, recs, n)
            if not n or len(mine) < n:  # no run, or not the first n prompts of the set
                continue
            alone = {c: first_rows(task, records(task, c), n) for c in _alone_configs(preset)}
            alone = {c: r for c, r in alone.items() if len(r) == n}
            if not alone:
                continue
            scores = {c: measure(task, r)[metric] for c, r in alone.items()}
            best = max(scores, key=lambda c: scores[c])
            ours, theirs = passes(task, mine), passes(task, alone[best])
            gained = sum(ours[k] and not theirs[k] for k in ours)
            lost = sum(theirs[k] and not ours[k] for k in ours)
            entry = {
                metric: round(measure(task, mine)[metric], 2),
                "n": n,
                "best_member": round(scores[best], 2),
                "best_member_config": best,
                "gained": gained,
                "lost": lost,
                "p": round(sign_test(gained, lost), 4),
            }
            cost_file = tasks.RESULTS / task / f"cost_{name}_vs_{best}.json"
            if cost_file.exists():
                timing = json.loads(cost_file.read_text())
                entry["time_vs_best_member"] = round(timing["ratio_per_answer"], 3)
                entry["time_prompts"] = timing["prompts"]
            out[task] = entry
            lines.append(f"{name} on {task}: {entry[metric]} against {best} {entry['best_member']} (n={n})")
        selected = tasks.RESULTS / f"selection_{name}.json"
        if selected.exists():  # the out-of-fold figure (quality_study/selection.py)
            sel = json.loads(selected.read_text())
            out["out_of_fold"] = {
                "k": sel["k"],
                "reference": sel["reference"],
                "candidates": sel["candidates"],
                "chosen_on_all_folds": sel["chosen_on_all_folds"],
                **sel["out_of_fold"],
                "source": str(selected.relative_to(tasks.ROOT)),
            }
            lines.append(f"{name} out of fold: {sel['out_of_fold']}")
        table[name] = out
    target = configs.PACKAGE_DATA / "preset_results.json"
    target.write_text(json.dumps(table, indent=1) + "\n")
    written = [target]
    markdown = preset_table(table)
    for doc in (tasks.ROOT / "README.md", tasks.ROOT / "docs" / "reports" / "quality.md"):
        if doc.exists() and _replace_between(doc, "preset-results", markdown):
            written.append(doc)
    return "\n".join([*lines, *(f"wrote {p.relative_to(tasks.ROOT)}" for p in written)])


def preset_table(results: dict[str, dict[str, Any]]) -> str:
    """The presets' results as a Markdown table: score (n) against the best member alone on the
    same prompts, gained / lost and p, and the time against that member where it was measured."""
    head = (
        "| preset | out of fold, against the best member alone (GSM8K; IFEval) | IFEval prompt strict "
        "| GSM8K accuracy | ARC-Easy accuracy | HumanEval pass@1 | time vs the best member alone |"
    )
    rows = [head, "|---|---|---|---|---|---|---|"]
    for name, tasks_ in results.items():
        cells = [f"`{name}`"]
        oof = tasks_.get("out_of_fold")
        if oof:
            shown = [
                f"{oof[t]['score']:.1f} vs {oof[t]['reference']:.1f} (+{oof[t]['gained']} / −{oof[t]['lost']}, "
                f"95% CI {oof[t]['ci95'][0]:+.1f} to {oof[t]['ci95'][1]:+.1f})"
                for t in ("gsm8k", "ifeval")
            ]
            where = f"{oof['k']} folds, {oof['reference']} alone; chosen: {oof['chosen_on_all_folds']}"
            cells.append("; ".join(shown) + f" ({where})")
        else:
            cells.append("not run")
        for task in ("ifeval", "gsm8k", "arc", "humaneval"):
            f = tasks_.get(task)
            if f is None:
                cells.append("not measured")
                continue
            metric = HEADLINE[task]
            cells.append(
                f"{f[metric]:.1f} vs {f['best_member']:.1f} ({f['best_member_config']} alone; n = {f['n']}; "
                f"+{f['gained']} / −{f['lost']}, p = {f['p']:.2f})"
            )
        timed = [f"{f['time_vs_best_member']:.2f}× ({t}, {f['time_prompts']} prompts side by side)"
                 for t, f in tasks_.items() if t != "out_of_fold" and "time_vs_best_member" in f]  # fmt: skip
        cells.append("; ".join(timed) or "not measured")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _replace_between(path: Path, marker: str, text: str) -> bool:
    """Replace what lies between ``<!-- MARKER:start -->`` and ``<!-- MARKER:end -->`` in ``path``."""
    content = path.read_text()
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    if start not in content or end not in content:
        return False
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{text}\n{end}{tail}")
    return True
