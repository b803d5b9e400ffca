"""The vocabulary of a loaded GGUF: tokenizing, token pieces, attributes and end-of-generation ids."""

from __future__ import annotations

import ctypes
from typing import Any

from specem_core.backends.llama_cpp._binding import LlamaCppError


class GgufVocabulary:
    """Tokenizer helpers of :class:`~specem_core.backends.llama_cpp.LlamaCppModel` (over its
    ``llama_vocab``; the pieces, texts and attributes are computed once per model)."""

    lib: Any
    name: str
    n_vocab: int
    _vocab: Any
    _pieces: list[bytes] | None
    _texts: list[str] | None
    _attrs: list[int] | None
    _eog: frozenset[int] | None

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text`` (``parse_special``: control-token text such as ``<|im_start|>`` is one token)."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        for _ in range(2):
            out = (ctypes.c_int32 * cap)()
            n = int(self.lib.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special))
            if n >= 0:
                return list(out[:n])
            cap = -n
        raise LlamaCppError(f"{self.name}: tokenization failed")

    def piece(self, token: int) -> bytes:
        """The bytes one token stands for (control tokens render as nothing)."""
        return self._all_pieces()[token] if 0 <= token < self.n_vocab else b""

    def _all_pieces(self) -> list[bytes]:
        if self._pieces is None:
            buf = ctypes.create_string_buffer(256)
            pieces = []
            for t in range(self.n_vocab):
                n = int(self.lib.llama_token_to_piece(self._vocab, t, buf, 256, 0, False))
                pieces.append(buf.raw[:n] if n > 0 else b"")
            self._pieces = pieces
        return self._pieces

    def piece_texts(self) -> list[str]:
        """Each token's bytes as text ('' where they are not whole UTF-8 characters); computed once
        per model, shared by its members (token healing)."""
        if self._texts is None:
            texts = []
            for piece in self._all_pieces():
                try:
                    texts.append(piece.decode("utf-8"))
                except UnicodeDecodeError:
                    texts.append("")
            self._texts = texts
        return self._texts

    def token_attrs(self) -> list[int]:
        """``llama_token_attr`` flags of every token."""
        if self._attrs is None:
            self._attrs = [int(self.lib.llama_vocab_get_attr(self._vocab, t)) for t in range(self.n_vocab)]
        return self._attrs

    def end_of_generation_ids(self) -> frozenset[int]:
        """Tokens that end a generation (EOS, EOT, ``<|im_end|>``…)."""
        if self._eog is None:
            self._eog = frozenset(t for t in range(self.n_vocab) if self.lib.llama_vocab_is_eog(self._vocab, t))
        return self._eog

    def token_text(self, token: int) -> str:
        """The text of one token as rendered in a chat template (special tokens included)."""
        buf = ctypes.create_string_buffer(256)
        n = int(self.lib.llama_token_to_piece(self._vocab, token, buf, 256, 0, True))
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")
