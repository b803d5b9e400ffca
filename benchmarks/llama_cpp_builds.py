"""Two builds of llama-cpp-python on this CPU, side by side in one run (alternating, same workload).

    python benchmarks/llama_cpp_builds.py                                   # avx2 against this CPU's best level
    python benchmarks/llama_cpp_builds.py --levels avx2 avx512-vbmi-vnni-bf16 --tokens 128 --repeats 2

The builds are the wheels ``scripts/build_llama_cpp.sh`` caches per CPU level
(``~/.cache/specem/wheels/LEVEL``; build a missing one with ``SPECEM_LLAMA_CPU=avx2 BUILD_ONLY=1
bash scripts/build_llama_cpp.sh``). Each is unpacked into a scratch folder and every measurement
runs in a child process that imports it first, alternating between the builds ``--repeats``
times. A child measures:

* **kernels**: one ``llama_decode`` call on a cached prefix of 1, 8 and 30 tokens per model (flash
  attention on, llama.cpp's default): decoding steps, merged requests, verification blocks;
* **engine**: ``T`` tokens from the default pair (SmolLM2 + Qwen2.5-Coder-0.5B) and from the trio
  (+ Qwen2.5-Coder-1.5B), greedy, ``ignore_eos``, with each member's plain greedy decoding of the
  same ``T`` tokens (the speed benchmark's floor) and the answer's text.

Prints the medians per build and the ratios against the first build (< 1: faster). Results:
``benchmarks/results/llama_cpp_builds.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "llama_cpp_builds.json"
PROMPT = "Write a long, detailed essay about the history of the city of Rome, from its founding to today."
PAIR = ["smollm2", "qwen2.5-coder"]
TRIO = ["qwen2.5-coder-1.5b", "qwen2.5-coder", "smollm2"]


def child(models: list[str], tokens: int) -> dict[str, Any]:
    """Every figure for the build this process imports."""
    sys.path.insert(0, str(HERE))
    import llama_cpp
    from llama_cpp_kernels import Probe
    from speed import plain_generate_seconds

    from specem_core import SpecEM, SpecEMConfig
    from specem_core.backends.llama_cpp import default_threads
    from specem_core.models import find_packaged, packaged_gguf
    from specem_core.registry import load_member

    info = llama_cpp.llama_print_system_info().decode()
    out: dict[str, Any] = {"system_info": info, "kernels": {}, "engine": {}}
    for name in models:
        packaged = find_packaged(name)
        assert packaged is not None, name
        probe = Probe(packaged_gguf(packaged), default_threads())
        out["kernels"][name] = probe.call_costs(probe.lib.LLAMA_FLASH_ATTN_TYPE_AUTO, repeats=10)
        probe.close()

    messages = [{"role": "user", "content": PROMPT}]
    loaded = {name: load_member(f"llamacpp:{name}") for name in dict.fromkeys([*PAIR, *TRIO])}
    for label, names in (("pair", PAIR), ("trio", TRIO)):
        members = [loaded[n] for n in names]
        engine = SpecEM(members, SpecEMConfig(segment_len=10, ignore_eos=True))
        engine.generate(messages, max_new_tokens=12)  # warm-up
        plain = {m.name: plain_generate_seconds(m, messages, tokens) for m in members}
        result = engine.generate(messages, max_new_tokens=tokens)
        out["engine"][label] = {
            "ensemble_s": result.seconds,
            "floor_s": sum(plain.values()),
            "plain_s": plain,
            "tokens": result.usage.completion_tokens,
            "first_segment_s": result.first_segment_seconds,
            "text": result.text,
        }
    return out


def unpack(level: str, cache: Path, scratch: Path) -> Path:
    wheels = sorted((cache / level).glob("llama_cpp_python-*.whl"))
    if not wheels:
        raise SystemExit(
            f"no cached wheel for level {level!r} in {cache / level}: build it with "
            f"SPECEM_LLAMA_CPU={level.split('-')[0]} BUILD_ONLY=1 bash scripts/build_llama_cpp.sh"
        )
    target = scratch / level
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheels[-1])],
        check=True,
    )
    return target


def best_level() -> str:
    script = HERE.parent / "scripts" / "build_llama_cpp.sh"
    env = {**os.environ, "PRINT_LEVEL": "1", "SPECEM_LLAMA_CPU": "auto"}
    return subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", nargs="+", help="cached build levels (default: avx2 and this CPU's best)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder", "qwen2.5-coder-1.5b", "gemma3"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.models, args.tokens)))
        return

    levels = args.levels or list(dict.fromkeys(["avx2", best_level()]))
    cache = Path(os.environ.get("SPECEM_WHEEL_CACHE", Path.home() / ".cache" / "specem" / "wheels"))
    runs: dict[str, list[dict[str, Any]]] = {level: [] for level in levels}
    with tempfile.TemporaryDirectory() as scratch:
        paths = {level: unpack(level, cache, Path(scratch)) for level in levels}
        for repeat in range(args.repeats):
            for level in levels:
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(paths[level]), str(HERE.parent)])}
                cmd = [sys.executable, __file__, "--child", "1", "--tokens", str(args.tokens), "--models", *args.models]
                done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                runs[level].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"repeat {repeat + 1}, {level}: done", flush=True)

    def median(level: str, *path: str) -> float:
        values = []
        for run in runs[level]:
            value: Any = run
            for key in path:
                value = value[key]
            values.append(float(value))
        return statistics.median(values)

    base = levels[0]
    print()
    print(f"llama.cpp builds on this CPU ({os.cpu_count()} CPUs), medians of {args.repeats}; ratio = build / {base}")
    print()
    print("| model | call | " + " | ".join(levels) + " | " + " | ".join(f"{lv} / {base}" for lv in levels[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(levels) - 1))
    summary: dict[str, Any] = {"levels": levels, "repeats": args.repeats, "tokens": args.tokens, "kernels": {}}
    for model in args.models:
        for size in (1, 8, 30):
            key = f"ms_{size}"
            ms = [median(level, "kernels", model, key) for level in levels]
            summary["kernels"].setdefault(model, {})[key] = dict(zip(levels, ms, strict=True))
            cells = " | ".join(f"{m:.1f} ms" for m in ms)
            ratios = " | ".join(f"{m / ms[0]:.2f}" for m in ms[1:])
            print(f"| {model} | {size} token{'s' if size > 1 else ''} | {cells} | {ratios} |")
    print()
    print(f"| engine, T={args.tokens} | figure | " + " | ".join(levels) + " | "
          + " | ".join(f"{lv} / {base}" for lv in levels[1:]) + " |")  # fmt: skip
    print("|---|---|" + "---|" * (2 * len(levels) - 1))
    summary["engine"] = {}
    for label in ("pair", "trio"):
        figures = {
            "ensemble s": [median(level, "engine", label, "ensemble_s") for level in levels],
            "floor s (members alone)": [median(level, "engine", label, "floor_s") for level in levels],
            "first segment s": [median(level, "engine", label, "first_segment_s") for level in levels],
        }
        floors = figures["floor s (members alone)"]
        figures["(a) ensemble / floor"] = [e / f for e, f in zip(figures["ensemble s"], floors, strict=True)]
        summary["engine"][label] = {k: dict(zip(levels, v, strict=True)) for k, v in figures.items()}
        for figure, values in figures.items():
            cells = " | ".join(f"{v:.2f}" for v in values)
            ratios = " | ".join(f"{v / values[0]:.2f}" for v in values[1:])
            print(f"| {label} | {figure} | {cells} | {ratios} |")
        # greedy answers repeat within a build; across builds the kernels' rounding differs, so a
        # near tie can fall the other way (as across CPUs)
        texts = {level: {run["engine"][label]["text"] for run in runs[level]} for level in levels}
        repeat = {level: len(t) == 1 for level, t in texts.items()}
        across = all(repeat.values()) and len({min(t) for t in texts.values()}) == 1
        summary["engine"][label].update(same_text_within_build=repeat, same_text_across_builds=across)
        print(
            f"| {label} | same answer in every run of the build | "
            + " | ".join(str(repeat[lv]) for lv in levels)
            + " |"
        )
        print(f"| {label} | same answer across builds | {across} |")
    summary["runs"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
