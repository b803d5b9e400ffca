"""The default preset on every surface: the same greedy request gives the same text through the
CLI, Python, LangChain, LlamaIndex and `specem serve` (slow: the real packaged members)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from serve_process import serving

pytestmark = pytest.mark.slow

PROMPT = "Name the largest planet of the solar system and say one fact about it."
TOKENS = 24


def test_the_same_request_gives_the_same_text_on_every_surface() -> None:
    from specem_core import SpecEM
    from specem_integrations.langchain import ChatSpecEM
    from specem_integrations.llamaindex import SpecEMLLM

    texts: dict[str, str] = {}
    texts["python"] = SpecEM.from_preset().generate(PROMPT, max_new_tokens=TOKENS).text
    texts["langchain"] = str(ChatSpecEM(max_tokens=TOKENS, temperature=0).invoke(PROMPT).content)
    texts["llamaindex"] = SpecEMLLM(max_tokens=TOKENS, temperature=0).complete(PROMPT).text
    proc = subprocess.run(
        [sys.executable, "-m", "specem_integrations.cli", "chat", PROMPT, "--max-tokens", str(TOKENS), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    cli = json.loads(proc.stdout)
    texts["cli"] = cli["text"]
    assert cli["members"] == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    with serving(["--max-concurrency", "1"]) as server:
        body = {"model": "specem", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS}
        response = httpx.post(f"{server.base_url}/chat/completions", json={**body, "temperature": 0}, timeout=300)
        response.raise_for_status()
        texts["server"] = response.json()["choices"][0]["message"]["content"]
        assert "preset quality" in server.log()
    assert texts["python"].strip()
    assert set(texts.values()) == {texts["python"]}, texts
