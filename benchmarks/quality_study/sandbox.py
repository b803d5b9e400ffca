"""Running model-written programs for grading, behind a boundary the operating system keeps.

Threat model. The code graded here was written by a model and is run as it stands: it may do
anything a Python program can, on purpose or by accident (delete files, fork without end, open
sockets, write megabytes to stderr, overwrite its own interpreter's state, lie about its result).
Nothing inside the interpreter can stop that: an audit hook, a restricted ``open`` or a result
written by the program's own process are all reachable from the program. So the boundary is the
kernel's, set up by `bubblewrap <https://github.com/containers/bubblewrap>`_ (``bwrap``, Debian's
``bubblewrap`` package) before the interpreter starts:

- **its own user**: as root, a fresh unprivileged uid for every run (``setpriv`` inside the box:
  no capabilities, an empty bounding set, ``no_new_privs``); as any other user, a user namespace
  in which it is ``nobody`` with no capabilities and cannot make further user namespaces;
- **its own mount view**: ``/usr`` (and ``/bin``, ``/lib*``), ``/etc/ld.so.cache`` and the
  interpreter's own prefix, all read-only; a fresh ``/proc`` and minimal ``/dev``; the only
  writable place is a new, size-limited ``tmpfs`` at ``/tmp`` (its working directory, ``HOME``
  and ``TMPDIR``) that disappears with it. Nothing else of the machine is there to read or write:
  no checkout, no home directory, no host ``/tmp``;
- **its own PID namespace**: the box ends when its first process ends; the kernel kills whatever
  it started (a ``setsid`` grandchild, a daemon) and the caller waits until all of it is gone;
- **its own network namespace** (no interface but a loopback that is down), IPC and UTS namespaces;
- **resource limits** (set by the box's own start-up code before the program runs; a program
  cannot raise a hard limit): processes and threads (``RLIMIT_NPROC``: counted for its own uid,
  or in its own user namespace), address space (``memory_mb``), CPU time (``timeout``), file size
  (16 MiB), open files (256), no core files; plus the caller's **wall clock**;
- **output drained while it runs**: stdout and stderr are read as they come (no pipe can fill up
  and stall a program) and only the last 64 KiB of each are kept.

Where that boundary cannot be had (no ``bwrap``, or the kernel refuses the namespaces),
:func:`run_program` raises :class:`SandboxUnavailable`: it never grades unprotected.

The verdict. A program's own process can forge anything it reports (an exit status, a line on a
pipe it holds, a result the harness in its own interpreter was about to write). So a **pass worth
trusting comes from code the program cannot touch**: with ``tests=`` (how the HumanEval grader
calls it) the program runs in one box and only defines the function under test; the tests run in
a second box of their own (another uid or user namespace, PID, mount and network namespace) and
call it through ``candidate(...)``, a proxy that sends the arguments to the program's box as
plain data and gets plain data back (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
``complex``, and ``list``/``tuple``/``dict``/``set``/``frozenset`` of those, tagged JSON, at most
16 MiB a reply). The program's box holds only those two pipes and its stderr: it can choose what
its function returns (which is what is being graded) and nothing else; the verdict is the tests'
box's exit status together with the line it writes to a pipe only that box holds. Without
``tests=`` the whole source runs in one box and its kind is the program's own claim (its exit
status): safe to run, but any program can claim to have passed (``os._exit(0)`` before a failing
``assert``).

Not covered: CPU and memory shared with the caller are limited per process, not for the box as a
whole (a fork bomb is capped at ``RLIMIT_NPROC`` processes of ``memory_mb`` each until the wall
clock ends it; kernel memory such as pipe buffers and ``memfd`` files is bounded only by the file
size and open-file limits); as root, the program may still make user namespaces of its own
inside the box (they add kernel surface, not reach: the mounts it sees stay read-only and locked,
the process limit still counts); a kernel bug that breaks namespaces breaks the box; a function
that returns a right answer for a wrong reason (the grader's tests decide what counts as right).

The outcome's ``kind``: ``passed``; ``failed`` (an ``AssertionError``: a test did not hold);
``error`` (any other exception; ``detail`` names it); ``syntax`` (the program does not compile);
``timeout`` (wall clock or CPU time); ``memory`` (``MemoryError``); ``forbidden`` (it ended on an
error from the boundary: a read-only or missing file system, a refused permission, no network,
the process or file-size limit, a full ``/tmp``); ``exit`` (``sys.exit``/``exit()``/``os._exit``
or a signal ended it before the tests finished).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("passed", "failed", "error", "syntax", "timeout", "memory", "forbidden", "exit")
"""Every outcome kind (see the module docstring)."""
FILE_SIZE_LIMIT = 16 * 2**20
"""Largest file the program may write (bytes)."""
TMP_SIZE = 64 * 2**20
"""Size of the box's only writable file system, its ``/tmp`` (bytes)."""
PROCESS_LIMIT = 32
"""Processes and threads the box may have at once (its first process included)."""
OPEN_FILES = 256
"""Open files per process."""
OUTPUT_KEPT = 64 * 2**10
"""Bytes kept of each box's output (the last ones; the rest is read and dropped)."""
STARTUP_GRACE = 1.0
"""Seconds added to ``timeout`` for starting the boxes' interpreters (not the program's time)."""
_EXIT_CODES = {"passed": 0, "failed": 10, "error": 11, "syntax": 12, "memory": 13, "exit": 14, "forbidden": 15}
_UID_BASE = 2_000_000_000  # as root: one fresh uid per box, from a range no account uses


