"""The transformers backend on tiny random models: cached scoring equals naive recomputation,
and no character is lost or corrupted at segment boundaries."""

from __future__ import annotations

from typing import Any

import pytest
import tiny
from avoiding import check_avoiding_the_first_word

from specem_core import Candidate, SamplingParams, SessionRequest, SpecEM, SpecEMConfig
from specem_core.testing.reference import naive_draft, naive_generate, naive_scores

REQ = SessionRequest([{"role": "user", "content": "Tell me about Paris, Berlin and 中文."}])
KINDS = ["llama", "qwen2", "gemma3"]


@pytest.fixture(scope="module")
def members() -> dict[str, Any]:
    return {k: tiny.member(k) for k in KINDS}


def _cands(draft_text: str, draft_ended: bool) -> list[Candidate]:
    own = [Candidate("self", draft_text, draft_ended)] if (draft_text or draft_ended) else []
    return [
        *own,
        Candidate("x", " hello wor", False),
        Candidate("y", "ld 中文", True),  # merges with a committed "wor"; multi-byte
        Candidate("z", "lo there😀", False),
        Candidate("w", "", True),  # only the end of turn
    ]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("score_eos", [True, False])
def test_cached_scores_equal_naive_full_recompute(members: dict[str, Any], kind: str, score_eos: bool) -> None:
    m = members[kind]
    session = m.open(REQ)
    prompt = m.encode_prompt(REQ)
    worst = 0.0
    for rnd in range(6):  # several rounds so the cache is reused and rolled back
        d = session.draft(5, SamplingParams())
        cands = _cands(d.text, d.ended)
        got = session.score(cands, score_eos=score_eos)
        want = naive_scores(m, prompt, session._text, [(c.text, c.ended) for c in cands], score_eos)
        for g, (logit, logprob) in zip(got, want, strict=True):
            worst = max(worst, abs(g.mean_logit - logit), abs(g.mean_logprob - logprob))
        committable = [c for c in cands if not c.ended and c.text]
        session.commit(committable[rnd % len(committable)].text)
        assert session._cache_length() == len(prompt) + len(session._resp_ids)
    assert worst <= 1e-4
    if kind == "gemma3":  # longer than the sliding window: the window is applied on the cached path too
        assert session._cache_length() > 16


@pytest.mark.parametrize("kind", KINDS)
def test_draft_equals_naive_greedy_and_commit_keeps_cache_exact(members: dict[str, Any], kind: str) -> None:
    m = members[kind]
    session = m.open(REQ)
    prompt = m.encode_prompt(REQ)
    for _ in range(4):
        d = session.draft(7, SamplingParams())
        assert (d.text, d.ended) == naive_draft(m, prompt, session._text, 7)
        if d.ended or not d.text:
            break
        session.score([Candidate("self", d.text, d.ended), Candidate("o", " ok", False)], score_eos=True)
        session.commit(d.text)
    # after commits through every path, the next-token logits equal a fresh forward pass
    import torch

    ids = prompt + m.encode_response(session._text)
    with torch.inference_mode():
        fresh = m.model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(session._next_logits, fresh, atol=1e-4)


