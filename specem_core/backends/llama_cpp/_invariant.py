"""Row-invariant llama.cpp kernels: a token's logits that do not depend on what shares its decode call.

With ``continuous_batching`` and ``history_invariant`` together, a request's rows are computed in
calls shaped by the other requests of the moment. llama.cpp's CPU kernels pick their algorithm by
the shape of the call, and the algorithms round differently (the logits move by 0.2-0.4, enough to
flip a near tie). Checked on the vendored llama.cpp of llama-cpp-python 0.3.36
(``ggml/src/ggml-cpu``), each path and what avoids it:

* **repacked weights** (``repack.cpp``, the CPU's "extra buffer type"): Q4_K and other weights are
  rearranged at load for a 4-row GEMM, with a different one-row GEMV. Off: the model is loaded with
  ``use_extra_bufts = false``.
* **the tiled K-quant matmul** (``tiled/tiled.cpp``): Q4_K/Q5_K/Q6_K weights against 8 rows or more
  take a tiled kernel, fewer rows the per-cell dot product. Off: ``GGML_CPU_TILED_MM=0``, which
  ggml reads once per process, at its first matmul (:func:`require_row_invariant_kernels`).
* **flash attention's tiled path** (``ops.cpp``): 64 query rows or more in one micro-batch. Avoided:
  micro-batches of at most :data:`INVARIANT_UBATCH` tokens.
* **flash attention's split-KV path**: a micro-batch of *one* token over 512 cells or more splits
  the cells among the threads and merges partial softmaxes. Avoided: a call whose last micro-batch
  would hold one token (a lone step, or 1 more than a multiple of :data:`INVARIANT_UBATCH`) carries
  a padding token in a sequence of its own (:data:`PAD_TOKENS`), removed after the call.

What is left computes each cell of a matmul as one dot product (llamafile's ``tinyBLAS`` for
Q5_0/Q8_0 weights included: each tile accumulates its cells in the same order whatever the tile
shape) and each query row's attention over the cells in cell order, skipping the cells its mask
hides. So a row's values depend on its tokens and on the *order of its sequence's cells*: flash
attention accumulates in f16, and a cell reused below a sequence's newer ones changes the sum
(0.4-0.5 on the logits of the packaged Qwen2.5 models). The shared context therefore frees no cell below a live one: see
:class:`~specem_core.backends.llama_cpp._shared.SharedContext`.

The price is the speed of these paths: prefill runs without the tiled matmul and the repacked
weights (measured in docs/reports/performance.md, "Continuous batching on llama.cpp").
"""

from __future__ import annotations

import logging
import os
import threading

from specem_core.errors import ConfigError

FA_TILE_ROWS = 64
"""ggml's ``GGML_FA_TILE_Q``: flash attention takes its tiled path from this many query rows."""
INVARIANT_UBATCH = FA_TILE_ROWS - 1
"""The largest micro-batch (``n_ubatch``) that keeps flash attention on its per-row path."""
PAD_TOKENS = 1
"""Tokens added to a call whose last micro-batch would hold one (one query row takes flash
attention's split-KV path)."""
TILED_MM_ENV = "GGML_CPU_TILED_MM"

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_decoded = False
"""Whether this process ran a ``llama_decode`` through this backend (ggml has read the variable)."""


def note_decode() -> None:
    """A decode call ran: from now on ggml's tiled-matmul setting is fixed for the process."""
    global _decoded
    _decoded = True


def require_row_invariant_kernels(model_name: str, flash_attention: bool | None = None) -> None:
    """Turn ggml's tiled K-quant matmul off for this process (``GGML_CPU_TILED_MM=0``).

    Raises:
        ConfigError: ``flash_attention=False`` (its per-row kernel is the invariant attention), or
            a llama.cpp decode already ran in this process with the tiled matmul on (ggml read the
            variable then and keeps what it read).
    """
    if flash_attention is False:
        raise ConfigError(
            f"{model_name}: continuous_batching with history_invariant needs flash attention: its per-row "
            "kernel is what keeps a row's logits independent of its call"
        )
    with _lock:
        if os.environ.get(TILED_MM_ENV) == "0":
            return
        if _decoded:
            raise ConfigError(
                f"{model_name}: continuous_batching with history_invariant needs ggml's tiled matmul off, "
                f"which ggml reads at the process's first decode and another llama.cpp model has decoded "
                f"already: load this model first, or start the process with {TILED_MM_ENV}=0"
            )
        os.environ[TILED_MM_ENV] = "0"
        _log.info(
            "%s: %s=0 for this process (row-invariant kernels): every llama.cpp model in it prefills "
            "without the tiled K-quant matmul",
            model_name,
            TILED_MM_ENV,
        )
