"""How soon eight served clients sharing a cached prefix can see a first segment: their steps one
request after another (what one context per request gives on this machine) or batched in one
llama.cpp context (what a redesign with a shared context and a sequence per request would give).

    python benchmarks/llama_cpp_batching.py              # the 1.5B, 8 clients on a 1,100-token prefix
    python benchmarks/llama_cpp_batching.py --smoke      # seconds: SmolLM2, 3 clients, a short prefix

``specem serve`` gives each request a context of its own (the shared system prompt is read from the
prefix cache, so each prefills only its question). On 2 cores eight such requests share the CPU,
and the slowest client saw its first segment after 3.7-4.8 s (goal: 2 s; docs/reports/performance.md).
This script measures the floor of the model work alone, through llama-cpp-python's low-level API on
one loaded model and one context (SpecEM's settings: 16 sequences in one unified KV cache, flash
attention on), with the prefix decoded once and copied to every client's sequence
(``llama_memory_seq_cp``: nothing is recomputed):

* **one after another**: each client's new tokens in one decode call, then its decode steps one
  token at a time; the time at which each client's last step is done;
* **batched**: every client's new tokens in one decode call, then each decode step once for all
  clients (one token per client per call); every client is done at the end.

No engine, HTTP or scoring work is in either figure, so both are lower bounds of what a server
reaches; the batched one is the best a shared-context redesign could do for the first segment.
Results: ``benchmarks/results/llama_cpp_batching.json``.

**Ceiling** (``--ceiling``): the most a shared context can give concurrent decoding on this CPU:
1, 8, 16 and 32 sequences (``--sequences``), each on its own cached prefix, decoding one token each
per ``llama_decode`` call with logits for every token (what drafting sessions need), flash attention
on (as ``continuous_batching`` sets it: its kernel skips the other sequences' cells); tokens/s and
the ratio to one sequence. ``--other-cells N`` keeps N KV rows of eight other sequences in the cache
meanwhile (idle sessions' rows in a shared context), and ``--flash-attention off`` shows what the
other attention path costs then::

    python benchmarks/llama_cpp_batching.py --ceiling --model qwen2.5-coder \
        --repeats 3 --out benchmarks/results/continuous_batching/ceiling_qwen2.5-coder.json
    python benchmarks/llama_cpp_batching.py --ceiling --model qwen2.5-coder --sequences 1 8 \
        --other-cells 8000 --flash-attention off --out benchmarks/results/continuous_batching/beside_fa_off.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llama_server import cpu_description

RESULTS = Path(__file__).parent / "results" / "llama_cpp_batching.json"
PARAGRAPH = "Company B1 in Lima makes drones and was founded in 1957 with 40 employees. "


def _decode(lib: Any, ctx: Any, batch: Any, items: list[tuple[int, int, int]]) -> None:
    """One ``llama_decode`` call: ``items`` are (token, position, sequence); logits for each
    sequence's last item only."""
    last = {seq: n for n, (_, _, seq) in enumerate(items)}
    batch.n_tokens = len(items)
    for j, (token, pos, seq) in enumerate(items):
        batch.token[j] = token
        batch.pos[j] = pos
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = seq
        batch.logits[j] = 1 if last[seq] == j else 0
    if lib.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")


