"""A Hugging Face causal LM as a SpecEM member: loading, chat format, tokenizer helpers, sessions."""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specem_core.backends._local import LocalVocabulary
from specem_core.backends._prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS, PrefixStore
from specem_core.backends.base import SessionRequest
from specem_core.backends.transformers.batched import BatchedPasses
from specem_core.backends.transformers.session import TransformersSession
from specem_core.chat_format import ChatFormat
from specem_core.errors import ModelNotFoundError
from specem_core.gguf import validate_gguf


class TransformersMember(BatchedPasses, LocalVocabulary):
    """A Hugging Face causal LM as a SpecEM member.

    Example:
        >>> member = TransformersMember.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")  # doctest: +SKIP
        >>> member = TransformersMember.from_pretrained("models/", gguf_file="qwen.gguf")       # doctest: +SKIP
        >>> member = TransformersMember(model, tokenizer, name="tiny")   # already-loaded objects

    Args:
        model: a loaded ``PreTrainedModel`` for causal LM.
        tokenizer: its tokenizer.
        name: unique name in the ensemble (default: the model's name or path).
        can_draft: this member proposes candidates.
        can_verify: this member scores candidates.
        chat_template: overrides the tokenizer's template; ``None`` keeps it (a tokenizer without
            one uses the plain format of :mod:`specem_core.chat_format`).
        request_batch_size: at most this many concurrent sessions' decode steps share one forward
            pass (see :attr:`request_batch_size`); 1 turns cross-request batching off.
        prefix_cache: keep the KV rows of finished requests (prompt and committed answer), so that
            a request sharing a prefix with one of them (the next turn of a chat, the same system
            prompt or RAG context) prefills only what is new. Entries are read-only and shared by
            every session that matches them.
        prefix_cache_tokens: most tokens kept in all; past it the least recently used prefixes are
            dropped (default :data:`~specem_core.backends._prefix_cache.DEFAULT_PREFIX_CACHE_TOKENS`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str | None = None,
        can_draft: bool = True,
        can_verify: bool = True,
        chat_template: str | None = None,
        request_batch_size: int = 16,
        prefix_cache: bool = True,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
    ) -> None:
        self.request_batch_size = request_batch_size
        """At most this many concurrent requests' one-token decode steps share a forward pass (1: each
        request runs its own passes); settable, validated when set."""
        self.prefix_cache = prefix_cache
        """Finished requests leave their KV rows for later requests that share their prefix."""
        self.prefixes: PrefixStore[list[tuple[Any, Any]]] = PrefixStore(prefix_cache_tokens)
        """Finished requests' KV rows (per layer: keys, values), by the token ids they hold."""
        self.model = model.eval()
        """The ``PreTrainedModel`` (in eval mode)."""
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns)
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.tokenizer = tokenizer
        """Its tokenizer."""
        self.name = name or _default_name(model)
        """Unique name in the ensemble: traces, weights and usage are keyed by it."""
        self.can_draft = can_draft
        """This member proposes candidates."""
        self.can_verify = can_verify
        """This member scores candidates."""
        self.chat = ChatFormat(tokenizer, chat_template)
        self.device = model.get_input_embeddings().weight.device
        """The device holding the model's input embeddings (where prompts are sent)."""
        self.eot_id = self._find_end_of_turn()
        self.stop_ids = frozenset(self._collect_stop_ids())
        self.pad_id = self.eot_id
        # Control tokens other than the end of turn never belong in a drafted answer. A tokenizer
        # may know more ids than the model has output rows (a token added after training, or on
        # reloading a saved tokenizer): the model can never pick those, so only its own are banned.
        outputs = _output_rows(model)
        self.suppress_ids = sorted(t for t in _special_ids(tokenizer) - self.stop_ids if t < outputs)
        self.stop_ids_in_vocab = sorted(t for t in self.stop_ids if t < outputs)
        """The stop ids the model can emit (banned when ``ignore_eos``)."""

    @classmethod
    def from_pretrained(
        cls,
        model_id_or_path: str | os.PathLike[str],
        *,
        name: str | None = None,
        gguf_file: str | None = None,
        dtype: Any = "auto",
        device: str | None = None,
        device_map: Any = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        can_draft: bool = True,
        can_verify: bool = True,
        chat_template: str | None = None,
        request_batch_size: int = 16,
        prefix_cache: bool = True,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        **model_kwargs: Any,
    ) -> TransformersMember:
        """Load a model from an HF id, a local directory, or a GGUF file.

        Args:
            model_id_or_path: hub id, directory, or a path ending in ``.gguf``.
            gguf_file: GGUF file name inside ``model_id_or_path`` (dequantized on load).
            dtype: ``"auto"`` (fp32 on CPU, bf16 on CUDA), a name such as ``"float16"``, or a
                ``torch.dtype``.
            device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``…; default CUDA when available.
            device_map: passed to transformers (e.g. ``"auto"`` to spread a large model over GPUs).
            request_batch_size: see :attr:`request_batch_size`.

        Raises:
            ModelNotFoundError: nothing loadable at that id or path; a local GGUF file that is
                missing, not GGUF, or truncated (checked by :func:`specem_core.gguf.validate_gguf`
                before anything is loaded).
        """
        source = str(model_id_or_path)
        if gguf_file is None and source.endswith(".gguf"):
            path = Path(source)
            validate_gguf(path)
            source, gguf_file = str(path.parent), path.name
        elif gguf_file is not None and Path(source).is_dir():
            validate_gguf(Path(source) / gguf_file)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if device is None and device_map is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = _resolve_dtype(dtype, device or "cuda")
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, **model_kwargs}
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # one bar per weight file is noise in a CLI / notebook
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            if attn_implementation:
                kwargs["attn_implementation"] = attn_implementation
            if device_map is not None:
                kwargs["device_map"] = device_map
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelNotFoundError(f"could not load model {str(model_id_or_path)!r}: {first}") from exc
        if device_map is None and device is not None:
            model = model.to(device)  # type: ignore[arg-type]
        return cls(
            model,
            tokenizer,
            name=name or Path(str(model_id_or_path)).name or None,
            can_draft=can_draft,
            can_verify=can_verify,
            chat_template=chat_template,
            request_batch_size=request_batch_size,
            prefix_cache=prefix_cache,
            prefix_cache_tokens=prefix_cache_tokens,
        )

    # -- Member protocol --------------------------------------------------------------------
    @property
    def context_window(self) -> int | None:
        """``max_position_embeddings`` of the model config, if set."""
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def concurrency_key(self) -> str:
        """The device holding the input embeddings; on a CPU with cross-request batching on, the
        device and the model: the device queue runs one pass at a time anyway, so members on one
        CPU draft side by side, and every request then has steps waiting for each model's next
        merged pass. On a GPU the members of one request run one after another: a small model's
        pass there is a string of short kernel launches, and two drafting threads trading the GIL
        at every launch made a lone request about 4x slower (``benchmarks/gpu_check.py`` on an
        H100: 27.1 s against 6.9 s for 128 tokens)."""
        if self._request_batch_size > 1 and self.device.type == "cpu":
            return self._model_key()
        return f"torch:{self.device}"

    def _model_key(self) -> str:
        """A key of its own per model on its device (members with different keys run concurrently)."""
        return f"torch:{self.device}#{id(self.model):x}"

    def open(self, request: SessionRequest) -> TransformersSession:
        """Render and encode the prompt and check that it fits (cheap: the prompt is prefilled on
        the session's first draft, score or commit).

        Raises:
            ContextWindowError: the prompt does not fit in :attr:`context_window`.
        """
        return TransformersSession(self, request)

    def __repr__(self) -> str:
        return (
            f"TransformersMember(name={self.name!r}, device={self.device}, "
            f"draft={self.can_draft}, verify={self.can_verify})"
        )

    # -- tokenizer helpers ------------------------------------------------------------------
    def _tokenize_prompt(self, text: str, add_special: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special))

    def encode_response(self, text: str) -> list[int]:
        """Canonical ids of the response text (it follows the prompt, so no special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _never_drafted(self) -> set[int]:
        return set(self.stop_ids) | set(self.suppress_ids) | _special_ids(self.tokenizer)

    def _decode_text(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    def _token_texts(self) -> list[str]:
        if "_texts" not in self.__dict__:
            vocab = len(self.tokenizer)
            self.__dict__["_texts"] = [self.tokenizer.decode([i]) for i in range(vocab)]
        texts: list[str] = self.__dict__["_texts"]
        return texts

    def _find_end_of_turn(self) -> int:
        after = self.chat.end_of_turn_text()
        special = _special_ids(self.tokenizer)
        if after:
            ids = self.tokenizer.encode(after, add_special_tokens=False)
            if ids and ids[0] in special:
                return int(ids[0])
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(self.model.generation_config, "eos_token_id", None)
            if isinstance(eos, list):
                eos = eos[0] if eos else None
        if eos is None:
            raise ModelNotFoundError(f"{self.name}: the tokenizer defines no EOS / end-of-turn token")
        return int(eos)

    def _collect_stop_ids(self) -> set[int]:
        ids = {self.eot_id}
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(x) for x in source)
        return ids


def _output_rows(model: Any) -> int:
    """How many token ids the model's head scores (its logits' width)."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return int(getattr(model.config, "vocab_size", 0) or 1 << 62)


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return ids


def _default_name(model: Any) -> str:
    path = str(getattr(model.config, "_name_or_path", "") or "")
    return Path(path).name or str(getattr(model.config, "model_type", "model"))


def _resolve_dtype(dtype: Any, device: str) -> Any:
    import torch

    if dtype == "auto" or dtype is None:
        if str(device).startswith("cuda") and torch.cuda.is_available():
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype):
            raise ModelNotFoundError(f"unknown dtype {dtype!r}")
        return value
    return dtype
