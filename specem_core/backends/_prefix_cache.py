"""The prefix cache of the local backends: KV prefixes of finished requests, matched on token ids,
so that a follow-up turn, or another request with the same system prompt, prefills only what is
new (llama.cpp keeps whole contexts, transformers ``DynamicCache`` rows; the store is generic).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from specem_core.errors import ConfigError

DEFAULT_PREFIX_CACHE_TOKENS = 16384
"""Tokens of finished requests' prefixes a member (transformers) or a model (llama.cpp, where each
idle context is charged its ``n_ctx`` KV cells) keeps by default (``prefix_cache_tokens``); the
memory this costs is measured in the Performance report."""
MIN_SHARED_FRACTION = 0.1
"""A cached prefix is worth taking over (rather than a free KV cache) when it covers at least this
share of the new prompt (the llama.cpp server's ``--slot-prompt-similarity`` default)."""

T = TypeVar("T")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_prefix_cache_tokens(value: int) -> int:
    """``prefix_cache_tokens`` checked: a budget of 0 or more tokens."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"prefix_cache_tokens must be an integer >= 0 (tokens kept per member), got {value!r}")
    return value


@dataclass
class CachedPrefix(Generic[T]):
    """One finished request's KV prefix: the token ids it holds and the backend's handle on them."""

    ids: tuple[int, ...]
    value: T
    last_used: int = 0


@dataclass
class PrefixMatch(Generic[T]):
    """The entry a new prompt shares the longest prefix with, and how many tokens it can reuse."""

    entry: CachedPrefix[T]
    reused: int


class PrefixStore(Generic[T]):
    """KV prefixes of finished requests, matched on token ids (never text).

    ``find`` returns the entry sharing the longest common prefix with a new prompt (ties: the least
    recently used, as the llama.cpp server picks its slots), capped at ``len(prompt) - 1`` so that at
    least one token is decoded for fresh next-token logits. ``add`` keeps at most ``budget_tokens``
    tokens in all, evicting the least recently used entries, and supersedes an entry whose ids
    are a prefix of the new one (the same conversation one turn earlier). Thread-safe.

    Args:
        budget_tokens: most tokens all entries together are charged (0 keeps nothing).
        on_evict: called with each evicted entry's value (frees what it holds).
        cost: tokens an entry is charged for its ids (default: their number; a llama.cpp context
            is charged the KV cells it reserves, whatever it holds).
    """

    def __init__(
        self,
        budget_tokens: int,
        on_evict: Callable[[T], None] | None = None,
        cost: Callable[[Sequence[int]], int] = len,
    ) -> None:
        self.budget_tokens = check_prefix_cache_tokens(budget_tokens)
        self._on_evict = on_evict
        self._cost = cost
        self._entries: list[CachedPrefix[T]] = []
        self._clock = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens all entries are charged against the budget."""
        with self._lock:
            return sum(self._cost(e.ids) for e in self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def find(self, prompt: Sequence[int], *, min_reused: int = 1, take: bool = False) -> PrefixMatch[T] | None:
        """The entry with the longest common prefix of at least ``min_reused`` tokens, or None.

        With ``take`` the entry leaves the store (an exclusive handle such as a llama.cpp context);
        otherwise it stays and only becomes the most recently used (shared, read-only tensors).
        """
        cap = len(prompt) - 1
        with self._lock:
            best: PrefixMatch[T] | None = None
            for entry in self._entries:
                reused = min(common_prefix(entry.ids, prompt), cap)
                if reused < max(min_reused, 1):
                    continue
                if (
                    best is None
                    or reused > best.reused
                    or (reused == best.reused and entry.last_used < best.entry.last_used)
                ):
                    best = PrefixMatch(entry, reused)
            if best is None:
                return None
            if take:
                self._entries.remove(best.entry)
            else:
                best.entry.last_used = next(self._clock)
            return best

    def pop_least_recent(self) -> CachedPrefix[T] | None:
        """Remove and return the least recently used entry (None when empty); not evicted: the
        caller takes over its value."""
        with self._lock:
            if not self._entries:
                return None
            entry = min(self._entries, key=lambda e: e.last_used)
            self._entries.remove(entry)
            return entry

    def add(self, ids: Sequence[int], value: T) -> bool:
        """Keep ``value`` for ``ids`` as the most recently used entry; False (nothing kept, and the
        value evicted) when ``ids`` is empty or longer than the whole budget."""
        key = tuple(ids)
        evicted: list[T] = []
        kept = False
        with self._lock:
            if key and self._cost(key) <= self.budget_tokens:
                for entry in [e for e in self._entries if key[: len(e.ids)] == e.ids]:
                    self._entries.remove(entry)  # the same conversation, shorter: superseded
                    evicted.append(entry.value)
                self._entries.append(CachedPrefix(key, value, next(self._clock)))
                kept = True
                total = sum(self._cost(e.ids) for e in self._entries)
                while total > self.budget_tokens:
                    oldest = min(self._entries, key=lambda e: e.last_used)
                    self._entries.remove(oldest)
                    total -= self._cost(oldest.ids)
                    evicted.append(oldest.value)
            else:
                evicted.append(value)
        for value_out in evicted:
            if self._on_evict is not None:
                self._on_evict(value_out)
        return kept

    def values(self) -> list[T]:
        """The entries' values."""
        with self._lock:
            return [e.value for e in self._entries]

    def clear(self) -> None:
        """Evict every entry."""
        with self._lock:
            entries, self._entries = self._entries, []
        for entry in entries:
            if self._on_evict is not None:
                self._on_evict(entry.value)
