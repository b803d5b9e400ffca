"""Which llama.cpp CPU kernel paths make a row's logits depend on what shares its decode call, and
what turning them off costs (``specem_core/backends/llama_cpp/_invariant.py``).

Each configuration runs in a child process of its own (ggml reads ``GGML_CPU_TILED_MM`` once per
process), through llama-cpp-python's low-level API on one packaged GGUF, one context with a unified
KV cache and flash attention on (as ``continuous_batching`` has it), 2 threads:

* **beside others**: sequence 0 decodes its prompt and 24 greedy steps alone; then again beside
  1, 3, 7 and 15 other sequences (each its own prompt; the prompts prefilled in one call, then one
  call per step for all of them), sequence 0 forced onto the tokens it wrote alone. The largest
  raw-logit difference of sequence 0 over the 25 rows, and how many of its 25 argmaxes stayed;
* **long context**: the same with ~600-token prompts (flash attention's split-KV path needs 512
  cells), alone and beside 1 and 7 others;
* **cell order**: beside 3 others that are removed after 8 steps, so that sequence 0's next rows
  land in cells below its older ones;
* **speed**: a 1,100-token prefill (calls of 512 tokens) and 32 decode steps after it, alone.

Configurations: ``default`` (llama.cpp as loaded by default), ``row-invariant`` (SpecEM's
``continuous_batching`` + ``history_invariant``: no repacked weights, ``GGML_CPU_TILED_MM=0``,
micro-batches of 63 tokens, a padding token where a micro-batch would hold one), and
``row-invariant`` with each of the four paths left on in turn::

    python benchmarks/llama_cpp_row_invariance.py --model qwen2.5-coder \\
        --out benchmarks/results/continuous_batching/avx512/row_invariance_qwen2.5-coder.json
    python benchmarks/llama_cpp_row_invariance.py --model qwen2.5-coder-1.5b-instruct --configs default row-invariant
    python benchmarks/llama_cpp_row_invariance.py --smoke   # seconds: SmolLM2, two configurations, 4 steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {"extra_bufts": True, "tiled_mm": True, "ubatch": 512, "pad": False},
    "row-invariant": {"extra_bufts": False, "tiled_mm": False, "ubatch": 63, "pad": True},
    "row-invariant, repacked weights": {"extra_bufts": True, "tiled_mm": False, "ubatch": 63, "pad": True},
    "row-invariant, tiled matmul": {"extra_bufts": False, "tiled_mm": True, "ubatch": 63, "pad": True},
    "row-invariant, micro-batches of 512": {"extra_bufts": False, "tiled_mm": False, "ubatch": 512, "pad": True},
    "row-invariant, no padding": {"extra_bufts": False, "tiled_mm": False, "ubatch": 63, "pad": False},
}
"""What each configuration sets (``pad``: a one-token micro-batch gets a padding token)."""

CHILD = r'''
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from specem_core.backends.llama_cpp._binding import load_library
from specem_core.models import find_packaged, packaged_gguf

config = json.loads(sys.argv[3])
STEPS, BESIDE, LONG_BESIDE, PREFILL = (4, (1, 3), (1,), 200) if config["smoke"] else (24, (1, 3, 7, 15), (1, 7), 1100)
lib = load_library()
mparams = lib.llama_model_default_params()
mparams.use_extra_bufts = config["extra_bufts"]
model = lib.llama_model_load_from_file(str(packaged_gguf(find_packaged(sys.argv[2]))).encode(), mparams)
vocab = lib.llama_model_get_vocab(model)
n_vocab = lib.llama_vocab_n_tokens(vocab)
PAD_SEQ = 31


def tokenize(text):
    data = text.encode()
    buf = (lib.llama_token * (len(data) + 8))()
    n = lib.llama_tokenize(vocab, data, len(data), buf, len(data) + 8, True, False)
    return list(buf[:n])


params = lib.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 16384, 512, config["ubatch"], 32
params.n_threads = params.n_threads_batch = 2
params.kv_unified, params.no_perf, params.flash_attn_type = True, True, 1
ctx = lib.llama_init_from_model(model, params)
mem = lib.llama_get_memory(ctx)
batch = lib.llama_batch_init(520, 0, 1)


def decode(items):
    """items: (token, position, sequence, wants logits); returns {batch index: logits row}."""
    n = len(items)
    pad = config["pad"] and n % config["ubatch"] == 1
    for j, (t, pos, seq, lg) in enumerate(items + ([(items[0][0], 0, PAD_SEQ, 0)] if pad else [])):
        batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = t, pos, 1, lg
        batch.seq_id[j][0] = seq
    batch.n_tokens = n + pad
    assert lib.llama_decode(ctx, batch) == 0
    if pad:
        lib.llama_memory_seq_rm(mem, PAD_SEQ, -1, -1)
    return {j: np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).copy()
            for j, item in enumerate(items) if item[3]}


def prefill(prompts, together):
    first = {}
    calls = [[(t, i, s, int(i == len(p) - 1)) for s, p in enumerate(prompts) for i, t in enumerate(p)]]
    if not together or len(calls[0]) > 512:
        calls = [[(t, i, s, int(i == len(p) - 1)) for i, t in enumerate(p)] for s, p in enumerate(prompts)]
    for call in calls:
        for c in range(0, len(call), 512):
            part = call[c:c + 512]
            rows = decode(part)
            for j, row in rows.items():
                first[part[j][2]] = row
    return first


def run(prompts, forced=None, drop_after=None):
    lib.llama_memory_clear(mem, True)
    first = prefill(prompts, together=True)
    rows = [first[0]]
    tokens = {s: [int(np.argmax(first[s]))] for s in range(len(prompts))}
    if forced:
        tokens[0] = [forced[0]]
    live = list(range(len(prompts)))
    for k in range(STEPS):
        if drop_after is not None and k == drop_after:
            for s in live[1:]:
                lib.llama_memory_seq_rm(mem, s, -1, -1)
            live = [0]
        items = [(tokens[s][-1], len(prompts[s]) + k, s, 1) for s in live]
        out = decode(items)
        rows.append(out[0])
        for j, s in enumerate(live):
            tokens[s].append(forced[k + 1] if forced and s == 0 else int(np.argmax(out[j])))
    return rows, tokens[0]


def compare(a, b):
    return {"max_logit_difference": round(max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)), 4),
            "argmax_same": sum(int(np.argmax(x) == np.argmax(y)) for x, y in zip(a, b)), "rows": len(a)}


short = [tokenize(f"Question {i}: tell me about topic number {i * 7} and why it matters to the {i} people.")
         for i in range(16)]
doc = "The lighthouse stands on a rock and its keeper writes a log every night. " * 40
long = [tokenize(doc + f"Question {i}: what did the keeper write on night {i}?") for i in range(8)]
result = {"beside_others": {}, "long_context": {}}
alone, path = run(short[:1])
for n in BESIDE:
    result["beside_others"][str(n)] = compare(alone, run(short[: n + 1], path)[0])
alone_long, path_long = run(long[:1])
for n in LONG_BESIDE:
    result["long_context"][str(n)] = compare(alone_long, run(long[: n + 1], path_long)[0])
result["cell_order"] = compare(alone, run(short[:4], path, drop_after=STEPS // 3)[0])
text = tokenize("Company B1 in Lima makes drones and was founded in 1957 with 40 employees. " * 120)[:PREFILL]
prefills, steps = [], []
for _ in range(3):
    lib.llama_memory_clear(mem, True)
    start = time.perf_counter()
    prefill([text], together=False)
    prefills.append(time.perf_counter() - start)
    start = time.perf_counter()
    for k in range(32):
        decode([(text[k], len(text) + k, 0, 1)])
    steps.append(32 / (time.perf_counter() - start))
result["speed"] = {"prefill_tokens": len(text), "prefill_s": round(min(prefills), 2),
                   "decode_tokens_per_s": round(max(steps), 1)}
print(json.dumps(result))
'''


def run_config(model: str, name: str, smoke: bool = False) -> dict[str, Any]:
    config = {**CONFIGS[name], "smoke": smoke}
    env = dict(os.environ)
    env.pop("GGML_CPU_TILED_MM", None)
    if not config["tiled_mm"]:
        env["GGML_CPU_TILED_MM"] = "0"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), model, json.dumps(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{name}: the child failed\n{done.stderr[-3000:]}")
    return {"settings": CONFIGS[name], **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--smoke", action="store_true", help="seconds: SmolLM2, two configurations, 4 steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.configs = "smollm2", ["default", "row-invariant"]
    from llama_server import cpu_description

    rows = {}
    for name in args.configs:
        rows[name] = run_config(args.model, name, args.smoke)
        r = rows[name]
        beside = ", ".join(f"{n}: {v['max_logit_difference']}" for n, v in r["beside_others"].items())
        long = ", ".join(f"{n}: {v['max_logit_difference']}" for n, v in r["long_context"].items())
        speed = r["speed"]
        print(
            f"{name:38s} beside {{{beside}}}  long {{{long}}}  cell order {r['cell_order']['max_logit_difference']}  "
            f"prefill of {speed['prefill_tokens']} {speed['prefill_s']} s  decode {speed['decode_tokens_per_s']} tok/s",
            flush=True,
        )
    record = {
        "command": "python benchmarks/llama_cpp_row_invariance.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "machine": {"platform": platform.platform(), "cpu": cpu_description(), "python": platform.python_version()},
        "configs": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
