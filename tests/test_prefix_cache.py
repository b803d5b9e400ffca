"""The prefix cache across requests (``specem_core.backends._prefix_cache.PrefixStore``, the llama.cpp
context pool and the transformers store): a follow-up turn prefills only its new tokens, a cached
context never serves rows past the common prefix, eviction keeps the budget, an edited earlier
message reuses only what still matches, concurrent sessions stay isolated, and greedy text with the
cache equals the text without it on batch-invariant weights."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import tiny

from specem_core import SamplingParams, SessionRequest, SpecEM, SpecEMConfig
from specem_core.backends._prefix_cache import PrefixStore, common_prefix
from specem_core.errors import ConfigError

SYSTEM = "You are a terse assistant. Answer with a few words."
GREEDY = SamplingParams()


def _chat(*turns: str) -> list[dict[str, str]]:
    """system + alternating user/assistant messages."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": SYSTEM}] + [
        {"role": roles[i % 2], "content": text} for i, text in enumerate(turns)
    ]


# -- the store ---------------------------------------------------------------------------------
def test_store_finds_the_longest_prefix_and_keeps_one_token_to_decode() -> None:
    store: PrefixStore[str] = PrefixStore(100)
    store.add([1, 2, 3, 4], "a")
    store.add([1, 2, 9], "b")
    match = store.find([1, 2, 3, 4, 5])
    assert match is not None
    assert (match.entry.value, match.reused) == ("a", 4)
    full = store.find([1, 2, 3, 4])  # an exact hit still decodes its last token
    assert full is not None
    assert full.reused == 3
    assert store.find([7, 8]) is None
    assert store.find([1, 2, 3], min_reused=3) is None  # only 2 usable: one token left to decode


def test_store_ties_go_to_the_least_recently_used_and_take_removes() -> None:
    store: PrefixStore[str] = PrefixStore(100)
    store.add([1, 2, 3], "old")
    store.add([1, 2, 4], "new")
    match = store.find([1, 2, 5], take=True)
    assert match is not None
    assert match.entry.value == "old"
    assert match.reused == 2
    assert len(store) == 1


def test_store_evicts_least_recently_used_past_its_budget_and_supersedes_shorter_turns() -> None:
    evicted: list[str] = []
    store: PrefixStore[str] = PrefixStore(10, evicted.append)
    store.add([1, 2, 3, 4], "a")
    store.add([5, 6, 7, 8], "b")
    store.find([1, 2, 3, 4, 9])  # a becomes the most recently used
    store.add([9, 9, 9], "c")  # 11 tokens: b (least recently used) goes
    assert evicted == ["b"]
    assert store.tokens == 7
    store.add([1, 2, 3, 4, 5, 6], "a2")  # the same conversation one turn on: a is superseded
    assert evicted == ["b", "a"]
    assert store.tokens == 9
    assert not store.add(list(range(11)), "too long")  # longer than the budget: never kept
    assert evicted[-1] == "too long"


def test_store_charges_each_entry_its_cost() -> None:
    store: PrefixStore[str] = PrefixStore(100, cost=lambda _ids: 60)  # e.g. KV cells reserved
    store.add([1, 2], "a")
    store.add([3, 4], "b")  # 120 > 100: a goes, however short
    assert store.tokens == 60
    assert store.find([3, 4, 5]) is not None
    assert store.find([1, 2, 5]) is None


def test_budget_must_be_a_non_negative_integer() -> None:
    with pytest.raises(ConfigError, match="prefix_cache_tokens"):
        PrefixStore(-1)


# -- transformers ------------------------------------------------------------------------------
def _tiny(kind: str, name: str = "", **kwargs: Any) -> Any:
    return tiny.member(kind, name=name or kind, **kwargs)


