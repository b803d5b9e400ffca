"""Shared fixtures: tiny in-process models (fast) and the real packaged models (slow)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
