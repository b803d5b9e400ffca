"""Shared fixtures: tiny in-process models (fast) and the real packaged default models (slow)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_cuda = torch.cuda.is_available()
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="no CUDA device visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_members() -> list[Any]:
    """Llama (ChatML BPE) + Qwen2 (turns BPE) + Gemma 3 (turns BPE, sliding window 16)."""
    import tiny

    return [tiny.member("llama"), tiny.member("qwen2"), tiny.member("gemma3")]


@pytest.fixture(scope="session")
def default_members() -> list[Any]:
    """The real packaged default pair (converted once into the local cache)."""
    from specem_core.registry import default_members

    return default_members()
