"""``continuous_batching`` on the llama.cpp backend (:mod:`specem_core.backends.llama_cpp._shared`):
concurrent sessions share ``llama_decode`` calls over one context, each still gets its own rows
(checked against a from-scratch evaluation in a private context, within the batch noise of the
packaged Qwen2.5-0.5B's kernels), a long prefill is chunked with other sessions' steps riding
along, slots go back to the pool and the prefix cache, a failed call reaches every session in it,
and the option is refused where it means nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")

from packaged_gguf import packaged_gguf_or_skip

from specem_core import ConfigError, SamplingParams, SessionRequest, SpecEM, load_member
from specem_core.backends.llama_cpp import LlamaCppError, LlamaCppMember, LlamaCppModel
from specem_core.backends.llama_cpp._shared import MAX_SLOTS, SLOT_SEQUENCES, Slot
from specem_core.testing.llama_cpp_diagnostics import evaluate_from_scratch

NOISE = 1.0
"""Raw-logit tolerance: the packaged 0.5B's rows move by about 0.3-0.5 with the batch they are
computed in (docs/guides/how-it-works.md, "Exactness"); another session's row differs by units."""
PROMPTS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Count from one to five.",
]


def _gguf(name: str = "qwen2.5-coder") -> Any:
    return packaged_gguf_or_skip(name)


@pytest.fixture(scope="module")
def private() -> Iterator[LlamaCppMember]:
    """The reference: private contexts, nothing shared."""
    model = LlamaCppModel(_gguf(), n_ctx=2048, max_contexts=2, n_threads=2)
    yield LlamaCppMember(model)
    model.close()


@pytest.fixture
def shared() -> Iterator[LlamaCppMember]:
    model = LlamaCppModel(_gguf(), n_ctx=2048, max_contexts=4, n_threads=2, continuous_batching=True)
    yield LlamaCppMember(model)
    model.close()


def _request(prompt: str) -> SessionRequest:
    return SessionRequest([{"role": "user", "content": prompt}])


def _draft_together(member: LlamaCppMember, prompts: list[str], tokens: int) -> list[tuple[Any, list[int], int]]:
    """Each prompt drafted greedily in its own thread, all at once: (logits after the prompt, the
    drafted ids, prompt tokens from the prefix cache) per prompt."""
    barrier = threading.Barrier(len(prompts))
    out: list[Any] = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            session = member.open(_request(prompts[i]))
            barrier.wait()
            draft = session.draft(tokens, SamplingParams(ignore_eos=True))
            head = session._committed_logits.copy()
            session.commit(draft.text, final=True)
            out[i] = (head, list(session._resp_ids), session.cached_tokens)
            session.close()
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def _check_rows(reference: LlamaCppMember, prompt: str, head: Any, answer: list[int]) -> None:
    """``head`` is the logits row after ``prompt`` and ``answer`` a greedy continuation of it,
    within the batch noise of a from-scratch evaluation in a private context."""
    ids = reference.encode_prompt(_request(prompt))
    fresh = evaluate_from_scratch(reference.model, ids + answer, lambda i: i >= len(ids) - 1)
    assert float(abs(head - fresh[len(ids) - 1]).max()) <= NOISE
    banned = sorted(reference.stop_ids)  # the drafts ignore the end of turn
    for k, token in enumerate(answer):
        row = fresh[len(ids) - 1 + k].copy()
        row[banned] = -float("inf")
        assert float(row.max() - row[token]) <= NOISE, (prompt, k)  # greedy, up to a near tie


def test_concurrent_sessions_share_calls_and_each_gets_its_own_rows(
    shared: LlamaCppMember, private: LlamaCppMember
) -> None:
    stats = shared.shared_stats
    assert stats is not None
    results = _draft_together(shared, PROMPTS, 16)
    assert stats.shared_calls > 0
    assert stats.largest >= 3  # four sessions drafting at once fall into step
    assert stats.jobs > stats.calls
    for prompt, (head, answer, _cached) in zip(PROMPTS, results, strict=True):
        assert len(answer) >= 8
        _check_rows(private, prompt, head, answer)


