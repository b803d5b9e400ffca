"""The quality study's code grading (benchmarks/quality_study/sandbox.py and the HumanEval task):
model-written programs run behind an operating-system boundary (bubblewrap), misbehaving ones are
graded as failures of the right kind, none can forge a pass, nothing of theirs reaches the host
or outlives the run, and the grading process survives them.

Each escape below got through the sandbox this one replaced (an audit hook in the program's own
interpreter); each test points its program at a file under ``tmp_path`` (never a system file) and
checks the host side: the file as it was, no process left (found by a name the program gives
itself through ``/proc/self/comm``).

Without bubblewrap these tests skip and say why, except where ``SPECEM_REQUIRE_SANDBOX=1`` (CI):
there they fail.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVAL = Path(__file__).resolve().parent / "data" / "eval"
"""Every tenth HumanEval problem, committed (``tests/data/eval/README.md``): never ``../shared/eval``."""
sys.path.insert(0, str(ROOT / "benchmarks"))

from quality_study import sandbox, tasks  # noqa: E402
from quality_study.sandbox import KINDS, PROCESS_LIMIT, SandboxUnavailable, run_program  # noqa: E402
from sandbox_guard import needs_sandbox  # noqa: E402

pytestmark = needs_sandbox

ROW: dict[str, Any] = {  # a HumanEval-shaped problem with a helper in its prompt, as some have
    "task_id": "Toy/0",
    "entry_point": "add_twice",
    "prompt": (
        "import math\n\n\ndef helper(x):\n    return x\n\n\n"
        'def add_twice(a: int, b: int) -> int:\n    """Return a + 2 * b."""\n'
    ),
    "test": "def check(candidate):\n    assert candidate(1, 2) == 5\n    assert candidate(0, 0) == 0\n",
}
RIGHT = "def add_twice(a, b):\n    return a + 2 * b\n"
WRONG = "def add_twice(a, b):\n    return 0\n"


def run(source: str, **kwargs: Any) -> Any:
    return run_program(source, timeout=kwargs.pop("timeout", 5.0), memory_mb=kwargs.pop("memory_mb", 512), **kwargs)


def grade(code: str) -> dict[str, Any]:
    return tasks.grade_humaneval(ROW, f"```python\n{code}\n```")


def token() -> str:
    return "sbx" + secrets.token_hex(5)  # a process name (at most 15 characters)


def named(name: str) -> list[int]:
    """Host processes that gave themselves this name."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


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
        ("open('/run/specem/new.txt', 'w')", "forbidden", "Permission denied"),
        ("open('/tmp/big', 'wb').write(b'x' * (17 * 2**20))", "forbidden", "File too large"),
        ("import sys\nsys.exit(0)", "exit", "SystemExit(0)"),
        ("exit()", "exit", "SystemExit(None)"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "exit", "signal SIGKILL"),
    ],
    ids=lambda v: v if isinstance(v, str) and v in KINDS else None,
)
def test_each_misbehaviour_is_graded_as_its_kind(source: str, kind: str, detail: str) -> None:
    outcome = run(source, timeout=2.0)
    assert (outcome.kind, outcome.passed) == (kind, kind == "passed"), outcome
    assert detail in outcome.detail


def test_writing_inside_its_own_tmp_is_allowed() -> None:
    outcome = run(
        "import os\nassert os.getcwd() == '/tmp'\nopen('scratch.txt', 'w').write('x')\n"
        "assert open('/tmp/scratch.txt').read() == 'x'"
    )
    assert outcome.passed, outcome
    assert run("import os\nassert os.listdir('/tmp') == [], os.listdir('/tmp')").passed  # a fresh /tmp each time


# --- the verdict: a pass the program cannot forge -------------------------------------------------


def test_humaneval_grading_passes_a_right_function_and_fails_a_wrong_one() -> None:
    assert grade(RIGHT)["passed"] is True
    assert grade(WRONG)["error_kind"] == "failed"


