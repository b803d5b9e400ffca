"""The packaged GGUF of a default model, or a skip naming the command that installs it."""

from __future__ import annotations

from pathlib import Path

import pytest


def packaged_gguf_or_skip(name: str) -> Path:
    """The ``.gguf`` of packaged model ``name`` (a verified GGUF in the cache will do)."""
    from specem_core.models import find_packaged, is_assembled, is_installed, packaged_gguf

    model = find_packaged(name)
    assert model is not None
    if not (is_installed(model) or is_assembled(model)):
        pytest.skip(f"{model.name} is not installed: specem models pull {model.name} --backend llamacpp")
    return packaged_gguf(model)
