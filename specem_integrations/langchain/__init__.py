"""LangChain integration: :class:`ChatSpecEM`, a SpecEM ensemble as a LangChain chat model.

:class:`SentenceTransformerEmbeddings` embeds with a local sentence-transformers model (offline RAG).

Requires ``langchain-core`` (``.venv/bin/pip install -e '.[langchain]'``).
"""

from __future__ import annotations

try:
    import langchain_core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "specem_integrations.langchain needs langchain-core: .venv/bin/pip install -e '.[langchain]'"
    ) from exc

from specem_integrations.langchain.chat_models import ChatSpecEM
from specem_integrations.langchain.embeddings import SentenceTransformerEmbeddings

__all__ = ["ChatSpecEM", "SentenceTransformerEmbeddings"]