def test_forged_pass_through_main_is_not_a_pass() -> None:
    # the old runner's report() lived in __main__; this runner's end() writes the plain-mode claim
    forged = WRONG + textwrap.dedent("""
        import __main__
        for name in ("report", "end"):
            if hasattr(__main__, name):
                getattr(__main__, name)("passed", "")
    """)
    result = grade(forged)
    assert result["passed"] is False, result
    assert result["error_kind"] == "exit"  # it ended its own box; the tests never saw add_twice


def test_forged_pass_through_descriptors_is_not_a_pass() -> None:
    # the old result pipe was argv[1]; here every descriptor the program holds gets a pass line
    forged = WRONG + textwrap.dedent("""
        import os, sys
        line = b'{"kind": "passed", "detail": ""}\\n'
        for fd in [*(int(a) for a in sys.argv[1:] if a.isdigit()), *range(3, 256)]:
            try:
                os.write(fd, line)
            except OSError:
                pass
        os._exit(0)
    """)
    result = grade(forged)
    assert result["passed"] is False, result
    assert result["error_kind"] in ("error", "exit"), result


def test_ending_before_the_tests_is_not_a_pass() -> None:
    result = grade(WRONG + "import os\nos._exit(0)\n")
    assert (result["passed"], result["error_kind"]) == (False, "exit"), result
    assert "status 0" in result["error"]


def test_an_always_equal_result_is_not_a_pass() -> None:
    # only plain data crosses to the tests: an object whose == is always true never reaches them
    result = grade(
        "class Same:\n    def __eq__(self, other):\n        return True\n\n\ndef add_twice(a, b):\n    return Same()\n"
    )
    assert (result["passed"], result["error_kind"]) == (False, "error"), result
    assert "not plain data" in result["error"]


def test_values_cross_as_plain_data_both_ways() -> None:
    source = "def echo(*args, **kwargs):\n    return [args, kwargs]\n"
    tests = (
        "value = (None, True, 3, -2.5, float('inf'), 'é\\n', b'\\x00', 1j, [1, (2,)], {'k': {3}}, frozenset({4}))\n"
        "assert candidate(*value, key=value) == [value, {'key': value}]\n"
        "assert type(candidate(1)[0]) is tuple and candidate(True)[0][0] is True\n"
    )
    outcome = run_program(source, tests=tests, entry_point="echo", timeout=5, memory_mb=512)
    assert outcome.passed, outcome


def test_the_programs_exceptions_reach_the_tests_by_type() -> None:
    source = "def f(x):\n    if x:\n        raise ValueError('bad x')\n    raise OSError(30, 'read-only')\n"
    tests = textwrap.dedent("""
        try:
            candidate(1)
        except ValueError as exc:
            assert str(exc) == "bad x"
        else:
            raise AssertionError("no ValueError")
        try:
            candidate(0)
        except OSError as exc:
            assert exc.errno == 30
        else:
            raise AssertionError("no OSError")
    """)
    assert run_program(source, tests=tests, entry_point="f", timeout=5, memory_mb=512).passed


# --- the boundary: nothing reaches the host ------------------------------------------------------


