"""Diagnostics of the llama.cpp backend: from-scratch evaluation, batch noise, plain greedy decoding.

What the tests, the naive reference loop, the build check and the speed benchmark compare the
cached sessions with; nothing in a request's path uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specem_core.backends.llama_cpp import LlamaCppModel
from specem_core.backends.llama_cpp._binding import Work


def evaluate_from_scratch(model: LlamaCppModel, ids: Sequence[int], positions: Callable[[int], bool]) -> dict[int, Any]:
    """Logit rows of ``ids`` evaluated in a fresh context (no cache reuse): the reference the
    tests and the naive loop compare the cached sessions with. ``positions(i)`` selects rows."""
    ctx = model.acquire_context()
    try:
        n = len(ids)
        work = Work(list(ids), list(range(n)), [0] * n, [-1 if positions(i) else None for i in range(n)])
        return ctx.decode(work).rows
    finally:
        model.release_context(ctx)


def batch_noise(model: LlamaCppModel, ids: Sequence[int]) -> float:
    """How far ``model``'s logits move when ``ids`` are decoded one token per call instead of in one
    batch (max |diff| over every position's raw logits). llama.cpp's kernels are batch-invariant
    for some quantization types only: 0.0 for Q4_1 below 64 positions, about 0.3-0.5 for Qwen2.5's
    Q4_K/Q5_0/Q6_K rows, several units for Gemma 3. A cached session mixes both schedules, so it
    cannot be closer to one from-scratch evaluation than this."""
    batched = evaluate_from_scratch(model, ids, lambda i: True)
    ctx = model.acquire_context()
    try:
        worst = 0.0
        for i, token in enumerate(ids):
            row = ctx.decode(Work([token], [i], [0], [-1])).rows[0]
            worst = max(worst, float(abs(row - batched[i]).max()))
        return worst
    finally:
        model.release_context(ctx)


def generate_greedy(
    model: LlamaCppModel, ids: Sequence[int], max_tokens: int, *, banned: Sequence[int] = ()
) -> list[int]:
    """Plain greedy decoding of one model, one token per ``llama_decode`` (no ensemble): the floor
    the speed benchmark compares the engine with. ``banned`` tokens (e.g. EOS) are never picked."""
    import numpy as np

    ctx = model.acquire_context()
    try:
        out: list[int] = []
        feed, pos = list(ids), 0
        while len(out) < max_tokens:
            n = len(feed)
            row = ctx.decode(Work(feed, list(range(pos, pos + n)), [0] * n, [None] * (n - 1) + [-1])).rows[n - 1]
            pos += n
            if banned:
                row[list(banned)] = -np.inf
            out.append(int(np.argmax(row)))
            feed = [out[-1]]
        return out
    finally:
        model.release_context(ctx)
