"""Engines shared by the LangChain tests, each built once per test session.

``real_engine()`` runs the embedded default pair (SmolLM2-135M-Instruct + Qwen2.5-Coder-0.5B-
Instruct, real packaged weights); only ``slow`` tests use it. ``tiny_engine()`` runs tiny random
models with real trained tokenizers (fast, meaningless text).
"""

from __future__ import annotations

import functools

from specem_core import SpecEM, SpecEMConfig

REAL_MAX_TOKENS = 40
"""Answer cap of the real-model tests: the ensemble decodes ~2-4 tokens/s on a 2-core CPU."""


@functools.cache
def real_engine() -> SpecEM:
    from specem_core.presets import preset_members

    return SpecEM(preset_members("paper"), SpecEMConfig(max_new_tokens=REAL_MAX_TOKENS))


@functools.cache
def tiny_engine() -> SpecEM:
    import tiny

    return SpecEM([tiny.member("llama"), tiny.member("qwen2")], SpecEMConfig(max_new_tokens=12, segment_len=4))
