"""The soak benchmark (``benchmarks/serve_soak.py``) for 2 minutes: mixed traffic against a real
``specem serve`` on the packaged members (llama.cpp in process) must lose and corrupt nothing and
leave no session behind. The 30-minute run is the benchmark's (``benchmarks/results/serve_soak.json``)."""

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