class SandboxUnavailable(RuntimeError):
    """The operating-system boundary cannot be set up here, so nothing is run (see the module
    docstring for what it needs)."""


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


# The boxes' start-up code: ``runner.py MODE CONFIG``. It sets the limits, then runs the program
# (modes "plain" and "program") or the trusted tests ("tests"). Everything after the limits is the
# program's to subvert in "plain"/"program" mode: nothing there is trusted by the caller except as
# the program's own claim ("plain") or as plain data ("program").
_RUNNER = r'''
import builtins, errno, json, os, resource, sys

os.write(2, b"specem-sandbox: started\n")  # before anything of the program's: bwrap got this far
MODE = sys.argv[1]
CONF = json.loads(sys.argv[2])
for _name, (_soft, _hard) in CONF["limits"].items():
    resource.setrlimit(getattr(resource, _name), (_soft, _hard))
del _name, _soft, _hard
CODES = CONF["codes"]
BOUNDARY = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENETUNREACH, errno.EAGAIN, errno.EFBIG,
            errno.ENOSPC, errno.EMFILE, errno.ECONNREFUSED}
REPLY_LIMIT = 16 * 2**20


class ProgramEnded(BaseException):
    """The program's box went away (or raised SystemExit) before the tests finished."""


class ProtocolError(BaseException):
    """The program's box sent something that is not a reply."""


class CandidateError(Exception):
    """An exception of the program's own type, raised by the function under test."""


def describe(exc):
    return (type(exc).__name__ + ": " + str(exc))[:300]


def classify(exc):
    if isinstance(exc, AssertionError):
        return "failed", describe(exc)
    if isinstance(exc, MemoryError):
        return "memory", describe(exc)
    if isinstance(exc, SystemExit):
        return "exit", "SystemExit(" + repr(exc.code)[:100] + ")"
    if isinstance(exc, ProgramEnded):
        return "exit", str(exc)
    if isinstance(exc, ProtocolError):
        return "error", "the program's reply broke the protocol: " + str(exc)[:200]
    if isinstance(exc, OSError) and exc.errno in BOUNDARY:
        return "forbidden", "refused by the sandbox: " + describe(exc)
    return "error", describe(exc)


def encode(x, depth=0):
    if depth > 100:
        raise ValueError("data nested more than 100 deep")
    d = depth + 1
    if x is None or isinstance(x, bool):
        return None if x is None else bool(x)
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return {"f": float.__repr__(float(x))}
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, list):
        return [encode(v, d) for v in x]
    if isinstance(x, tuple):
        return {"t": [encode(v, d) for v in x]}
    if isinstance(x, dict):
        return {"d": [[encode(k, d), encode(v, d)] for k, v in x.items()]}
    if isinstance(x, frozenset):
        return {"z": [encode(v, d) for v in x]}
    if isinstance(x, set):
        return {"s": [encode(v, d) for v in x]}
    if isinstance(x, (bytes, bytearray)):
        return {"b": bytes(x).hex()}
    if isinstance(x, complex):
        return {"c": [float.__repr__(x.real), float.__repr__(x.imag)]}
    raise TypeError("a " + type(x).__name__ + " is not plain data")


def decode(x, depth=0):
    if depth > 101:
        raise ProtocolError("data nested too deep")
    d = depth + 1
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is list:
        return [decode(v, d) for v in x]
    if type(x) is dict and len(x) == 1:
        ((tag, v),) = x.items()
        try:
            if tag == "f" and type(v) is str:
                return float(v)
            if tag in ("t", "s", "z") and type(v) is list:
                items = [decode(i, d) for i in v]
                return tuple(items) if tag == "t" else set(items) if tag == "s" else frozenset(items)
            if tag == "d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
                return {decode(k, d): decode(w, d) for k, w in v}
            if tag == "b" and type(v) is str:
                return bytes.fromhex(v)
            if tag == "c" and type(v) is list and len(v) == 2 and all(type(p) is str for p in v):
                return complex(float(v[0]), float(v[1]))
        except (TypeError, ValueError) as exc:
            raise ProtocolError(describe(exc)) from None
    raise ProtocolError("not plain data: " + repr(x)[:80])


def send(stream, message):
    stream.write(json.dumps(message, allow_nan=False).encode() + b"\n")
    stream.flush()


def receive(stream):
    line = stream.readline(REPLY_LIMIT + 1)
    if not line.endswith(b"\n"):
        if len(line) > REPLY_LIMIT:
            raise ProtocolError("a message over " + str(REPLY_LIMIT) + " bytes")
        raise ProgramEnded("the program's box ended before the tests finished")
    try:
        return json.loads(line)
    except ValueError as exc:
        raise ProtocolError(describe(exc)) from None


def raised(exc):
    number = getattr(exc, "errno", None)
    return {"type": type(exc).__name__, "message": str(exc)[:300],
            "errno": number if type(number) is int else None}


def rebuilt(info):
    if type(info) is not dict:
        raise ProtocolError("not an exception: " + repr(info)[:80])
    name, message, number = info.get("type"), str(info.get("message"))[:300], info.get("errno")
    if name in ("SystemExit", "KeyboardInterrupt", "GeneratorExit"):
        return ProgramEnded(str(name) + " in the program: " + message)
    cls = getattr(builtins, name, None) if type(name) is str and name.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            if issubclass(cls, OSError) and type(number) is int:
                return cls(number, message)
            return cls(message)
        except Exception:
            pass
    return CandidateError(str(name)[:80] + ": " + message)


def end(kind, detail, verdict=None):
    if verdict is not None:
        os.write(verdict, (json.dumps({"kind": kind, "detail": detail}) + "\n").encode())
    else:
        sys.stderr.write("\nspecem-sandbox-outcome: " + json.dumps({"kind": kind, "detail": detail}) + "\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(CODES[kind])


def load(path):
    with open(path, encoding="utf-8") as fh:
        return compile(fh.read(), "<" + MODE + ">", "exec")


if MODE == "plain":
    try:
        code = load("/run/specem/source.py")
    except (SyntaxError, ValueError) as exc:
        end("syntax", describe(exc))
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except BaseException as exc:
        end(*classify(exc))
    end("passed", "")

elif MODE == "program":
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)  # the program's prints go to stderr, not into the replies
    os.close(null)
    try:
        code = load("/run/specem/source.py")
    except (SyntaxError, ValueError) as exc:
        send(replies, {"syntax": describe(exc)})
        os._exit(CODES["syntax"])
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(code, namespace)
        function = namespace.get(CONF["entry_point"])
        if not callable(function):
            raise NameError("the program defines no function " + CONF["entry_point"])
    except BaseException as exc:
        send(replies, {"raised": raised(exc)})
        os._exit(CODES["error"])
    send(replies, {"ready": True})
    while True:
        try:
            request = receive(requests)
        except BaseException:  # the tests are over (or sent nonsense): nothing more to answer
            os._exit(0)
        try:
            value = function(*decode(request["args"]), **decode(request["kwargs"]))
            message = {"value": encode(value)}
        except BaseException as exc:
            message = {"raised": raised(exc)}
        send(replies, message)

elif MODE == "tests":
    verdict = CONF["verdict_fd"]
    os.dup2(2, 1)
    requests = os.fdopen(CONF["requests_fd"], "wb")
    replies = os.fdopen(CONF["replies_fd"], "rb")

    def candidate(*args, **kwargs):
        try:
            send(requests, {"args": encode(list(args)), "kwargs": encode(dict(kwargs))})
        except (BrokenPipeError, ConnectionResetError):
            raise ProgramEnded("the program's box ended before the tests finished") from None
        reply = receive(replies)
        if type(reply) is dict and "value" in reply:
            return decode(reply["value"])
        if type(reply) is dict and "raised" in reply:
            raise rebuilt(reply["raised"])
        raise ProtocolError("not a reply: " + repr(reply)[:80])

    try:
        code = load("/run/specem/tests.py")
        hello = receive(replies)
        if type(hello) is dict and "syntax" in hello:
            end("syntax", str(hello["syntax"])[:300], verdict)
        if type(hello) is dict and "raised" in hello:
            raise rebuilt(hello["raised"])
        if hello != {"ready": True}:
            raise ProtocolError("not a greeting: " + repr(hello)[:80])
        exec(code, {"__name__": "__main__", "__builtins__": builtins, "candidate": candidate})
    except BaseException as exc:
        end(*classify(exc), verdict)
    end("passed", "", verdict)
'''


