"""What llama.cpp's CPU kernels cost and how exact they are, per packaged GGUF, side by side.

    python benchmarks/llama_cpp_kernels.py                       # smollm2, qwen2.5-coder, gemma3
    python benchmarks/llama_cpp_kernels.py --models qwen2.5-coder-1.5b
    python benchmarks/llama_cpp_kernels.py --requantize      # also each model requantized to Q4_1

For flash attention on (llama.cpp's default, "auto") and off, it measures:

* **cost of one call** on a cached prefix: 1 token, 8 tokens and 30 tokens, and the ratios — what
  batching buys on this CPU (8 tokens for 8 concurrent requests' drafting steps; 30 tokens for a
  verification block of three 10-token candidates);
* **batch invariance**: the same sequence decoded one token per call against one batch (max |diff|
  of the last position's raw logits);
* **cell order**: a position stored in a *lower* KV cell than an older one (prefill A; another
  sequence takes the next cells; A decodes one token; the other sequence is freed; A decodes the
  next token into the freed, lower cell) against the same steps in order.

The last two are why the llama.cpp backend gives each request a private context filled upwards
(README, "A llama.cpp limitation"); the first bounds what batching concurrent requests can gain.
``--requantize`` adds each model requantized to Q4_1 (SmolLM2's packaged type): batch invariance
depends on the quantization type's kernels, and Q4_1's are batch-invariant with flash attention on
(results: ``benchmarks/results/llama_cpp_kernels_q4_1.json``).
Results: ``benchmarks/results/llama_cpp_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

TEXT = b"The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived a king who"
RESULTS = Path(__file__).parent / "results" / "llama_cpp_kernels.json"


class Probe:
    """One GGUF loaded through llama-cpp-python's low-level API."""

    def __init__(self, path: Path, threads: int) -> None:
        import numpy as np

        from specem_core.backends.llama_cpp._binding import load_library

        self.np = np
        self.lib = lib = load_library()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(vocab))
        buf = (lib.llama_token * 256)()
        n = lib.llama_tokenize(vocab, TEXT, len(TEXT), buf, 256, True, False)
        self.ids = list(buf[:n])
        self.threads = threads

    def context(self, flash: int) -> Any:
        lib = self.lib
        cp = lib.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = 4
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.flash_attn_type = flash
        cp.no_perf = True
        return lib.llama_init_from_model(self.model, cp)

    def decode(self, ctx: Any, tokens: list[int], pos: int, seq: int = 0, logits: bool = True) -> Any:
        lib = self.lib
        batch = lib.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if logits and i == len(tokens) - 1 else 0
            batch.n_tokens = len(tokens)
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            lib.llama_batch_free(batch)
        if not logits:
            return None
        row = lib.llama_get_logits_ith(ctx, len(tokens) - 1)
        return self.np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy()

    def measure(self, flash: int, repeats: int) -> dict[str, float]:
        lib, np, a = self.lib, self.np, self.ids
        n = len(a)
        full = [*a, a[3], a[4]]
        out: dict[str, float] = {}

        ctx = self.context(flash)
        batch_row = self.decode(ctx, full, 0)
        lib.llama_free(ctx)
        ctx = self.context(flash)
        for i, t in enumerate(full):
            single_row = self.decode(ctx, [t], i)
        lib.llama_free(ctx)
        out["one_per_call_vs_batch"] = float(np.abs(single_row - batch_row).max())

        ctx = self.context(flash)
        mem = lib.llama_get_memory(ctx)
        self.decode(ctx, a, 0, logits=False)
        lib.llama_memory_seq_cp(mem, 0, 1, 0, n)
        self.decode(ctx, a[5:10], n, seq=1)
        self.decode(ctx, [full[n]], n)
        lib.llama_memory_seq_rm(mem, 1, n, -1)
        lower = self.decode(ctx, [full[n + 1]], n + 1)
        lib.llama_free(ctx)
        ctx = self.context(flash)
        self.decode(ctx, a, 0, logits=False)
        self.decode(ctx, [full[n]], n)
        in_order = self.decode(ctx, [full[n + 1]], n + 1)
        lib.llama_free(ctx)
        out["lower_cell_vs_in_order"] = float(np.abs(lower - in_order).max())

        out.update(self.call_costs(flash, repeats))
        out["batch8_speedup"] = 8 * out["ms_1"] / out["ms_8"]
        out["batch30_speedup"] = 30 * out["ms_1"] / out["ms_30"]
        return out

    def call_costs(self, flash: int, repeats: int) -> dict[str, float]:
        """Milliseconds of one decode call of 1, 8 and 30 tokens on a cached prefix (``ms_1`` …)."""
        lib, a = self.lib, self.ids
        n = len(a)
        out: dict[str, float] = {}
        ctx = self.context(flash)
        mem = lib.llama_get_memory(ctx)
        self.decode(ctx, a, 0, logits=False)
        for size in (1, 8, 30):
            block = (a * 2)[:size]
            self.decode(ctx, block, n)  # warm
            lib.llama_memory_seq_rm(mem, 0, n, -1)
            t = time.perf_counter()
            for _ in range(repeats):
                self.decode(ctx, block, n)
                lib.llama_memory_seq_rm(mem, 0, n, -1)
            out[f"ms_{size}"] = 1000 * (time.perf_counter() - t) / repeats
        lib.llama_free(ctx)
        return out

    def close(self) -> None:
        self.lib.llama_model_free(self.model)


def main() -> None:
    from specem_core.backends.llama_cpp import default_threads, requantize
    from specem_core.backends.llama_cpp._binding import load_library
    from specem_core.models import find_packaged, packaged_gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder", "gemma3"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--requantize", action="store_true", help="also measure each model requantized to Q4_1")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} (_q4_1 with --requantize)")
    args = parser.parse_args()
    lib = load_library()
    modes = {"auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO, "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED}
    results: dict[str, Any] = {"threads": args.threads, "models": {}}
    print(
        f"{'model':<28} {'flash attn':<10} {'1 tok ms':>9} {'8 tok ms':>9} {'30 tok ms':>10} "
        f"{'x8 batch':>9} {'x30 batch':>10} {'1/call vs batch':>16} {'lower cell':>11}"
    )
    scratch = tempfile.TemporaryDirectory()
    variants: list[tuple[str, Path]] = []
    for name in args.models:
        packaged = find_packaged(name)
        if packaged is None:
            raise SystemExit(f"unknown packaged model {name!r}")
        variants.append((name, packaged_gguf(packaged)))
        if args.requantize:
            target = Path(scratch.name) / f"{name}.gguf"
            variants.append((f"{name} (Q4_1)", requantize(packaged_gguf(packaged), target)))
    for name, path in variants:
        probe = Probe(path, args.threads)
        results["models"][name] = {}
        for label, flash in modes.items():
            r = probe.measure(flash, args.repeats)
            results["models"][name][label] = r
            print(
                f"{name:<28} {label:<10} {r['ms_1']:>9.1f} {r['ms_8']:>9.1f} {r['ms_30']:>10.1f} "
                f"{r['batch8_speedup']:>8.2f}x {r['batch30_speedup']:>9.2f}x "
                f"{r['one_per_call_vs_batch']:>16.4f} {r['lower_cell_vs_in_order']:>11.4f}",
                flush=True,
            )
        probe.close()
    scratch.cleanup()
    out = args.out or (RESULTS.with_name("llama_cpp_kernels_q4_1.json") if args.requantize else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
