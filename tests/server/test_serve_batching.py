"""Cross-request batching behind a real ``specem serve``: concurrent requests on transformers
members share decode passes (``/health`` shows it) and answer exactly as they do one at a time."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from serve_process import ServeProcess, start_serve

PROMPTS = [
    "Explain why the sky is blue.",
    "Give advice to someone learning to cook.",
    "Describe the rules of chess in simple words.",
    "What are the benefits of regular exercise?",
]


@pytest.fixture(scope="module")
def transformers_server() -> Iterator[ServeProcess]:
    server = start_serve(["--model", "smollm2", "--backend", "transformers", "--max-concurrency", "4", "--queue", "4"])
    try:
        yield server
    finally:
        server.cleanup()


def _ask(server: ServeProcess, prompt: str) -> str:
    body: dict[str, Any] = {
        "model": "specem",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 24,
        "temperature": 0,
        "specem": {"ignore_eos": True},
    }
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120.0)
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


def _batching(server: ServeProcess) -> dict[str, Any]:
    queues: dict[str, dict[str, Any]] = server.health()["decode_batching"]
    assert list(queues) == ["torch:cpu"]
    return queues["torch:cpu"]


def test_concurrent_requests_share_decode_passes_and_answer_as_alone(transformers_server: ServeProcess) -> None:
    alone = [_ask(transformers_server, p) for p in PROMPTS]
    before = _batching(transformers_server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _ask(transformers_server, p), PROMPTS))
    after = _batching(transformers_server)
    assert together == alone
    steps, passes = after["decode_steps"] - before["decode_steps"], after["passes"] - before["passes"]
    assert steps >= len(PROMPTS) * 20
    assert steps / passes > 1.5, after  # four requests drafting at once mostly share their passes
    assert after["largest"] >= 3
    transformers_server.wait_idle()


def test_request_batch_size_1_turns_batching_off() -> None:
    server = start_serve(["--model", "smollm2", "--backend", "transformers", "--request-batch-size", "1"])
    try:
        assert server.health()["decode_batching"] == {}
        assert _ask(server, PROMPTS[0])
    finally:
        server.cleanup()


def test_continuous_batching_shares_llama_cpp_calls_across_requests() -> None:
    """``--continuous-batching``: concurrent requests on a llama.cpp member share its decode calls
    (``/health`` shows them per model); every request is answered in full."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    server = start_serve(
        ["--model", "smollm2", "--backend", "llamacpp", "--continuous-batching", "--max-concurrency", "4"]
    )
    try:
        (name, before), *others = server.health()["decode_batching"].items()
        assert not others
        assert name.startswith("llama.cpp:")
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: _ask(server, p), PROMPTS))
        assert all(together)
        after = server.health()["decode_batching"][name]
        assert after["jobs"] - before["jobs"] >= len(PROMPTS) * 20
        assert after["shared_calls"] > before["shared_calls"]
        assert after["largest"] >= 3
        server.wait_idle()
    finally:
        server.cleanup()


def test_without_continuous_batching_llama_cpp_reports_no_queue() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    server = start_serve(["--model", "smollm2", "--backend", "llamacpp"])
    try:
        assert server.health()["decode_batching"] == {}
    finally:
        server.cleanup()
