"""Member weights learned by ``specem serve`` when the state file cannot be written: the answer the
ensemble made is returned (200), a warning is logged, and the weights keep learning in memory.

Served in process (Starlette's TestClient) over two tiny transformers members with different
tokenizers, so that greedy drafts differ and every request teaches the weights. Saving fails for a
real reason: a directory stands where :meth:`MemberWeights.save` writes its temporary file.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from specem_core import SpecEM, SpecEMConfig
from specem_core.weights import MemberWeights

pytest.importorskip("starlette", reason="the server extra is not installed (pip install -e '.[server]')")


def _blocked(path: Path) -> Path:
    """Make saving ``path`` fail: its temporary file (``<name>.<pid>.tmp``) is a directory."""
    blocker = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    blocker.mkdir()
    return blocker


@pytest.mark.parametrize("stream", [False, True])
def test_an_unwritable_state_file_keeps_the_answer_and_logs_a_warning(
    tiny_members: list[Any], tmp_path: Path, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    from starlette.testclient import TestClient

    from specem_integrations.server.app import create_app

    path = tmp_path / "weights.json"
    weights = MemberWeights.open(path)  # written now: the file is valid and readable
    saved = path.read_text()
    _blocked(path)
    engine = SpecEM(tiny_members[:2], SpecEMConfig(segment_len=4, max_new_tokens=12), member_weights=weights)
    body = {"model": "specem", "messages": [{"role": "user", "content": "Hello!"}], "stream": stream}
    with TestClient(create_app(engine)) as client, caplog.at_level(logging.WARNING, logger="specem.weights"):
        response = client.post("/v1/chat/completions", json=body)
        health = client.get("/health").json()
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert all("error" not in e for e in events), events
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        assert events[-1]["choices"] == [] or events[-1]["choices"][0]["finish_reason"] == "length"
    else:
        text = response.json()["choices"][0]["message"]["content"]
    assert text  # the answer reached the client
    assert health["requests"]["failed"] == 0
    assert weights.requests == 1  # learned in memory
    assert path.read_text() == saved  # the file was not touched
    warnings = [r for r in caplog.records if r.name == "specem.weights" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert str(path) in warnings[0].getMessage()
