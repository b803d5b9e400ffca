"""Decoding speed when other processes keep the CPU busy, side by side in one run.

    python benchmarks/contention.py                 # alone on the machine: every row, 0 / 1 / all cores busy
    python benchmarks/contention.py --before        # plus SpecEM with the old fixed thread count
    python benchmarks/contention.py --rows one pair --busy 0 2 --runs 3
    python benchmarks/contention.py --smoke         # seconds: 4 tokens, idle and all cores busy

Busy cores are taken by ``python -c "while True: pass"`` processes, one per core, started before a
level's runs and killed after them. Rows (greedy, ``--tokens`` new tokens each, the same prompt):

- ``peer``: llama-cpp-python's ``Llama`` on the packaged GGUF of ``--model`` (the peer a user would
  pick), ``n_threads`` = the CPUs available (at most 8), sampling with ``temp=0``;
- ``one``: SpecEM with that model as its only member (``ignore_eos``, the llama.cpp backend's
  default threads: ``n_threads="auto"``, which follow the cores other processes leave free);
- ``pair``: the ``paper`` preset (SmolLM2-135M + Qwen2.5-Coder-0.5B), default threads;
- with ``--before``, ``one-fixed`` and ``pair-fixed``: the same with ``n_threads`` pinned to the
  CPUs available, which was the default before issue #63 (so one build records before and after).

Within a level the rows take turns (peer, one, pair, peer, ...) ``--runs`` times after one short
warm-up each, so drift hits all of them. A run stops after ``--cell-seconds`` (a collapsing row
would take minutes): its tokens/s is then what it produced by that time. Prints tokens/s per run and
each row's slowdown against its own speed alone (median runs); the goal of issue #63 is at most
~4x with every core busy (a fair share of 2 cores is 2-3x). Each SpecEM run's record also says how
many decodes of each member ran with each thread count.
Writes ``benchmarks/results/contention.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "contention.json"
PROMPT = "Write a long, detailed essay about the history of the city of Rome, from its founding to today."
ROWS = ["peer", "one", "pair"]
BEFORE_ROWS = ["one-fixed", "pair-fixed"]
HOG = "while True: pass"

Runner = Callable[[int, float], dict[str, Any]]
"""``run(tokens, deadline)``: one generation of ``tokens`` tokens (stopped at ``deadline``, a
``time.perf_counter`` value) -> ``{"tokens", "seconds", "stopped"}``."""


def _die_with_parent() -> None:
    """In a hog, before it runs: killed when this script dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux: busy_cores' finally still kills them
        pass