def _turns(engine: SpecEM, questions: list[str], max_new_tokens: int = 12) -> list[Any]:
    """A conversation: each answer goes into the next request's history."""
    history: list[str] = []
    results = []
    for question in questions:
        history.append(question)
        result = engine.generate(_chat(*history), max_new_tokens=max_new_tokens)
        history.append(result.text)
        results.append(result)
    return results


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_transformers_follow_up_turn_prefills_only_its_new_tokens(kind: str) -> None:
    member = _tiny(kind)
    config = SpecEMConfig(segment_len=4, max_new_tokens=12)
    first, second = _turns(SpecEM([member], config), ["Tell me about Paris.", "And Berlin?"])
    usage = second.usage.per_member[0]
    prompt2 = member.encode_prompt(SessionRequest(_chat("Tell me about Paris.", first.text, "And Berlin?")))
    held = member.encode_prompt(SessionRequest(_chat("Tell me about Paris."))) + member.encode_response(first.text)
    shared = common_prefix(held, prompt2)
    assert shared > 0
    assert usage.cached_tokens == shared
    new_tokens = usage.prompt_tokens - shared
    assert usage.prefilled_tokens == new_tokens  # only what is new was run through the model
    assert second.usage.cached_tokens == shared


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_transformers_greedy_text_with_the_cache_equals_without(kind: str) -> None:
    questions = ["Tell me about Paris.", "And Berlin?", "Compare them."]
    config = SpecEMConfig(segment_len=4, max_new_tokens=12)
    cached = _turns(SpecEM([_tiny(kind), _tiny("llama", "second")], config), questions)
    plain = _turns(
        SpecEM([_tiny(kind, prefix_cache=False), _tiny("llama", "second", prefix_cache=False)], config), questions
    )
    assert [r.text for r in cached] == [r.text for r in plain]
    assert [[s.winner for s in r.segments] for r in cached] == [[s.winner for s in r.segments] for r in plain]
    assert cached[1].usage.cached_tokens > 0
    assert all(r.usage.cached_tokens == 0 for r in plain)


def test_transformers_scores_on_a_reused_prefix_equal_a_fresh_session() -> None:
    from specem_core import Candidate

    member = _tiny("qwen2")
    fresh = _tiny("qwen2", prefix_cache=False)
    first = SessionRequest(_chat("Tell me about Paris."))
    session = member.open(first)
    session.draft(4, GREEDY)
    session.commit("Paris is")
    session.close()
    edited = SessionRequest(_chat("Tell me about Rome."))  # edits the last message: a shorter match
    cands = [Candidate("a", " a city", False), Candidate("b", "Rome", True)]
    reused, alone = member.open(edited), fresh.open(edited)
    got, want = reused.score(cands, score_eos=True), alone.score(cands, score_eos=True)
    prompt = member.encode_prompt(edited)
    assert 0 < reused.cached_tokens == common_prefix(member.encode_prompt(first), prompt) < len(prompt)
    for g, w in zip(got, want, strict=True):
        assert g.mean_logit == pytest.approx(w.mean_logit, abs=1e-4)
    reused.close()
    alone.close()


def test_transformers_prefix_cache_off_and_budget() -> None:
    off = _tiny("llama", prefix_cache=False)
    SpecEM([off], SpecEMConfig(max_new_tokens=4)).generate(_chat("hi"))
    assert len(off.prefixes) == 0
    small = _tiny("llama", prefix_cache_tokens=8)  # shorter than any prompt: nothing is kept
    SpecEM([small], SpecEMConfig(max_new_tokens=4)).generate(_chat("hi"))
    assert len(small.prefixes) == 0
    with pytest.raises(ConfigError, match="prefix_cache_tokens"):
        _tiny("llama", prefix_cache_tokens=-5)


# -- llama.cpp ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_q4_1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 as shipped (Q4_1): llama.cpp's kernels are batch-invariant for it below 64 cached
    positions, so prefix reuse must be exact there."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    from specem_core.models import find_packaged, is_assembled, is_installed, packaged_gguf

    model = find_packaged("smollm2")
    assert model is not None
    if not (is_installed(model) or is_assembled(model)):
        pytest.skip("SmolLM2 is not installed: specem models pull smollm2 --backend llamacpp")
    return packaged_gguf(model)


