"""``specem serve`` option checks (before any model loads) and the admission queue's rules."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket

import pytest

from specem_integrations.cli import main
from specem_integrations.server._admission import Admission, QueueFullError


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-key-env", "SPECEM_TEST_SURELY_UNSET_VAR"], "SPECEM_TEST_SURELY_UNSET_VAR is not set"),
        (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
        (["--queue", "-1"], "--queue must be at least 0"),
        (["--request-batch-size", "0"], "--request-batch-size must be at least 1"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--segment-len", "0"], "segment_len"),
        (["--served-model-name", " "], "--served-model-name must not be empty"),
    ],
)
def test_bad_options_exit_2_before_loading(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECEM_TEST_SURELY_UNSET_VAR", raising=False)
    code, err = _run(["serve", "--model", "no-such-model-anywhere", *argv], capsys)
    assert code == 2
    assert err.startswith("specem: error:")
    assert message in err


def test_busy_port_fails_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = _run(["serve", "--model", "no-such-model-anywhere", "--port", str(port)], capsys)
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_unknown_model_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(["serve", "--model", "no-such-model-anywhere", "--port", "0"], capsys)
    assert code == 2
    assert "unknown model" in err


def test_help_lists_the_options() -> None:
    out = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stdout(out):
        main(["serve", "--help"])
    text = out.getvalue()
    for option in (
        "--model",
        "--backend",
        "--host",
        "--port",
        "--api-key-env",
        "--max-concurrency",
        "--request-batch-size",
        "--queue",
        "--request-timeout",
        "--served-model-name",
        "--segment-len",
        "--log-format",
        "--metrics-public",
    ):
        assert option in text


def test_an_unknown_log_format_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "no-such-model-anywhere", "--log-format", "xml"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'xml'" in capsys.readouterr().err


async def test_admission_bounds_and_fifo() -> None:
    admission = Admission(max_concurrency=2, queue=2)
    await admission.acquire()
    await admission.acquire()
    assert (admission.running, admission.waiting) == (2, 0)
    order: list[str] = []

    async def wait(name: str) -> None:
        await admission.acquire()
        order.append(name)

    first = asyncio.ensure_future(wait("first"))
    second = asyncio.ensure_future(wait("second"))
    await asyncio.sleep(0)
    assert admission.waiting == 2
    with pytest.raises(QueueFullError) as info:
        await admission.acquire()
    assert info.value.retry_after >= 1

    admission.release(1.0)  # the slot passes to the first waiter
    await first
    assert order == ["first"]
    assert (admission.running, admission.waiting) == (2, 1)

    second.cancel()  # a waiter that goes away leaves the queue
    with pytest.raises(asyncio.CancelledError):
        await second
    assert admission.waiting == 0
    for _ in range(2):
        admission.release(1.0)
    assert admission.running == 0
    await admission.acquire()
    assert admission.running == 1


async def test_admission_without_queue_refuses_at_once() -> None:
    admission = Admission(max_concurrency=1, queue=0)
    await admission.acquire()
    with pytest.raises(QueueFullError):
        await admission.acquire()
    admission.release(None)
    await admission.acquire()
    assert admission.running == 1
