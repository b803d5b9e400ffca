"""Start ``specem serve``, open streaming answers, SIGTERM it mid-answer, record how it exits; repeat.

Each run: ``specem serve --port 0`` on loopback with llama.cpp members, ``--streams`` streaming
requests that cannot finish within ``--shutdown-timeout`` (so the shutdown ends them mid-round),
SIGTERM once every stream has produced text, then the exit status. A clean run exits 0 with no
fatal-signal report in its log; a crash is a negative status (``-11``: SIGSEGV) or a
``Fatal Python error`` in the log (the server runs with ``PYTHONFAULTHANDLER=1``, so a crash's log
holds every thread's Python stack; ``--keep-logs DIR`` keeps those logs; ``--cores DIR`` keeps
the core dumps of unclean runs, for ``gdb -batch -ex "thread apply all bt" python DIR/runNNN/core``).

    python scripts/repro/serve_exit_loop.py --runs 40 --label after --out benchmarks/results/serve_exit_loop.json

The "before" code (``--tree DIR --label before``): a checkout of the commit before the fix (main
afbd99a) with ``os._exit`` taken out, i.e. ``main()`` returning ``_serve(args, out, err)`` for
``serve`` instead of calling ``_exit_after_serving``; without that edit ``os._exit`` hides the crash.

Prints one line per run and a summary; ``--out`` stores the runs and the summary in a JSON file
under ``--label`` (the code under test, e.g. ``before`` / ``after``; other labels in the file are
kept), with the versions and the machine's load average when the loop started.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"specem serve: listening on (http://\S+?)/v1 ")
STORY = {"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}


def _stream(url: str, max_tokens: int, first: threading.Event, outcome: dict[str, Any]) -> None:
    body = {"messages": [STORY], "max_tokens": max_tokens, "stream": True, "specem": {"ignore_eos": True}}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    first.set()
                if line.strip():
                    outcome["last"] = line
    except httpx.HTTPError as exc:  # the server went away: recorded, not raised
        outcome["error"] = type(exc).__name__
    finally:
        first.set()


def _allow_core_dump() -> None:
    """In the server process: core dumps on (written to its working directory with core_pattern ``core``)."""
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def one_run(args: argparse.Namespace, index: int) -> dict[str, Any]:
    """One serve + streams + SIGTERM; the exit status and what the log says."""
    cmd = [sys.executable, "-m", "specem_integrations.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    for model in args.model:
        cmd += ["--model", model]
    cmd += ["--backend", "llamacpp", "--segment-len", str(args.segment_len), "--no-access-log"]
    cmd += ["--max-concurrency", str(args.streams), "--shutdown-timeout", str(args.shutdown_timeout)]
    env = dict(os.environ, PYTHONFAULTHANDLER="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.tree), env.get("PYTHONPATH", "")]))
    fd, log_name = tempfile.mkstemp(prefix="specem-exit-", suffix=".log")
    cwd = Path(args.cores) / f"run{index:03d}" if args.cores else None
    if cwd is not None:
        cwd.mkdir(parents=True, exist_ok=True)
    with os.fdopen(fd, "wb") as log_file:
        process = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            preexec_fn=_allow_core_dump if cwd is not None else None,
        )
    log = Path(log_name)
    record: dict[str, Any] = {"run": index}
    try:
        url = ""
        deadline = time.monotonic() + 240
        while not url and time.monotonic() < deadline and process.poll() is None:
            found = _LISTENING.search(log.read_text(errors="replace"))
            url = found.group(1) if found else ""
            time.sleep(0.1)
        while url and time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        if not url or process.poll() is not None:
            raise RuntimeError(f"specem serve did not start:\n{log.read_text(errors='replace')[-2000:]}")
        events = [threading.Event() for _ in range(args.streams)]
        outcomes: list[dict[str, Any]] = [{} for _ in range(args.streams)]
        threads = [
            threading.Thread(target=_stream, args=(url, args.max_tokens, e, o), daemon=True)
            for e, o in zip(events, outcomes, strict=True)
        ]
        for t in threads:
            t.start()
        for e in events:
            e.wait(240)
        time.sleep(args.delay)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=args.shutdown_timeout + 90)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
            record["hung"] = True
        record["seconds_to_exit"] = round(time.monotonic() - sent, 2)
        for t in threads:
            t.join(10)
        text = log.read_text(errors="replace")
        record["status"] = code
        record["fatal"] = any(x in text for x in ("Fatal Python error", "Segmentation fault", "terminate called"))
        record["clean"] = code == 0 and not record["fatal"] and not record.get("hung")
        record["streams_ended_with_done"] = sum(o.get("last") == "data: [DONE]" for o in outcomes)
        if cwd is not None and record["clean"]:
            shutil.rmtree(cwd, ignore_errors=True)
        if not record["clean"] and args.keep_logs:
            keep = Path(args.keep_logs)
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"run{index:03d}.log").write_text(text)
        return record
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.unlink(missing_ok=True)


def _environment(tree: Path) -> dict[str, Any]:
    """What the crash rate depends on: the code, the library versions, the machine and its load."""
    from importlib.metadata import version

    def git(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(tree), *command], capture_output=True, text=True, check=False)

    commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain")
    return {
        "commit": commit.stdout.strip() or None,
        "uncommitted_changes": bool(dirty.stdout.strip()) if commit.returncode == 0 else None,
        "python": sys.version.split()[0],
        "llama_cpp_python": version("llama_cpp_python"),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--model", action="append", help="a member (repeatable; default: smollm2)")
    parser.add_argument("--streams", type=int, default=8, help="streaming answers open at the SIGTERM")
    parser.add_argument("--max-tokens", type=int, default=2000, help="per answer: more than the grace period allows")
    parser.add_argument("--segment-len", type=int, default=4)
    parser.add_argument("--shutdown-timeout", type=int, default=2, help="serve's grace period (seconds)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between the first text and the SIGTERM")
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose code serves (default: this one)")
    parser.add_argument("--label", default="", help="names the code under test in --out (before / after)")
    parser.add_argument("--out", help="write the runs and summary as JSON here")
    parser.add_argument("--keep-logs", help="keep the server logs of unclean runs in this folder")
    parser.add_argument("--cores", help="run each server in DIR/runNNN with core dumps on (kept for unclean runs)")
    args = parser.parse_args()
    args.model = args.model or ["smollm2"]
    args.tree = Path(args.tree).resolve()
    environment = _environment(args.tree)
    runs = []
    for i in range(args.runs):
        record = one_run(args, i)
        runs.append(record)
        print(json.dumps(record), flush=True)
    summary = {
        "label": args.label,
        "runs": len(runs),
        "clean": sum(r["clean"] for r in runs),
        "crashed": sum(r["status"] < 0 or r["fatal"] for r in runs),
        "statuses": sorted({r["status"] for r in runs}),
        "members": args.model,
        "streams": args.streams,
        "shutdown_timeout": args.shutdown_timeout,
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        out = Path(args.out)
        stored = json.loads(out.read_text()) if out.exists() else {}
        stored[args.label or "runs"] = {"environment": environment, "summary": summary, "runs": runs}
        out.write_text(json.dumps(stored, indent=1) + "\n")
    return 0 if summary["clean"] == summary["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
