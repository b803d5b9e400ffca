"""The soak benchmark (``benchmarks/serve_soak.py``): mixed traffic against a real ``specem serve``
on the packaged members must lose nothing, answer every request without an error it did not ask
for (a soak of 5xx is not a pass) and leave no session behind; every greedy answer is compared
with the answer its prompt got alone before the traffic (not merely with the server's own trace).

For 2 minutes on llama.cpp members (in process), where the comparison is recorded but a difference
is not a fault by itself (a near tie can flip with the KV-cache cells a context lands in: see the
benchmark's docstring); for 1 minute on transformers members, where a greedy answer is the same
alone and batched, so every answer must equal its reference. The 30-minute run is the benchmark's
(``benchmarks/results/serve_soak.json``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from script_loader import load_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None,
        reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh builds and installs it)",
    ),
]


def test_two_minute_soak_loses_nothing_and_leaves_no_session(tmp_path: Path) -> None:
    soak = load_script("benchmarks/serve_soak.py", "serve_soak_2min")
    out = tmp_path / "soak.json"
    assert soak.main(["--minutes", "2", "--window-minutes", "0.5", "--concurrency", "8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["lost"] == 0, result["problems"]
    assert result["corrupted"] == 0, result["problems"]
    assert result["errors"] == 0, result["problems"]  # a soak of 5xx with error bodies is not a pass
    assert result["outcomes"]["error"] == 0
    # every complete greedy answer was compared with the answer its prompt got alone
    assert len(result["reference"]) == 6
    assert all(isinstance(text, str) and text for text in result["reference"].values())
    completed = result["by_kind"]["stream"].get("completed", 0) + result["by_kind"]["plain"].get("completed", 0)
    assert result["compared"] == completed > 0
    assert 0 <= result["differs"] <= result["compared"]
    assert result["sessions_left"] == 0
    assert result["came_back_idle"]
    assert result["rss_growth"] is not None
    assert result["rss_growth"] < 0.20  # loose for 2 minutes; the 30-minute target is < 5 %
    assert len(result["windows"]) == 4
    kinds = result["by_kind"]
    assert kinds["stream"].get("completed", 0) > 0  # every kind of traffic ran and was checked
    assert kinds["plain"].get("completed", 0) > 0
    assert kinds["cancel"].get("cancelled", 0) > 0
    assert kinds["bad"].get("rejected", 0) > 0
    assert kinds["tools"].get("completed", 0) + kinds["json"].get("completed", 0) > 0
    assert out.with_suffix(".md").read_text().startswith("| window |")


def test_one_minute_soak_on_transformers_answers_as_alone(tmp_path: Path) -> None:
    soak = load_script("benchmarks/serve_soak.py", "serve_soak_transformers")
    out = tmp_path / "soak.json"
    args = ["--minutes", "1", "--window-minutes", "0.5", "--concurrency", "8", "--backend", "transformers"]
    assert soak.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["lost"], result["corrupted"], result["errors"]) == (0, 0, 0), result["problems"]
    completed = result["by_kind"]["stream"].get("completed", 0) + result["by_kind"]["plain"].get("completed", 0)
    assert result["compared"] == completed >= 5
    assert result["differs"] == 0, result["problems"]  # batched or alone, the same greedy answer
    assert result["sessions_left"] == 0
    assert result["came_back_idle"]
