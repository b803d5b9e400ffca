"""The import contracts in pyproject.toml (``[tool.importlinter]``): the repository keeps them, and
a deliberate violation in a throw-away copy breaks them (so the check is not vacuous).

Both run ``lint-imports`` in a subprocess without its cache: nothing is written into the
repository, and nothing is fetched.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is a dev dependency (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specem_core", "specem_integrations")
FORBIDDEN = "specem_core does not import specem_integrations"


def lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contracts, analysing the packages found from ``cwd``
    (it puts ``cwd`` first on ``sys.path``)."""
    exe = Path(sys.executable).with_name("lint-imports")
    entry = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    command = [str(exe)] if exe.exists() else [sys.executable, "-c", entry]
    return subprocess.run(
        [*command, "--no-cache", "--config", str(ROOT / "pyproject.toml"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _python_only(directory: str, names: list[str]) -> set[str]:
    """``shutil.copytree`` ignore: copy packages and their ``.py`` files only."""
    return {n for n in names if n == "__pycache__" or (not n.endswith(".py") and not Path(directory, n).is_dir())}


def test_repository_keeps_every_import_contract() -> None:
    result = lint_imports(ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    summary = re.search(r"Contracts: (\d+) kept, (\d+) broken", out)
    assert summary is not None, out
    assert int(summary.group(1)) >= 4, out
    assert summary.group(2) == "0", out
    assert f"{FORBIDDEN} KEPT" in out


def test_a_core_module_importing_an_integration_breaks_the_contract(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=_python_only)
    victim = tmp_path / "specem_core" / "types.py"
    victim.write_text(victim.read_text() + "\nimport specem_integrations.langchain  # deliberate violation\n")

    result = lint_imports(tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert f"{FORBIDDEN} BROKEN" in out
    # the copy was analysed (not the installed package), and the report names the import
    assert "specem_core.types -> specem_integrations.langchain" in out
    assert not (tmp_path / ".import_linter_cache").exists()


def test_no_core_module_is_over_600_lines_and_the_collapsed_graph_has_no_circle() -> None:
    """A module of ``specem_core`` holds one concern (#64: the loop, the facade, retries, the
    trusted member's rules each in their own); past 600 lines it is holding several again.
    ``scripts/import_graph.py`` says which, and draws the graph."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--max-lines", "600"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 circles" in done.stdout
