"""Speculative drafting on the round's earlier candidates (``SpecEMConfig.reuse_other_drafts``), on and
off, side by side in one run.

    python benchmarks/draft_hints.py                                        # default pair, T = 256
    python benchmarks/draft_hints.py --members qwen2.5-coder-1.5b qwen2.5-coder --tokens 256

Greedy with ``ignore_eos``, llama.cpp members, alternating on / off ``--repeats`` times after one
warm-up. Prints seconds per answer, the on / off ratio, and how many of each member's drafted
tokens it took from an earlier candidate's rows instead of a decode step.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

PROMPT = "Write a long, detailed essay about the history of the city of Rome, from its founding to today."


def main() -> None:
    from specem_core import SpecEM, SpecEMConfig
    from specem_core.registry import load_member

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", nargs="+", default=["smollm2", "qwen2.5-coder"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_hints.json"))
    args = parser.parse_args()

    members = [load_member(f"llamacpp:{name}") for name in args.members]
    messages = [{"role": "user", "content": PROMPT}]
    config = SpecEMConfig(segment_len=10, ignore_eos=True, max_new_tokens=args.tokens)
    SpecEM(members, config).generate(messages, max_new_tokens=12)  # warm-up
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for hints in (False, True):
            engine = SpecEM(members, config.replace(reuse_other_drafts=hints))
            start = time.perf_counter()
            result = engine.generate(messages)
            seconds = time.perf_counter() - start
            usage = {
                u.member: {"drafted": u.drafted_tokens, "reused": u.reused_tokens} for u in result.usage.per_member
            }
            tokens = result.usage.completion_tokens
            runs.append({"draft_hints": hints, "seconds": seconds, "tokens": tokens, "usage": usage})
            print(f"reuse_other_drafts={hints!s:5} {seconds:6.2f}s  {usage}", flush=True)
    off = [r["seconds"] for r in runs if not r["draft_hints"]]
    on = [r["seconds"] for r in runs if r["draft_hints"]]
    ratio = (sum(on) / len(on)) / (sum(off) / len(off))
    last = runs[-1]["usage"]
    reuse = {m: u["reused"] / max(u["drafted"], 1) for m, u in last.items()}
    print(f"\nmembers {', '.join(m.name for m in members)}; T={args.tokens}; machine {platform.machine()}")
    print(f"mean s/answer: off {sum(off) / len(off):.2f}, on {sum(on) / len(on):.2f}; on / off = **{ratio:.2f}**")
    print("share of drafted tokens reused: " + ", ".join(f"{m} {100 * v:.0f}%" for m, v in reuse.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"members": args.members, "tokens": args.tokens, "on_over_off": ratio, "reused_share": reuse}
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    previous[",".join(args.members)] = {"runs": runs, "summary": summary}
    args.out.write_text(json.dumps(previous, indent=2))


if __name__ == "__main__":
    main()
