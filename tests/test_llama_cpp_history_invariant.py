"""``history_invariant`` on the llama.cpp backend (``LlamaCppModel``): a request's logits and greedy
drafts are bit for bit those of a new process, after other requests and beside them, while the
prefix cache still hands over whole chunks of a shared prompt. On the packaged Qwen2.5-0.5B and
1.5B, whose kernels are not batch-invariant, so that reused rows from another batch shape would
show, and SmolLM2, whose flash-attention decode step moves with the thread count."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")

from packaged_gguf import packaged_gguf_or_skip
from test_build_scripts import AVX512  # the CPU check the llama.cpp build uses

from specem_core import Candidate, ConfigError, SamplingParams, SessionRequest, load_member
from specem_core.backends.llama_cpp import LlamaCppMember, LlamaCppModel
from specem_core.backends.llama_cpp._binding import BALLAST, INVARIANT_CHUNK, Context
from specem_core.testing.llama_cpp_diagnostics import batch_noise

DOC = " ".join(
    f"Section {i}: the {kind} at site {i * 7} was inspected on day {i + 3}; {note}."
    for i, (kind, note) in enumerate(
        [
            ("pump", "the seal leaked and was replaced"),
            ("valve", "it sticks when cold"),
            ("boiler", "pressure stayed within limits"),
            ("fan", "a blade was cracked"),
            ("filter", "it was clogged with dust"),
            ("sensor", "readings drifted by two degrees"),
            ("pipe", "corrosion was found near the joint"),
            ("motor", "bearings were noisy"),
        ]
    )
)
FIRST = [{"role": "user", "content": f"{DOC}\n\nWhich part leaked?"}]
OTHER = [{"role": "user", "content": f"{DOC}\n\nWhat was wrong with the fan?"}]
TOKENS = 12
LONG = 80
"""A first answer long enough to pass a chunk boundary: its decoded rows would be handed over."""


def _gguf(name: str = "qwen2.5-coder") -> Any:
    return packaged_gguf_or_skip(name)


@pytest.fixture(scope="module", params=["qwen2.5-coder", "qwen2.5-coder-1.5b"])
def gguf(request: pytest.FixtureRequest) -> Any:
    """The 0.5B gives a one-token batch other values than a prefill's; the 1.5B's prefill rows
    also change with the batch's length."""
    return _gguf(request.param)


@contextlib.contextmanager
def _model(gguf: Any, invariant: bool) -> Iterator[LlamaCppModel]:
    model = LlamaCppModel(gguf, n_ctx=2048, max_contexts=4, history_invariant=invariant)
    try:
        yield model
    finally:
        model.close()


def _answer(member: LlamaCppMember, messages: list[dict[str, str]], tokens: int = TOKENS) -> tuple[Any, str, int]:
    """Prefill ``messages``, draft greedily and commit: the logits after the prompt, the text and
    how many prompt tokens came from the prefix cache."""
    session = member.open(SessionRequest(messages))
    try:
        draft = session.draft(tokens, SamplingParams(ignore_eos=True))
        logits = session._committed_logits.copy()
        cached = session.cached_tokens
        session.commit(draft.text, final=True)
        return logits, draft.text, cached
    finally:
        session.close()


def _cold(gguf: Any, messages: list[dict[str, str]], tokens: int = TOKENS) -> tuple[Any, str]:
    """The same request in a model loaded for it alone (what a new process computes)."""
    with _model(gguf, True) as model:
        logits, text, cached = _answer(LlamaCppMember(model), messages, tokens)
    assert cached == 0
    return logits, text


def test_reused_rows_and_answers_equal_a_new_process_after_and_beside_other_requests(gguf: Any) -> None:
    with _model(gguf, True) as model:
        member = LlamaCppMember(model)
        _, first_text, _ = _answer(member, FIRST, LONG)
        follow_up = [*FIRST, {"role": "assistant", "content": first_text}, {"role": "user", "content": "And the fan?"}]
        # the same request again (the default cache would decode its last prompt token alone)
        again_logits, again_text, again_cached = _answer(member, FIRST, LONG)
        # another request on the shared document, then the follow-up, each after the others
        other_logits, other_text, other_cached = _answer(member, OTHER)
        follow_logits, follow_text, follow_cached = _answer(member, follow_up)
        # beside each other: two sessions hold contexts at once
        both = [member.open(SessionRequest(m)) for m in (OTHER, follow_up)]
        texts = [session.draft(TOKENS, SamplingParams(ignore_eos=True)).text for session in both]
        for session in both:
            session.close()
    assert other_cached > 0
    assert other_cached % INVARIANT_CHUNK == 0
    assert follow_cached >= other_cached  # the first request's prompt, not its decoded answer
    assert again_cached > 0
    assert again_text == first_text
    runs = [(FIRST, again_logits, again_text, LONG), (OTHER, other_logits, other_text, TOKENS)]
    runs.append((follow_up, follow_logits, follow_text, TOKENS))
    for messages, logits, text, tokens in runs:
        cold_logits, cold_text = _cold(gguf, messages, tokens)
        assert (logits == cold_logits).all()  # bit for bit
        assert text == cold_text
    assert texts == [other_text, follow_text]


