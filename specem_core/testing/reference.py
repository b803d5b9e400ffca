"""A plain SpecEM loop that recomputes everything every round (no cache reuse).

It is the yardstick the fast engine is checked and measured against:

* tests: the engine in ``faithful`` mode must make the same decisions as :func:`naive_generate`,
  and its cached scores must equal :func:`naive_scores`;
* ``benchmarks/speed.py``: :func:`naive_generate` is "the authors' way" — every round each
  member re-reads its whole prefix to draft (``model.generate``) and again to verify — so the
  cost per token grows with the response.

Greedy drafting only; formulas as in the authors' code (mean raw logit, sum normalization,
Hedge with 1/k decay, update before the vote, ties to the lowest index).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specem_core.backends.base import SessionRequest
from specem_core.backends.transformers import TransformersMember

if TYPE_CHECKING:
    from specem_core.backends.llama_cpp import LlamaCppMember


@dataclass
class NaiveRound:
    candidates: list[tuple[str, bool]]
    raw: list[list[float]]
    winner: int


@dataclass
class NaiveResult:
    text: str
    rounds: list[NaiveRound] = field(default_factory=list)


def naive_draft(
    member: TransformersMember | LlamaCppMember, prompt: list[int], response: str, max_tokens: int
) -> tuple[str, bool]:
    """Greedy continuation of ``prompt + enc(response)``, recomputed from scratch."""
    if not isinstance(member, TransformersMember):
        return _naive_draft_llama(member, prompt, response, max_tokens)
    import torch

    resp_ids = member.encode_response(response)
    ids = prompt + resp_ids
    suppress = member.suppress_ids
    new: list[int] = []
    ended = False
    with torch.inference_mode():
        while True:
            step = torch.tensor([ids + new], device=member.model.device)
            logits = member.model(input_ids=step).logits[0, -1].float()
            if suppress:
                logits[suppress] = float("-inf")
            token = int(torch.argmax(logits))
            if token in member.stop_ids:
                ended = True
                break
            new.append(token)
            text = _continuation(member, resp_ids, new)
            if len(new) >= max_tokens and (not text.endswith("\ufffd") or len(new) >= max_tokens + 4):
                break
    text = _continuation(member, resp_ids, new)
    while text.endswith("\ufffd") and new:
        new.pop()
        ended = False
        text = _continuation(member, resp_ids, new)
    return text, ended


def authors_draft(
    member: TransformersMember | LlamaCppMember, prompt: list[int], response: str, max_tokens: int
) -> tuple[str, bool]:
    """The authors' drafting: ``model.generate`` over the whole prefix every round (KV cache only
    inside the call), greedy, no character-level fixes beyond ours. (llama.cpp members: the
    same greedy loop over a fresh context, one token per call after the prefix.)"""
    if not isinstance(member, TransformersMember):
        return _authors_draft_llama(member, prompt, response, max_tokens)
    import torch

    resp_ids = member.encode_response(response)
    ids = torch.tensor([prompt + resp_ids], device=member.model.device)
    with torch.inference_mode():
        out = member.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=sorted(member.stop_ids),
            pad_token_id=member.pad_id,
            suppress_tokens=member.suppress_ids or None,
        )
    new = out[0, ids.shape[1] :].tolist()
    ended = bool(new) and new[-1] in member.stop_ids
    if ended:
        new = new[:-1]
    return _continuation(member, resp_ids, new), ended


def _continuation(member: TransformersMember, resp_ids: list[int], new: list[int]) -> str:
    head = member.tokenizer.decode(resp_ids)
    whole = member.tokenizer.decode(resp_ids + new)
    return str(whole[len(head) :])


def naive_scores(
    member: TransformersMember | LlamaCppMember,
    prompt: list[int],
    response: str,
    candidates: Sequence[tuple[str, bool]],
    score_eos: bool,
) -> list[tuple[float, float]]:
    """(mean raw logit, mean log-prob) of each candidate, one full forward pass per candidate."""
    if not isinstance(member, TransformersMember):
        return _naive_scores_llama(member, prompt, response, candidates, score_eos)
    import torch

    resp_ids = member.encode_response(response)
    out: list[tuple[float, float]] = []
    with torch.inference_mode():
        for text, ended in candidates:
            full = member.encode_response(response + text)
            lcp = 0
            while lcp < min(len(full), len(resp_ids)) and full[lcp] == resp_ids[lcp]:
                lcp += 1
            targets = full[lcp:]
            if ended and (score_eos or not targets):
                targets = [*targets, member.eot_id]
            seq = prompt + full[:lcp] + targets
            logits = member.model(input_ids=torch.tensor([seq], device=member.model.device)).logits[0].float()
            start = len(prompt) + lcp
            raw = [float(logits[p - 1, seq[p]]) for p in range(start, len(seq))]
            lps = torch.log_softmax(logits, dim=-1)
            lp = [float(lps[p - 1, seq[p]]) for p in range(start, len(seq))]
            out.append((sum(raw) / len(raw), sum(lp) / len(lp)))
    return out


def _naive_draft_llama(member: LlamaCppMember, prompt: list[int], response: str, max_tokens: int) -> tuple[str, bool]:
    """:func:`naive_draft` on llama.cpp: every token re-reads the whole prefix in a fresh sequence."""
    import numpy as np

    from specem_core.backends.llama_cpp._binding import incomplete_utf8
    from specem_core.testing.llama_cpp_diagnostics import evaluate_from_scratch

    resp_ids = member.encode_response(response)
    new: list[int] = []
    ended = False
    while True:
        ids = prompt + resp_ids + new
        last = len(ids) - 1
        logits = evaluate_from_scratch(member.model, ids, last.__eq__)[last]
        if member.suppress_ids:
            logits[member.suppress_ids] = -np.inf
        token = int(np.argmax(logits))
        if token in member.stop_ids:
            ended = True
            break
        new.append(token)
        if len(new) >= max_tokens and (not incomplete_utf8(member.decode_bytes(new)) or len(new) >= max_tokens + 4):
            break
    while new and incomplete_utf8(member.decode_bytes(new)):
        new.pop()
        ended = False
    return member.decode_bytes(new).decode("utf-8", errors="replace"), ended


def _authors_draft_llama(member: LlamaCppMember, prompt: list[int], response: str, max_tokens: int) -> tuple[str, bool]:
    from specem_core.testing.llama_cpp_diagnostics import generate_greedy

    resp_ids = member.encode_response(response)
    new = generate_greedy(member.model, prompt + resp_ids, max_tokens, banned=member.suppress_ids)
    ended = False
    for i, token in enumerate(new):
        if token in member.stop_ids:
            new, ended = new[:i], True
            break
    return member.decode_bytes(new).decode("utf-8", errors="replace"), ended


def _naive_scores_llama(
    member: LlamaCppMember,
    prompt: list[int],
    response: str,
    candidates: Sequence[tuple[str, bool]],
    score_eos: bool,
) -> list[tuple[float, float]]:
    """:func:`naive_scores` on llama.cpp: each candidate evaluated with its whole prefix, from scratch."""
    import numpy as np

    from specem_core.testing.llama_cpp_diagnostics import evaluate_from_scratch

    resp_ids = member.encode_response(response)
    out: list[tuple[float, float]] = []
    for text, ended in candidates:
        full = member.encode_response(response + text)
        lcp = 0
        while lcp < min(len(full), len(resp_ids)) and full[lcp] == resp_ids[lcp]:
            lcp += 1
        targets = full[lcp:]
        if ended and (score_eos or not targets):
            targets = [*targets, member.eot_id]
        seq = prompt + full[:lcp] + targets
        start = len(prompt) + lcp
        rows = evaluate_from_scratch(member.model, seq, (start - 1).__le__)
        raw: list[float] = []
        lp: list[float] = []
        for p in range(start, len(seq)):
            row = rows[p - 1].astype(np.float64)
            top = float(row.max())
            lse = top + math.log(float(np.exp(row - top).sum()))
            raw.append(float(row[seq[p]]))
            lp.append(float(row[seq[p]]) - lse)
        out.append((sum(raw) / len(raw), sum(lp) / len(lp)))
    return out


def naive_generate(
    members: Sequence[TransformersMember | LlamaCppMember],
    messages: Sequence[Mapping[str, Any]],
    *,
    segment_len: int = 10,
    max_new_tokens: int = 64,
    hedge: bool = True,
    eta0: float = 0.5,
    drafting: str = "recompute",
) -> NaiveResult:
    """The authors' loop, recomputing every prefix every round (greedy, faithful formulas).

    ``drafting="recompute"`` re-runs the full prefix for every drafted token (the plainest
    possible definition, used by the tests); ``"generate"`` drafts with ``model.generate`` as
    the authors' code does (used by the speed benchmark).
    """
    draft_fn = authors_draft if drafting == "generate" else naive_draft
    prompts = [m.encode_prompt(SessionRequest(list(messages))) for m in members]
    n = len(members)
    weights = [1.0 / n] * n
    result = NaiveResult(text="")
    for k in range(1, max_new_tokens + 9):
        remaining = max_new_tokens - len(members[0].encode_response(result.text))
        if remaining <= 0:
            break
        cands = [
            draft_fn(m, p, result.text, min(segment_len, remaining)) for m, p in zip(members, prompts, strict=True)
        ]
        keep = [c for c in cands if c[0] or c[1]]
        owners = [i for i, c in enumerate(cands) if c[0] or c[1]]
        if not keep:
            break
        raw: list[list[float]] = []
        winner = 0
        if len(keep) > 1:
            for m, p in zip(members, prompts, strict=True):
                raw.append([s[0] for s in naive_scores(m, p, result.text, keep, score_eos=False)])
            norm = []
            for row in raw:
                total = sum(row)
                norm.append([v / total if total else 0.0 for v in row])
            if hedge:
                eta = eta0 * math.sqrt(1 / n) / k
                rewards: list[float | None] = []
                for i in range(n):
                    if i not in owners:
                        rewards.append(None)
                        continue
                    col = owners.index(i)
                    wins = sum(
                        1
                        for j in range(n)
                        if j != i
                        for c in range(len(keep))
                        if owners[c] != i and norm[j][col] >= norm[j][c]
                    )
                    rewards.append(max(wins, 1) / ((n - 1) * (len(keep) - (1 if i in owners else 0))))
                known = [r for r in rewards if r is not None]
                filled = [r if r is not None else sum(known) / len(known) for r in rewards]
                weights = [w * math.exp(eta * r) for w, r in zip(weights, filled, strict=True)]
                total_w = sum(weights)
                weights = [w / total_w for w in weights]
            combined = [sum(weights[j] * norm[j][c] for j in range(n)) for c in range(len(keep))]
            winner = max(range(len(keep)), key=lambda c: (combined[c], -c))
        text, ended = keep[winner]
        result.rounds.append(NaiveRound(keep, raw, winner))
        result.text += text
        if ended:
            break
    return result
