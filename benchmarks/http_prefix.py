"""What an HTTP member's server reads from its prefix cache, call by call (vLLM, CPU build).

    SPECEM_VLLM_PYTHON=~/.cache/specem/vllm-venv/bin/python python benchmarks/http_prefix.py

Starts vLLM on the packaged SmolLM2 (automatic prefix caching is on by default in its V1 engine;
``--enable-prompt-tokens-details`` makes it report ``usage.prompt_tokens_details.cached_tokens``),
runs a two-turn conversation over a ~1k-token context through SpecEM with that server as its member
(two members on it, so that each round also verifies the other's candidate), and records every
call the members make: its kind (a draft, or a verification: ``echo`` with prompt log-probs, or a
next-token request), its prompt tokens and the tokens the server read from its cache. vLLM turns
``echo`` + ``logprobs`` into prompt log-probs and then skips *reading* its prefix cache
(``skip_reading_prefix_cache``), so with ``--verify-mode echo`` (the path before #62) drafts hit
the cache and verifications do not; the default path here (``next_token``: the server is started
without ``--enable-scale-out``, so ``prompt_tail`` is not offered) reads it for both.
Writes ``benchmarks/results/http_prefix_vllm.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_server import start_vllm_server
from multiturn import context_document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context-lines", type=int, default=36)
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--verify-mode", default="auto", help="the members' verify_mode (echo: the path before #62)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/http_prefix_vllm.json"))
    args = parser.parse_args()

    from specem_core import SpecEM, SpecEMConfig
    from specem_core.backends.http.client import OpenAIClient
    from specem_core.registry import load_member

    calls: list[dict[str, Any]] = []
    original = OpenAIClient.post

    async def recorded(self: OpenAIClient, path: str, payload: Any, *, timeout: float | None = None) -> Any:
        start = time.perf_counter()
        body = await original(self, path, payload, timeout=timeout)
        usage = (body or {}).get("usage") or {} if isinstance(body, dict) else {}
        details = usage.get("prompt_tokens_details") or {}
        calls.append(
            {
                "path": path,
                "kind": (
                    "verify"
                    if payload.get("echo") or payload.get("logprob_token_ids")
                    else "draft"
                    if path.endswith("completions")
                    else "tokenize"
                ),
                "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens", 0),
                "seconds": round(time.perf_counter() - start, 3),
            }
        )
        return body

    OpenAIClient.post = recorded  # type: ignore[method-assign]  # measuring only: every call is recorded
    server = start_vllm_server(args.model, max_model_len=4096, extra_args=["--enable-prompt-tokens-details"])
    try:
        spec = f"openai:{server.base_url}#{server.alias}"
        members = [load_member(spec, name=n, verify_mode=args.verify_mode) for n in ("a", "b")]
        engine = SpecEM(members, SpecEMConfig(max_new_tokens=args.max_tokens, segment_len=10))
        messages = [
            {"role": "system", "content": "Answer from this context only.\n\n" + context_document(args.context_lines)},
            {"role": "user", "content": "Which company has its headquarters in Osaka?"},
        ]
        turns = []
        for turn, question in enumerate(["", "And how many employees does it have?"]):
            if question:
                messages += [{"role": "user", "content": question}]
            before = len(calls)
            result = engine.generate(messages)
            messages.insert(len(messages), {"role": "assistant", "content": result.text})
            mine = calls[before:]
            turns.append(
                {
                    "turn": turn + 1,
                    "seconds": result.seconds,
                    "calls": mine,
                    "draft_prompt_tokens": sum(c["prompt_tokens"] or 0 for c in mine if c["kind"] == "draft"),
                    "draft_cached_tokens": sum(c["cached_tokens"] or 0 for c in mine if c["kind"] == "draft"),
                    "verify_prompt_tokens": sum(c["prompt_tokens"] or 0 for c in mine if c["kind"] == "verify"),
                    "verify_cached_tokens": sum(c["cached_tokens"] or 0 for c in mine if c["kind"] == "verify"),
                }
            )
            t = turns[-1]
            print(
                f"turn {t['turn']}: {t['seconds']:.1f}s; drafts: {t['draft_cached_tokens']} of "
                f"{t['draft_prompt_tokens']} prompt tokens from cache; verifications: "
                f"{t['verify_cached_tokens']} of {t['verify_prompt_tokens']}",
                flush=True,
            )
    finally:
        server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"server": "vllm", "model": args.model, "verify_mode": args.verify_mode, "turns": turns}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
