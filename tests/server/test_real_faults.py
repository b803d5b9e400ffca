"""Real faults against a real ``specem serve``: member servers (llama-cpp-python on the packaged
SmolLM2-135M GGUF) SIGKILLed mid-answer, restarted on their port, all down; and SIGTERM to
``specem serve`` with 8 streams open. Processes on loopback, no mocks.

The member servers' circuit breaker is the default ``BreakerPolicy()`` (3 transport failures in a
row open it; first probe after 5 s, doubling after each failed probe up to 30 s).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from llama_server import LlamaServer, llama_cpp_available, start_server
from serve_process import ServeProcess, openai_error, start_serve

from specem_core.backends.http.client import BreakerPolicy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not llama_cpp_available(),
        reason="llama-cpp-python[server] is not installed (scripts/build_llama_cpp.sh builds and installs it)",
    ),
]

STORY = {"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}
RECOVERY_BOUND = 2 * BreakerPolicy().max_cool_down + 60
"""Seconds within which a restarted member must be used again: the longest cool-down, twice (a
probe may fail while the server restarts), plus the requests themselves on shared cores."""


@pytest.fixture(scope="module")
def members() -> Iterator[dict[str, LlamaServer]]:
    started: dict[str, LlamaServer] = {}
    try:
        for name in ("smol-a", "smol-b"):
            started[name] = start_server("smollm2", alias=name)
        yield started
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(scope="module")
def ensemble(members: dict[str, LlamaServer]) -> Iterator[ServeProcess]:
    """Two server members and one in-process llama.cpp member."""
    args = [f"openai:{members[n].base_url}#{n}" for n in ("smol-a", "smol-b")]
    server = start_serve(
        [
            *[x for spec in args for x in ("--model", spec)],
            "--model",
            "smollm2",
            "--backend",
            "llamacpp",
            "--segment-len",
            "4",
            "--temperature",
            "0",
            "--no-model-exit",
            "--request-timeout",
            "300",
            "--no-access-log",
        ]
    )
    try:
        yield server
    finally:
        server.cleanup()


def kill(members: dict[str, LlamaServer], name: str) -> None:
    members[name].process.kill()
    members[name].process.wait(timeout=10)


def restart(members: dict[str, LlamaServer], name: str) -> None:
    members[name] = start_server("smollm2", alias=name, port=members[name].port)


def ask(server: ServeProcess, max_tokens: int = 8, timeout: float = 300) -> httpx.Response:
    body = {"messages": [STORY], "max_tokens": max_tokens, "specem": {"trace": True, "ignore_eos": True}}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=timeout)


def stream_lines(response: httpx.Response) -> Iterator[str]:
    return (line for line in response.iter_lines() if line.startswith("data: "))


def test_member_killed_mid_stream_the_answer_completes_and_reports_it(
    ensemble: ServeProcess, members: dict[str, LlamaServer]
) -> None:
    assert ask(ensemble).status_code == 200  # the members are probed while up
    body = {"messages": [STORY], "max_tokens": 48, "stream": True, "specem": {"trace": True, "ignore_eos": True}}
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{ensemble.base_url}/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        lines = stream_lines(response)
        for line in lines:
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            if len(chunks) == 2:  # the role chunk, then the first segment: kill while the answer streams
                assert chunk["choices"][0]["delta"]["content"]
                kill(members, "smol-a")
        else:
            pytest.fail("the stream ended without [DONE]")
    assert all("error" not in c for c in chunks)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    trace = final["specem"]
    assert [e["member"] for e in trace["excluded"]] == ["smol-a"]
    exclusion = trace["excluded"][0]
    assert exclusion["round"] >= 2
    assert exclusion["stage"] in ("draft", "score", "commit")
    assert exclusion["error"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == "".join(s["text"] for s in trace["segments"])  # nothing lost, nothing twice
    assert all(s["winner"] != "smol-a" for s in trace["segments"][exclusion["round"] :])


def test_member_down_is_skipped_at_once_and_used_again_after_restart(
    ensemble: ServeProcess, members: dict[str, LlamaServer]
) -> None:
    if members["smol-a"].process.poll() is None:
        assert ask(ensemble).status_code == 200
        kill(members, "smol-a")
        assert ask(ensemble).status_code == 200  # this one finds it down and opens the breaker
    down = ask(ensemble)
    assert down.status_code == 200
    excluded = down.json()["specem"]["excluded"]
    assert [e["member"] for e in excluded] == ["smol-a"]
    # Breaker open: refused without a connection attempt (or, past a cool-down, one refused probe).
    assert "ServerUnavailableError" in excluded[0]["error"]
    assert "circuit" in excluded[0]["error"]
    pid = ensemble.pid
    restart(members, "smol-a")
    deadline = time.monotonic() + RECOVERY_BOUND
    while True:
        answer = ask(ensemble)
        assert answer.status_code == 200
        trace = answer.json()["specem"]
        if not trace["excluded"]:
            break
        assert time.monotonic() < deadline, f"smol-a still excluded {RECOVERY_BOUND}s after its restart: {trace}"
        time.sleep(1.0)
    assert any("smol-a" in s["drafters"] for s in trace["segments"])
    assert ensemble.pid == pid
    assert ensemble.process.poll() is None


def test_all_members_down_is_a_clear_500_and_the_server_keeps_serving(members: dict[str, LlamaServer]) -> None:
    for name in ("smol-a", "smol-b"):
        if members[name].process.poll() is not None:
            restart(members, name)
    specs = [x for n in ("smol-a", "smol-b") for x in ("--model", f"openai:{members[n].base_url}#{n}")]
    timeout = 120
    server = start_serve([*specs, "--segment-len", "4", "--request-timeout", str(timeout), "--no-access-log"])
    try:
        assert ask(server).status_code == 200
        kill(members, "smol-a")
        kill(members, "smol-b")
        started = time.monotonic()
        failed = ask(server)
        assert time.monotonic() - started < timeout
        error = openai_error(failed, 500)
        assert error["code"] == "all_members_failed"
        assert "smol-a" in error["message"]
        assert "smol-b" in error["message"]
        restart(members, "smol-a")
        deadline = time.monotonic() + RECOVERY_BOUND
        while (answer := ask(server)).status_code != 200:
            assert openai_error(answer, 500)["code"] == "all_members_failed"
            assert time.monotonic() < deadline, "no answer after a member came back"
            time.sleep(1.0)
        assert answer.json()["choices"][0]["message"]["content"]
        assert server.health()["status"] == "ok"
    finally:
        server.cleanup()
        if members["smol-b"].process.poll() is not None:
            restart(members, "smol-b")


# -- graceful shutdown ---------------------------------------------------------------------------
FAMILY = "SPECEM_TEST_FAMILY"
"""An environment variable with a fresh value per server: the server and everything it starts
inherit it, so they can be found after the server exits (when its children would have been
reparented and no longer be its children)."""


def family(token: str) -> list[psutil.Process]:
    """The live processes (zombies aside) whose environment carries ``token``."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get(FAMILY) == token and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