def _llama(path: Path, **kwargs: Any) -> Any:
    from specem_core.backends.llama_cpp import LlamaCppMember, LlamaCppModel

    return LlamaCppMember(LlamaCppModel(path, n_ctx=1024, **kwargs), name="smollm2")


SHORT = ["Hi.", "Bye."]
"""Short turns: the whole conversation stays below 64 positions, where SmolLM2's kernels are
batch-invariant and cached rows equal a fresh evaluation bit for bit."""


def test_llama_cpp_follow_up_turn_prefills_only_its_new_tokens(smollm_q4_1: Path) -> None:
    member = _llama(smollm_q4_1)
    engine = SpecEM([member], SpecEMConfig(segment_len=4, max_new_tokens=8))
    first, second = _turns(engine, ["What is 2+2?", "And 3+3?"], max_new_tokens=8)
    prompt2 = member.encode_prompt(SessionRequest(_chat("What is 2+2?", first.text, "And 3+3?")))
    held = member.encode_prompt(SessionRequest(_chat("What is 2+2?"))) + member.encode_response(first.text)
    shared = min(common_prefix(held, prompt2), len(prompt2) - 1)
    usage = second.usage.per_member[0]
    assert shared > len(member.encode_prompt(SessionRequest(_chat("What is 2+2?")))) // 2
    assert usage.cached_tokens == shared
    assert usage.prefilled_tokens == len(prompt2) - shared
    assert member.model.contexts_in_use == 0
    assert len(member.model.prefixes) == 1


def test_llama_cpp_greedy_text_with_the_cache_equals_without(smollm_q4_1: Path) -> None:
    config = SpecEMConfig(segment_len=3, max_new_tokens=6)
    cached = _turns(SpecEM([_llama(smollm_q4_1)], config), SHORT, max_new_tokens=6)
    plain = _turns(SpecEM([_llama(smollm_q4_1, prefix_cache=False)], config), SHORT, max_new_tokens=6)
    assert [r.text for r in cached] == [r.text for r in plain]
    assert cached[1].usage.cached_tokens > 0
    assert plain[1].usage.cached_tokens == 0


def _head_logits_equal_fresh(member: Any, session: Any) -> float:
    """Max |diff| between the session's next-token logits and a from-scratch evaluation."""
    from specem_core.testing.llama_cpp_diagnostics import evaluate_from_scratch

    ids = session._prompt_ids + session._resp_ids
    fresh = evaluate_from_scratch(member.model, ids, lambda i: i == len(ids) - 1)[len(ids) - 1]
    return float(abs(session._committed_logits - fresh).max())


def test_llama_cpp_never_serves_another_conversations_rows_past_the_common_prefix(smollm_q4_1: Path) -> None:
    member = _llama(smollm_q4_1)
    a = member.open(SessionRequest(_chat("Name a red fruit.")))
    draft = a.draft(4, GREEDY)
    a.score([], score_eos=False)
    a.commit(draft.text)
    a.close()
    other = SessionRequest(_chat("Name a blue fruit."))  # same system prompt, another question
    b = member.open(other)
    b.draft(2, GREEDY)
    prompt_a = member.encode_prompt(SessionRequest(_chat("Name a red fruit.")))
    assert b.cached_tokens == common_prefix(prompt_a, member.encode_prompt(other))
    assert 0 < b.cached_tokens < len(prompt_a)
    assert _head_logits_equal_fresh(member, b) == 0.0
    b.close()


