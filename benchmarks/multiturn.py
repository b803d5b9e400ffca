"""Conversations, agents and shared system prompts: what the prefix cache saves, side by side.

    python benchmarks/multiturn.py                          # every row and workload (alone on the machine)
    python benchmarks/multiturn.py --rows peer-1.5b one-1.5b quality --workloads rag
    python benchmarks/multiturn.py --rows peer-1.5b one-1.5b --workloads rag --only-after --runs 5
    python benchmarks/multiturn.py --smoke                  # seconds: SmolLM2, short turns (CI smoke test)

Workloads (the same text for every row; each row's own answers go into its history, as in a chat):

1. ``rag``: a system prompt holding a retrieved context of ~1.1k tokens, then ``--turns`` questions.
2. ``agent``: a system prompt describing 3 tools, a task, then 4 tool round trips (the assistant's
   tool call and the tool's result are scripted, so every row sees the same trace) and the answer.
3. ``serve``: ``specem serve``'s app on loopback with the ``quality`` preset, a ~1.1k-token system
   prompt shared by every client: one request alone, then ``--clients`` concurrent streaming clients.

Rows: ``peer-<model>`` (llama-cpp-python's ``Llama`` on the same GGUF: the peer a user would pick,
reusing the previous call's prefix), ``one-1.5b`` (SpecEM with the 1.5B as its only member),
``quality`` and ``fast`` (the presets); each SpecEM row runs with the prefix cache (``after``) and
without it (``before``, ``prefix_cache=False``: every request re-reads its whole prompt), and with
``--invariant`` also with ``history_invariant`` (``cache=invariant``: only rows a cold prefill
computes identically are reused, so follow-ups prefill the previous answer again), and with
``--continuous-invariant`` with it and ``continuous_batching`` (row-invariant kernels: every row is
reused, prefill is slower). Each row
runs in a subprocess of its own, so its peak RSS is its own.

Per turn: seconds, time to the first segment (first token for the peer), prompt tokens, and per
member the tokens read from the prefix cache and the tokens prefilled. Summary per row: seconds per
completion token over turns >= 2 and its ratio to the peer running the row's best member. Follow-up
turns last under a second, so one run's ratio moves by 0.1-0.2 with the machine's noise: ``--runs N``
runs every row N times, the rows taking turns (peer, SpecEM, peer, ...), and reports the median per
row with every run's figure.
Writes ``benchmarks/results/multiturn.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "multiturn.json"

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Perth", "Quito", "Tunis", "Riga", "Hanoi"]
PRODUCTS = ["solar panels", "bicycles", "water filters", "drones", "textbooks", "coffee", "robots", "boats"]


def context_document(lines: int = 40) -> str:
    """A retrieved context of made-up company facts (deterministic, ~28 tokens a line)."""
    out = []
    for i in range(lines):
        out.append(
            f"Company {chr(65 + i % 26)}{i}: founded in {1950 + (i * 7) % 70}, headquarters in "
            f"{CITIES[i % len(CITIES)]}, {100 + (i * 137) % 9000} employees, makes {PRODUCTS[i % len(PRODUCTS)]}."
        )
    return "\n".join(out)


RAG_QUESTIONS = [
    "Which company has its headquarters in Osaka and what does it make?",
    "How many employees does that company have?",
    "Name one company founded before 1960.",
    "Which of the companies you named makes bicycles?",
    "Summarize what you told me in one sentence.",
]
TOOLS_TEXT = """You can call these tools by answering with one JSON object {"name": ..., "arguments": {...}}:
- multiply(a: number, b: number): the product of a and b.
- add(a: number, b: number): the sum of a and b.
- lookup_city(company: string): the city where a company has its headquarters.
When you have the final answer, answer in words."""
AGENT_TASK = "What is 12 times 7, plus 5? Then tell me where company C2 has its headquarters and multiply 89 by 2."
AGENT_TRACE = [
    ('{"name": "multiply", "arguments": {"a": 12, "b": 7}}', "Result of multiply: 84"),
    ('{"name": "add", "arguments": {"a": 84, "b": 5}}', "Result of add: 89"),
    ('{"name": "lookup_city", "arguments": {"company": "C2"}}', "Result of lookup_city: Nairobi"),
    ('{"name": "multiply", "arguments": {"a": 89, "b": 2}}', "Result of multiply: 178"),
]
SERVE_QUESTIONS = [
    "Which company is in Lima?",
    "Which company makes drones?",
    "Name a company founded in 1957.",
    "Which company is in Riga?",
    "How many employees does B1 have?",
    "Which company makes coffee?",
    "Which company is in Perth?",
    "Where is company D3?",
    "What does company E4 make?",
]
PRESET_MEMBERS = {"one-1.5b": ["qwen2.5-coder-1.5b"], "quality": None, "fast": None}
BEST_MEMBER = {"one-1.5b": "1.5b", "quality": "1.5b", "fast": "0.5b"}
PEERS = {"1.5b": "qwen2.5-coder-1.5b", "0.5b": "qwen2.5-coder", "smollm2": "smollm2"}


def rss_mib() -> float:
    """This process's resident set now (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the conversations ---------------------------------------------------------------------------
