"""Calls to several members at once: concurrently across devices and servers, one after another
on one (a member's ``concurrency_key``)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from specem_core.backends.base import Member

T = TypeVar("T")


class MemberPool:
    """Runs one call per member, concurrently across concurrency keys when allowed."""

    def __init__(self, members: Sequence[Member], parallel: bool | None) -> None:
        self._keys = [m.concurrency_key for m in members]
        keys = set(self._keys)
        self.parallel = (len(keys) > 1) if parallel is None else parallel
        self._executor = ThreadPoolExecutor(max_workers=len(members)) if self.parallel else None

    def map(self, fn: Callable[[int], T], indices: Sequence[int], members: Sequence[Member]) -> list[T | BaseException]:
        """``fn(i)`` for each index; exceptions are returned, not raised."""

        def safe(i: int) -> T | BaseException:
            try:
                return fn(i)
            except Exception as exc:
                return exc

        if self._executor is None or len(indices) < 2:
            return [safe(i) for i in indices]
        groups: dict[str, list[int]] = {}
        for i in indices:
            groups.setdefault(members[i].concurrency_key, []).append(i)

        def run_group(group: list[int]) -> list[T | BaseException]:
            return [safe(i) for i in group]  # one device / server: its members run one after another

        # each call runs in a copy of the caller's context (its context variables, e.g. a request id for logs)
        futures = {
            key: self._executor.submit(contextvars.copy_context().run, run_group, group)
            for key, group in groups.items()
        }
        by_index: dict[int, T | BaseException] = {}
        for key, fut in futures.items():
            for i, res in zip(groups[key], fut.result(), strict=True):
                by_index[i] = res
        return [by_index[i] for i in indices]

    def concurrent(self, indices: Sequence[int]) -> bool:
        """Whether these members' calls would run at the same time (different devices or servers)."""
        return self._executor is not None and len({self._keys[i] for i in indices}) > 1

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