def test_another_sessions_row_would_be_caught(shared: LlamaCppMember, private: LlamaCppMember) -> None:
    """The check above can fail: a row of another prompt is far outside the noise."""
    (head, answer, _), (other, _, _) = _draft_together(shared, PROMPTS[:2], 4)
    with pytest.raises(AssertionError):
        _check_rows(private, PROMPTS[0], other, answer)
    _check_rows(private, PROMPTS[0], head, answer)


def test_a_long_prefill_is_chunked_with_other_sessions_steps_riding_along(private: LlamaCppMember) -> None:
    model = LlamaCppModel(_gguf(), n_ctx=2048, max_contexts=2, n_threads=2, n_batch=64, continuous_batching=True)
    member = LlamaCppMember(model)
    try:
        assert model.shared is not None
        stats = model.shared.stats
        long_prompt = "Summarise: " + " ".join(f"item {i} is {i * 3} units long;" for i in range(40))
        drafter = member.open(_request(PROMPTS[0]))
        drafter.draft(1, SamplingParams())  # prefilled: its steps are one token each from here
        before = stats.shared_calls
        stop = threading.Event()

        def keep_drafting() -> None:
            while not stop.is_set():
                draft = drafter.draft(4, SamplingParams(ignore_eos=True))
                drafter.commit(draft.text)

        worker = threading.Thread(target=keep_drafting)
        worker.start()
        try:
            session = member.open(_request(long_prompt))
            calls = stats.calls
            session.draft(1, SamplingParams())
            head = session._committed_logits.copy()
        finally:
            stop.set()
            worker.join(300)
        prompt_len = len(member.encode_prompt(_request(long_prompt)))
        assert prompt_len > 4 * 64
        assert stats.calls - calls >= prompt_len // 64  # at most n_batch tokens a call
        assert stats.shared_calls - before >= prompt_len // 64 - 1  # the drafter's steps rode along
        ids = private.encode_prompt(_request(long_prompt))
        fresh = evaluate_from_scratch(private.model, ids, lambda i: i == len(ids) - 1)[len(ids) - 1]
        assert float(abs(head - fresh).max()) <= NOISE
        session.close()
        drafter.close()
    finally:
        model.close()


def test_slots_go_back_to_the_pool_and_the_prefix_cache(shared: LlamaCppMember, private: LlamaCppMember) -> None:
    model = shared.model
    assert model.shared is not None
    first = _draft_together(shared, [PROMPTS[1]], 8)[0]
    again = _draft_together(shared, [PROMPTS[1]], 8)[0]
    assert first[2] == 0
    assert again[2] > 0  # the finished request's rows, kept in its slot
    _check_rows(private, PROMPTS[1], again[0], again[1])
    # more requests than slots: the fifth waits for a slot, every one is served
    results = _draft_together(shared, [*PROMPTS, PROMPTS[0]], 4)
    assert all(answer for _, answer, _ in results)
    assert model.peak_contexts_in_use <= model.max_contexts == 4
    assert model.contexts_in_use == 0


def test_a_cached_prompt_is_forked_into_a_free_slot_and_kept_whole(
    shared: LlamaCppMember, private: LlamaCppMember
) -> None:
    """A request sharing only part of a cached request's rows (the same document, another question)
    reads them from a free slot that shares their cells; the cached slot keeps all its rows, so the
    first request's follow-up still finds its whole answer."""
    model = shared.model
    doc = " ".join(f"Fact {i}: the valve at site {i} was checked on day {i + 2}." for i in range(20))
    first = f"{doc}\n\nWhich valve was checked on day 5?"
    other = f"{doc}\n\nWhich valve was checked on day 9?"
    _draft_together(shared, [first], 8)
    held = model.prefixes.tokens
    head2, answer2, cached = _draft_together(shared, [other], 8)[0]
    assert cached > 100  # the document, from the first request's slot
    assert model.prefixes.tokens >= held  # the first request's rows are all still cached
    _check_rows(private, other, head2, answer2)
    again = _draft_together(shared, [first], 8)[0]
    assert again[2] >= len(shared.encode_prompt(_request(first))) - 1  # its whole prompt, still there


