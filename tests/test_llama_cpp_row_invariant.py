"""``continuous_batching`` with ``history_invariant`` (:mod:`specem_core.backends.llama_cpp._invariant`):
row-invariant kernels in a shared context give every request its answer alone, beside other
requests and after them, and the process-wide kernel setting is refused once ggml has read it.

The ensemble runs in a child process: ggml reads ``GGML_CPU_TILED_MM`` at the process's first
decode, and this test process has decoded with the tiled matmul on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specem_core import ConfigError
from specem_core.backends.llama_cpp import _invariant

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, threading
from specem_core import SpecEM, load_member

prompts = ["Why is the sky blue?", "Name three colours.", "What is a computer program?", "Count to five."]
members = [
    load_member(name, backend="llamacpp", continuous_batching=True, history_invariant=True, n_ctx=512, max_contexts=16)
    for name in sys.argv[1].split(",")
]
engine = SpecEM(members, max_new_tokens=int(sys.argv[2]), temperature=0.0, ignore_eos=True)
alone = [engine.generate(p).text for p in prompts]
together = [""] * len(prompts)
threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, engine.generate(prompts[i]).text))
           for i in range(len(prompts))]
for t in threads:
    t.start()
for t in threads:
    t.join()
after = [engine.generate(p).text for p in reversed(prompts)][::-1]
stats = [m.shared_stats for m in members]
print(json.dumps({
    "alone": alone, "together": together, "after": after,
    "largest": [s.largest for s in stats], "padded": [s.padded_calls for s in stats],
    "compactions": [s.compactions for s in stats], "order_breaks": [s.order_breaks for s in stats],
    "ubatch_rows": [m.model.shared.n_ubatch for m in members],
}))
"""


def _run_child(members: str, tokens: int) -> dict[str, list]:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    from packaged_gguf import packaged_gguf_or_skip

    for name in members.split(","):
        packaged_gguf_or_skip(name)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, members, str(tokens)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_each_request_gets_its_answer_alone_beside_others_and_after_them() -> None:
    """The packaged Qwen2.5-0.5B (Q5_0/Q8_0 weights through llamafile's kernels, Q4_K/Q6_K
    through ggml's) and SmolLM2 as a pair: four requests alone, then at once in shared calls, then
    again in reverse order; 24 tokens each, past the point where a shared call moves near ties
    without the kernels' route. With ``n_ctx=512`` the ballast is freed between requests (the
    cached prefixes moved to the bottom of the cache), and the later requests still match."""
    result = _run_child("qwen2.5-coder,smollm2", 24)
    assert all(result["alone"])
    assert result["together"] == result["alone"]
    assert result["after"] == result["alone"]
    assert min(result["largest"]) > 1  # the concurrent requests did share calls
    assert min(result["padded"]) > 0  # one-token calls carried the padding token
    assert min(result["compactions"]) > 0
    assert result["order_breaks"] == [0, 0]
    assert result["ubatch_rows"] == [_invariant.INVARIANT_UBATCH] * 2


def test_the_kernel_setting_is_taken_before_the_first_decode_and_refused_after(monkeypatch: pytest.MonkeyPatch) -> None:
    before = os.environ.get(_invariant.TILED_MM_ENV)
    monkeypatch.setenv(_invariant.TILED_MM_ENV, "1")  # recorded first, so the process's value comes back after
    monkeypatch.delenv(_invariant.TILED_MM_ENV)
    monkeypatch.setattr(_invariant, "_decoded", False)
    _invariant.require_row_invariant_kernels("m.gguf")
    assert os.environ[_invariant.TILED_MM_ENV] == "0"
    monkeypatch.delenv(_invariant.TILED_MM_ENV)
    monkeypatch.setattr(_invariant, "_decoded", True)
    with pytest.raises(ConfigError, match="GGML_CPU_TILED_MM=0") as caught:
        _invariant.require_row_invariant_kernels("m.gguf")
    assert "m.gguf" in str(caught.value)
    monkeypatch.setenv(_invariant.TILED_MM_ENV, "0")  # set by the user before the process started
    _invariant.require_row_invariant_kernels("m.gguf")
    monkeypatch.undo()
    assert os.environ.get(_invariant.TILED_MM_ENV) == before


def test_refused_without_flash_attention() -> None:
    """The refusal comes before the model loads, so nothing of the process's settings changes."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    from packaged_gguf import packaged_gguf_or_skip

    from specem_core.backends.llama_cpp import LlamaCppModel

    gguf = packaged_gguf_or_skip("smollm2")
    with pytest.raises(ConfigError, match="needs flash attention"):
        LlamaCppModel(gguf, n_ctx=256, flash_attention=False, continuous_batching=True, history_invariant=True)
