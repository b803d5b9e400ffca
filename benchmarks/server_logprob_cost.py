"""What a token's log-prob costs on llama.cpp's servers: one greedy completion asked three ways.

    python benchmarks/server_logprob_cost.py                 # the 1.5B, llama-cpp-python and llama-server, 1 thread
    python benchmarks/server_logprob_cost.py --model 0.5b --tokens 20 --repeats 5
    python benchmarks/server_logprob_cost.py --smoke         # seconds: SmolLM2, llama-cpp-python only

A verifier scores a candidate by the log-probs of its tokens, so a server member's vote asks its
server for log-probs on every candidate token (SPEC §1). This measures what that costs each
server, on the same model and thread count, the prompt read from the server's cache every time
(the same prompt is sent first to warm it):

* ``plain`` -- ``--tokens`` greedy tokens, no log-probs (what the server alone does);
* ``logprobs`` -- the same with the chosen token's log-prob (``logprobs=1`` on llama-cpp-python's
  ``/v1/completions``, ``n_probs=1`` on llama-server's ``/completion``): a draft that carries its
  own scores;
* ``forced`` -- the same tokens forced by a grammar of their ids, with log-probs: how a member
  scores another member's candidate on these servers (``token_scoring``).

Prints seconds per token of each (median of ``--repeats``), the extra seconds a token's log-prob
costs, and each ratio to ``plain``; writes ``--out`` (default
``benchmarks/results/server_logprob_cost.json``). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODELS = {
    "1.5b": "qwen2.5-coder-1.5b-instruct",
    "0.5b": "qwen2.5-coder-0.5b-instruct",
    "smollm2": "smollm2-135m-instruct",
}
PROMPT = (
    "The maintenance report for the plant's third quarter lists the repairs below. "
    + " ".join(
        f"Item {i}: the pump on line {i % 7} was serviced by technician {i % 5} for {i * 3} minutes." for i in range(24)
    )
    + "\nSummary of the report: The"
)


def token_grammar(ids: list[int]) -> str:
    from specem_core.backends.http.token_scoring import token_grammar as grammar

    return grammar(ids)


def after_prompt(ids: list[int], prompt_ids: list[int]) -> list[int]:
    """The generated tokens' ids (the prompt ends in a word, so no token spans the boundary)."""
    if ids[: len(prompt_ids)] != prompt_ids:
        raise RuntimeError("the prompt's tokens are not a prefix of the prompt and answer's")
    return ids[len(prompt_ids) :]


def timed(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    response = client.post(url, json=body)
    response.raise_for_status()
    return time.perf_counter() - start, response.json()


def three_ways(
    client: httpx.Client,
    url: str,
    plain: dict[str, Any],
    listed: dict[str, Any],
    forced: dict[str, Any],
    forced_tokens: int,
    repeats: int,
) -> dict[str, list[float]]:
    """Seconds per token of each request, ``repeats`` times (``plain`` and ``listed`` ask the
    same number of new tokens; ``forced`` asks ``forced_tokens``)."""
    tokens = plain.get("max_tokens") or plain["n_predict"]
    return {
        "plain": [timed(client, url, plain)[0] / tokens for _ in range(repeats)],
        "logprobs": [timed(client, url, listed)[0] / tokens for _ in range(repeats)],
        "forced": [timed(client, url, forced)[0] / forced_tokens for _ in range(repeats)],
    }


def llama_cpp_python(client: httpx.Client, base: str, tokens: int, repeats: int) -> dict[str, list[float]]:
    url, root = f"{base}/completions", base.removesuffix("/v1")
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0.0, "seed": 0}
    timed(client, url, body)  # the prompt into the server's cache
    _, answer = timed(client, url, {**body, "logprobs": 1})
    text = answer["choices"][0]["text"]
    ids = client.post(f"{root}/extras/tokenize", json={"input": PROMPT + text}).json()["tokens"]
    ids = after_prompt(ids, client.post(f"{root}/extras/tokenize", json={"input": PROMPT}).json()["tokens"])
    forced = {**body, "max_tokens": len(ids), "logprobs": 1, "grammar": token_grammar(ids)}
    return three_ways(client, url, body, {**body, "logprobs": 1}, forced, len(ids), repeats)


def llama_server(client: httpx.Client, base: str, tokens: int, repeats: int) -> dict[str, list[float]]:
    base = base.removesuffix("/v1")  # llama-server's native endpoints
    url = f"{base}/completion"
    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0.0, "cache_prompt": True, "seed": 0}
    _, answer = timed(client, url, body)
    ids = client.post(f"{base}/tokenize", json={"content": PROMPT + answer["content"]}).json()["tokens"]
    ids = after_prompt(ids, client.post(f"{base}/tokenize", json={"content": PROMPT}).json()["tokens"])
    forced = {**body, "n_predict": len(ids), "n_probs": 1, "grammar": token_grammar(ids)}
    return three_ways(client, url, body, {**body, "n_probs": 1}, forced, len(ids), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="1.5b")
    parser.add_argument("--servers", nargs="+", choices=["llama-cpp-python", "llama.cpp"], default=None)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from llama_server import cpu_description, llama_server_binary, start_llama_cpp_server, start_server

    if args.smoke:
        args.model, args.tokens, args.repeats, args.servers = "smollm2", 4, 1, ["llama-cpp-python"]
    servers = args.servers or ["llama-cpp-python", *(["llama.cpp"] if llama_server_binary() else [])]
    model = MODELS[args.model]
    rows: dict[str, dict[str, Any]] = {}
    for kind in servers:
        if kind == "llama.cpp":
            server = start_llama_cpp_server(model, n_ctx=2048, n_threads=args.threads, parallel=1)
        else:
            server = start_server(model, n_ctx=2048, n_threads=args.threads)
        try:
            with httpx.Client(timeout=600) as client:
                run = llama_server if kind == "llama.cpp" else llama_cpp_python
                times = run(client, server.base_url, args.tokens, args.repeats)
        finally:
            server.stop()
        median = {k: statistics.median(v) for k, v in times.items()}
        rows[kind] = {"seconds_per_token": times, "median": median}
        print(
            f"{kind:17} s/token: plain {median['plain']:.3f}, with log-probs {median['logprobs']:.3f} "
            f"(+{median['logprobs'] - median['plain']:.3f}, {median['logprobs'] / median['plain']:.2f}x), "
            f"forced {median['forced']:.3f} ({median['forced'] / median['plain']:.2f}x)"
        )
    record = {
        "command": " ".join(sys.argv),
        "machine": cpu_description(),
        "model": model,
        "threads": args.threads,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "rows": rows,
    }
    if not args.smoke:
        out = args.out or ROOT / "benchmarks" / "results" / "server_logprob_cost.json"
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
