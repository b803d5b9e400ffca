"""Speed of the SpecEM engine against its floor, measured side by side in one run.

    python benchmarks/speed.py                       # default models, T = 128 and 512
    python benchmarks/speed.py --tokens 64 128 --naive-tokens 64

Prints (a) ensemble time for T tokens / the sum of each member's plain greedy ``generate``
time for the same T (target <= 1.15); (b) per-token cost at the largest vs the smallest T
(target growth <= 1.2x); (c) time to the first committed segment; (d) the same loop without
cache reuse (the authors' way: ``model.generate`` over the whole prefix every round and an
uncached verification pass), for comparison. Both loops run greedy with ``ignore_eos`` so every
run produces exactly T tokens of the first member (the naive loop may stop at EOS: its cost is
compared per token).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

PROMPT = "Write a long, detailed essay about the history of the city of Rome, from its founding to today."


def plain_generate_seconds(member: Any, messages: list[dict[str, str]], tokens: int) -> float:
    """One member alone: HF ``generate`` (KV cache, greedy) for exactly ``tokens`` new tokens."""
    import torch

    from specem_core.backends.base import SessionRequest

    ids = torch.tensor([member.encode_prompt(SessionRequest(messages))])
    start = time.perf_counter()
    with torch.inference_mode():
        out = member.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=member.pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--naive-tokens", type=int, default=128, help="0 skips the no-cache loop")
    parser.add_argument("--segment-len", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speed.json"))
    args = parser.parse_args()

    import torch

    from specem_core import SpecEM, SpecEMConfig
    from specem_core.models import default_members
    from specem_core.reference import naive_generate

    members = default_members()
    messages = [{"role": "user", "content": PROMPT}]
    engine = SpecEM(members, SpecEMConfig(segment_len=args.segment_len, ignore_eos=True))
    # warm-up (allocator, kernels)
    engine.generate(messages, max_new_tokens=12)
    for m in members:
        plain_generate_seconds(m, messages, 8)

    rows: list[dict[str, Any]] = []
    for t in args.tokens:
        plain = {m.name: plain_generate_seconds(m, messages, t) for m in members}
        result = engine.generate(messages, max_new_tokens=t)
        produced = result.usage.completion_tokens
        floor = sum(plain.values()) * produced / t
        rows.append(
            {
                "tokens": t,
                "ensemble_tokens": produced,
                "ensemble_s": result.seconds,
                "plain_s": plain,
                "floor_s": floor,
                "ratio_vs_floor": result.seconds / floor,
                "s_per_token": result.seconds / produced,
                "first_segment_s": result.first_segment_seconds,
                "rounds": len(result.segments),
                "wins": result.wins,
            }
        )
        print(f"T={t}: ensemble {result.seconds:.1f}s for {produced} tokens, floor {floor:.1f}s", flush=True)

    naive: dict[str, Any] | None = None
    if args.naive_tokens:
        start = time.perf_counter()
        out = naive_generate(
            members, messages, segment_len=args.segment_len, max_new_tokens=args.naive_tokens, drafting="generate"
        )
        seconds = time.perf_counter() - start
        produced = len(members[0].encode_response(out.text))
        same = next((r for r in rows if r["tokens"] == args.naive_tokens), rows[0])
        naive = {
            "tokens": args.naive_tokens,
            "produced": produced,
            "seconds": seconds,
            "s_per_token": seconds / max(produced, 1),
            "vs_engine_per_token": (seconds / max(produced, 1)) / same["s_per_token"],
        }

    small, large = rows[0], rows[-1]
    growth = large["s_per_token"] / small["s_per_token"]
    names = [m.name for m in members]
    print()
    print(f"SpecEM speed — members: {', '.join(names)}; segment_len {args.segment_len}; greedy, ignore_eos")
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print()
    print(
        "| T | ensemble s | plain generate s ("
        + " + ".join(names)
        + ") | (a) ensemble / floor | s per token | (c) first segment s |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        plain_txt = " + ".join(f"{r['plain_s'][n]:.1f}" for n in names)
        print(
            f"| {r['tokens']} | {r['ensemble_s']:.1f} | {plain_txt} = {sum(r['plain_s'].values()):.1f} | "
            f"**{r['ratio_vs_floor']:.2f}** | {r['s_per_token']:.3f} | {r['first_segment_s']:.2f} |"
        )
    print()
    print(f"(b) per-token cost at T={large['tokens']} / T={small['tokens']}: **{growth:.2f}x**")
    if naive is not None:
        print(
            f"(d) without cache reuse (authors' way), T={naive['tokens']}: {naive['seconds']:.1f}s for "
            f"{naive['produced']} tokens = {naive['s_per_token']:.3f} s/token, "
            f"**{naive['vs_engine_per_token']:.2f}x** the engine's per-token cost"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "naive": naive, "growth": growth, "members": names}, indent=2))


if __name__ == "__main__":
    main()