@contextmanager
def busy_cores(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes spinning on the CPU while the block runs (killed at its end, whatever happens)."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=_die_with_parent) for _ in range(count)]
    try:
        if hogs:
            time.sleep(0.5)  # let them reach the CPU (and a load measurement window pass)
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def peer_runner(model: str, prompt: list[int], threads: int) -> Runner:
    """llama-cpp-python's ``Llama``: greedy, one token per step, ``tokens`` tokens (EOS ignored)."""
    from llama_cpp import Llama

    from specem_core.models import find_packaged, packaged_gguf

    packaged = find_packaged(model)
    assert packaged is not None, model
    path = str(packaged_gguf(packaged))
    llm: Any = Llama(path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(tokens: int, deadline: float) -> dict[str, Any]:
        llm.reset()  # each run reads its prompt, as SpecEM's runs do (its prefix cache aside)
        start = time.perf_counter()
        produced = 0
        stopped = False
        for _ in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
            produced += 1
            if produced >= tokens:
                break
            if time.perf_counter() > deadline:
                stopped = True
                break
        return {"tokens": produced, "seconds": time.perf_counter() - start, "stopped": stopped}

    return run


def specem_runner(engine: Any, messages: list[dict[str, str]]) -> Runner:
    """A SpecEM engine whose config has ``ignore_eos``: every run commits ``tokens`` tokens; its
    record also says how many decodes of each member ran with each thread count."""
    first = engine.members[0]
    models = [m.model for m in engine.members]

    def run(tokens: int, deadline: float) -> dict[str, Any]:
        before = [dict(m.decodes_by_threads) for m in models]
        start = time.perf_counter()
        text: list[str] = []
        produced = None
        stopped = False
        for event in engine.stream(messages, max_new_tokens=tokens):
            text.append(event.delta)
            if event.done and event.result is not None:
                produced = event.result.usage.completion_tokens
            elif time.perf_counter() > deadline:
                stopped = True
                break
        seconds = time.perf_counter() - start
        if produced is None:  # stopped early: count what was committed
            produced = len(first.encode_response("".join(text)))
            stopped = produced < tokens
        threads = {
            m.name: {
                str(n): count - was.get(n, 0)
                for n, count in sorted(m.decodes_by_threads.items())
                if count > was.get(n, 0)
            }
            for m, was in zip(models, before, strict=True)
        }
        return {"tokens": produced, "seconds": seconds, "stopped": stopped, "decode_threads": threads}

    return run


def build_rows(names: list[str], model: str, messages: list[dict[str, str]]) -> dict[str, Runner]:
    """Each row's runner."""
    from specem_core import SpecEM, SpecEMConfig
    from specem_core.backends.base import SessionRequest
    from specem_core.backends.llama_cpp import default_threads
    from specem_core.registry import load_member

    fixed = default_threads()  # the old default: the CPUs available, at most 8
    runners: dict[str, Runner] = {}
    for name in names:
        threads: dict[str, Any] = {"n_threads": fixed if name.endswith("-fixed") else "auto"}
        if name == "peer":
            member: Any = load_member(model, backend="llamacpp", n_threads="auto")  # its prompt's tokens
            runners[name] = peer_runner(model, member.encode_prompt(SessionRequest(messages)), fixed)
            continue
        if name.startswith("one"):
            engine = SpecEM([load_member(model, backend="llamacpp", **threads)], SpecEMConfig(ignore_eos=True))
        else:
            engine = SpecEM.from_preset("paper", backend="llamacpp", member_kwargs=threads, ignore_eos=True)
        runners[name] = specem_runner(engine, messages)
    return runners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=ROWS + BEFORE_ROWS, default=None, help="default: peer one pair")
    parser.add_argument("--before", action="store_true", help="also the SpecEM rows with the old fixed thread count")
    parser.add_argument("--model", default="qwen2.5-coder", help="packaged model of the peer and one rows")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=2, help="runs per row and level (rows take turns)")
    parser.add_argument(
        "--busy", type=int, nargs="+", default=None, help="cores kept busy per level (default: 0, 1 and all)"
    )
    parser.add_argument("--cell-seconds", type=float, default=60.0, help="a run stops after this many seconds")
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="4 tokens, one run, idle and all cores busy")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run busy_cores' cleanup on a plain kill too
    from specem_core.backends.llama_cpp import default_threads

    cores = default_threads()
    rows = args.rows or ROWS + (BEFORE_ROWS if args.before else [])
    levels = args.busy if args.busy is not None else sorted({0, 1, cores})
    if args.smoke:
        args.tokens, args.runs, args.warmup_tokens, args.cell_seconds = 4, 1, 2, 10.0
        levels = args.busy if args.busy is not None else [0, cores]
    if args.runs < 1 or args.tokens < 1 or any(n < 0 for n in levels):
        parser.error("--runs and --tokens must be positive, --busy counts at least 0")
    if 0 not in levels:
        parser.error("--busy must include 0 (the speed alone that the ratios divide)")

    messages = [{"role": "user", "content": PROMPT}]
    runners = build_rows(rows, args.model, messages)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {row: {} for row in rows}
    for busy in levels:
        print(f"-- {busy} of {cores} cores busy", flush=True)
        with busy_cores(busy):
            for row in rows:
                runners[row](args.warmup_tokens, time.perf_counter() + args.cell_seconds)
            for run in range(args.runs):
                for row in rows:
                    record = runners[row](args.tokens, time.perf_counter() + args.cell_seconds)
                    record["tokens_per_s"] = record["tokens"] / record["seconds"] if record["seconds"] else 0.0
                    results[row].setdefault(str(busy), []).append(record)
                    late = " (stopped at --cell-seconds)" if record["stopped"] else ""
                    print(
                        f"{row:>10} run {run + 1}: {record['tokens']} tokens in {record['seconds']:.2f}s, "
                        f"{record['tokens_per_s']:.1f} tok/s{late}",
                        flush=True,
                    )

    summary: dict[str, dict[str, Any]] = {}
    print()
    header = " | ".join(["row", *(f"{n} busy: tok/s (slower x)" if n else "alone: tok/s" for n in levels)])
    print(header)
    for row in rows:
        alone = statistics.median(r["tokens_per_s"] for r in results[row]["0"])
        summary[row] = {}
        cells = []
        for busy in levels:
            speeds = [r["tokens_per_s"] for r in results[row][str(busy)]]
            speed = statistics.median(speeds)
            slower = [alone / s if s else None for s in speeds]  # None: nothing produced in time
            summary[row][str(busy)] = {"tokens_per_s": speed, "slower": slower, "runs": speeds}
            shown = "/".join(f"{s:.1f}" for s in speeds)
            factors = " / ".join("-" if x is None else f"{x:.1f}x" for x in slower)
            cells.append(shown if busy == 0 else f"{shown} ({factors})")
        print(" | ".join([row, *cells]))

    record = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": cores},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "levels": levels,
        "summary": summary,
        "runs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
