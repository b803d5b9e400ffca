"""Cross-request batching: the device queue's scheduling, merged decode steps equal each session's
own step on every architecture, and concurrent requests share passes and answer as they would alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import tiny

from specem_core import SamplingParams, SessionRequest, SpecEM, SpecEMConfig
from specem_core.backends._batching import DeviceQueue, Step
from specem_core.backends.transformers import TransformersMember
from specem_core.errors import ConfigError
from specem_core.testing.reference import naive_draft, naive_scores

KINDS = ["llama", "qwen2", "gemma3"]
PROMPTS = [
    "Tell me about Paris.",
    "Hello world! How are you today? Numbers: 12345 678 90 3.14159 42",
    "def add(a, b): return a + b",
]


def _request(text: str) -> SessionRequest:
    return SessionRequest([{"role": "user", "content": text}])


# -- the queue ----------------------------------------------------------------------------------
def test_queue_runs_one_pass_at_a_time_and_merges_waiting_steps() -> None:
    queue = DeviceQueue(gather_s=0.05)
    running = threading.Lock()
    overlaps: list[int] = []
    served: list[list[int]] = []

    def run(steps: Any) -> list[int]:
        if not running.acquire(blocking=False):
            overlaps.append(1)
            return [0] * len(steps)
        try:
            served.append([s.payload for s in steps])
            time.sleep(0.02)
            return [s.payload * 10 for s in steps]
        finally:
            running.release()

    def worker(i: int) -> list[int]:
        out = []
        with queue.drafting("model"):
            for k in range(5):
                out.append(queue.step(Step("model", i * 100 + k, run, max_rows=8)))
                if k == 2:
                    queue.exclusive(lambda: run([]))  # a prefill or verification pass in between
        return out

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(worker, range(4)))
    assert results == [[(i * 100 + k) * 10 for k in range(5)] for i in range(4)]
    assert not overlaps
    assert queue.stats.steps == 20
    assert queue.stats.largest >= 2  # the four drafting loops fell into step
    assert queue.stats.passes < 20
    assert queue.stats.exclusive == 4
    assert all(len({p // 100 for p in batch}) == len(batch) for batch in served if batch)  # one step per session


def test_queue_never_merges_steps_of_different_models_and_serves_each_with_its_own_pass() -> None:
    queue = DeviceQueue(gather_s=0.05)
    served: list[tuple[str, list[str]]] = []

    def runner(name: str) -> Any:
        def run(steps: Any) -> list[str]:
            served.append((name, [s.group for s in steps]))
            time.sleep(0.01)
            return [f"{name}:{s.payload}" for s in steps]

        return run

    runs = {"a": runner("a"), "b": runner("b")}

    def worker(i: int) -> str:
        group = "a" if i % 2 else "b"
        with queue.drafting(group):
            return str(queue.step(Step(group, str(i), runs[group], max_rows=2)))

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(worker, range(8))) == [f"{'a' if i % 2 else 'b'}:{i}" for i in range(8)]
    assert all(set(groups) == {name} and len(groups) <= 2 for name, groups in served)


def test_a_failing_pass_fails_every_step_in_it_and_the_queue_keeps_serving() -> None:
    # A long gather window: the first pass of model "m" waits for the steps of all its drafting
    # sessions (they are all drafting before any steps), so that pass holds every one of them.
    queue = DeviceQueue(gather_s=5.0)
    n = 4
    served: dict[str, list[list[int]]] = {"m": [], "other": []}
    other_queued = threading.Event()

    def run_m(steps: Any) -> list[int]:
        served["m"].append(sorted(s.payload for s in steps))
        if len(served["m"]) == 1:
            # the failing pass: hold the device until the other model's steps queue behind it
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                with queue._cond:
                    if sum(s.group == "other" for s in queue._steps) == 2:
                        other_queued.set()
                        break
                time.sleep(0.005)
            raise RuntimeError("device lost")
        return [s.payload * 10 for s in steps]

    def run_other(steps: Any) -> list[str]:
        served["other"].append(sorted(s.payload for s in steps))
        return [f"ok:{s.payload}" for s in steps]

    ready = threading.Barrier(n)

    def worker_m(i: int) -> tuple[str, Any]:
        with queue.drafting("m"):
            ready.wait(timeout=5.0)
            try:
                first: str = f"no error: {queue.step(Step('m', i, run_m, max_rows=8))}"
            except RuntimeError as exc:
                first = str(exc)
            return first, queue.step(Step("m", i, run_m, max_rows=8))  # the queue keeps serving

    def worker_other(i: int) -> Any:
        with queue.drafting("other"):
            while not served["m"]:  # submit while the failing pass is running
                time.sleep(0.001)
            return queue.step(Step("other", i, run_other, max_rows=8))

    with ThreadPoolExecutor(n + 2) as pool:
        m_futures = [pool.submit(worker_m, i) for i in range(n)]
        other_futures = [pool.submit(worker_other, i) for i in range(2)]
        m_outcomes = [f.result(timeout=30) for f in m_futures]
        other_outcomes = [f.result(timeout=30) for f in other_futures]

    assert served["m"][0] == list(range(n))  # the failing pass held every session's step ...
    assert [first for first, _ in m_outcomes] == ["device lost"] * n  # ... and each of them got the error
    assert [second for _, second in m_outcomes] == [i * 10 for i in range(n)]  # later passes are fine
    assert other_queued.is_set()  # the other model's steps were queued during the failing pass ...
    assert other_outcomes == ["ok:0", "ok:1"]  # ... and were served normally
    assert sorted(p for batch in served["other"] for p in batch) == [0, 1]
    assert queue.step(Step("m", 7, run_m)) == 70
    assert not queue._busy
    assert queue._steps == []


# -- merged passes on real (tiny) models ---------------------------------------------------------
@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[Any, Any]]:
    """Per kind: a batching member and an unbatched member over the same weights."""
    out = {}
    for kind in KINDS:
        batched = tiny.member(kind)
        alone = TransformersMember(batched.model, batched.tokenizer, name=kind, request_batch_size=1)
        out[kind] = (batched, alone)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_merged_decode_steps_equal_each_sessions_own_step(pairs: dict[str, tuple[Any, Any]], kind: str) -> None:
    batched, alone = pairs[kind]
    merged = [batched.open(_request(p)) for p in PROMPTS]
    single = [alone.open(_request(p)) for p in PROMPTS]
    for i, (a, b) in enumerate(zip(merged, single, strict=True)):  # different committed lengths too
        a._ensure_prefilled()
        b._ensure_prefilled()
        a.commit(" hello" * i)
        b.commit(" hello" * i)
    assert len({s.kv_length() for s in merged}) == len(merged)
    worst = 0.0
    tokens = [int(s._next_logits.argmax()) for s in single]
    for _ in range(24):  # past gemma3's sliding window of 16
        steps = [Step(0, (s, t), batched.decode_rows) for s, t in zip(merged, tokens, strict=True)]
        rows = batched.decode_rows(steps)
        own = [s.forward([t]) for s, t in zip(single, tokens, strict=True)]
        worst = max(worst, *(float((r - o).abs().max()) for r, o in zip(rows, own, strict=True)))
        tokens = [int(o.argmax()) for o in own]
    assert worst <= 1e-4
    for a, b in zip(merged, single, strict=True):
        assert a.kv_length() == b.kv_length()
        for la, lb in zip(a._cache.layers, b._cache.layers, strict=True):
            assert float((la.keys - lb.keys).abs().max()) <= 1e-4
            assert float((la.values - lb.values).abs().max()) <= 1e-4


def _held(queue: DeviceQueue, pending: int, work: list[threading.Thread]) -> None:
    """Run ``work`` while the device is busy, until ``pending`` steps wait, then free the device:
    the waiting steps are then served together (deterministic merging)."""
    release = threading.Event()
    holder = threading.Thread(target=queue.exclusive, args=(release.wait,))
    holder.start()
    while not queue._busy:
        time.sleep(0.001)
    for t in work:
        t.start()
    deadline = time.monotonic() + 30
    while len(queue._steps) < pending and time.monotonic() < deadline:
        time.sleep(0.001)
    release.set()
    for t in [holder, *work]:
        t.join()


@pytest.mark.parametrize("kind", KINDS)
def test_merged_verification_blocks_score_exactly_and_a_merged_row_can_win(
    pairs: dict[str, tuple[Any, Any]], kind: str
) -> None:
    batched, _ = pairs[kind]
    queue = batched.queue()
    sessions = [batched.open(_request(p)) for p in PROMPTS]
    for i, s in enumerate(sessions):  # different committed lengths: the merged pass pads
        s.commit(" hello wor" * (i + 1))
    cands = [[(" hello wor", False), ("ld 中文", True), ("lo there😀", False)], [("ld", False)], [(" 42", True)]]
    got: list[Any] = [None] * len(sessions)

    def score(i: int) -> None:
        got[i] = sessions[i].score([tiny_candidate(t, e) for t, e in cands[i]], score_eos=True)

    before = (queue.stats.score_passes, queue.stats.score_blocks)
    _held(queue, len(sessions), [threading.Thread(target=score, args=(i,)) for i in range(len(sessions))])
    assert (queue.stats.score_passes - before[0], queue.stats.score_blocks - before[1]) == (1, len(sessions))
    for i, s in enumerate(sessions):
        want = naive_scores(batched, batched.encode_prompt(_request(PROMPTS[i])), s._text, cands[i], True)
        for g, (logit, logprob) in zip(got[i], want, strict=True):
            assert abs(g.mean_logit - logit) <= 1e-4
            assert abs(g.mean_logprob - logprob) <= 1e-4
    bases = [s._pass.base for s in sessions]
    assert [s._pass.pad for s in sessions] == [max(bases) - b for b in bases]
    assert len(set(bases)) == len(bases)
    for i, s in enumerate(sessions):  # a merged row wins: its KV (after the padding) becomes the cache
        s.commit(cands[i][0][0])
        prompt = batched.encode_prompt(_request(PROMPTS[i]))
        assert s.kv_length() == len(prompt) + len(s._resp_ids)
        d = s.draft(6, SamplingParams())
        assert (d.text, d.ended) == naive_draft(batched, prompt, s._text, 6)


def test_drafts_made_in_merged_steps_equal_naive_greedy(pairs: dict[str, tuple[Any, Any]]) -> None:
    batched, _ = pairs["qwen2"]
    queue = batched.queue()
    sessions = [batched.open(_request(p)) for p in PROMPTS]
    for s in sessions:
        s._ensure_prefilled()
    drafts: list[Any] = [None] * len(sessions)

    def draft(i: int) -> None:
        drafts[i] = sessions[i].draft(12, SamplingParams())

    before = (queue.stats.passes, queue.stats.steps)
    _held(queue, len(sessions), [threading.Thread(target=draft, args=(i,)) for i in range(len(sessions))])
    passes, steps = queue.stats.passes - before[0], queue.stats.steps - before[1]
    assert steps >= 11 * len(sessions)
    assert passes < steps
    for i, (s, d) in enumerate(zip(sessions, drafts, strict=True)):
        prompt = batched.encode_prompt(_request(PROMPTS[i]))
        assert (d.text, d.ended) == naive_draft(batched, prompt, "", 12)
        s.commit(d.text)  # keeps the drafted KV rows, written by merged passes
        want = naive_scores(batched, prompt, s._text, [(" ok", False)], True)[0]
        g = s.score([tiny_candidate(" ok", False)], score_eos=True)[0]
        assert abs(g.mean_logit - want[0]) <= 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_prompts_arriving_together_prefill_in_one_pass(pairs: dict[str, tuple[Any, Any]], kind: str) -> None:
    batched, alone = pairs[kind]
    queue = batched.queue()
    sessions = [batched.open(_request(p)) for p in PROMPTS]
    drafts: list[Any] = [None] * len(sessions)

    def draft(i: int) -> None:
        drafts[i] = sessions[i].draft(6, SamplingParams())

    before = (queue.stats.prefill_passes, queue.stats.prefills)
    _held(queue, len(sessions), [threading.Thread(target=draft, args=(i,)) for i in range(len(sessions))])
    assert (queue.stats.prefill_passes - before[0], queue.stats.prefills - before[1]) == (1, len(sessions))
    for i, (s, d) in enumerate(zip(sessions, drafts, strict=True)):
        prompt = batched.encode_prompt(_request(PROMPTS[i]))
        assert (d.text, d.ended) == naive_draft(batched, prompt, "", 6)
        reference = alone.open(_request(PROMPTS[i]))
        reference._ensure_prefilled()
        first = s._cache.layers[0]
        assert first.keys.shape[-2] >= len(prompt)
        mine = first.keys[..., : len(prompt), :]
        theirs = reference._cache.layers[0].keys[..., : len(prompt), :]
        assert float((mine - theirs).abs().max()) <= 1e-4  # the padded pass's rows, cut to the prompt


def tiny_candidate(text: str, ended: bool) -> Any:
    from specem_core import Candidate

    return Candidate("x", text, ended)


def _decisive(kind: str, seed: int) -> TransformersMember:
    """A tiny member whose logits are spread out, so that rounding never flips a greedy pick."""
    model, tok = {"llama": tiny.tiny_llama, "qwen2": tiny.tiny_qwen2}[kind](seed)
    model.get_output_embeddings().weight.data *= 200.0
    return TransformersMember(model, tok, name=kind)


def test_concurrent_requests_share_decode_passes_and_answer_as_they_would_alone() -> None:
    members = [_decisive("llama", 0), _decisive("qwen2", 1)]
    engine = SpecEM(members, SpecEMConfig(segment_len=6, max_new_tokens=30, ignore_eos=True))
    prompts = [*PROMPTS, "The capital of Germany is", "SpecEM ensembles several models."]
    alone = [engine.generate([{"role": "user", "content": p}]).text for p in prompts]
    stats = members[0].batch_stats
    assert stats is not None
    before_passes, before_steps = stats.passes, stats.steps
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: engine.generate([{"role": "user", "content": p}]).text, prompts))
    assert together == alone
    passes, steps = stats.passes - before_passes, stats.steps - before_steps
    assert steps / passes > 1.5, (steps, passes)  # most steps shared a pass


def test_request_batch_size_is_validated_and_1_bypasses_the_queue() -> None:
    model, tok = tiny.tiny_llama()
    with pytest.raises(ConfigError, match="request_batch_size"):
        TransformersMember(model, tok, request_batch_size=0)
    with pytest.raises(ConfigError, match="request_batch_size"):
        TransformersMember(model, tok, request_batch_size=True)  # type: ignore[arg-type]
    member = TransformersMember(model, tok, request_batch_size=1)
    assert member.batch_stats is None
    session = member.open(_request("hi"))
    session.draft(4, SamplingParams())
    member.request_batch_size = 4
    assert member.batch_stats is not None


def test_members_on_a_cpu_draft_side_by_side_and_on_an_accelerator_one_after_another() -> None:
    # On a GPU two drafting threads trade the GIL at every kernel launch (about 4x slower for a
    # lone request on an H100, benchmarks/gpu_check.py): there the engine must run them in turn.
    on_cpu = [TransformersMember(*tiny.tiny_llama(seed), name=f"cpu-{seed}") for seed in (0, 1)]
    assert len({m.concurrency_key for m in on_cpu}) == 2  # different keys: the engine runs them concurrently
    elsewhere = []
    for seed in (0, 1):
        model, tok = tiny.tiny_llama(seed)
        elsewhere.append(TransformersMember(model.to("meta"), tok, name=f"meta-{seed}"))
    assert {m.concurrency_key for m in elsewhere} == {"torch:meta"}  # one key: in turn
    assert all(m.batch_stats is not None for m in elsewhere)  # still batching across requests
    unqueued = [TransformersMember(*tiny.tiny_llama(seed), request_batch_size=1) for seed in (0, 1)]
    assert {m.concurrency_key for m in unqueued} == {"torch:cpu"}
