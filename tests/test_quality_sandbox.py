"""The quality study's code grading (benchmarks/quality_study/sandbox.py and the HumanEval task):
model-written programs that misbehave are graded as failures of the right kind, and the grading
process survives them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT.parent / "shared" / "eval"
sys.path.insert(0, str(ROOT / "benchmarks"))

from quality_study import tasks  # noqa: E402
from quality_study.sandbox import KINDS, network_isolation, run_program  # noqa: E402

ROW: dict[str, Any] = {  # a HumanEval-shaped problem with a helper in its prompt, as some have
    "task_id": "Toy/0",
    "entry_point": "add_twice",
    "prompt": (
        "import math\n\n\ndef helper(x):\n    return x\n\n\n"
        'def add_twice(a: int, b: int) -> int:\n    """Return a + 2 * b."""\n'
    ),
    "test": "def check(candidate):\n    assert candidate(1, 2) == 5\n    assert candidate(0, 0) == 0\n",
}


def run(source: str, **kwargs: Any) -> Any:
    return run_program(source, timeout=kwargs.pop("timeout", 5.0), memory_mb=kwargs.pop("memory_mb", 512), **kwargs)


@pytest.mark.parametrize(
    ("source", "kind", "detail"),
    [
        ("assert 1 + 1 == 2", "passed", ""),
        ("assert 1 + 1 == 3, 'arithmetic'", "failed", "AssertionError: arithmetic"),
        ("{}['missing']", "error", "KeyError"),
        ("def f(:\n    pass", "syntax", "SyntaxError"),
        ("while True:\n    pass", "timeout", ""),
        ("import time\ntime.sleep(60)", "timeout", "wall clock"),
        ("block = bytearray(10 * 2**30)", "memory", "MemoryError"),
        ("open('/tmp/specem-sandbox-escape.txt', 'w').write('x')", "forbidden", "write outside the sandbox"),
        ("open('../escape.txt', 'a').write('x')", "forbidden", "write outside the sandbox"),
        ("import os\nos.remove('/etc/hostname')", "forbidden", "os.remove outside the sandbox"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "forbidden", "network"),
        ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "forbidden", "signal"),
        ("import subprocess\nsubprocess.run(['true'])", "forbidden", "process"),
        ("import os\nos.system('true')", "forbidden", "process"),
        ("import ctypes\nctypes.CDLL(None)", "forbidden", "native code"),
        ("import sys\nsys.exit(0)", "exit", "SystemExit(0)"),
        ("exit()", "exit", "SystemExit(None)"),
        ("import os\nos._exit(0)", "exit", "before the tests finished"),
    ],
    ids=lambda v: v if isinstance(v, str) and v in KINDS else None,
)
def test_each_misbehaviour_is_graded_as_its_kind(source: str, kind: str, detail: str) -> None:
    outcome = run(source, timeout=2.0)
    assert (outcome.kind, outcome.passed) == (kind, kind == "passed"), outcome
    assert detail in outcome.detail


def test_refusals_leave_nothing_outside_and_the_grader_survives(tmp_path: Path) -> None:
    target = tmp_path / "escape.txt"
    # the refusal is caught by the program, which then "passes": still a failure, nothing written
    source = f"try:\n    open({str(target)!r}, 'w')\nexcept Exception:\n    pass\nassert True"
    outcome = run(source)
    assert outcome.kind == "forbidden"
    assert not outcome.passed
    assert not target.exists()
    # a program that kills its parent's process group is refused; we are still here to check it
    assert run("import os, signal\nos.killpg(0, signal.SIGKILL)").kind == "forbidden"
    assert run("assert True").passed


def test_writing_inside_its_own_directory_is_allowed_and_removed() -> None:
    outcome = run(
        "import os\nopen('scratch.txt', 'w').write('x')\nassert open('scratch.txt').read() == 'x'\nprint(os.getcwd())"
    )
    assert outcome.passed, outcome


def test_the_child_has_no_network_namespace_access_where_the_kernel_allows_it() -> None:
    if not network_isolation():
        pytest.skip("unshare -n is refused here (no root, no user namespaces): only the audit hook guards the network")
    # before the hook exists: list the interfaces the child sees through /proc (only loopback, down)
    probe = run_program("assert open('/proc/net/dev').read().count(':') == 1, open('/proc/net/dev').read()", timeout=5)
    assert probe.passed, probe


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="timeout"):
        run_program("pass", timeout=0)


@pytest.mark.parametrize(
    ("reply", "passed"),
    [
        # the whole function in a fence, with prose around it: replaces the stub, keeps the prompt's imports
        ("Sure:\n```python\ndef add_twice(a, b):\n    return helper(a) + 2 * b\n```\nIt adds.", True),
        # a fence cut by the token cap
        ("```python\ndef add_twice(a, b):\n    return a + 2 * b\n", True),
        # only the body, indented or not
        ("    return a + 2 * b\n", True),
        ("return a + 2 * b", True),
        # a wrong answer, and a first block that is not the function (the one defining it is graded)
        ("```python\ndef add_twice(a, b):\n    return a + b\n```", False),
        ("```text\nexample\n```\n```python\ndef add_twice(a, b):\n    return a + 2 * b\n```", True),
    ],
)
def test_humaneval_completions_are_extracted_and_graded(reply: str, passed: bool) -> None:
    grade = tasks.grade_humaneval(ROW, reply)
    assert grade["passed"] is passed, grade
    assert grade["error_kind"] == ("passed" if passed else "failed")


def test_humaneval_program_runs_the_tests_after_the_completion() -> None:
    program = tasks.humaneval_program(ROW, "```python\ndef add_twice(a, b):\n    return 0\n```")
    assert program.index("def add_twice(a, b)") < program.index("def check") < program.index("check(add_twice)")
    assert tasks.grade_humaneval(ROW, "```python\ndef add_twice(a, b):\n    return 0\n```")["error_kind"] == "failed"


def test_humaneval_prompt_and_stop_keep_the_answer_to_its_code() -> None:
    key, prompt = tasks.prompt_of("humaneval", ROW)
    assert key == "Toy/0"
    assert prompt.startswith(tasks.HUMANEVAL_PREFIX)
    assert "```python\nimport math" in prompt
    (stop,) = tasks.STOP["humaneval"]
    assert stop in "```python\ndef f():\n    pass\n```\nprose"
    assert stop not in "Here:\n```python\ndef f():"


def test_canonical_solutions_pass() -> None:
    if not (EVAL / "humaneval.jsonl").is_file():
        pytest.skip("../shared/eval/humaneval.jsonl is not beside this checkout")
    rows = tasks.load_rows("humaneval", None) if tasks.EVAL_DIR == EVAL else []
    if not rows:
        pytest.skip("SPECEM_EVAL_DIR points elsewhere")
    # every tenth problem, as a fenced whole function and as a bare body (all 164 passed both ways
    # when the harness was written; that run takes half a minute)
    for row in rows[::10]:
        fenced = f"```python\n{row['prompt']}{row['canonical_solution']}\n```"
        for reply in (fenced, row["canonical_solution"]):
            grade = tasks.grade_humaneval(row, reply)
            assert grade["passed"], (row["task_id"], grade)


def test_the_task_names_the_sandbox_kinds() -> None:
    assert tasks.KINDS_OF_GRADE == KINDS