def test_llama_cpp_edited_earlier_message_reuses_only_what_still_matches(smollm_q4_1: Path) -> None:
    member = _llama(smollm_q4_1)
    engine = SpecEM([member], SpecEMConfig(segment_len=3, max_new_tokens=4))
    first = engine.generate(_chat("Hi."), max_new_tokens=4)
    edited = _chat("Hello.", first.text, "Bye.")  # the first message changed after the fact
    session = member.open(SessionRequest(edited))
    session.draft(2, GREEDY)
    prompt = member.encode_prompt(SessionRequest(edited))
    assert session.cached_tokens == common_prefix(member.encode_prompt(SessionRequest(_chat("Hi."))), prompt)
    assert _head_logits_equal_fresh(member, session) == 0.0
    session.close()


def test_llama_cpp_eviction_under_a_tiny_budget_frees_contexts(smollm_q4_1: Path) -> None:
    member = _llama(smollm_q4_1, prefix_cache_tokens=1024)  # an idle context is charged its 1024 cells
    engine = SpecEM([member], SpecEMConfig(max_new_tokens=3))
    for question in ["One?", "Two?", "Three?"]:
        engine.generate(_chat(question))
        assert member.model.prefixes.tokens <= 1024
    assert len(member.model.prefixes) == 1  # each conversation evicts the last: its context is freed
    tiny_budget = _llama(smollm_q4_1, prefix_cache_tokens=5)
    SpecEM([tiny_budget], SpecEMConfig(max_new_tokens=3)).generate(_chat("One?"))
    assert len(tiny_budget.model.prefixes) == 0
    assert tiny_budget.model.contexts_in_use == 0


def test_llama_cpp_concurrent_sessions_on_one_member_stay_isolated(smollm_q4_1: Path) -> None:
    config = SpecEMConfig(segment_len=3, max_new_tokens=6)
    questions = [["Hi.", "Bye."], ["Yes?", "No?"], ["Red?", "Blue?"]]
    want = [
        [r.text for r in _turns(SpecEM([_llama(smollm_q4_1, prefix_cache=False)], config), q, 6)] for q in questions
    ]
    member = _llama(smollm_q4_1, max_contexts=2)  # fewer contexts than conversations: they are shared
    engine = SpecEM([member], config)
    got: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            got[n] = [r.text for r in _turns(engine, questions[n], 6)]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert [got[n] for n in range(len(questions))] == want
    assert member.model.peak_contexts_in_use <= 2
    assert member.model.contexts_in_use == 0


def test_llama_cpp_concurrent_requests_sharing_a_long_prefix_each_reuse_it(smollm_q4_1: Path) -> None:
    """A served system prompt: the context holding it serves one request; the others load the
    host-memory copy of its rows into contexts of their own, with the same logits bit for bit."""
    from specem_core.backends.llama_cpp.model import SNAPSHOT_MIN_TOKENS

    member = _llama(smollm_q4_1)
    system = " ".join(f"Rule {i}: be brief and exact." for i in range(40))

    def request(question: str) -> SessionRequest:
        return SessionRequest([{"role": "system", "content": system}, {"role": "user", "content": question}])

    first = member.open(request("Hi."))
    first.draft(2, GREEDY)
    first.close()
    member.model.settle()  # the long prefix is copied to host memory off the request's path
    assert len(member.encode_prompt(request("Hi."))) >= SNAPSHOT_MIN_TOKENS
    assert len(member.model.snapshots) == 1
    a, b = member.open(request("Bye.")), member.open(request("Bye."))
    a.draft(2, GREEDY)  # takes the context that holds the rows
    b.draft(2, GREEDY)  # loads the copy into a context of its own
    shared = common_prefix(member.encode_prompt(request("Hi.")), member.encode_prompt(request("Bye.")))
    assert a.cached_tokens == b.cached_tokens == shared >= SNAPSHOT_MIN_TOKENS
    assert member.model.contexts_in_use == 2
    assert (a._committed_logits == b._committed_logits).all()
    assert a.draft(4, GREEDY).text == b.draft(4, GREEDY).text
    a.close()
    b.close()