def rag_turns(turns: int, context_lines: int) -> tuple[str, list[str]]:
    system = "Answer from this context only, briefly.\n\n" + context_document(context_lines)
    return system, RAG_QUESTIONS[:turns]


def run_conversation(ask: Any, system: str, questions: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """A chat: each answer joins the history of the next question."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    records = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        record, answer = ask(messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        records.append(record)
    return records


def run_agent(ask: Any, max_tokens: int) -> list[dict[str, Any]]:
    """An agent trace: the model's turn, then the scripted tool call and result, four times, then
    the answer turn (every row sees the same history)."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": TOOLS_TEXT},
        {"role": "user", "content": AGENT_TASK},
    ]
    records = []
    for call, result in [*AGENT_TRACE, (None, None)]:
        record, _ = ask(messages, max_tokens)
        records.append(record)
        if call is not None and result is not None:
            messages += [{"role": "assistant", "content": call}, {"role": "user", "content": result}]
    return records


# -- rows ----------------------------------------------------------------------------------------
def peer_asker(model: str) -> Any:
    """llama-cpp-python's ``Llama`` on the packaged GGUF (its own prefix reuse, greedy, streamed)."""
    from llama_cpp import Llama

    from specem_core.backends.llama_cpp import default_threads
    from specem_core.models import find_packaged, packaged_gguf

    packaged = find_packaged(model)
    assert packaged is not None, model
    threads = default_threads()
    llm = Llama(str(packaged_gguf(packaged)), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)

    def ask(messages: list[dict[str, str]], max_tokens: int) -> tuple[dict[str, Any], str]:
        start = time.perf_counter()
        first = None
        parts: list[str] = []
        chat: Any = messages
        stream: Any = llm.create_chat_completion(chat, max_tokens=max_tokens, temperature=0.0, stream=True)
        for chunk in stream:
            delta = chunk["choices"][0]["delta"].get("content")
            if delta:
                first = first if first is not None else time.perf_counter() - start
                parts.append(delta)
        seconds = time.perf_counter() - start
        text = "".join(parts)
        completion = len(llm.tokenize(text.encode(), add_bos=False, special=False)) if text else 0
        return {"seconds": seconds, "first_segment": first, "completion_tokens": completion, "text": text}, text

    return ask


Cache = bool | str
"""A SpecEM row's prefix cache: on (True), off (False), ``"invariant"`` (on, with the llama.cpp
members' ``history_invariant``: only rows a cold prefill computes identically are reused) or
``"continuous-invariant"`` (``history_invariant`` with ``continuous_batching``: row-invariant
kernels, every row reused)."""


def cache_kwargs(cache: Cache) -> dict[str, Any]:
    """The member options of a cache setting."""
    if cache == "invariant":
        return {"prefix_cache": True, "history_invariant": True}
    if cache == "continuous-invariant":
        return {"prefix_cache": True, "history_invariant": True, "continuous_batching": True}
    return {"prefix_cache": bool(cache)}


