"""Soak test of ``specem serve``: mixed traffic at a fixed concurrency for a fixed time.

    python benchmarks/serve_soak.py                               # 30 minutes, 8 clients, default members
    python benchmarks/serve_soak.py --minutes 2 --window-minutes 0.5 --out /tmp/soak.json

Starts ``specem serve --port 0`` on loopback (``--model`` repeatable, default the packaged
``smollm2`` and ``qwen2.5-coder`` on llama.cpp in process; ``--server-arg`` passes anything else)
and stops it at the end. ``--concurrency`` clients each send one request after another until
``--minutes`` have passed or ``--max-requests`` were sent, drawing each request's kind from a
seeded mix:

* ``stream`` — streamed greedy answer with the per-round trace: the concatenated deltas must equal
  the committed segments, with a finish reason, usage and ``[DONE]``; compared with its prompt's
  **reference answer**;
* ``plain`` — non-streamed greedy answer: a string content and a finish reason; compared with its
  prompt's reference answer;
* ``tools`` — a forced call of a tool: its arguments must parse as a JSON object with the
  required key;
* ``json`` — ``response_format`` with a JSON schema: the content must parse and have the keys;
* ``cancel`` — a long stream dropped after its first content chunk (expected: ``cancelled``);
* ``bad`` — a malformed request (expected: a 400 with an OpenAI error body).

Reference answers: before the traffic starts, each prompt is asked once, alone, greedy. Every
stream or plain answer under load is compared with its prompt's reference (``compared``); those
that differ are counted (``differs``, with examples in ``problems``): the server's own trace cannot
vouch for an answer that concurrency changed. On transformers members a greedy answer is the same
alone and batched with others, so any difference is a fault. On llama.cpp members it is not: which
KV-cache cells a context's tokens land in (they depend on the requests before it) moves the logits
slightly (``benchmarks/llama_cpp_kernels.py``'s "lower cell" column) and can flip a near tie, so
there ``differs`` is reported, not a fault by itself.

Outcomes: ``completed``, ``cancelled`` (as intended), ``rejected`` (the bad requests' 400s),
``error`` (a proper OpenAI error the request did not expect: 429, 5xx, an error event),
``corrupted`` (an answer that breaks the checks above) and ``lost`` (neither a complete answer nor a
proper error: a dropped connection, a stream without ``[DONE]``, a client timeout, a 5xx without
an error body). Per window (``--window-minutes``, default 5): requests by outcome, p50/p99 latency
of completed requests, the server's RSS (median of samples every ``--sample-seconds``) and open
sessions (``/health``, the largest sample). At the end the server must come back to idle.

Writes ``--out`` (default ``benchmarks/results/serve_soak.json``) with the top-level keys
``lost``, ``corrupted``, ``rss_growth`` (fraction, the second window's RSS to the last one's) and
``sessions_left``, beside ``windows``, and the same table as markdown next to it (``.md``).
Also ``errors`` (requests that got a proper error they did not expect), ``compared`` and
``differs`` (see above). Targets: 0 lost, 0 corrupted, 0 errors, RSS growth < 5 %, 0 sessions
left; on transformers members also 0 differs. Loopback only; every loop is
bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))

from serve_process import ServeProcess, start_serve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import PROMPTS as LOAD_PROMPTS

KINDS = {"stream": 4, "plain": 2, "tools": 1, "json": 1, "cancel": 1, "bad": 1}
"""The traffic mix (relative weights)."""
OUTCOMES = ("completed", "cancelled", "rejected", "error", "corrupted", "lost")
PROMPTS = LOAD_PROMPTS[:6]
"""The load benchmark's first six prompts."""
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}
BAD_BODIES: list[Any] = [
    {"messages": "not a list"},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
    {"model": "specem"},
]


@dataclass
class Record:
    """One request as its client saw it."""

    kind: str
    started: float
    """Seconds since the start of the run."""
    outcome: str = "lost"
    seconds: float = 0.0
    detail: str = ""
    compared: bool = False
    """Whether the answer was checked against its prompt's reference answer."""
    differs: bool = False
    """Whether it differed from that reference."""


