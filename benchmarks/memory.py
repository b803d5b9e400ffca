"""Resident memory of an ensemble on llama.cpp, measured in this process (Linux ``/proc``).

    python benchmarks/memory.py                                   # 1.5B + 0.5B + 135M
    python benchmarks/memory.py --members smollm2 qwen2.5-coder --concurrent 4

Prints the resident set (VmRSS) after the interpreter starts, after each member loads (weights are
memory-mapped: pages count once touched), after one answer, and after ``--concurrent`` answers at
the same time (each request holds one llama.cpp context per member), plus the peak (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

PROMPT = "Write a short paragraph about the history of Rome."


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder", "smollm2"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_llamacpp.json"))
    args = parser.parse_args()

    from specem_core import SpecEM, SpecEMConfig
    from specem_core.registry import load_member

    rows: list[dict[str, Any]] = [{"step": "interpreter + specem imported", "rss_mib": rss_mib()[0]}]
    members = []
    for spec in args.members:
        t0 = time.perf_counter()
        members.append(load_member(spec, backend="llamacpp"))
        rows.append(
            {"step": f"+ {members[-1].name} loaded", "rss_mib": rss_mib()[0], "load_s": time.perf_counter() - t0}
        )
    engine = SpecEM(members, SpecEMConfig(max_new_tokens=args.max_new_tokens))
    t0 = time.perf_counter()
    result = engine.generate(PROMPT)
    rows.append(
        {
            "step": f"after one answer ({result.usage.completion_tokens} tokens)",
            "rss_mib": rss_mib()[0],
            "seconds": time.perf_counter() - t0,
        }
    )
    threads = [threading.Thread(target=engine.generate, args=(PROMPT,)) for _ in range(args.concurrent)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows.append(
        {
            "step": f"after {args.concurrent} concurrent answers",
            "rss_mib": rss_mib()[0],
            "seconds": time.perf_counter() - t0,
        }
    )
    peak = rss_mib()[1]
    print(f"members: {', '.join(m.name for m in members)} (llama.cpp, GGUF as shipped)")
    print("| step | resident MiB |")
    print("|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['rss_mib']:.0f} |")
    print(f"peak resident (VmHWM): {peak:.0f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"members": [m.name for m in members], "rows": rows, "peak_mib": peak}, indent=2))


if __name__ == "__main__":
    main()