def specem_asker(row: str, cache: Cache) -> Any:
    from specem_core import SpecEM

    kwargs: dict[str, Any] = {"member_kwargs": cache_kwargs(cache), "backend": "llamacpp"}
    members = PRESET_MEMBERS.get(row)
    engine = SpecEM.from_preset("quality", members=members, **kwargs) if members else SpecEM.from_preset(row, **kwargs)

    def ask(messages: list[dict[str, str]], max_tokens: int) -> tuple[dict[str, Any], str]:
        start = time.perf_counter()
        first = None
        result = None
        for event in engine.stream(messages, max_new_tokens=max_tokens):
            if first is None and event.delta:
                first = time.perf_counter() - start
            if event.done:
                result = event.result
        assert result is not None
        usage = result.usage
        return {
            "seconds": time.perf_counter() - start,
            "first_segment": first if first is not None else result.first_segment_seconds,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "text": result.text,
            "members": {
                u.member: {"prompt": u.prompt_tokens, "cached": u.cached_tokens, "prefilled": u.prefilled_tokens}
                for u in usage.per_member
            },
        }, result.text

    return ask


def run_row(row: str, cache: Cache, workloads: list[str], args: argparse.Namespace) -> dict[str, Any]:
    loaded_at = time.perf_counter()
    ask = peer_asker(PEERS[row.removeprefix("peer-")]) if row.startswith("peer-") else specem_asker(row, cache)
    out: dict[str, Any] = {"row": row, "cache": cache, "load_seconds": time.perf_counter() - loaded_at}
    out["rss_loaded_mib"] = rss_mib()
    if "rag" in workloads:
        system, questions = rag_turns(args.turns, args.context_lines)
        out["rag"] = run_conversation(ask, system, questions, args.max_tokens)
    if "agent" in workloads:
        out["agent"] = run_agent(ask, args.max_tokens)
    out["rss_end_mib"] = rss_mib()
    out["peak_rss_mib"] = peak_rss_mib()
    return out