@pytest.mark.parametrize(
    "pieces",
    [
        ["hel", "lo wor", "ld"],  # tokens that merge across boundaries
        ["12345", "678", "90"],  # space-free segments (the authors' code lost a character here)
        ["Caf", "é na", "ïve"],  # accents
        ["中", "文字", "符😀"],  # CJK + emoji
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_committed_text_is_exact_at_boundaries(members: dict[str, Any], kind: str, pieces: list[str]) -> None:
    m = members[kind]
    session = m.open(REQ)
    for p in pieces:
        session.score([Candidate("a", p, False), Candidate("b", p + "!", False)], score_eos=True)
        session.commit(p)
    assert session._text == "".join(pieces)
    assert session._resp_ids == m.encode_response("".join(pieces))
    assert m.tokenizer.decode(session._resp_ids) == "".join(pieces)


def test_utf8_character_split_by_the_length_cap_is_completed(members: dict[str, Any]) -> None:
    m = members["llama"]
    session = m.open(REQ)
    emoji_ids = m.encode_response("😀")
    assert len(emoji_ids) > 1  # the byte-level tokenizer needs several tokens for it
    d = session._decode_continuation(emoji_ids[:1])
    assert d.endswith("\ufffd")  # a cut inside the character decodes to a replacement char
    for _ in range(8):
        draft = session.draft(1, SamplingParams(temperature=1.0))
        assert not draft.text.endswith("\ufffd")
        if draft.ended or not draft.text:
            break
        session.commit(draft.text)


def test_session_prompt_too_long_for_context_window() -> None:
    from specem_core import ContextWindowError

    m = tiny.member("llama")
    long = SessionRequest([{"role": "user", "content": "word " * 600}])
    with pytest.raises(ContextWindowError, match="context window is 512"):
        m.open(long)


@pytest.mark.parametrize("hedge", [True, False])
@pytest.mark.parametrize("segment_len", [3, 8])
def test_faithful_engine_makes_the_naive_loops_decisions(
    tiny_members: list[Any], hedge: bool, segment_len: int
) -> None:
    msgs = [{"role": "user", "content": "Write code to add numbers."}]
    engine = SpecEM(
        tiny_members, SpecEMConfig(reproduce_paper=True, segment_len=segment_len, max_new_tokens=40, hedge=hedge)
    )
    got = engine.generate(msgs)
    assert len(got.segments) >= 3
    want = naive_generate(tiny_members, msgs, segment_len=segment_len, max_new_tokens=40, hedge=hedge)
    assert got.text == want.text
    assert [s.winner_index for s in got.segments] == [r.winner for r in want.rounds]
    for seg, rnd in zip(got.segments, want.rounds, strict=True):
        assert [(c.text, c.ended) for c in seg.candidates] == rnd.candidates
        for row, ref in zip(seg.raw_scores, rnd.raw, strict=True):
            assert row == pytest.approx(ref, abs=1e-4)


def test_sampling_is_reproducible_with_a_seed(tiny_members: list[Any]) -> None:
    engine = SpecEM(tiny_members[:2], SpecEMConfig(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_new_tokens=20))
    a = engine.generate("hi")
    b = engine.generate("hi")
    c = engine.generate("hi", seed=8)
    assert a.text == b.text
    assert [s.candidates for s in a.segments] != [s.candidates for s in c.segments]


def test_plain_format_for_models_without_a_template() -> None:
    from specem_core.backends.transformers import TransformersMember

    model, shared = tiny.tiny_qwen2()
    m = TransformersMember(model, shared, name="plain", chat_template=None)
    m.chat.template = None  # as for Gemma-3-270M: no chat template in the GGUF
    prompt = m.chat.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt == "### System:\nBe brief.\n\n### User:\nHi\n\n### Assistant:\n"
    assert "\n### User:" in m.chat.turn_stop_strings


@pytest.mark.parametrize("kind", KINDS)
def test_token_healing_redraws_the_last_committed_token(members: dict[str, Any], kind: str) -> None:
    """With ``token_healing`` the draft starts by redrawing the committed text's last token among
    the tokens that extend its text (greedy: the best of those), and the session is left exactly
    at the committed prefix afterwards."""
    import torch

    m = members[kind]
    assert m.token_texts_concatenate()
    # a committed text whose last token has longer relatives in this tiny vocabulary
    committed = next(
        t
        for t in ("hel", "hello w", "Paris, B", "he")
        if len(m.tokens_extending(m.token_text(m.encode_response(t)[-1]))) > 1
    )
    session = m.open(REQ)
    prompt = m.encode_prompt(REQ)
    session.commit(committed)
    ids = prompt + session._resp_ids
    tail = m.token_text(ids[-1])
    allowed = m.tokens_extending(tail)
    assert all(m.token_text(t).startswith(tail) for t in allowed)
    with torch.inference_mode():
        before_last = m.model(input_ids=torch.tensor([ids[:-1]])).logits[0, -1]
    best = allowed[int(torch.argmax(before_last[allowed]))]

    healed = session.draft(6, SamplingParams(token_healing=True))
    assert (tail + healed.text).startswith(m.token_text(best))  # the redrawn token leads the draft
    assert session._cache_length() == len(ids)
    with torch.inference_mode():
        fresh = m.model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(session._next_logits, fresh, atol=1e-4)

    cands = [Candidate("self", healed.text, healed.ended), Candidate("o", "orld", False)]
    got = session.score(cands, score_eos=True)
    want = naive_scores(m, prompt, session._text, [(c.text, c.ended) for c in cands], True)
    for g, (logit, logprob) in zip(got, want, strict=True):
        assert g.mean_logit == pytest.approx(logit, abs=1e-4)
        assert g.mean_logprob == pytest.approx(logprob, abs=1e-4)
    if healed.text and not healed.ended:
        session.commit(healed.text)
        assert session._text == committed + healed.text
        plain = session.draft(5, SamplingParams())
        assert (plain.text, plain.ended) == naive_draft(m, prompt, session._text, 5)


def test_token_healing_in_the_engine(tiny_members: list[Any]) -> None:
    """With ``token_healing`` every round's candidates are the members' healed drafts (each
    member alone, after the earlier rounds' text), and healing changed at least one of them:
    with healing off the engine's candidates are the plain drafts and this test fails."""
    from engine_replay import replay_drafts

    msgs = [{"role": "user", "content": "Write code to add numbers."}]
    config = SpecEMConfig(segment_len=3, max_new_tokens=16, token_healing=True)
    result = SpecEM(tiny_members, config).generate(msgs)
    assert result.excluded == []
    drafts = replay_drafts(
        tiny_members,
        msgs,
        result,
        segment_len=3,
        max_new_tokens=16,
        feature=SamplingParams(token_healing=True),
    )
    assert len(result.segments) >= 2
    for d in drafts:
        assert d.engine == d.with_feature, f"round {d.round}, {d.member}: not the healed draft ({d})"
    changed = [d for d in drafts if d.with_feature != d.without_feature]
    assert changed, "healing changed no draft: this prompt does not exercise it"
    assert SpecEMConfig(reproduce_paper=True, token_healing=True).token_healing is False


def test_open_is_cheap_and_the_prompt_is_prefilled_on_first_use() -> None:
    """Opening renders, encodes and checks the window only; the first draft, score or commit
    prefills once, and whichever comes first the results equal a fresh computation."""
    m = tiny.member("llama")
    calls: list[int] = []
    hook = m.model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(1), with_kwargs=True)
    prompt = m.encode_prompt(REQ)
    try:
        by_draft, by_score, by_commit, by_final = (m.open(REQ) for _ in range(4))
        assert calls == []
        assert by_draft.prompt_tokens == len(prompt)
        d = by_draft.draft(5, SamplingParams())
        assert (d.text, d.ended) == naive_draft(m, prompt, "", 5)
        cands = [Candidate("x", " hello wor", False), Candidate("y", "ld 中文", True)]
        got = by_score.score(cands, score_eos=True)
        want = naive_scores(m, prompt, "", [(c.text, c.ended) for c in cands], True)
        for g, (logit, logprob) in zip(got, want, strict=True):
            assert g.mean_logit == pytest.approx(logit, abs=1e-4)
            assert g.mean_logprob == pytest.approx(logprob, abs=1e-4)
        by_commit.commit("hel")
        d = by_commit.draft(4, SamplingParams())
        assert (d.text, d.ended) == naive_draft(m, prompt, "hel", 4)
        n = len(calls)
        by_final.commit("The end.", final=True)  # accounting only: still no model work
        assert len(calls) == n
        assert by_final.completion_tokens == len(m.encode_response("The end."))
    finally:
        hook.remove()


def test_tokenizer_ids_beyond_the_models_head_are_not_banned() -> None:
    # A tokenizer can know more ids than the model scores (a special token added after training,
    # or one a saved tokenizer gains on reload): drafting must not index logits with them.
    from specem_core.backends.transformers import TransformersMember

    model, tok = tiny.tiny_qwen2()
    rows = model.get_output_embeddings().weight.shape[0]
    tok.add_special_tokens({"additional_special_tokens": ["<extra_control>"]})
    extra = tok.convert_tokens_to_ids("<extra_control>")
    assert extra >= rows
    member = TransformersMember(model, tok, name="qwen2")
    assert extra not in member.suppress_ids
    assert member.suppress_ids  # the model's own control tokens stay banned
    result = SpecEM([member], SpecEMConfig(max_new_tokens=8, ignore_eos=True)).generate("hi")
    assert result.excluded == []
    assert result.usage.completion_tokens >= 8


def test_a_draft_told_to_avoid_a_word_starts_with_another() -> None:
    """``SamplingParams(avoid_words=...)`` (``copy_break``) on the real SmolLM2 (its fp32 copy): the
    draft's first word is not the avoided one, and a word the draft does not start with changes nothing."""
    from specem_core import models, registry

    packaged = models.find_packaged("smollm2")
    if packaged is None or not models.is_converted(packaged):
        pytest.skip("SmolLM2's fp32 copy is not installed (scripts/install_dev.sh converts it)")
    member = registry.load_member("smollm2", backend="transformers")
    session = member.open(SessionRequest([{"role": "user", "content": "What is the capital of France?"}]))
    try:
        check_avoiding_the_first_word(session, 10)
    finally:
        session.close()


def test_drafts_stop_at_their_first_line_end_when_asked() -> None:
    """``SamplingParams(stop_at_line_end=True)`` (``segment_boundary="line"``) on the real
    SmolLM2 (its fp32 copy): each draft is the greedy draft up to its first token with a newline."""
    from specem_core import models, registry

    packaged = models.find_packaged("smollm2")
    if packaged is None or not models.is_converted(packaged):
        pytest.skip("SmolLM2's fp32 copy is not installed (scripts/install_dev.sh converts it)")
    member = registry.load_member("smollm2", backend="transformers")
    request = SessionRequest([{"role": "user", "content": "Write a Python function that adds two numbers."}])
    session = member.open(request)
    lines = 0
    try:
        for _ in range(4):
            session.draft(48, SamplingParams())
            ids = session._draft.ids
            cut = next((i + 1 for i, t in enumerate(ids) if "\n" in member.tokenizer.decode([t])), len(ids))
            want = member.tokenizer.decode(ids[:cut])
            got = session.draft(48, SamplingParams(stop_at_line_end=True))
            assert got.text == want
            lines += "\n" in got.text
            session.commit(got.text)
    finally:
        session.close()
    assert lines >= 2
