"""The example notebooks run top to bottom (a cell that raises fails), stay small, and show what
each one is there to show: its key outputs (the answer to the question it asks, the tool result,
the server's health), checked in the committed notebook and again after a fresh run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))

KEY_OUTPUTS: dict[str, list[tuple[str, str]]] = {
    # notebook -> (a line of the cell's source, a pattern its outputs must match)
    "01_quickstart.ipynb": [
        (
            "for preset in PRESETS.values():",
            r"quality\s+qwen2\.5-coder-1\.5b-instruct \+ qwen2\.5-coder-0\.5b",
        ),
        ("for preset in PRESETS.values():", r"quality -> .*\b42\b"),  # 17 + 25 by the default preset
        ("result = engine.generate('Give two tips", r"(stop|length) \d+ tokens in"),
        ("calibration = calibrate(members[:2]", r"qwen2\.5-coder-0\.5b-instruct:\s+\d+\.\d%\s+errors=0"),
        ("for event in engine.stream('Say hello", r"(?m)^\[(smollm2-135m|qwen2\.5-coder-0\.5b)-instruct\] '"),
    ],
    "02_langchain_rag.ipynb": [
        ("prompt = ChatPromptTemplate.from_messages(", r"7319"),  # the vault's code, from the retrieved text
        ("msg = (prompt | llm).invoke(", r"Paris"),
        ("msg = (prompt | llm).invoke(", r"'output_tokens': [1-9]"),
    ],
    "03_llamaindex_query_engine.ipynb": [
        ("query('What is the launch code of project Zephyr?')", r"(?m)^(?!\[).*\b7319\b"),  # the answer's line
        ("query('What is the launch code of project Zephyr?')", r"The secret launch code of project Zephyr is 7319"),
        ("query('What colour are bananas?')", r"(?i)yellow"),
    ],
    "04_agents_with_tools.ipynb": [
        ("agent = create_agent(llm, tools=[multiply])", r"'name': 'multiply', 'args': \{'a': 6, 'b': 7\}"),
        ("agent = create_agent(llm, tools=[multiply])", r"ToolMessage '42'"),
        ("fagent = FunctionAgent(", r"\('times', \{'a': 123, 'b': 45\}, '5535'\)"),
    ],
    "05_benchmarks.ipynb": [
        ("speed_file = root", r"\[llamacpp\] members: smollm2-135m-instruct, qwen2\.5-coder-0\.5b-instruct"),
        ("speed_file = root", r"ratio \d\.\d\d"),
        ("hints_file = root", r"on / off = \d\.\d\d"),
    ],
    "06_serve.ipynb": [
        ("server = subprocess.Popen(", r"'status': 'ok'"),
        ("msg = llm.invoke('What is the capital of France?", r"Paris"),
        ("print(llm.bind_tools([multiply]", r"'name': 'multiply', 'args': \{'a': 6, 'b': 7\}"),
        ("print(llm.bind_tools([multiply]", r"name='Paris' country='France'"),
        ("server.send_signal(signal.SIGINT)", r"server stopped"),
    ],
}


def _text(output: Any) -> str:
    if output.get("output_type") == "stream":
        return str(output.get("text", ""))
    return str(output.get("data", {}).get("text/plain", ""))


def check_key_outputs(name: str, nb: Any) -> None:
    """Every key output of the notebook is in its cell's outputs (and no cell shows an error)."""
    cells = [c for c in nb.cells if c.cell_type == "code"]
    for c in cells:
        errors = [o for o in c.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"{name}: {c.source[:80]!r} shows an error: {errors[0].get('ename')}"
    for anchor, pattern in KEY_OUTPUTS[name]:
        (cell,) = [c for c in cells if anchor in c.source]
        text = "".join(_text(o) for o in cell.get("outputs", []))
        assert re.search(pattern, text), f"{name}: {anchor!r} printed no {pattern!r}:\n{text[:1500]}"


def test_every_notebook_has_key_outputs() -> None:
    assert sorted(p.name for p in NOTEBOOKS) == sorted(KEY_OUTPUTS)


def test_notebooks_are_committed_executed_small_and_show_their_results() -> None:
    import nbformat

    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        assert path.stat().st_size < 300_000, f"{path.name} carries large outputs"
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code
        assert all(c.get("execution_count") for c in code), f"{path.name} is not executed"
        check_key_outputs(path.name, nb)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_shows_its_results(path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # nothing of the committed run may count for this one
        if cell.cell_type == "code":
            cell.outputs = []
    client = NotebookClient(nb, timeout=1500, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    check_key_outputs(path.name, nb)