class _Stream(threading.Thread):
    """One streamed request read to its end in a thread: its data lines, and when it ended."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {"messages": [STORY], "max_tokens": max_tokens, "stream": True, "specem": {"ignore_eos": True}}
        self.lines: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None
        self.ended = False

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=300) as response:
                assert response.status_code == 200
                for line in stream_lines(response):
                    self.lines.append(line)
                    if any('"content":"' in x and '"content":""' not in x for x in self.lines):
                        self.first.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.ended = True
            self.first.set()


def _shutdown_with_streams(shutdown_timeout: int, max_tokens: int) -> tuple[list[_Stream], int, bool]:
    """8 streams open, then SIGTERM. Checks that the server exits cleanly (``check_clean_exit``:
    before the llama.cpp exit race was fixed, about 1 shutdown in 8 that ended answers mid-round
    died with SIGSEGV, and then ``os._exit`` hid it). Returns the streams, the exit status, and
    whether a new connection was refused while some stream was still open."""
    token = secrets.token_hex(8)
    server = start_serve(
        [
            "--model",
            "smollm2",
            "--backend",
            "llamacpp",
            "--segment-len",
            "4",
            "--max-concurrency",
            "8",
            "--shutdown-timeout",
            str(shutdown_timeout),
            "--no-access-log",
        ],
        env={FAMILY: token},
        exit_probe=True,
    )
    try:
        streams = [_Stream(f"{server.base_url}/chat/completions", max_tokens) for _ in range(8)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(240), "a stream never started"
        assert all(s.error is None and not s.ended for s in streams)
        assert server.pid in [p.pid for p in family(token)]  # the search finds what it looks for
        server.process.send_signal(signal.SIGTERM)
        refused_while_streaming = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{server.url}/health", timeout=2)
            except httpx.ConnectError:
                refused_while_streaming = not all(s.ended for s in streams)
                break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        for s in streams:
            s.join(timeout=shutdown_timeout + 60)
        code = server.process.wait(timeout=shutdown_timeout + 60)  # it exits by itself, or this raises
        server.check_clean_exit(code)  # status 0 after a normal interpreter exit: no crash, no os._exit
        # nothing it started outlives it, reparented or not (polled: a killed process takes a moment)
        deadline = time.monotonic() + 10
        while (left := family(token)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], [(p.pid, p.cmdline()) for p in left]
        with pytest.raises(httpx.ConnectError):  # and its port is closed
            httpx.get(f"{server.url}/health", timeout=2)
        return streams, code, refused_while_streaming
    finally:
        server.cleanup()


def test_sigterm_with_8_streams_lets_them_finish_and_exits_0() -> None:
    streams, code, refused = _shutdown_with_streams(shutdown_timeout=240, max_tokens=40)
    assert code == 0
    assert refused  # new connections are refused while the 8 answers finish
    for s in streams:
        assert s.error is None, s.error
        assert s.lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in s.lines[:-1]]
        assert all("error" not in c for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error_chunk() -> None:
    streams, code, refused = _shutdown_with_streams(shutdown_timeout=2, max_tokens=2000)
    assert code == 0
    assert refused
    for s in streams:
        assert s.error is None, s.error
        assert s.lines[-1] == "data: [DONE]"
        last = json.loads(s.lines[-2][6:])
        assert last["error"]["code"] == "server_shutting_down"
        assert set(last["error"]) == {"message", "type", "param", "code"}
        contents = [json.loads(x[6:]) for x in s.lines[:-2]]
        assert all("error" not in c and c["choices"][0]["finish_reason"] is None for c in contents if c["choices"])