@dataclass
class Sample:
    at: float
    rss_mib: float | None
    sessions_open: int | None


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    reference: dict[str, str] = field(default_factory=dict)
    """Prompt -> its greedy answer asked alone, before the traffic."""


def _error_body(response: httpx.Response) -> dict[str, Any] | None:
    """The ``error`` object of a proper OpenAI error response, else ``None``."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
        return error
    return None


def _chat(args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    prompt = rng.choice(PROMPTS)
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens, "temperature": 0}


def _against_reference(record: Record, body: dict[str, Any], text: str, reference: dict[str, str]) -> None:
    """Compare a complete answer with what its prompt got alone before the traffic."""
    expected = reference.get(body["messages"][0]["content"])
    if expected is None or record.outcome != "completed":
        return
    record.compared = True
    if text != expected:
        record.differs = True
        record.detail = f"differs from the answer alone: {text[:60]!r} vs {expected[:60]!r}"


async def reference_answers(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, str]:
    """Each prompt's greedy answer, asked alone (one request at a time) before the traffic."""
    answers = {}
    for prompt in PROMPTS:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens, "temperature": 0}
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        answers[prompt] = str(response.json()["choices"][0]["message"]["content"])
    return answers


async def _stream(
    client: httpx.AsyncClient,
    record: Record,
    body: dict[str, Any],
    *,
    drop: bool,
    reference: dict[str, str] | None = None,
) -> None:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "specem": {"trace": True}}
    deltas: list[str] = []
    chunks: list[dict[str, Any]] = []
    done = False
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            record.outcome = "error" if _error_body(response) else "lost"
            record.detail = f"HTTP {response.status_code}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                record.outcome = "error"
                record.detail = str(chunk["error"].get("code"))
                return
            chunks.append(chunk)
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    deltas.append(content)
                    if drop:  # a client that goes away mid-answer
                        record.outcome = "cancelled"
                        return
    if not done:
        record.detail = "no [DONE]"
        return  # lost
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    trace = next((c["specem"] for c in reversed(chunks) if "specem" in c), None)
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    text = "".join(deltas)
    problems = []
    if not finishes or finishes[-1] not in ("stop", "length"):
        problems.append(f"finish {finishes[-1:] or None}")
    if trace is None or text != "".join(s["text"] for s in trace["segments"]):
        problems.append("deltas differ from the committed segments")
    if usage is None or usage.get("completion_tokens", 0) < (1 if text else 0):
        problems.append(f"usage {usage}")
    if drop:
        problems.append("a stream meant to be dropped ended before any content")
    record.outcome = "corrupted" if problems else "completed"
    record.detail = "; ".join(problems)
    if reference is not None:
        _against_reference(record, body, text, reference)


async def _post(client: httpx.AsyncClient, record: Record, body: Any) -> dict[str, Any] | None:
    """The 200 body, or ``None`` with the outcome recorded."""
    response = await client.post("/v1/chat/completions", json=body)
    if response.status_code == 200:
        data: dict[str, Any] = response.json()
        return data
    error = _error_body(response)
    record.detail = f"HTTP {response.status_code} {error.get('code') if error else ''}".strip()
    if record.kind == "bad":
        record.outcome = "rejected" if response.status_code == 400 and error else "lost"
    else:
        record.outcome = "error" if error else "lost"
    return None


def _check_message(
    record: Record, data: dict[str, Any], body: dict[str, Any], reference: dict[str, str] | None = None
) -> None:
    problems: list[str] = []
    choice = data["choices"][0]
    message = choice["message"]
    if choice.get("finish_reason") not in ("stop", "length", "tool_calls"):
        problems.append(f"finish {choice.get('finish_reason')}")
    if record.kind == "plain" and not isinstance(message.get("content"), str):
        problems.append("no content")
    if record.kind == "tools":
        calls = message.get("tool_calls") or []
        if not calls:
            problems.append("no tool call")
        for call in calls:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except (ValueError, KeyError, TypeError):
                problems.append("tool arguments do not parse")
                continue
            if not isinstance(arguments, dict) or "city" not in arguments:
                problems.append(f"tool arguments {arguments!r}")
    if record.kind == "json":
        try:
            value = json.loads(message.get("content") or "")
        except ValueError:
            value = None
        if not isinstance(value, dict) or not {"city", "country"} <= set(value):
            problems.append(f"content is not the schema's JSON: {str(message.get('content'))[:80]!r}")
    record.outcome = "corrupted" if problems else "completed"
    record.detail = "; ".join(problems)
    if record.kind == "plain" and reference is not None:
        _against_reference(record, body, str(message.get("content")), reference)


