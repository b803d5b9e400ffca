"""Shared fixtures: tiny in-process models (fast) and the real packaged models (slow)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# what a server member's probe finds is cached per server (specem_core.backends.http.probe_cache):
# tests, and the servers and CLIs they start, write nothing to disk, and each test starts empty
os.environ["SPECEM_PROBE_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _empty_probe_cache() -> None:
    from specem_core.backends.http import probe_cache

    probe_cache.clear(disk=False)


@pytest.fixture(scope="session")
def tiny_members() -> list[Any]:
    """Llama (ChatML BPE) + Qwen2 (turns BPE) + Gemma 3 (turns BPE, sliding window 16)."""
    import tiny

    return [tiny.member("llama"), tiny.member("qwen2"), tiny.member("gemma3")]


@pytest.fixture(scope="session")
def paper_members() -> list[Any]:
    """The real packaged first default pair, SmolLM2-135M + Qwen2.5-Coder-0.5B (the ``paper``
    preset's members; on llama.cpp, or transformers from the local fp32 cache)."""
    from specem_core.presets import preset_members

    return preset_members("paper")


@pytest.fixture(scope="session")
def smollm2_server() -> Iterator[Any]:
    """One real ``python -m llama_cpp.server`` over the packaged SmolLM2 GGUF for the whole test
    session (``llama_server.start_server``), stopped at the end."""
    from llama_server import llama_cpp_available, start_server

    if not llama_cpp_available():
        pytest.skip("llama-cpp-python[server] is not installed (scripts/build_llama_cpp.sh builds and installs it)")
    server = start_server("smollm2", n_threads=1, n_ctx=2048)
    try:
        yield server
    finally:
        server.stop()
