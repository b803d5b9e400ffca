"""Speed of the SpecEM engine against its floor, measured side by side in one run.

    python benchmarks/speed.py                                   # llama.cpp and transformers, T = 128, 512
    python benchmarks/speed.py --backend llamacpp --tokens 64 128 --naive-tokens 64

Prints (a) ensemble time for T tokens / the sum of each member's plain greedy ``generate``
time for the same T (target <= 1.15); (b) per-token cost at the largest vs the smallest T
(target growth <= 1.2x); (c) time to the first committed segment; (d) the same loop without
cache reuse (the authors' way: ``model.generate`` over the whole prefix every round and an
uncached verification pass), for comparison. Both loops run greedy with ``ignore_eos`` so every
run produces exactly T tokens of the first member (the naive loop may stop at EOS: its cost is
compared per token). With several backends, (e) compares the committed tokens/s of the default
pair on each backend with the first one, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

PROMPT = "Write a long, detailed essay about the history of the city of Rome, from its founding to today."


def plain_generate_seconds(member: Any, messages: list[dict[str, str]], tokens: int) -> float:
    """One member alone, greedy, exactly ``tokens`` new tokens: HF ``generate`` (KV cache) for a
    transformers member, a one-token-per-decode llama.cpp loop for a llama.cpp member."""
    from specem_core.backends.base import SessionRequest

    if hasattr(member.model, "n_ctx"):  # llama.cpp
        from specem_core.backends.llama_cpp import generate_greedy

        prompt = member.encode_prompt(SessionRequest(messages))
        start = time.perf_counter()
        out = generate_greedy(member.model, prompt, tokens, banned=sorted(member.stop_ids) + member.suppress_ids)
        elapsed = time.perf_counter() - start
        assert len(out) == tokens
        return elapsed
    import torch

    ids = torch.tensor([member.encode_prompt(SessionRequest(messages))], device=member.model.device)
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


def measure(backend: str, args: argparse.Namespace, messages: list[dict[str, str]]) -> dict[str, Any]:
    """Every figure of one backend (the members are loaded here and released at the end)."""
    from specem_core import SpecEM, SpecEMConfig
    from specem_core.reference import naive_generate
    from specem_core.registry import default_members

    members = default_members(backend=backend)
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
                "tokens_per_s": produced / result.seconds,
                "first_segment_s": result.first_segment_seconds,
                "rounds": len(result.segments),
                "wins": result.wins,
            }
        )
        print(
            f"[{backend}] T={t}: ensemble {result.seconds:.1f}s for {produced} tokens, floor {floor:.1f}s", flush=True
        )

    naive: dict[str, Any] | None = None
    if args.naive_tokens:
        start = time.perf_counter()
        drafting = "generate" if backend == "transformers" else "recompute"
        out = naive_generate(
            members, messages, segment_len=args.segment_len, max_new_tokens=args.naive_tokens, drafting=drafting
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
            "drafting": drafting,
        }
    small, large = rows[0], rows[-1]
    return {
        "backend": backend,
        "rows": rows,
        "naive": naive,
        "growth": large["s_per_token"] / small["s_per_token"],
        "members": [m.name for m in members],
    }


def report(res: dict[str, Any], segment_len: int) -> None:
    names = res["members"]
    rows = res["rows"]
    print()
    print(
        f"SpecEM speed [{res['backend']}] — members: {', '.join(names)}; segment_len {segment_len}; greedy, ignore_eos"
    )
    print(
        "| T | ensemble s | plain greedy s ("
        + " + ".join(names)
        + ") | (a) ensemble / floor | s per token | tokens/s | (c) first segment s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        plain_txt = " + ".join(f"{r['plain_s'][n]:.2f}" for n in names)
        print(
            f"| {r['tokens']} | {r['ensemble_s']:.2f} | {plain_txt} = {sum(r['plain_s'].values()):.2f} | "
            f"**{r['ratio_vs_floor']:.2f}** | {r['s_per_token']:.4f} | {r['tokens_per_s']:.1f} | "
            f"{r['first_segment_s']:.2f} |"
        )
    print()
    print(f"(b) per-token cost at T={rows[-1]['tokens']} / T={rows[0]['tokens']}: **{res['growth']:.2f}x**")
    naive = res["naive"]
    if naive is not None:
        print(
            f"(d) without cache reuse ({naive['drafting']} drafting), T={naive['tokens']}: {naive['seconds']:.1f}s for "
            f"{naive['produced']} tokens = {naive['s_per_token']:.3f} s/token, "
            f"**{naive['vs_engine_per_token']:.2f}x** the engine's per-token cost"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend", nargs="+", default=["llamacpp", "transformers"], choices=["llamacpp", "transformers"]
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--naive-tokens", type=int, default=128, help="0 skips the no-cache loop")
    parser.add_argument("--segment-len", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speed.json"))
    args = parser.parse_args()

    import gc

    messages = [{"role": "user", "content": PROMPT}]
    results = []
    for backend in args.backend:
        results.append(measure(backend, args, messages))
        gc.collect()
    cpu = platform.processor() or platform.machine()
    print()
    print(f"machine: {cpu}, {os.cpu_count()} CPUs")
    for res in results:
        report(res, args.segment_len)
    comparison: list[dict[str, Any]] = []
    if len(results) > 1:
        first = results[0]
        print()
        for other in results[1:]:
            for a, b in zip(first["rows"], other["rows"], strict=True):
                ratio = a["tokens_per_s"] / b["tokens_per_s"]
                comparison.append(
                    {"tokens": a["tokens"], "backends": [first["backend"], other["backend"]], "ratio": ratio}
                )
                print(
                    f"(e) T={a['tokens']}: committed tokens/s {first['backend']} {a['tokens_per_s']:.1f} vs "
                    f"{other['backend']} {b['tokens_per_s']:.1f} = **{ratio:.2f}x**"
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results, "comparison": comparison}, indent=2))


if __name__ == "__main__":
    main()