async def one_request(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    rng: random.Random,
    t0: float,
    reference: dict[str, str] | None = None,
) -> Record:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    record = Record(kind, time.monotonic() - t0)
    started = time.monotonic()
    try:
        if kind == "stream":
            await _stream(client, record, _chat(args, rng), drop=False, reference=reference)
        elif kind == "cancel":
            body = {**_chat(args, rng), "max_tokens": 512, "specem": {"ignore_eos": True}}
            await _stream(client, record, body, drop=True)
        elif kind == "bad":
            await _post(client, record, rng.choice(BAD_BODIES))
        else:
            body = _chat(args, rng)
            if kind == "tools":
                body = {
                    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                    "tools": [WEATHER_TOOL],
                    "tool_choice": "required",
                    "max_tokens": args.max_tokens * 2,
                }
            elif kind == "json":
                body = {
                    "messages": [{"role": "user", "content": "Name a city and its country."}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
                    "max_tokens": args.max_tokens * 2,
                }
            data = await _post(client, record, body)
            if data is not None:
                _check_message(record, data, body, reference)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
        record.outcome = "lost"
        record.detail = f"{type(exc).__name__}: {exc}"[:200]
    record.seconds = time.monotonic() - started
    return record


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def health(server: ServeProcess) -> dict[str, Any] | None:
    try:
        return server.health()
    except (httpx.HTTPError, ValueError):
        return None


async def sampler(server: ServeProcess, run: Run, args: argparse.Namespace, t0: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        h = await asyncio.to_thread(health, server)
        run.samples.append(Sample(time.monotonic() - t0, rss_mib(server.pid), (h or {}).get("sessions_open")))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=args.sample_seconds)


async def soak(server: ServeProcess, args: argparse.Namespace) -> Run:
    run = Run()
    budget = {"left": args.max_requests}
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    timeout = httpx.Timeout(args.client_timeout)
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits) as client:
        run.reference = await reference_answers(client, args)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60

        async def worker(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            while time.monotonic() < end and budget["left"] > 0:
                budget["left"] -= 1
                run.records.append(await one_request(client, args, rng, t0, run.reference))

        sampling = asyncio.create_task(sampler(server, run, args, t0, stop))
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        stop.set()
        await sampling
    return run


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def windows(run: Run, args: argparse.Namespace) -> list[dict[str, Any]]:
    width = args.window_minutes * 60
    count = max(1, int(-(-args.minutes * 60 // width)))
    out = []
    for w in range(count):
        lo, hi = w * width, (w + 1) * width
        recs = [r for r in run.records if lo <= r.started < hi]
        done = [r.seconds for r in recs if r.outcome == "completed"]
        rss = [s.rss_mib for s in run.samples if lo <= s.at < hi and s.rss_mib is not None]
        sessions = [s.sessions_open for s in run.samples if lo <= s.at < hi and s.sessions_open is not None]
        out.append(
            {
                "window": w + 1,
                "from_min": round(lo / 60, 2),
                "to_min": round(hi / 60, 2),
                "requests": len(recs),
                "outcomes": {o: sum(r.outcome == o for r in recs) for o in OUTCOMES},
                "p50_s": _round(_pct(done, 0.5)),
                "p99_s": _round(_pct(done, 0.99)),
                "rss_mib": _round(statistics.median(rss) if rss else None, 1),
                "sessions_open_max": max(sessions) if sessions else None,
            }
        )
    return out


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def markdown(result: dict[str, Any]) -> str:
    head = "| window | minutes | requests | " + " | ".join(OUTCOMES) + " | p50 s | p99 s | RSS MiB | sessions open |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for w in result["windows"]:
        cells = [
            str(w["window"]),
            f"{w['from_min']:g}-{w['to_min']:g}",
            str(w["requests"]),
            *[str(w["outcomes"][o]) for o in OUTCOMES],
            *[str(w[k]) for k in ("p50_s", "p99_s", "rss_mib", "sessions_open_max")],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    summary = (
        f"\nlost {result['lost']}, corrupted {result['corrupted']}, errors {result['errors']}, "
        f"{result['differs']} of {result['compared']} greedy answers differ from the answer alone, "
        f"RSS growth {result['rss_growth']}, "
        f"sessions left {result['sessions_left']}; {result['requests']} requests over {result['minutes']} min "
        f"at concurrency {result['concurrency']} ({', '.join(result['members'])})\n"
    )
    return "\n".join(lines) + "\n" + summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long traffic runs (default 30)")
    parser.add_argument("--window-minutes", type=float, default=5.0, help="the report's window (default 5)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")
    parser.add_argument("--max-requests", type=int, default=100_000, help="a bound on requests sent")
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length of the chat requests")
    parser.add_argument("--model", action="append", default=None, help="member (repeatable)")
    parser.add_argument("--backend", default="llamacpp", help="the members' backend (default llamacpp)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra argument of the server")
    parser.add_argument("--sample-seconds", type=float, default=5.0, help="RSS / sessions sampling period")
    parser.add_argument("--client-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to come back to idle at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve_soak.json")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.window_minutes <= 0 or args.concurrency < 1 or args.max_requests < 1:
        parser.error("--minutes and --window-minutes must be > 0, --concurrency and --max-requests >= 1")
    members = args.model or ["smollm2", "qwen2.5-coder"]
    server_args = [x for m in members for x in ("--model", m)]
    server_args += ["--backend", args.backend, "--max-concurrency", str(args.concurrency), "--no-access-log"]
    server_args += ["--request-timeout", str(args.client_timeout), *args.server_arg]
    server = start_serve(server_args)
    try:
        rss_start = rss_mib(server.pid)
        started = time.monotonic()
        run = asyncio.run(soak(server, args))
        wall = time.monotonic() - started
        try:
            idle = server.wait_idle(args.idle_timeout)
            came_idle = True
        except AssertionError:
            idle, came_idle = health(server) or {}, False
        rss_end = rss_mib(server.pid)
    finally:
        server.cleanup()
    table = windows(run, args)
    rss_values = [w["rss_mib"] for w in table if w["rss_mib"] is not None]
    growth = (rss_values[-1] - rss_values[1]) / rss_values[1] if len(rss_values) >= 2 else None
    outcomes = Counter(r.outcome for r in run.records)
    result = {
        "lost": outcomes["lost"],
        "corrupted": outcomes["corrupted"],
        "errors": outcomes["error"],
        "compared": sum(r.compared for r in run.records),
        "differs": sum(r.differs for r in run.records),
        "rss_growth": None if growth is None else round(growth, 4),
        "sessions_left": idle.get("sessions_open"),
        "came_back_idle": came_idle,
        "requests": len(run.records),
        "outcomes": {o: outcomes[o] for o in OUTCOMES},
        "by_kind": {k: dict(Counter(r.outcome for r in run.records if r.kind == k)) for k in KINDS},
        "problems": sorted(
            {
                f"{r.kind}: {r.outcome}: {r.detail}"
                for r in run.records
                if r.outcome in ("lost", "corrupted", "error") or r.differs
            }
        )[:50],
        "windows": table,
        "reference": run.reference,
        "minutes": args.minutes,
        "window_minutes": args.window_minutes,
        "wall_s": round(wall, 1),
        "concurrency": args.concurrency,
        "members": members,
        "backend": args.backend,
        "max_tokens": args.max_tokens,
        "mix": KINDS,
        "rss_mib_start": _round(rss_start, 1),
        "rss_mib_end": _round(rss_end, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