# -- serve ---------------------------------------------------------------------------------------
def run_serve(cache: Cache, args: argparse.Namespace) -> dict[str, Any]:
    """``specem serve``'s app (quality) on a loopback port: one request, then concurrent clients."""
    import httpx
    import uvicorn

    from specem_core import SpecEM
    from specem_integrations.server import create_app

    preset = args.serve_preset
    members = ["smollm2"] if args.smoke else None
    kwargs: dict[str, Any] = {"member_kwargs": cache_kwargs(cache), "backend": "llamacpp"}
    engine = SpecEM.from_preset(preset, members=members, **kwargs) if members else SpecEM.from_preset(preset, **kwargs)
    app = create_app(engine, max_concurrency=args.clients, model_name="specem")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    system = "Answer from this context only, in a few words.\n\n" + context_document(args.context_lines)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def one(question: str) -> dict[str, Any]:
        body = {
            "model": "specem",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": args.serve_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = None
        usage: dict[str, Any] = {}
        with httpx.Client(timeout=900) as client, client.stream("POST", url, json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and first is None:
                    first = time.perf_counter() - start
                usage = chunk.get("usage") or usage
        return {
            "seconds": time.perf_counter() - start,
            "first_segment": first,
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        }

    try:
        warm = one(SERVE_QUESTIONS[0])
        results: list[dict[str, Any]] = [{}] * args.clients
        start = time.perf_counter()

        def client(i: int) -> None:
            results[i] = one(SERVE_QUESTIONS[1 + i % (len(SERVE_QUESTIONS) - 1)])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(1800)
        wall = time.perf_counter() - start
    finally:
        server.should_exit = True
        thread.join(30)
    tokens = sum(r.get("completion_tokens", 0) for r in results)
    return {
        "row": f"serve-{preset}",
        "cache": cache,
        "first_request": warm,
        "clients": results,
        "wall_seconds": wall,
        "tokens_per_second": tokens / wall if wall else None,
        "first_segment_max": max((r["first_segment"] or 0.0) for r in results) if results else None,
        "peak_rss_mib": peak_rss_mib(),
    }


# -- memory --------------------------------------------------------------------------------------
def run_memory(cache: Cache, args: argparse.Namespace) -> dict[str, Any]:
    """What the cache holds on to: ``--conversations`` distinct conversations, one after another
    (each its own ~300-token system prompt), on the ``--serve-preset`` engine; RSS after each."""
    from specem_core import SpecEM

    kwargs: dict[str, Any] = {"member_kwargs": cache_kwargs(cache), "backend": "llamacpp"}
    members = ["smollm2"] if args.smoke else None
    preset = args.serve_preset
    engine = SpecEM.from_preset(preset, members=members, **kwargs) if members else SpecEM.from_preset(preset, **kwargs)
    loaded = rss_mib()
    after = []
    for n in range(args.conversations):
        lines = context_document(10 + n).splitlines()[n:]
        system = f"Conversation {n}. Answer briefly.\n\n" + "\n".join(lines)
        engine.generate([{"role": "system", "content": system}, {"role": "user", "content": "Hi."}], max_new_tokens=4)
        after.append(round(rss_mib(), 1))
    return {"row": f"memory-{preset}", "cache": cache, "rss_loaded_mib": loaded, "rss_after_mib": after}


# -- driver --------------------------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    cache: Cache = {"on": True, "off": False}.get(args.cache, args.cache)
    if args.row.startswith("memory"):
        out = run_memory(cache, args)
    elif args.row.startswith("serve"):
        out = run_serve(cache, args)
    else:
        out = run_row(args.row, cache, args.workloads, args)
    print("MULTITURN-RESULT " + json.dumps(out))


def spawn(row: str, cache: Cache, args: argparse.Namespace) -> dict[str, Any]:
    flag = cache if isinstance(cache, str) else ("on" if cache else "off")
    cmd = [sys.executable, __file__, "--child", "--row", row, "--cache", flag]
    for flag in ("turns", "max_tokens", "context_lines", "clients", "serve_tokens", "serve_preset", "conversations"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    cmd += ["--workloads", *args.workloads] + (["--smoke"] if args.smoke else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.row_timeout, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("MULTITURN-RESULT "):
            return dict(json.loads(line.removeprefix("MULTITURN-RESULT ")))
    raise RuntimeError(f"row {row} (cache {cache}) failed:\n{done.stderr[-3000:]}")


def per_token(records: list[dict[str, Any]], skip_first: bool = True) -> float | None:
    """Seconds per completion token over the turns after the first."""
    later = records[1:] if skip_first else records
    tokens = sum(r["completion_tokens"] for r in later)
    return sum(r["seconds"] for r in later) / tokens if tokens else None


def median_per_token(runs: list[dict[str, Any]], workload: str) -> tuple[float | None, list[float]]:
    """The median over runs of seconds per completion token (turns >= 2), and each run's figure."""
    each = [x for x in (per_token(r[workload]) for r in runs if workload in r) if x is not None]
    return (statistics.median(each) if each else None), each


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (row, cache): medians over its runs (turn by turn for the turn figures)."""
    runs_of: dict[tuple[str, Cache], list[dict[str, Any]]] = {}
    for r in rows:
        if not r["row"].startswith("serve"):
            runs_of.setdefault((r["row"], r["cache"]), []).append(r)
    out = []
    for (row, cache), runs in runs_of.items():
        best = row.removeprefix("peer-") if row.startswith("peer-") else BEST_MEMBER.get(row, "1.5b")
        peer_runs = runs_of.get((f"peer-{best}", True), [])
        entry: dict[str, Any] = {"row": row, "cache": cache, "runs": len(runs)}
        entry["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
        for workload in ("rag", "agent"):
            records = [r[workload] for r in runs if workload in r]
            if not records:
                continue
            mine, each = median_per_token(runs, workload)
            peer, _ = median_per_token(peer_runs, workload)
            turns = range(min(len(rec) for rec in records))
            entry[workload] = {
                "seconds_per_token_turns_2_plus": mine,
                "seconds_per_token_each_run": each,
                "vs_peer_best_member": (mine / peer) if mine and peer else None,
                "turn_seconds": [round(statistics.median(rec[t]["seconds"] for rec in records), 2) for t in turns],
                "first_segment": [
                    round(statistics.median(rec[t]["first_segment"] or 0 for rec in records), 2) for t in turns
                ],
                "max_prefilled_per_member_turns_2_plus": [
                    max((m["prefilled"] for rec in records for m in rec[t].get("members", {}).values()), default=None)
                    for t in turns[1:]
                ],
            }
        out.append(entry)
    return out


def table(summary: list[dict[str, Any]], serve: list[dict[str, Any]]) -> None:
    head = f"{'row':<12} {'cache':<6} {'workload':<6} {'s/token t>=2':>12} {'vs peer':>8}"
    print(f"{head}  turn seconds (median)  each run")
    for e in summary:
        for w in ("rag", "agent"):
            if w in e:
                d = e[w]
                ratio = f"{d['vs_peer_best_member']:.2f}x" if d["vs_peer_best_member"] else "-"
                spt = d["seconds_per_token_turns_2_plus"]
                each = [round(x, 3) for x in d["seconds_per_token_each_run"]]
                line = f"{e['row']:<12} {e['cache']!s:<6} {w:<6} {spt or 0:>12.3f} {ratio:>8}"
                print(f"{line}  {d['turn_seconds']}  {each}")
    for s in serve:
        print(
            f"{s['row']} cache={s['cache']}: first request {s['first_request']['seconds']:.1f}s, "
            f"{len(s['clients'])} clients {s['wall_seconds']:.1f}s, {s['tokens_per_second']:.2f} tok/s, "
            f"max first segment {s['first_segment_max']:.2f}s, "
            f"cached_tokens {[c.get('cached_tokens') for c in s['clients']]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", nargs="+", default=["peer-1.5b", "peer-0.5b", "one-1.5b", "quality", "fast"])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["rag", "agent", "serve", "memory"],
        choices=["rag", "agent", "serve", "memory"],
    )
    parser.add_argument("--turns", type=int, default=4, help="RAG questions (2-5)")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens a turn, at most")
    parser.add_argument("--context-lines", type=int, default=40, help="lines of retrieved context (~28 tokens each)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--serve-tokens", type=int, default=16)
    parser.add_argument("--serve-preset", default="quality")
    parser.add_argument("--conversations", type=int, default=10, help="distinct conversations (memory)")
    parser.add_argument("--only-after", action="store_true", help="SpecEM rows with the cache only")
    parser.add_argument(
        "--invariant", action="store_true", help="SpecEM rows also with history_invariant (cache=invariant)"
    )
    parser.add_argument(
        "--continuous-invariant",
        action="store_true",
        help="SpecEM rows also with history_invariant and continuous_batching (cache=continuous-invariant)",
    )
    parser.add_argument("--smoke", action="store_true", help="seconds: SmolLM2 rows, 2 short turns, 2 clients")
    parser.add_argument("--runs", type=int, default=1, help="runs of every conversation row, taking turns (medians)")
    parser.add_argument("--row-timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        PRESET_MEMBERS["one-smollm2"] = ["smollm2"]
        BEST_MEMBER["one-smollm2"] = "smollm2"
    if args.child:
        child(args)
        return
    if args.smoke:
        args.rows, args.turns, args.max_tokens, args.context_lines = ["peer-smollm2", "one-smollm2"], 2, 8, 6
        args.clients, args.serve_tokens, args.conversations = 2, 4, 2
        args.out = args.out if args.out != RESULTS else Path(os.devnull)
    rows: list[dict[str, Any]] = []
    conversation = [w for w in args.workloads if w in ("rag", "agent")]
    for run in range(args.runs if conversation else 0):
        for row in args.rows:
            caches: list[Cache] = [True] if args.only_after else [True, False]
            caches += ["invariant"] if args.invariant else []
            caches += ["continuous-invariant"] if args.continuous_invariant else []
            for cache in [True] if row.startswith("peer-") else caches:
                started = time.perf_counter()
                rows.append(spawn(row, cache, argparse.Namespace(**{**vars(args), "workloads": conversation})))
                print(f"run {run + 1}: {row} cache={cache}: {time.perf_counter() - started:.0f}s", flush=True)
    serve = []
    if "serve" in args.workloads:
        serve_caches: list[Cache] = [True] if args.only_after else [True, False]
        for cache in serve_caches + (["invariant"] if args.invariant else []):
            serve.append(spawn("serve", cache, args))
    memory = []
    if "memory" in args.workloads:
        for cache in [True, False]:
            memory.append(spawn("memory", cache, args))
            print(
                f"memory cache={cache}: loaded {memory[-1]['rss_loaded_mib']:.0f} MiB, after each conversation "
                f"{memory[-1]['rss_after_mib']}",
                flush=True,
            )
    summary = summarize(rows)
    table(summary, serve)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k not in {"child", "row", "cache", "out"}},
        "summary": summary,
        "rows": rows,
        "serve": serve,
        "memory": memory,
    }
    if str(args.out) != os.devnull:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
