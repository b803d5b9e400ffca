"""The example notebooks run top to bottom (a cell that raises fails) and stay small."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_are_committed_executed_and_small() -> None:
    import nbformat

    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        assert path.stat().st_size < 300_000, f"{path.name} carries large outputs"
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code
        assert all(c.get("execution_count") for c in code), f"{path.name} is not executed"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=1500, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