@dataclass(frozen=True)
class _Boundary:
    bwrap: str
    setpriv: str | None  # as root: drop to a fresh uid inside the box
    python: str
    mounts: tuple[str, ...]


def _mounts(python: str) -> tuple[str, ...]:
    """bwrap's mount options for the read-only view: system directories, the loader's cache and the
    interpreter's prefix (parents made 0755: bwrap makes missing parents 0700)."""
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    made = {"/", "/usr"}

    def parents(path: str) -> None:
        for parent in reversed(Path(path).parents):
            name = str(parent)
            if name not in made:
                made.add(name)
                args.extend(["--perms", "0755", "--dir", name])

    if os.path.isfile("/etc/ld.so.cache"):
        parents("/etc/ld.so.cache")
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for prefix in sorted({os.path.realpath(sys.base_prefix), os.path.dirname(python)}):
        if prefix == "/usr" or prefix.startswith("/usr/") or prefix in made:
            continue
        parents(prefix)
        made.add(prefix)
        args += ["--ro-bind", prefix, prefix]
    return tuple(args)


def _boundary() -> _Boundary:
    """What the boxes are made with here; raises :class:`SandboxUnavailable` where they cannot be."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable("the sandbox needs Linux namespaces; refusing to run model-written code")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bwrap (bubblewrap) is not on PATH: install it (Debian: apt-get install bubblewrap); "
            "refusing to run model-written code without an operating-system boundary"
        )
    setpriv = None
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None or not setpriv.startswith(("/usr/", "/bin/")):
            raise SandboxUnavailable("running as root needs setpriv (util-linux) in /usr/bin to drop to a fresh uid")
    python = os.path.realpath(sys.executable)
    return _probe(_Boundary(bwrap, setpriv, python, _mounts(python)))


@functools.lru_cache(maxsize=4)
def _probe(boundary: _Boundary) -> _Boundary:
    """Run one empty program in a box (once per process): the kernel's answer, not a guess."""
    box = _Box(boundary, "plain", {"source.py": "pass"}, limits=_limits(10.0, 256), stdin=subprocess.DEVNULL)
    returncode = box.wait(time.monotonic() + 30.0)
    box.close()
    if returncode != 0 or box.drain.head != _STARTED:
        raise SandboxUnavailable(
            f"bubblewrap could not set up the sandbox here (status {returncode}): {box.output().strip()[-500:]}; "
            "refusing to run model-written code without an operating-system boundary"
        )
    return boundary