def test_a_slot_holds_its_sequences_only(shared: LlamaCppMember) -> None:
    model = shared.model
    slots = [model.acquire_context() for _ in range(3)]
    try:
        assert all(isinstance(s, Slot) for s in slots)
        bases = sorted(s.base for s in slots if isinstance(s, Slot))
        assert bases == [bases[0] + k * SLOT_SEQUENCES for k in range(3)]
    finally:
        for s in slots:
            model.release_context(s)


def test_a_failed_call_reaches_its_session_and_the_next_call_runs(shared: LlamaCppMember) -> None:
    """Fault injection: llama_decode refuses one call."""
    model = shared.model
    assert model.shared is not None
    real = model.shared._lib

    class Refusing:
        def __init__(self) -> None:
            self.left = 1

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def llama_decode(self, ctx: Any, batch: Any) -> int:
            if self.left:
                self.left -= 1
                return 2
            return int(real.llama_decode(ctx, batch))

    session = shared.open(_request(PROMPTS[0]))
    model.shared._lib = Refusing()
    try:
        with pytest.raises(LlamaCppError, match="llama_decode returned 2"):
            session.draft(2, SamplingParams())
    finally:
        model.shared._lib = real
    session.close()
    again = shared.open(_request(PROMPTS[0]))
    assert again.draft(2, SamplingParams()).tokens == 2
    again.close()


def test_the_engine_serves_concurrent_requests_on_shared_calls() -> None:
    """Two members (SmolLM2, Qwen2.5-0.5B), each on a shared context: three requests at once
    complete, and each model's calls served several of them."""
    members = [
        load_member(name, backend="llamacpp", continuous_batching=True, n_ctx=2048, max_contexts=3)
        for name in ("smollm2", "qwen2.5-coder")
    ]
    engine = SpecEM(members, max_new_tokens=24, temperature=0.0)
    answers: list[str] = [""] * 3
    threads = [
        threading.Thread(target=lambda i=i: answers.__setitem__(i, engine.generate(PROMPTS[i]).text)) for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(answers)
    for member in members:
        stats = member.shared_stats
        assert stats is not None
        assert stats.shared_calls > 0


def test_refused_where_it_means_nothing() -> None:
    """(With ``history_invariant`` too: ``tests/test_llama_cpp_row_invariant.py``.)"""
    with pytest.raises(ConfigError, match="continuous_batching must be True or False"):
        LlamaCppModel(_gguf(), n_ctx=512, continuous_batching=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at most 16 sessions"):
        LlamaCppModel(_gguf(), n_ctx=512, continuous_batching=True, max_contexts=17)
    with pytest.raises(ConfigError, match="continuous_batching set for server member"):
        load_member("openai:http://127.0.0.1:9/v1#m", continuous_batching=True)
    with pytest.raises(ConfigError, match="continuous_batching set for transformers member"):
        load_member("smollm2", backend="transformers", continuous_batching=True)


def test_the_shared_context_takes_flash_attention_and_up_to_sixteen_slots() -> None:
    """Flash attention is on unless asked otherwise (its kernel skips other sessions' cells); 16
    slots use 256 sequence ids, llama.cpp's most, and load (its output buffer must hold a row
    per sequence)."""
    smol = _gguf("smollm2")
    model = LlamaCppModel(smol, n_ctx=256, continuous_batching=True, max_contexts=MAX_SLOTS)
    try:
        assert model.shared is not None
        assert (model.shared.slots, model.flash_attn_type) == (16, -1)
        assert model.shared.n_ctx == 16 * 256
    finally:
        model.close()
    model = LlamaCppModel(smol, n_ctx=256, continuous_batching=True, max_contexts=2, flash_attention=False)
    try:
        assert model.flash_attn_type == 0
    finally:
        model.close()


def test_without_the_option_nothing_is_shared(private: LlamaCppMember) -> None:
    assert private.model.shared is None
    assert private.shared_stats is None