def test_chdir_then_relative_write_and_delete_reach_nothing(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    program = f"import os\nos.chdir({str(tmp_path)!r})\nopen('pwned.txt', 'w').write('x')\nos.remove('victim.txt')\n"
    outcome = run(program)
    assert not outcome.passed
    assert victim.read_text() == "kept"
    assert not (tmp_path / "pwned.txt").exists()
    # and the same by absolute paths
    outcome = run(f"open({str(tmp_path / 'pwned.txt')!r}, 'w').write('x')\nimport os\nos.remove({str(victim)!r})")
    assert not outcome.passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


def test_dir_fd_writes_reach_nothing(tmp_path: Path) -> None:
    program = (
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.write(os.open('pwned.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd), b'x')\n"
    )
    outcome = run(program)
    assert not outcome.passed
    assert list(tmp_path.iterdir()) == []


def test_a_process_started_with_raw_fork_exec_stays_in_the_box(tmp_path: Path) -> None:
    name = token()
    child = (
        f"open('/proc/self/comm', 'w').write({name!r})\n"
        f"try:\n    open({str(tmp_path / 'pwned.txt')!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
        "import time\ntime.sleep(60)\n"
    )
    program = (
        "import multiprocessing.util, sys, time\n"  # spawnv_passfds: _posixsubprocess.fork_exec, raw
        f"multiprocessing.util.spawnv_passfds(sys.executable.encode(), [sys.executable, '-c', {child!r}], ())\n"
        "time.sleep(1)\n"
    )
    started = time.monotonic()
    outcome = run(program)
    assert outcome.passed, outcome  # starting processes is allowed: they are inside the box
    assert time.monotonic() - started < 4  # not held up by the sleeping child
    assert list(tmp_path.iterdir()) == []
    assert named(name) == []  # gone when the run returned


def test_a_setsid_grandchild_holding_the_pipes_neither_stalls_nor_outlives_the_run() -> None:
    name = token()
    program = textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # the grandchild: its own session, the box's stdout and stderr open
                open('/proc/self/comm', 'w').write({name!r})
                time.sleep(60)
            os._exit(0)
        time.sleep(0.5)
    """)
    started = time.monotonic()
    outcome = run(program, timeout=10.0)
    assert outcome.passed, outcome
    assert time.monotonic() - started < 5
    assert named(name) == []
    # the same from the graded function's box
    result = grade(RIGHT + program)
    assert result["passed"] is True, result
    assert named(name) == []


def test_a_fork_storm_is_capped_and_ends_with_the_run() -> None:
    name = token()
    program = textwrap.dedent(f"""
        import os, time
        open('/proc/self/comm', 'w').write({name!r})
        children = 0
        while True:
            try:
                pid = os.fork()
            except BlockingIOError:
                break
            if pid == 0:
                while True:  # every child storms too, politely
                    try:
                        os.fork()
                    except OSError:
                        time.sleep(0.05)
            children += 1
        time.sleep(0.5)
        raise AssertionError(f"stopped after {{children}} children")
    """)
    started = time.monotonic()
    outcome = run(program, timeout=5.0)
    assert outcome.kind == "failed", outcome
    children = int(outcome.detail.split()[-2])
    assert 0 < children < PROCESS_LIMIT
    assert time.monotonic() - started < 5
    assert named(name) == []


def test_a_storm_that_never_stops_ends_at_the_wall_clock() -> None:
    name = token()
    program = textwrap.dedent(f"""
        import os, time
        open('/proc/self/comm', 'w').write({name!r})
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.05)
    """)
    started = time.monotonic()
    outcome = run(program, timeout=2.0)
    assert outcome.kind == "timeout", outcome
    assert time.monotonic() - started < 2.0 + sandbox.STARTUP_GRACE + 2
    assert named(name) == []


def test_300_kb_of_stderr_then_a_pass_is_a_pass() -> None:
    noisy = "import sys\nsys.stderr.write('x' * 300_000)\nprint('y' * 300_000)\n"
    assert run(noisy + "assert True").passed
    result = grade(RIGHT + noisy)
    assert result["passed"] is True, result


def test_no_network_not_even_the_hosts_loopback() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        port = server.getsockname()[1]
        outcome = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert outcome.kind == "forbidden", outcome
        with pytest.raises(TimeoutError):
            server.accept()
    assert run("assert open('/proc/net/dev').read().count(':') == 1, open('/proc/net/dev').read()").passed  # lo only


def test_the_checkout_and_home_are_not_there_to_read() -> None:
    outcome = run(f"print(open({str(ROOT / 'pyproject.toml')!r}).read())")
    assert (outcome.kind, outcome.detail.split(":")[0]) == ("error", "FileNotFoundError"), outcome
    home = Path.home()
    prefix = Path(os.path.realpath(sys.base_prefix))
    allowed = {prefix.relative_to(home).parts[0]} if prefix.is_relative_to(home) else set()  # the interpreter's way in
    program = f"import os\nseen = set(os.listdir({str(home)!r})) if os.path.isdir({str(home)!r}) else set()\n"
    assert run(program + f"assert seen <= {allowed!r}, seen").passed


def test_it_runs_as_an_unprivileged_user() -> None:
    program = (
        "import os\nstatus = open('/proc/self/status').read()\n"
        "assert os.getuid() != 0 and os.geteuid() != 0, os.getuid()\n"
        "assert 'CapEff:\\t0000000000000000' in status, status\n"
        "assert 'NoNewPrivs:\\t1' in status or os.getuid() == 65534, status\n"
    )
    assert run(program).passed


def test_refuses_to_run_without_the_boundary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap to be found
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        run("assert True")
    with pytest.raises(SandboxUnavailable):
        grade(RIGHT)
    assert "bwrap" in (sandbox.sandbox_available() or "")


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="timeout"):
        run_program("pass", timeout=0)
    with pytest.raises(ValueError, match="entry_point"):
        run_program("pass", tests="pass")


def test_without_tests_the_kind_is_the_programs_own_claim() -> None:
    # documented: in plain mode an early os._exit(0) is a "pass"; the grader never uses plain mode
    assert run("import os\nos._exit(0)\nassert False").kind == "passed"


# --- the HumanEval task ----------------------------------------------------------------------------


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
    result = tasks.grade_humaneval(ROW, reply)
    assert result["passed"] is passed, result
    assert result["error_kind"] == ("passed" if passed else "failed")


def test_humaneval_program_holds_the_function_and_the_tests_hold_the_checks() -> None:
    program = tasks.humaneval_program(ROW, "```python\ndef add_twice(a, b):\n    return 0\n```")
    assert program.index("def helper") < program.index("def add_twice(a, b)")
    assert "check" not in program  # the tests run in a box of their own
    tests = tasks.humaneval_tests(ROW)
    assert tests.index("def helper") < tests.index("add_twice = candidate") < tests.index("def check")
    assert tests.rstrip().endswith("check(add_twice)")


def test_humaneval_prompt_and_stop_keep_the_answer_to_its_code() -> None:
    key, prompt = tasks.prompt_of("humaneval", ROW)
    assert key == "Toy/0"
    assert prompt.startswith(tasks.HUMANEVAL_PREFIX)
    assert "```python\nimport math" in prompt
    (stop,) = tasks.STOP["humaneval"]
    assert stop in "```python\ndef f():\n    pass\n```\nprose"
    assert stop not in "Here:\n```python\ndef f():"


def test_canonical_solutions_pass_and_stubs_fail() -> None:
    path = EVAL / "humaneval_every_tenth.jsonl"
    assert path.is_file(), f"{path} is missing: the tests' HumanEval rows are committed there"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert [row["task_id"] for row in rows] == [f"HumanEval/{n}" for n in range(0, 164, 10)]
    # every tenth problem, as a fenced whole function and as a bare body (all 164 passed both ways
    # when the two-box grading was written: 328 gradings, 44 s); the prompt's stub alone fails
    for row in rows:
        fenced = f"```python\n{row['prompt']}{row['canonical_solution']}\n```"
        for reply in (fenced, row["canonical_solution"]):
            result = tasks.grade_humaneval(row, reply)
            assert result["passed"], (row["task_id"], result)
        assert not tasks.grade_humaneval(row, "    pass\n")["passed"], row["task_id"]


def test_the_task_names_the_sandbox_kinds() -> None:
    assert tasks.KINDS_OF_GRADE == KINDS