def sandbox_available() -> str | None:
    """``None`` where :func:`run_program` can run programs here, else why it refuses."""
    try:
        _boundary()
    except SandboxUnavailable as exc:
        return str(exc)
    return None


def _limits(timeout: float, memory_mb: int) -> dict[str, tuple[int, int]]:
    cpu = max(1, int(timeout + 0.999))
    memory = memory_mb * 2**20
    return {
        "RLIMIT_NPROC": (PROCESS_LIMIT, PROCESS_LIMIT),
        "RLIMIT_AS": (memory, memory),
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_FSIZE": (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT),
        "RLIMIT_NOFILE": (OPEN_FILES, OPEN_FILES),
        "RLIMIT_CORE": (0, 0),
    }


_STARTED = b"specem-sandbox: started\n"


class _Drain(threading.Thread):
    """Reads a pipe to its end as the box writes it, keeping its first line and its last
    :data:`OUTPUT_KEPT` bytes."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.head = b""
        self.kept = bytearray()
        self.total = 0
        self.start()

    def run(self) -> None:
        try:
            while chunk := os.read(self.fd, 65536):
                if len(self.head) < len(_STARTED):
                    self.head += chunk[: len(_STARTED) - len(self.head)]
                self.total += len(chunk)
                self.kept += chunk
                if len(self.kept) > OUTPUT_KEPT:
                    del self.kept[: len(self.kept) - OUTPUT_KEPT]
        except OSError:
            pass
        finally:
            os.close(self.fd)

    def text(self) -> str:
        text = bytes(self.kept)
        if self.head == _STARTED and self.total == len(self.kept):
            text = text[len(_STARTED) :]
        return text.decode(errors="replace")


class _Box:
    """One bwrap sandbox running the runner in ``mode`` with ``files`` under ``/run/specem``."""

    def __init__(
        self,
        boundary: _Boundary,
        mode: str,
        files: dict[str, str],
        *,
        limits: dict[str, tuple[int, int]],
        stdin: int,
        stdout: int | None = None,
        pass_fds: tuple[int, ...] = (),
        extra: Mapping[str, object] | None = None,
    ) -> None:
        config = {"limits": limits, "codes": _EXIT_CODES, **(extra or {})}
        data: list[int] = []
        info_read, info_write = os.pipe()
        out_read, out_write = os.pipe()
        try:
            args = [boundary.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
            args += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
            args += ["--info-fd", str(info_write), "--clearenv"]
            for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/tmp"), ("TMPDIR", "/tmp"),
                               ("LANG", "C.UTF-8"), ("OMP_NUM_THREADS", "1")):  # fmt: skip
                args += ["--setenv", key, value]
            if boundary.setpriv:  # root: keep only what setpriv needs to drop to the fresh uid
                args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
                args += ["--cap-add", "CAP_SETPCAP"]
            else:
                args += ["--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
            args += [*boundary.mounts, "--proc", "/proc", "--dev", "/dev"]
            args += ["--perms", "1777", "--size", str(TMP_SIZE), "--tmpfs", "/tmp"]
            args += ["--perms", "0755", "--dir", "/run", "--perms", "0755", "--dir", "/run/specem"]
            for name, text in {"runner.py": _RUNNER, **files}.items():
                fd = os.memfd_create(name, os.MFD_CLOEXEC)
                data.append(fd)
                os.write(fd, text.encode())
                os.lseek(fd, 0, os.SEEK_SET)
                args += ["--perms", "0444", "--ro-bind-data", str(fd), f"/run/specem/{name}"]
            args += ["--chdir", "/tmp", "--"]
            if boundary.setpriv:
                uid = str(_UID_BASE + secrets.randbelow(100_000_000))
                args += [boundary.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
                args += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
            args += [boundary.python, "-I", "-B", "/run/specem/runner.py", mode, json.dumps(config)]
            self.process = subprocess.Popen(
                args,
                stdin=stdin,
                stdout=out_write if stdout is None else stdout,
                stderr=out_write,
                pass_fds=(info_write, *data, *pass_fds),
                close_fds=True,
                start_new_session=True,
            )
        except BaseException:
            for fd in (info_read, out_read):
                os.close(fd)
            raise
        finally:
            for fd in (info_write, out_write, *data):
                os.close(fd)
        self.drain = _Drain(out_read)
        self.init = self._init_pidfd(info_read)

    def _init_pidfd(self, info_read: int) -> int | None:
        """A pidfd on the box's PID 1 (from bwrap's ``--info-fd``): it ends after all else in the box."""
        text = b""
        deadline = time.monotonic() + 10.0
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([info_read], [], [], max(0.0, deadline - time.monotonic()))
                chunk = os.read(info_read, 4096) if ready else b""
                if not chunk:
                    break
                text += chunk
                with contextlib.suppress(ValueError):
                    return os.pidfd_open(int(json.loads(text)["child-pid"]))
        except (OSError, KeyError, TypeError):
            return None
        finally:
            os.close(info_read)
        return None

    def wait(self, deadline: float) -> int | None:
        """The box's exit status, or ``None`` if it is still running at ``deadline``."""
        try:
            return self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """End the box (if still running) and wait until nothing of it is left."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()  # its PID 1 dies with it (--die-with-parent), and with that the rest
        self.process.wait()
        if self.init is not None:
            with contextlib.suppress(OSError):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self.init, signal.SIGKILL)
                select.select([self.init], [], [], 10.0)  # readable once the whole namespace is gone
            os.close(self.init)
            self.init = None
        self.drain.join(timeout=10.0)

    def output(self) -> str:
        return self.drain.text()

    def check_started(self, status: int | None) -> None:
        """Raise :class:`SandboxUnavailable` if the box ended before its runner's first line: bwrap
        (or the interpreter) failed to start, so nothing of the program ran. (The runner writes
        that line before the program exists: a program cannot make a box look unstarted.)"""
        if status is not None and self.drain.head != _STARTED:
            raise SandboxUnavailable(
                f"the sandbox did not start (status {status}): {self.output().strip()[:500]}; "
                "refusing to run model-written code without an operating-system boundary"
            )


def run_program(
    source: str,
    *,
    timeout: float = 10.0,
    memory_mb: int = 1024,
    tests: str | None = None,
    entry_point: str = "",
) -> Outcome:
    """Run ``source`` as a Python program in the sandbox and say how it ended.

    Args:
        source: the program. Without ``tests``, the whole program (its kind is its own claim).
        timeout: wall-clock seconds for the whole run (CPU time is limited to the same).
        memory_mb: address-space limit of each process in the boxes.
        tests: trusted test code, run in a box of its own, in which ``candidate(*args)`` calls the
            program's ``entry_point`` with plain data (see the module docstring). Only a run with
            ``tests`` gives a pass the program cannot forge.
        entry_point: the function ``candidate`` calls (needed with ``tests``).

    Raises:
        SandboxUnavailable: the operating-system boundary cannot be had here; nothing was run.
    """
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError("timeout and memory_mb must be > 0")
    if tests is not None and not entry_point.isidentifier():
        raise ValueError("tests need the program's entry_point (a function name)")
    boundary = _boundary()
    limits = _limits(timeout, memory_mb)
    started = time.perf_counter()
    deadline = time.monotonic() + timeout + STARTUP_GRACE
    if tests is None:
        box = _Box(boundary, "plain", {"source.py": source}, limits=limits, stdin=subprocess.DEVNULL)
        try:
            status = box.wait(deadline)
        finally:
            box.close()
        box.check_started(status)
        return _plain_outcome(status, box.output(), time.perf_counter() - started)

    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    verdict_read, verdict_write = os.pipe()
    boxes: list[_Box] = []
    try:
        try:
            program_conf: dict[str, object] = {"entry_point": entry_point}
            boxes.append(
                _Box(
                    boundary,
                    "program",
                    {"source.py": source},
                    limits=limits,
                    stdin=requests_read,
                    stdout=replies_write,
                    extra=program_conf,
                )
            )
        finally:
            os.close(requests_read)
            os.close(replies_write)
        try:
            tests_conf: dict[str, object] = {
                "requests_fd": requests_write,
                "replies_fd": replies_read,
                "verdict_fd": verdict_write,
            }
            boxes.append(
                _Box(
                    boundary,
                    "tests",
                    {"tests.py": tests},
                    limits=limits,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(requests_write, replies_read, verdict_write),
                    extra=tests_conf,
                )
            )
        finally:
            os.close(requests_write)
            os.close(replies_read)
            os.close(verdict_write)
        program, checker = boxes
        status = checker.wait(deadline)
        if status is not None:  # give the program's box a moment to end on its own (its pipes are closed)
            program.wait(time.monotonic() + 0.5)
    finally:
        for box in boxes:
            box.close()
        verdict = _read_all(verdict_read)
    seconds = time.perf_counter() - started
    checker.check_started(status)
    program.check_started(program.process.returncode if status is not None else None)
    return _checked_outcome(status, verdict, program.process.returncode, seconds)


def _read_all(fd: int) -> str:
    """What the tests' box wrote to the verdict pipe (every writer is gone by now)."""
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 65536:
                break
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def _signal_name(status: int) -> str | None:
    """bwrap reports a signal death as 128 + the signal's number."""
    if status > 128:
        with contextlib.suppress(ValueError):
            return signal.Signals(status - 128).name
    if status < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-status).name
    return None


