"""The transformers backend on a CUDA GPU: exactness, then speed against its floor.

    python benchmarks/gpu_check.py --models DIR [DIR ...] --out results.json

Each ``DIR`` holds a model's ``config.json`` and tokenizer files (no weights needed: the weights
are random, drawn with a fixed seed, so the check runs where the packaged weights cannot be
copied). Exactness: in fp32 on the GPU, cached scores equal a full recomputation
(``specem_core.testing.reference.naive_scores``) and the faithful engine makes the naive loop's decisions.
Speed: in bf16, the ensemble's time for T tokens against the sum of each member's own greedy
``generate`` for T tokens (the floor; ``benchmarks/speed.py``'s figure (a)), greedy with
``ignore_eos``. Random weights produce meaningless text; the work per token is that of the real
architecture and vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

MESSAGES = [{"role": "user", "content": "Write a long, detailed essay about the history of Rome."}]


def load(directory: Path, dtype: Any, name: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specem_core.backends.transformers import TransformersMember

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(directory)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return TransformersMember(model, tokenizer, name=name)


def exactness(dirs: list[Path]) -> dict[str, Any]:
    import torch

    from specem_core import Candidate, SamplingParams, SessionRequest, SpecEM, SpecEMConfig
    from specem_core.testing.reference import naive_generate, naive_scores

    members = [load(d, torch.float32, f"{d.name}-fp32") for d in dirs]
    worst = 0.0
    request = SessionRequest(MESSAGES)
    for m in members:
        session = m.open(request)
        prompt = m.encode_prompt(request)
        for _ in range(4):
            d = session.draft(6, SamplingParams())
            cands = [
                Candidate("self", d.text, d.ended),
                Candidate("x", " hello wor", False),
                Candidate("y", "ld!", True),
            ]
            got = session.score(cands, score_eos=True)
            want = naive_scores(m, prompt, session._text, [(c.text, c.ended) for c in cands], True)
            for g, (logit, logprob) in zip(got, want, strict=True):
                worst = max(worst, abs((g.mean_logit or 0.0) - logit), abs((g.mean_logprob or 0.0) - logprob))
            session.commit(cands[1].text if d.ended else d.text)
        session.close()
    engine = SpecEM(members, SpecEMConfig(reproduce_paper=True, segment_len=6, max_new_tokens=36))
    got_run = engine.generate(MESSAGES)
    want_run = naive_generate(members, MESSAGES, segment_len=6, max_new_tokens=36)
    same = got_run.text == want_run.text and [s.winner_index for s in got_run.segments] == [
        r.winner for r in want_run.rounds
    ]
    out = {"max_score_difference_fp32": worst, "faithful_equals_naive": same, "rounds": len(got_run.segments)}
    print(f"exactness (fp32, cuda): {out}", flush=True)
    return out


def speed(dirs: list[Path], tokens: list[int]) -> dict[str, Any]:
    import torch
    from speed import plain_generate_seconds

    from specem_core import SpecEM, SpecEMConfig

    members = [load(d, torch.bfloat16, d.name) for d in dirs]
    engine = SpecEM(members, SpecEMConfig(segment_len=10, ignore_eos=True))
    engine.generate(MESSAGES, max_new_tokens=24)
    for m in members:
        plain_generate_seconds(m, MESSAGES, 8)
    rows = []
    for t in tokens:
        plain = {m.name: plain_generate_seconds(m, MESSAGES, t) for m in members}
        torch.cuda.synchronize()
        result = engine.generate(MESSAGES, max_new_tokens=t)
        produced = result.usage.completion_tokens
        floor = sum(plain.values()) * produced / t
        row = {
            "tokens": t,
            "ensemble_s": result.seconds,
            "plain_s": plain,
            "ratio_vs_floor": result.seconds / floor,
            "tokens_per_s": produced / result.seconds,
            "first_segment_s": result.first_segment_seconds,
        }
        rows.append(row)
        print(f"speed (bf16, cuda) T={t}: {json.dumps(row)}", flush=True)
    growth = (rows[-1]["ensemble_s"] / tokens[-1]) / (rows[0]["ensemble_s"] / tokens[0])
    return {"rows": rows, "per_token_growth": growth, "scheduling": scheduling(members, tokens[0])}


def scheduling(members: list[Any], tokens: int) -> dict[str, Any]:
    """One request, ``tokens`` tokens, under three schedulings of the members on one GPU, side by
    side: the backend's (one after another, passes through the device queue), the members drafting
    side by side in threads through the queue (the backend's choice on a CPU), and no queue
    (``request_batch_size=1``). The answers must be the same text."""
    import torch

    from specem_core import SpecEM, SpecEMConfig
    from specem_core.backends.transformers import TransformersMember

    config = SpecEMConfig(segment_len=10, ignore_eos=True)
    chosen = TransformersMember.concurrency_key
    batch_sizes = [m.request_batch_size for m in members]
    out: dict[str, Any] = {}
    texts = set()
    for label in ("backend", "side_by_side", "unqueued"):
        if label == "side_by_side":  # the key the backend gives members on a CPU
            TransformersMember.concurrency_key = property(TransformersMember._model_key)  # type: ignore[assignment]
        for m, size in zip(members, batch_sizes, strict=True):
            m.request_batch_size = 1 if label == "unqueued" else size
        try:
            engine = SpecEM(members, config)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            result = engine.generate(MESSAGES, max_new_tokens=tokens)
        finally:
            TransformersMember.concurrency_key = chosen  # type: ignore[method-assign]
        texts.add(result.text)
        out[label] = {"seconds": result.seconds, "tokens_per_s": result.usage.completion_tokens / result.seconds}
        print(f"scheduling T={tokens} {label}: {json.dumps(out[label])}", flush=True)
    for m, size in zip(members, batch_sizes, strict=True):
        m.request_batch_size = size
    out["same_text"] = len(texts) == 1
    return out


def prefix_cache(dirs: list[Path], context_words: int = 1500) -> dict[str, Any]:
    """A follow-up turn over a long context, with and without the prefix cache (bf16): the same
    greedy text, and the follow-up's seconds and prefilled tokens side by side."""
    import torch

    from specem_core import SpecEM, SpecEMConfig

    context = " ".join(f"fact{i} is {i * 7 % 100}." for i in range(context_words // 3))
    out: dict[str, Any] = {}
    # the second pass is the one reported: the first warms CUDA's kernels for both shapes (a
    # cached follow-up runs a short query over a long cache, a fresh one a long prefill)
    for cache in (True, False, True, False):
        members = [load(d, torch.bfloat16, d.name) for d in dirs]
        for m in members:
            m.prefix_cache = cache
        engine = SpecEM(members, SpecEMConfig(max_new_tokens=32, ignore_eos=True))
        messages = [{"role": "system", "content": context}, {"role": "user", "content": "What is fact3?"}]
        first = engine.generate(messages)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And fact5?"}]
        torch.cuda.synchronize()
        second = engine.generate(messages)
        torch.cuda.synchronize()
        out["after" if cache else "before"] = {
            "turn1_seconds": first.seconds,
            "turn2_seconds": second.seconds,
            "turn2_prompt_tokens": second.usage.prompt_tokens,
            "turn2_cached_tokens": [u.cached_tokens for u in second.usage.per_member],
            "turn2_prefilled_tokens": [u.prefilled_tokens for u in second.usage.per_member],
            "texts": [first.text, second.text],
        }
    out["same_text"] = out["after"]["texts"] == out["before"]["texts"]
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    parser.add_argument("--only", choices=["prefix_cache"], help="run one section")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    if args.only == "prefix_cache":
        report = {"device": torch.cuda.get_device_name(0), "prefix_cache": prefix_cache(args.models)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        return
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "exactness": exactness(args.models),
        "speed": speed(args.models, args.tokens),
        "prefix_cache": prefix_cache(args.models),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
