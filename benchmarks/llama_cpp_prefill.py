"""What a follow-up turn's prefill costs on a cached prefix, per llama.cpp context setting, side by side.

    python benchmarks/llama_cpp_prefill.py                      # the 1.5B, a 1,100-token prefix
    python benchmarks/llama_cpp_prefill.py --smoke              # seconds: SmolLM2, a short prefix

A RAG follow-up on the prefix cache prefills only its ~18 new tokens on top of ~1,100 cached ones;
on this machine that call is a third of the turn, and the one-member ensemble's follow-ups measured
1.22x llama-cpp-python's ``Llama`` on the same model (docs/reports/performance.md). The contexts
differ in three settings; this script measures each, through llama-cpp-python's low-level API on
one loaded model, one setting at a time and all three together:

* SpecEM's context when this was written: ``n_ctx`` 8,192 (the 1.5B's default), 16 sequences in
  one unified KV cache (sequence 0 and the scratch sequences candidates are scored in), flash
  attention on (llama.cpp's choice; SpecEM now turns it off on a CPU for all but Q4_1 weights:
  ``default_flash_attention``);
* flash attention off (``Llama``'s default);
* ``n_ctx`` 4,096 (``Llama``'s usual setting);
* one sequence, not unified;
* all three as ``Llama`` has them.

Per setting: the median time of decoding the new tokens on the cached prefix (7 repeats, the first
dropped, the rows past the prefix removed before each) and of one-token decode steps after it.
Results: ``benchmarks/results/llama_cpp_prefill.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "llama_cpp_prefill.json"
PARAGRAPH = "Retrieved document: the Zephyr project keeps its launch schedule in the archive. "
SETTINGS: list[tuple[str, int, int, bool, bool]] = [
    # label, n_ctx, sequences, unified KV, flash attention
    ("SpecEM's context: n_ctx 8192, 16 sequences unified, flash attention on", 8192, 16, True, True),
    ("flash attention off", 8192, 16, True, False),
    ("n_ctx 4096", 4096, 16, True, True),
    ("1 sequence, not unified", 8192, 1, False, True),
    ("as llama-cpp-python's Llama: n_ctx 4096, 1 sequence, flash attention off", 4096, 1, False, False),
]


def _decode(lib: Any, ctx: Any, tokens: list[int], start: int) -> None:
    batch = lib.llama_batch_init(512, 0, 1)
    try:
        for offset in range(0, len(tokens), 512):
            chunk = tokens[offset : offset + 512]
            batch.n_tokens = len(chunk)
            for j, token in enumerate(chunk):
                batch.token[j] = token
                batch.pos[j] = start + offset + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = 0
            batch.logits[len(chunk) - 1] = 1
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
    finally:
        lib.llama_batch_free(batch)


def measure(model_name: str, prefix_tokens: int, new_tokens: int, repeats: int, settings: list[Any]) -> dict[str, Any]:
    import llama_cpp as lib

    from specem_core.models import find_packaged, packaged_gguf

    packaged = find_packaged(model_name)
    if packaged is None:
        raise SystemExit(f"unknown packaged model {model_name!r}")
    path = str(packaged_gguf(packaged))
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
    vocab = lib.llama_model_get_vocab(model)
    need = prefix_tokens + new_tokens + 8
    text = (PARAGRAPH * (need // 10 + 1)).encode()
    buf = (lib.llama_token * (need * 2))()
    count = lib.llama_tokenize(vocab, text, len(text), buf, need * 2, True, False)
    if count < prefix_tokens + new_tokens + 8:
        raise RuntimeError(f"the text encodes to {count} tokens only")
    prefix, follow = list(buf[:prefix_tokens]), list(buf[prefix_tokens : prefix_tokens + new_tokens])
    rows = []
    for label, n_ctx, sequences, unified, flash in settings:
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, 512, 512, sequences
        params.n_threads = params.n_threads_batch = 2
        params.kv_unified, params.no_perf = unified, True
        params.flash_attn_type = 1 if flash else 0
        ctx = lib.llama_init_from_model(model, params)
        memory = lib.llama_get_memory(ctx)
        try:
            _decode(lib, ctx, prefix, 0)
            prefill = []
            for _ in range(repeats):
                lib.llama_memory_seq_rm(memory, 0, len(prefix), -1)
                start = time.perf_counter()
                _decode(lib, ctx, follow, len(prefix))
                prefill.append(time.perf_counter() - start)
            steps = []
            for _ in range(3):
                lib.llama_memory_seq_rm(memory, 0, len(prefix) + len(follow), -1)
                start = time.perf_counter()
                for k in range(8):
                    _decode(lib, ctx, [follow[k % len(follow)]], len(prefix) + len(follow) + k)
                steps.append((time.perf_counter() - start) / 8)
        finally:
            lib.llama_free(ctx)
        row = {
            "setting": label,
            "n_ctx": n_ctx,
            "sequences": sequences,
            "kv_unified": unified,
            "flash_attention": flash,
            "prefill_seconds_median": round(statistics.median(prefill[1:] or prefill), 4),
            "decode_ms_per_token_median": round(1000 * statistics.median(steps), 2),
        }
        rows.append(row)
        print(
            f"{label:75s} prefill {new_tokens} tokens: {row['prefill_seconds_median']:.3f} s   "
            f"decode: {row['decode_ms_per_token_median']:.1f} ms/token",
            flush=True,
        )
    lib.llama_model_free(model)
    base = rows[0]["prefill_seconds_median"]
    for row in rows:
        row["prefill_vs_specem"] = round(row["prefill_seconds_median"] / base, 3)
    return {
        "model": model_name,
        "prefix_tokens": prefix_tokens,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prefix-tokens", type=int, default=1100)
    parser.add_argument("--new-tokens", type=int, default=18)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="seconds: SmolLM2, 40 + 8 tokens, 2 settings")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.smoke:
        result = measure("smollm2-135m-instruct", 40, 8, 2, [SETTINGS[0], SETTINGS[-1]])
    else:
        result = measure(args.model, args.prefix_tokens, args.new_tokens, args.repeats, SETTINGS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
