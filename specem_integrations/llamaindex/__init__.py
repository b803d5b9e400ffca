"""LlamaIndex integration: the SpecEM ensemble as a LlamaIndex LLM.

Example:
    >>> from llama_index.core import Settings
    >>> from specem_integrations.llamaindex import SpecEMLLM
    >>> Settings.llm = SpecEMLLM(max_new_tokens=64)

Needs ``.venv/bin/pip install -e '.[llamaindex]'`` (llama-index-core 0.14).
"""

from __future__ import annotations

try:
    import llama_index.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "specem_integrations.llamaindex needs llama-index-core: .venv/bin/pip install -e '.[llamaindex]'"
    ) from exc

from specem_integrations.llamaindex.base import SpecEMLLM
from specem_integrations.llamaindex.embeddings import SentenceTransformerEmbedding

__all__ = ["SentenceTransformerEmbedding", "SpecEMLLM"]