def measure(
    model_name: str, prefix_tokens: int, new_tokens: int, steps: int, clients: int, repeats: int
) -> dict[str, Any]:
    import llama_cpp as lib

    from specem_core.models import find_packaged, packaged_gguf

    packaged = find_packaged(model_name)
    if packaged is None:
        raise SystemExit(f"unknown packaged model {model_name!r}")
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(str(packaged_gguf(packaged)).encode(), lib.llama_model_default_params())
    vocab = lib.llama_model_get_vocab(model)
    need = prefix_tokens + clients * new_tokens + 8
    text = (PARAGRAPH * (need // 10 + 1)).encode()
    buf = (lib.llama_token * (len(text) + 8))()
    count = lib.llama_tokenize(vocab, text, len(text), buf, len(text) + 8, True, False)
    if count < need:
        raise RuntimeError(f"the text encodes to {count} tokens only")
    tokens = list(buf[:need])
    prefix = tokens[:prefix_tokens]
    questions = [tokens[prefix_tokens + c * new_tokens : prefix_tokens + (c + 1) * new_tokens] for c in range(clients)]
    params = lib.llama_context_default_params()
    params.n_ctx = 8192
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = max(16, clients + 1)
    params.n_threads = params.n_threads_batch = 2
    params.kv_unified, params.no_perf = True, True
    params.flash_attn_type = 1
    ctx = lib.llama_init_from_model(model, params)
    memory = lib.llama_get_memory(ctx)
    batch = lib.llama_batch_init(512, 0, 1)
    seqs = list(range(1, clients + 1))

    def fresh() -> None:
        """Every client's sequence back to the shared prefix (held by sequence 0)."""
        for seq in seqs:
            lib.llama_memory_seq_rm(memory, seq, -1, -1)
            lib.llama_memory_seq_cp(memory, 0, seq, 0, prefix_tokens)

    def step_token(c: int, k: int) -> int:
        return questions[c][k % new_tokens]  # any token: the work does not depend on which

    def one_after_another() -> list[float]:
        fresh()
        done = []
        start = time.perf_counter()
        for c, seq in enumerate(seqs):
            _decode(lib, ctx, batch, [(t, prefix_tokens + i, seq) for i, t in enumerate(questions[c])])
            for k in range(steps):
                _decode(lib, ctx, batch, [(step_token(c, k), prefix_tokens + new_tokens + k, seq)])
            done.append(time.perf_counter() - start)
        return done

    def batched() -> list[float]:
        fresh()
        start = time.perf_counter()
        items = [(t, prefix_tokens + i, seq) for c, seq in enumerate(seqs) for i, t in enumerate(questions[c])]
        for offset in range(0, len(items), 512):
            _decode(lib, ctx, batch, items[offset : offset + 512])
        for k in range(steps):
            _decode(
                lib, ctx, batch, [(step_token(c, k), prefix_tokens + new_tokens + k, seq) for c, seq in enumerate(seqs)]
            )
        return [time.perf_counter() - start] * clients

    try:
        for offset in range(0, prefix_tokens, 512):
            chunk = prefix[offset : offset + 512]
            _decode(lib, ctx, batch, [(t, offset + i, 0) for i, t in enumerate(chunk)])
        serial_runs, batched_runs = [], []
        for _ in range(repeats):  # interleaved, so that both see the same machine state
            serial_runs.append(one_after_another())
            batched_runs.append(batched())
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)

    def summary(runs: list[list[float]]) -> dict[str, Any]:
        kept = runs[1:] or runs  # the first repeat warms the caches
        return {
            "last_client_seconds_median": round(statistics.median(r[-1] for r in kept), 3),
            "first_client_seconds_median": round(statistics.median(r[0] for r in kept), 3),
            "per_client_seconds_median": [round(statistics.median(r[c] for r in kept), 3) for c in range(clients)],
        }

    serial, together = summary(serial_runs), summary(batched_runs)
    return {
        "model": model_name,
        "clients": clients,
        "prefix_tokens": prefix_tokens,
        "new_tokens_per_client": new_tokens,
        "decode_steps_per_client": steps,
        "repeats": repeats,
        "machine": {"platform": platform.platform(), "cpu": cpu_description(), "python": platform.python_version()},
        "one_after_another": serial,
        "batched": together,
        "batched_vs_one_after_another_last_client": round(
            together["last_client_seconds_median"] / serial["last_client_seconds_median"], 3
        ),
    }


def ceiling(
    model_name: str,
    sequences: list[int],
    prefix_tokens: int,
    steps: int,
    repeats: int,
    *,
    other_cells: int = 0,
    flash_attention: bool = True,
) -> dict[str, Any]:
    """Tokens/s of ``steps`` one-token-per-sequence decode calls for each count of ``sequences``
    (``other_cells``: KV rows of eight other sequences that stay in the cache meanwhile, as idle
    sessions' rows do in a shared context)."""
    from specem_core.backends.llama_cpp._binding import load_library
    from specem_core.models import find_packaged, packaged_gguf

    packaged = find_packaged(model_name)
    if packaged is None:
        raise SystemExit(f"unknown packaged model {model_name!r}")
    lib = load_library()  # initialised once, quiet
    model = lib.llama_model_load_from_file(str(packaged_gguf(packaged)).encode(), lib.llama_model_default_params())
    vocab = lib.llama_model_get_vocab(model)
    text = (PARAGRAPH * (prefix_tokens // 10 + 1)).encode()
    buf = (lib.llama_token * (len(text) + 8))()
    count = lib.llama_tokenize(vocab, text, len(text), buf, len(text) + 8, True, False)
    prefix = list(buf[: min(count, prefix_tokens)])
    most = max(sequences)
    size = ctypes_string(lib, model, "general.file_type")
    params = lib.llama_context_default_params()
    params.n_ctx = most * (len(prefix) + steps + 16) + other_cells + 512
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = most + 8
    params.n_threads = params.n_threads_batch = 2
    params.kv_unified, params.no_perf = True, True
    params.flash_attn_type = -1 if flash_attention else 0  # -1: llama.cpp's choice, on
    ctx = lib.llama_init_from_model(model, params)
    memory = lib.llama_get_memory(ctx)
    batch = lib.llama_batch_init(512, 0, 1)
    rows: dict[int, dict[str, float]] = {}
    try:
        for seq in range(most):  # each sequence its own prefix rows, as separate requests have
            _decode(lib, ctx, batch, [(t, i, seq) for i, t in enumerate(prefix)])
        for other in range(most, most + 8 if other_cells else most):
            held = other_cells // 8
            for offset in range(0, held, 512):
                chunk = range(offset, min(held, offset + 512))
                _decode(lib, ctx, batch, [(prefix[i % len(prefix)], i, other) for i in chunk])
        for n in sequences:
            runs = []
            for _ in range(repeats + 1):  # the first run warms up
                for seq in range(n):
                    lib.llama_memory_seq_rm(memory, seq, len(prefix), -1)
                start = time.perf_counter()
                for k in range(steps):
                    items = [(prefix[k % len(prefix)], len(prefix) + k, seq) for seq in range(n)]
                    _decode(lib, ctx, batch, items)
                runs.append(n * steps / (time.perf_counter() - start))
            rows[n] = {"tokens_per_s": round(statistics.median(runs[1:]), 1)}
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    base = rows[min(rows)]["tokens_per_s"]
    for row in rows.values():
        row["x_one_sequence"] = round(row["tokens_per_s"] / base, 2)
    return {
        "model": model_name,
        "file_type": size,
        "flash_attn_type": int(params.flash_attn_type),
        "other_cells": other_cells,
        "prefix_tokens": len(prefix),
        "steps": steps,
        "repeats": repeats,
        "threads": 2,
        "machine": {"platform": platform.platform(), "cpu": cpu_description(), "python": platform.python_version()},
        "sequences": rows,
    }


def ctypes_string(lib: Any, model: Any, key: str) -> str:
    """A GGUF metadata value as text ('' when missing)."""
    import ctypes

    buf = ctypes.create_string_buffer(256)
    n = int(lib.llama_model_meta_val_str(model, key.encode(), buf, 256))
    return buf.value.decode() if n >= 0 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1100)
    parser.add_argument("--new-tokens", type=int, default=18, help="each client's question (template markers included)")
    parser.add_argument(
        "--steps", type=int, default=6, help="decode steps to the first segment (the served answers: 2-6 tokens)"
    )
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="seconds: SmolLM2, 3 clients, 40 + 4 tokens")
    parser.add_argument("--ceiling", action="store_true", help="tokens/s of 1, 8, 16, 32 sequences (see above)")
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8, 16, 32], help="--ceiling: counts")
    parser.add_argument(
        "--other-cells", type=int, default=0, help="--ceiling: KV rows other sequences hold meanwhile (idle sessions)"
    )
    parser.add_argument("--flash-attention", choices=["on", "off"], default="on", help="--ceiling")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.ceiling:
        if args.smoke:
            args.model, args.sequences, args.prefix_tokens, args.steps, args.repeats = (
                "smollm2-135m-instruct",
                [1, 2],
                16,
                2,
                1,
            )
        prefix = 64 if args.prefix_tokens == 1100 else args.prefix_tokens  # --ceiling's default prefix
        steps = 16 if args.steps == 6 else args.steps
        result = ceiling(
            args.model,
            args.sequences,
            prefix,
            steps,
            args.repeats,
            other_cells=args.other_cells,
            flash_attention=args.flash_attention == "on",
        )
        for n, row in result["sequences"].items():
            print(f"{n:3d} sequences: {row['tokens_per_s']:7.1f} tokens/s  x{row['x_one_sequence']:.2f}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    if args.smoke:
        args.model, args.clients, args.prefix_tokens, args.new_tokens, args.steps, args.repeats = (
            "smollm2-135m-instruct",
            3,
            40,
            4,
            2,
            2,
        )
    result = measure(args.model, args.prefix_tokens, args.new_tokens, args.steps, args.clients, args.repeats)
    for label in ("one_after_another", "batched"):
        row = result[label]
        print(
            f"{label:18s} {result['clients']} clients: first done {row['first_client_seconds_median']:.2f} s, "
            f"last done {row['last_client_seconds_median']:.2f} s"
        )
    print(f"batched / one after another (last client): {result['batched_vs_one_after_another_last_client']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