def _plain_outcome(status: int | None, output: str, seconds: float) -> Outcome:
    if status is None:
        return Outcome("timeout", "wall clock", seconds)
    claims = [line for line in output.splitlines() if line.startswith("specem-sandbox-outcome: ")]
    detail = ""
    if claims:
        with contextlib.suppress(ValueError, TypeError, KeyError):
            detail = str(json.loads(claims[-1].split(": ", 1)[1])["detail"])[:300]
    kinds = {code: kind for kind, code in _EXIT_CODES.items()}
    if status in kinds:
        return Outcome(kinds[status], detail if status else "", seconds)
    return _died(status, seconds)


def _died(status: int, seconds: float) -> Outcome:
    name = _signal_name(status)
    if name == "SIGXCPU":
        return Outcome("timeout", "CPU time (SIGXCPU)", seconds)
    if name is not None:
        return Outcome("exit", f"signal {name}", seconds)
    return Outcome("exit", f"exited with status {status} before the tests finished", seconds)


def _checked_outcome(status: int | None, verdict: str, program_status: int | None, seconds: float) -> Outcome:
    if status is None:
        return Outcome("timeout", "wall clock", seconds)
    kind, detail = "", ""
    lines = verdict.splitlines()
    if len(lines) == 1:
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            data = json.loads(lines[0])
            kind, detail = str(data["kind"]), str(data["detail"])[:300]
    if kind not in KINDS or _EXIT_CODES.get(kind) != status:  # never a pass: say what happened
        died = _died(status, seconds)
        return (
            died
            if died.kind == "timeout"
            else Outcome("error", f"the tests ended without a verdict ({died.detail})", seconds)
        )
    if kind == "exit" and program_status is not None and program_status != 0:
        ended = _died(program_status, seconds)
        if ended.kind == "timeout":
            return ended
        detail = f"{detail} ({ended.detail})"
    elif kind == "exit" and program_status == 0:
        detail = f"{detail} (its status 0)"
    return Outcome(kind, detail, seconds)
