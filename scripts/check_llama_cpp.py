"""Check the installed llama-cpp-python build on this CPU (scripts/install.sh runs it once the
default models' weights are in).

    .venv/bin/python scripts/check_llama_cpp.py     # exit 0: the build is sound here; 1: it is not

SmolLM2's packaged GGUF (Q4_1, whose CPU kernels are batch-invariant below 64 positions) is
decoded once as one batch and once a token per call, in a child process so that a crash in the
batched kernels (what the default ``-march=native`` build did on an AMX CPU) is reported, not
fatal. The build passes when both schedules give finite logits that agree within 1e-3, which is
what the engine's exactness and the tests rely on. A build that fails is marked
(``FAILED_CHECK`` in its wheel cache folder), so that ``scripts/build_llama_cpp.sh`` installs the
AVX2 build on its next run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived a king"
TOLERANCE = 1e-3


def child() -> None:
    """Decode ``TEXT`` both ways and print the largest difference (the process may crash)."""
    import math

    from specem_core.backends.llama_cpp import LlamaCppModel
    from specem_core.models import find_packaged, packaged_gguf
    from specem_core.testing.llama_cpp_diagnostics import batch_noise

    packaged = find_packaged("smollm2")
    assert packaged is not None
    model = LlamaCppModel(packaged_gguf(packaged), n_ctx=256)
    ids = model.tokenize(TEXT, add_special=True, parse_special=False)
    noise = batch_noise(model, ids)
    print(f"{len(ids)} tokens, one batch vs one token per call: max |diff| {noise:.6f}", flush=True)
    sys.exit(0 if math.isfinite(noise) and noise <= TOLERANCE else 3)


def build_level() -> str:
    """The level ``build_llama_cpp.sh`` recorded in the installed package ("unknown" if none)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return "unknown"
    marker = Path(spec.origin).parent / "SPECEM_BUILD_LEVEL"
    return marker.read_text().strip() if marker.exists() else "unknown"


def main() -> int:
    level = build_level()
    run = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True)
    detail = (run.stdout + run.stderr).strip().splitlines()
    if run.returncode == 0:
        print(f"check_llama_cpp: the {level} build of llama.cpp is sound here ({detail[-1]})")
        return 0
    if run.returncode < 0:
        why = f"crashed (signal {-run.returncode}) in a batched decode"
    elif run.returncode == 3:
        why = f"gives logits that depend on batching ({detail[-1]}; want <= {TOLERANCE})"
    else:
        why = "failed: " + " / ".join(detail[-3:])
    print(f"check_llama_cpp: the {level} build of llama.cpp {why}", file=sys.stderr)
    if level != "unknown":
        cache = Path(os.environ.get("SPECEM_WHEEL_CACHE", Path.home() / ".cache" / "specem" / "wheels"))
        (cache / level).mkdir(parents=True, exist_ok=True)
        (cache / level / "FAILED_CHECK").write_text(why + "\n")
    return 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child()
    sys.exit(main())
