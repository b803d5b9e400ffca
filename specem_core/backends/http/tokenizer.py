"""A server member's local tokenizer: loading it, what it tells about stop tokens and the end of a
turn. A tokenizer is optional: it gives the chat template and exact token counts; a Jinja
``chat_template`` alone renders through :class:`TemplateOnly`, which counts no tokens."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specem_core.chat_format import ChatFormat, JinjaChatTemplate
from specem_core.errors import ModelNotFoundError


class TemplateOnly(JinjaChatTemplate):
    """Renders a Jinja chat template without a tokenizer (for ``chat_template=`` alone, or the
    template a GGUF file carries); it stands in for a tokenizer that counts no tokens.

    Args:
        template: the Jinja chat template.
        bos_token, eos_token: the texts templates write for ``bos_token`` / ``eos_token``.
        end_of_turn: the end-of-turn special token's text (``<|im_end|>``), when known.
        stop_ids: ids of the end-of-turn / end-of-sequence tokens (for ``ignore_eos``).
    """

    def __init__(
        self,
        template: str,
        bos_token: str = "",
        eos_token: str = "",
        *,
        end_of_turn: str | None = None,
        stop_ids: tuple[int, ...] = (),
    ) -> None:
        super().__init__(template, bos_token, eos_token)
        self.end_of_turn = end_of_turn
        self.stop_ids = tuple(stop_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return []


FILE_TOKENIZER_CLASSES = frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast",
                                    "PreTrainedTokenizerFast", "TokenizersBackend"})  # fmt: skip
"""``tokenizer_class`` values whose transformers tokenizer is exactly the directory's
``tokenizer.json`` (byte-level BPE; transformers rewrites nothing at load), so
:class:`TokenizerFile` reads it without importing transformers."""


class TokenizerFile(JinjaChatTemplate):
    """A tokenizer directory read with the ``tokenizers`` library alone: the ids, special tokens
    and chat template a server member needs, without importing transformers (seconds in a new
    process, on a member's first request). It offers what the member asks of a Hugging Face
    tokenizer: ``encode``, ``apply_chat_template``, ``eos_token_id``, ``convert_tokens_to_ids``,
    ``convert_ids_to_tokens``, ``all_special_ids`` and ``added_tokens_decoder``.

    Args:
        path: a directory holding ``tokenizer.json`` and ``tokenizer_config.json`` (the chat
            template there or in ``chat_template.jinja``).
    """

    def __init__(self, path: str | os.PathLike[str], config: dict[str, Any] | None = None) -> None:
        import json
        from types import SimpleNamespace

        from tokenizers import Tokenizer

        directory = Path(path)
        if config is None:  # ``tokenizer_config.json``, when the caller has not read it already
            config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers renders with "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja = directory / "chat_template.jinja"
        if not isinstance(template, str) and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        super().__init__(template or "", _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
        self.chat_template: str | None = template if isinstance(template, str) else None  # type: ignore[assignment]
        self.name_or_path = str(directory)
        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        added = config.get("added_tokens_decoder") or {}
        self.added_tokens_decoder = {
            int(i): SimpleNamespace(content=t.get("content", ""), special=bool(t.get("special")))
            for i, t in added.items()
            if isinstance(t, dict)
        }
        specials = {i for i, t in self.added_tokens_decoder.items() if t.special}
        named = (self.bos_token, self.eos_token, *(_token_text(config.get(k)) for k in ("unk_token", "pad_token")))
        specials |= {i for i in map(self.convert_tokens_to_ids, named) if i is not None}
        self.all_special_ids = sorted(specials)

    def __repr__(self) -> str:
        return f"TokenizerFile({self.name_or_path!r})"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def eos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.eos_token)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token) if token else None

    def convert_ids_to_tokens(self, index: int) -> str | None:
        return self._tokenizer.id_to_token(int(index))

    @staticmethod
    def reads(path: Path) -> bool:
        """Whether ``path`` is a directory this class reads as transformers would."""
        return _file_config(path) is not None


def _file_config(path: Path) -> dict[str, Any] | None:
    """``path``'s ``tokenizer_config.json`` when :class:`TokenizerFile` reads the directory as
    transformers would (a ``tokenizer.json`` beside it, a class in :data:`FILE_TOKENIZER_CLASSES`,
    ``tokenizers`` installed), else ``None``."""
    import importlib.util
    import json

    if not (path / "tokenizer.json").is_file() or not (path / "tokenizer_config.json").is_file():
        return None
    if importlib.util.find_spec("tokenizers") is None:
        return None
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and config.get("tokenizer_class") in FILE_TOKENIZER_CLASSES else None


def _token_text(value: Any) -> str:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return str(value.get("content") or "")
    return value if isinstance(value, str) else ""


def load_tokenizer(spec: str | os.PathLike[str]) -> Any:
    """A tokenizer from a directory or a Hugging Face model id: a directory whose tokenizer is a
    plain ``tokenizer.json`` (:data:`FILE_TOKENIZER_CLASSES`, e.g. Qwen2.5 and SmolLM2) is read
    with ``tokenizers`` alone (:class:`TokenizerFile`: no transformers import); anything else
    with transformers' ``AutoTokenizer``.

    The name of a packaged default model (``"smollm2"``) is not resolved here: the registry turns
    it into its converted directory first (:func:`specem_core.registry.resolve_tokenizer`, which
    :func:`specem_core.registry.load_member` applies to ``tokenizer=``).

    Raises:
        ModelNotFoundError: nothing loadable there.
    """
    text = str(spec)
    path = Path(text).expanduser()
    config = _file_config(path) if path.is_dir() else None
    if config is not None:
        return TokenizerFile(path, config)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - the [hf] extra is missing
        raise ModelNotFoundError("loading a tokenizer needs transformers: pip install 'specem[hf]'") from exc
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        hint = ""
        if "/" not in text and os.sep not in text and not path.exists():
            hint = " (for a packaged model name, pass tokenizer=specem_core.registry.resolve_tokenizer(name))"
        reason = str(exc).splitlines()[0] if str(exc) else exc
        raise ModelNotFoundError(f"no tokenizer at {text!r}: {reason}{hint}") from exc


def stop_token_ids(tokenizer: Any, end_of_turn: str | None) -> list[int]:
    """Ids of the end-of-turn / EOS tokens (for ``ignore_eos`` through ``logit_bias``), if known."""
    if isinstance(tokenizer, TemplateOnly):
        return sorted(set(tokenizer.stop_ids))
    if tokenizer is None:
        return []
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    if end_of_turn:
        with contextlib.suppress(Exception):
            value = tokenizer.convert_tokens_to_ids(end_of_turn)
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return sorted(ids)


def avoided_bias(tokenizer: Any, words: Sequence[str]) -> dict[str, float]:
    """A ``logit_bias`` that keeps ``words`` from being written (``copy_break``): the first token of
    each as a draft would start it (bare or after a space, lower case, capitalized or upper case)
    at -100; empty without a tokenizer, or without words."""
    if not words or tokenizer is None or isinstance(tokenizer, TemplateOnly):
        return {}
    ids: set[int] = set()
    for word in words:
        for form in (word, word.capitalize(), word.upper()):
            for text in (form, " " + form):
                with contextlib.suppress(Exception):
                    encoded = tokenizer.encode(text, add_special_tokens=False)
                    if encoded:
                        ids.add(int(encoded[0]))
    return {str(i): -100.0 for i in sorted(ids)}


def end_of_turn_token(chat: ChatFormat, tokenizer: Any) -> str | None:
    """The end-of-turn special token's text (e.g. ``<|im_end|>``), when the tokenizer knows it."""
    after = chat.end_of_turn_text()
    if isinstance(tokenizer, TemplateOnly) and tokenizer.end_of_turn and after:
        return tokenizer.end_of_turn if after.startswith(tokenizer.end_of_turn) else None
    if not after or tokenizer is None or isinstance(tokenizer, TemplateOnly):
        return None
    try:
        ids = tokenizer.encode(after, add_special_tokens=False)
        specials = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
        if ids and int(ids[0]) in specials:
            return str(tokenizer.convert_ids_to_tokens(int(ids[0])))
    except Exception:
        return None
    return None