def test_without_it_a_follow_up_gets_other_logits(gguf: Any) -> None:
    """The control: by default a follow-up reuses the rows of the answer before it, which were
    decoded a token at a time, and these kernels give a one-token batch other values than a
    prefill's: its logits differ from a new process's (by about 0.3 here). Where a CPU's kernels
    are batch-invariant for these weights there is nothing to show."""
    with _model(gguf, False) as model:
        member = LlamaCppMember(model)
        ids = member.encode_prompt(SessionRequest(FIRST))[:48]
        if batch_noise(model, ids) == 0.0:
            pytest.skip("this CPU's kernels are batch-invariant for these weights")
        _, first_text, _ = _answer(member, FIRST)
        follow_up = [*FIRST, {"role": "assistant", "content": first_text}, {"role": "user", "content": "And?"}]
        logits, _, cached = _answer(member, follow_up)
    assert cached > len(ids)
    cold_logits, _ = _cold(gguf, follow_up)
    assert not (logits == cold_logits).all()


def test_a_prompt_one_token_into_a_chunk_hands_over_whole_chunks_only(gguf: Any) -> None:
    """A prompt that ends one token into a chunk: its last row was computed in a one-token batch,
    which a follow-up's new-process prefill computes inside a whole chunk; it is prefilled again."""
    with _model(gguf, True) as model:
        member = LlamaCppMember(model)
        words = ["Which part leaked?"]
        while len(member.encode_prompt(SessionRequest(_asking(" ".join(words))))) % INVARIANT_CHUNK != 1:
            words.insert(0, "Please")
        first = _asking(" ".join(words))
        _, text, _ = _answer(member, first)
        follow_up = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "And?"}]
        logits, _, cached = _answer(member, follow_up)
    assert cached > 0
    assert cached % INVARIANT_CHUNK == 0
    cold_logits, _ = _cold(gguf, follow_up)
    assert (logits == cold_logits).all()


def _asking(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{DOC}\n\n{question}"}]


def test_prefills_run_in_aligned_chunks_and_only_their_rows_are_kept(gguf: Any) -> None:
    """One ``llama_decode`` per chunk; the context goes back to the prefix cache holding the
    prompt's rows and none of the answer's (decoded a token at a time, as no new process would)."""
    with _model(gguf, True) as model:
        member = LlamaCppMember(model)
        prompt = member.encode_prompt(SessionRequest(FIRST))
        calls = model.decode_calls
        session = member.open(SessionRequest(FIRST))
        draft = session.draft(1, SamplingParams())
        assert model.decode_calls - calls == -(-len(prompt) // INVARIANT_CHUNK)  # no step for one token
        session.commit(draft.text)
        own = session.draft(TOKENS, SamplingParams(ignore_eos=True))
        other = Candidate("other", " The pump's seal.", False)
        session.score([Candidate("own", own.text, False), other], score_eos=False)
        session.commit(other.text)  # the other's rows are adopted: the draft's cells retired below them
        assert session._ballast > 0
        session.commit(session.draft(TOKENS, SamplingParams(ignore_eos=True)).text, final=True)
        session.close()
        [entry] = model.prefixes._entries
        assert list(entry.ids) == prompt
        context = entry.value
        assert isinstance(context, Context)
        assert context._lib.llama_memory_seq_pos_max(context._mem, BALLAST) == -1  # the retired cells freed


def _smollm2() -> Any:
    return _gguf("smollm2")


def test_decodes_use_every_thread_whatever_the_load() -> None:
    """With ``n_threads="auto"`` a decode that starts beside another gets fewer threads; with
    ``history_invariant`` each gets ``n_threads``."""
    with _model(_smollm2(), False) as model:
        if model.n_threads < 2:
            pytest.skip("one CPU: nothing to share")
        with model.decode_threads(), model.decode_threads() as beside:
            assert beside < model.n_threads
    with _model(_smollm2(), True) as model:
        assert model.auto_threads
        with model.decode_threads() as first, model.decode_threads() as beside:
            assert (first, beside) == (model.n_threads, model.n_threads)


@pytest.mark.skipif(AVX512, reason="measured with the AVX2 build; this CPU runs the AVX512 one")
def test_the_thread_count_moves_a_flash_attention_decode_step() -> None:
    """Why the count is fixed: SmolLM2 (Q4_1, flash attention on) decodes a step on a cached
    prompt with other logits on 1 thread than on 2 (measured with the AVX2 build that CPUs without
    AVX512 run)."""
    from specem_core.backends.llama_cpp._binding import Work

    rows = []
    for threads in (1, 2):
        model = LlamaCppModel(_smollm2(), n_ctx=1024, n_threads=threads, prefix_cache=False)
        try:
            if model.n_threads != threads:
                pytest.skip("one CPU")
            context = model.acquire_context()
            ids = [(i * 37) % 5000 + 100 for i in range(300)]
            context.decode(Work(ids, list(range(300)), [0] * 300, [None] * 300))
            rows.append(context.decode(Work([ids[0]], [300], [0], [-1])).rows[0])
            model.release_context(context)
        finally:
            model.close()
    assert not (rows[0] == rows[1]).all()


def test_a_server_or_transformers_member_refuses_it() -> None:
    with pytest.raises(ConfigError, match="history_invariant"):
        load_member("openai:http://127.0.0.1:9/v1#m", history_invariant=True)
    with pytest.raises(ConfigError, match="True or False"):
        LlamaCppModel(_gguf(), history_invariant="yes")  # type: ignore[arg-type]
