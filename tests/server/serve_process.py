"""Start and stop a real ``specem serve`` process on loopback (tests, benchmarks, notebook).

The server is started with ``--port 0``; the port it picked is read from the line it prints
(``specem serve: listening on http://127.0.0.1:PORT/v1 ...``), then ``/health`` is polled.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SERVER_KEY = "sk-specem-test-SECRET-31415926"
"""The bearer key of the tests' authenticated server (passed through the environment only)."""

_LISTENING = re.compile(r"specem serve: listening on (http://\S+?)/v1 ")

FINALIZED = "serve_process: interpreter finalized; threads alive:"
"""The line the exit probe prints from the interpreter's last ``atexit`` handler (see :func:`start_serve`)."""

_EXIT_PROBE = (
    "import atexit, sys, threading\n"
    "atexit.register(lambda: print({marker!r}, sorted(t.name for t in threading.enumerate()"
    " if t is not threading.main_thread()), file=sys.stderr, flush=True))\n"
    "from specem_integrations.cli import main\n"
    "sys.exit(main())\n"
)
"""Runs the CLI like ``-m specem_integrations.cli``, with an ``atexit`` handler registered before
anything else: it runs last, so its line shows that the interpreter's normal exit ran (``os._exit``
skips it) and which threads were still alive then."""


@dataclass
class ServeProcess:
    """A running ``specem serve``."""

    process: subprocess.Popen[bytes]
    url: str
    """``http://127.0.0.1:PORT`` (no ``/v1``)."""
    api_key: str | None
    log_path: Path

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``…/v1``)."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        return self.process.pid

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/health", timeout=10.0)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def check_clean_exit(self, code: int) -> None:
        """A server started with ``exit_probe=True`` exited normally: status 0 (no fatal signal,
        no SIGSEGV / SIGABRT), the interpreter's ``atexit`` handlers ran (it was not cut short by
        ``os._exit``), no request worker thread (``specem-astream``) was still alive then, and no
        fatal-error report is in its log."""
        log = self.log()
        status = f"{code} ({signal.Signals(-code).name})" if code < 0 else str(code)
        assert code == 0, f"specem serve exited with status {status}:\n{self.log_tail()}"
        probe = [line for line in log.splitlines() if line.startswith(FINALIZED)]
        assert probe, f"the interpreter's exit handlers did not run (os._exit?):\n{self.log_tail()}"
        assert "specem-astream" not in probe[-1], f"request threads still alive at exit: {probe[-1]}"
        for fatal in ("Fatal Python error", "Segmentation fault", "terminate called"):
            assert fatal not in log, f"{fatal!r} in the log:\n{self.log_tail()}"

    def wait_health(self, timeout: float = 60.0, **expected: int) -> dict[str, Any]:
        """Poll ``/health`` until each ``expected`` counter has its value (``requests_queued=1``…)."""
        deadline = time.monotonic() + timeout
        health = self.health()
        while time.monotonic() < deadline:
            health = self.health()
            if all(health[k] == v for k, v in expected.items()):
                return health
            time.sleep(0.05)
        raise AssertionError(f"/health never showed {expected}: {health}")

    def wait_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Poll ``/health`` until no request runs or waits and no session or engine worker is left."""
        deadline = time.monotonic() + timeout
        health = self.health()
        while time.monotonic() < deadline:
            health = self.health()
            if (
                health["requests_in_flight"] == 0
                and health["requests_queued"] == 0
                and not health["sessions_open"]
                and health["engine_workers"] == 0
            ):
                return health
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout}s: {health}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        """Ask for a graceful shutdown; kill after ``timeout``. Returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return int(self.process.returncode)

    def cleanup(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def start_serve(
    args: Sequence[str] = ("--model", "smollm2"),
    *,
    api_key: str | None = None,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 240.0,
    python: str | None = None,
    exit_probe: bool = False,
) -> ServeProcess:
    """Start ``python -m specem_integrations.cli serve --port 0 ARGS`` and wait until ``/health`` answers.

    With ``api_key`` the key is passed through the environment variable ``SPECEM_TEST_SERVER_KEY``
    (``--api-key-env``), never on the command line. With ``exit_probe`` the CLI runs under an
    ``atexit`` probe and ``PYTHONFAULTHANDLER=1``, for :meth:`ServeProcess.check_clean_exit`.
    """
    launch = ["-c", _EXIT_PROBE.format(marker=FINALIZED)] if exit_probe else ["-m", "specem_integrations.cli"]
    cmd = [python or sys.executable, *launch, "serve", "--host", "127.0.0.1", "--port", "0"]
    cmd += args
    child_env = dict(os.environ)
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env.setdefault("TRANSFORMERS_OFFLINE", "1")
    child_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # (no OMP_NUM_THREADS here: transformers members run one forward pass at a time per device,
    # batching concurrent requests' decode steps, so a pass may use every core; a benchmark of
    # --request-batch-size 1, where requests run their passes side by side, sets it to 1 itself)
    if exit_probe:
        child_env["PYTHONFAULTHANDLER"] = "1"  # a fatal signal before finalization prints every thread's stack
    child_env.update(env or {})
    if api_key is not None:
        child_env["SPECEM_TEST_SERVER_KEY"] = api_key
        cmd += ["--api-key-env", "SPECEM_TEST_SERVER_KEY"]
    fd, log_name = tempfile.mkstemp(prefix="specem-serve-", suffix=".log")
    log_file = os.fdopen(fd, "wb")
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env)
    log_file.close()
    server = ServeProcess(process, "", api_key, Path(log_name))
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = server.log_tail()
            server.cleanup()
            raise RuntimeError(f"specem serve exited with {process.returncode}:\n{tail}")
        if not server.url:
            found = _LISTENING.search(server.log())
            if found:
                server.url = found.group(1)
        if server.url:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                    return server
        time.sleep(0.2)
    tail = server.log_tail()
    server.cleanup()
    raise RuntimeError(f"specem serve did not start within {startup_timeout:.0f}s:\n{tail}")


@contextlib.contextmanager
def serving(args: Sequence[str] = ("--model", "smollm2"), **kwargs: Any) -> Iterator[ServeProcess]:
    """``with serving([...]) as server:`` — started, then stopped gracefully."""
    server = start_serve(args, **kwargs)
    try:
        yield server
    finally:
        server.cleanup()


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error response, checked: the status, exactly the
    four keys, a non-empty message and no traceback in it; beside it the request id, the same as
    the ``X-Request-ID`` header."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "request_id"}
    assert body["request_id"] == response.headers["x-request-id"]
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert "Traceback" not in error["message"]
    return error
