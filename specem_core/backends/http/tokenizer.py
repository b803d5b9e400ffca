"""A server member's local tokenizer: loading it, what it tells about stop tokens and the end of a
turn. A tokenizer is optional: it gives the chat template and exact token counts; a Jinja
``chat_template`` alone renders through :class:`TemplateOnly`, which counts no tokens."""

from __future__ import annotations

import contextlib
import os
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


def load_tokenizer(spec: str | os.PathLike[str]) -> Any:
    """A Hugging Face tokenizer from a directory or a Hugging Face model id.

    The name of a packaged default model (``"smollm2"``) is not resolved here: the registry turns
    it into its converted directory first (:func:`specem_core.registry.resolve_tokenizer`, which
    :func:`specem_core.registry.load_member` applies to ``tokenizer=``).

    Raises:
        ModelNotFoundError: nothing loadable there.
    """
    text = str(spec)
    path = Path(text).expanduser()
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
