"""Speed of the SpecEM engine against its floor, measured side by side in one run.

    python benchmarks/speed.py                                   # llama.cpp and transformers, T = 128, 512
    python benchmarks/speed.py --backend llamacpp --tokens 64 128 --naive-tokens 64
    python benchmarks/speed.py --repeats 3 --naive-tokens 0      # medians of 3 alternations
    python benchmarks/speed.py --preset quality --backend llamacpp   # another preset's members

Prints (a) ensemble time for T tokens / the sum of each member's plain greedy ``generate``
time for the same T (target <= 1.15); (b) per-token cost at the largest vs the smallest T
(target growth <= 1.2x); (c) time to the first committed segment; (d) the same loop without
cache reuse (the authors' way: ``model.generate`` over the whole prefix every round and an
uncached verification pass), for comparison. Both loops run greedy with ``ignore_eos`` so every
run produces exactly T tokens of the first member (the naive loop may stop at EOS: its cost is
compared per token). With several backends, (e) compares the committed tokens/s of the default
pair on each backend with the first one, measured in the same run. (f) splits each answer's time
by member and by call of the member protocol (``draft``, ``score``, ``commit``) next to that
member's floor: what the ensemble spends beyond the floor, and where. With ``--repeats N`` the
floor and the ensemble alternate N times and every figure is a median ((a) also shows its range):
on a small VM a single pair of runs moves (a) by 0.1-0.2. (g), llama.cpp only: what one
verification block costs in one-token decode steps on the member's kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from statistics import median
from typing import Any

PROMPT = "Write a long, detailed essay about the history of the city of Rome, from its founding to today."


def plain_generate_seconds(member: Any, messages: list[dict[str, str]], tokens: int) -> float:
    """One member alone, greedy, exactly ``tokens`` new tokens: HF ``generate`` (KV cache) for a
    transformers member, a one-token-per-decode llama.cpp loop for a llama.cpp member."""
    from specem_core.backends.base import SessionRequest

    if hasattr(member.model, "n_ctx"):  # llama.cpp
        from specem_core.testing.llama_cpp_diagnostics import generate_greedy

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


def block_costs(member: Any, messages: list[dict[str, str]], block: int, repeats: int = 9) -> dict[str, float] | None:
    """What verification costs a llama.cpp member's kernels: milliseconds of one decode step and of
    one ``block``-token call on the cached prompt, with every position's logit row (as verification
    reads them) and without (the body alone); medians of ``repeats``. None for other backends.

    Timed through the backend's own decode path (its context pool, row copies and log-probs), on
    the member the engine uses; ``llama_cpp_kernels.Probe.call_costs`` times bare C calls that read
    the last row only, which is what drafting pays, not verification."""
    if not hasattr(member.model, "n_ctx"):
        return None
    from specem_core.backends.base import SessionRequest
    from specem_core.backends.llama_cpp._binding import Work

    model = member.model
    prompt = member.encode_prompt(SessionRequest(messages))
    n = len(prompt)
    ctx = model.acquire_context()
    try:
        ctx.decode(Work(prompt, list(range(n)), [0] * n, [None] * (n - 1) + [-1]))
        tokens = (prompt * (block // n + 1))[:block]

        def ms(size: int, rows: bool) -> float:
            times = []
            for _ in range(repeats):
                outputs: list[int | None] = [-1] * size if rows else [None] * size
                start = time.perf_counter()
                ctx.decode(Work(tokens[:size], list(range(n, n + size)), [0] * size, outputs))
                times.append(1000 * (time.perf_counter() - start))
                ctx.truncate(0, n)
            return median(times)

        step, with_rows, without = ms(1, True), ms(block, True), ms(block, False)
    finally:
        model.release_context(ctx)
    return {"block": block, "step_ms": step, "block_ms": with_rows, "block_no_rows_ms": without}


class CallTimes:
    """Time spent in each member's ``draft`` / ``score`` / ``commit`` calls, told by the engine
    (:class:`specem_core.observers.MemberObserver`: nothing wraps the members)."""

    CALLS = ("draft", "score", "commit")

    def __init__(self, members: list[Any]) -> None:
        import threading

        self.members = members
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.seconds = {m.name: dict.fromkeys(self.CALLS, 0.0) for m in self.members}
            self.calls = {m.name: dict.fromkeys(self.CALLS, 0) for m in self.members}
            self._spans: list[tuple[float, float]] = []

    @property
    def overlapped(self) -> bool:
        """Whether two calls ever ran at once (members side by side): their seconds then overlap."""
        with self._lock:
            spans = sorted(self._spans)
        latest_end = float("-inf")
        for start, end in spans:
            if start < latest_end:
                return True
            latest_end = max(latest_end, end)
        return False

    def session_opened(self, member: str) -> None:
        return None

    def session_closed(self, member: str) -> None:
        return None

    def call_finished(self, call: Any) -> None:
        if call.stage not in self.CALLS:
            return
        with self._lock:
            self.seconds[call.member][call.stage] += call.seconds
            self.calls[call.member][call.stage] += 1
            self._spans.append((call.started, call.ended))


def measure(backend: str, args: argparse.Namespace, messages: list[dict[str, str]]) -> dict[str, Any]:
    """Every figure of one backend (the members are loaded here and released at the end)."""
    from specem_core import SpecEM, SpecEMConfig
    from specem_core.presets import preset_members
    from specem_core.testing.reference import naive_generate

    members = preset_members(args.preset, backend=backend)
    timings = CallTimes(members)
    engine = SpecEM(members, SpecEMConfig(segment_len=args.segment_len, ignore_eos=True), observers=[timings])
    # warm-up (allocator, kernels)
    engine.generate(messages, max_new_tokens=12)
    for m in members:
        plain_generate_seconds(m, messages, 8)

    rows: list[dict[str, Any]] = []
    for t in args.tokens:
        runs: list[dict[str, Any]] = []
        for _ in range(args.repeats):  # floor and ensemble alternate, so drift hits both
            plain = {m.name: plain_generate_seconds(m, messages, t) for m in members}
            timings.reset()
            result = engine.generate(messages, max_new_tokens=t)
            produced = result.usage.completion_tokens
            floor = sum(plain.values()) * produced / t
            runs.append(
                {
                    "ensemble_s": result.seconds,
                    "plain_s": plain,
                    "ratio_vs_floor": result.seconds / floor,
                    "first_segment_s": result.first_segment_seconds,
                    "call_seconds": {name: dict(v) for name, v in timings.seconds.items()},
                    "calls": {name: dict(v) for name, v in timings.calls.items()},
                    "calls_overlapped": timings.overlapped,
                }
            )
            print(
                f"[{backend}] T={t}: ensemble {result.seconds:.1f}s for {produced} tokens, floor {floor:.1f}s",
                flush=True,
            )
        ensemble_s = median(r["ensemble_s"] for r in runs)
        plain = {m.name: median(r["plain_s"][m.name] for r in runs) for m in members}
        ratios = [r["ratio_vs_floor"] for r in runs]
        rows.append(
            {
                "tokens": t,
                "ensemble_tokens": produced,  # greedy: every repeat gives the same answer
                "ensemble_s": ensemble_s,
                "plain_s": plain,
                "floor_s": sum(plain.values()) * produced / t,
                "ratio_vs_floor": median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "s_per_token": ensemble_s / produced,
                "tokens_per_s": produced / ensemble_s,
                "first_segment_s": median(r["first_segment_s"] for r in runs),
                "rounds": len(result.segments),
                "wins": result.wins,
                "call_seconds": {
                    name: {c: median(r["call_seconds"][name][c] for r in runs) for c in CallTimes.CALLS}
                    for name in plain
                },
                "calls": runs[-1]["calls"],
                "calls_overlapped": any(r["calls_overlapped"] for r in runs),
                "usage": [vars(u) for u in result.usage.per_member],
                "repeats": runs,
            }
        )

    blocks = {m.name: block_costs(m, messages, args.segment_len) for m in members}
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
        "preset": args.preset,
        "members": [m.name for m in members],
        "block_costs": {name: cost for name, cost in blocks.items() if cost is not None},
    }


def _spread(row: dict[str, Any]) -> str:
    """The ratio's range over the repeats, when there were several."""
    if len(row.get("repeats", ())) < 2:
        return ""
    low, high = row["ratio_range"]
    return f" ({low:.2f}–{high:.2f})"


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
            f"**{r['ratio_vs_floor']:.2f}**{_spread(r)} | {r['s_per_token']:.4f} | {r['tokens_per_s']:.1f} | "
            f"{r['first_segment_s']:.2f} |"
        )
    print()
    print(f"(b) per-token cost at T={rows[-1]['tokens']} / T={rows[0]['tokens']}: **{res['growth']:.2f}x**")
    print()
    print(f"(f) where an answer's time goes [{res['backend']}]: seconds in each member's calls next to its floor")
    print(
        "| T | member | floor s | draft s (calls) | score s (calls) | commit s (calls) | "
        "drafted / reused tokens | beyond floor s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    overlapped = any(r["calls_overlapped"] for r in rows)
    for r in rows:
        scale = r["ensemble_tokens"] / r["tokens"]
        usage = {u["member"]: u for u in r["usage"]}
        for name in names:
            sec, calls = r["call_seconds"][name], r["calls"][name]
            floor = r["plain_s"][name] * scale
            beyond = "–" if r["calls_overlapped"] else f"{sum(sec.values()) - floor:+.2f}"
            u = usage.get(name, {})
            print(
                f"| {r['tokens']} | {name} | {floor:.2f} | "
                + " | ".join(f"{sec[c]:.2f} ({calls[c]})" for c in CallTimes.CALLS)
                + f" | {u.get('drafted_tokens', 0)} / {u.get('reused_tokens', 0)} | {beyond} |"
            )
        if not r["calls_overlapped"]:
            other = r["ensemble_s"] - sum(sum(r["call_seconds"][n].values()) for n in names)
            print(f"| {r['tokens']} | (engine: vote, text, stops) | – | – | – | – | – | {other:+.2f} |")
    if overlapped:
        print(
            "Members ran their calls side by side (one device each, or a backend that overlaps them), "
            "so their seconds overlap and do not add up to the answer's time."
        )
    for name, cost in res.get("block_costs", {}).items():
        print(
            f"(g) {name}: a {cost['block']}-token block on the cached prompt with its logit rows (a verification "
            f"pass) {cost['block_ms']:.1f} ms = **{cost['block_ms'] / cost['step_ms']:.1f}** one-token steps "
            f"({cost['step_ms']:.1f} ms); without rows {cost['block_no_rows_ms']:.1f} ms"
        )
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
    parser.add_argument(
        "--preset",
        default="paper",
        help="whose members run (default paper: SmolLM2-135M + Qwen2.5-Coder-0.5B, the published figures' pair)",
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--naive-tokens", type=int, default=128, help="0 skips the no-cache loop")
    parser.add_argument("--segment-len", type=int, default=10)
    parser.add_argument(
        "--repeats", type=int, default=1, help="floor and ensemble alternate this many times; medians are reported"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speed.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

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
