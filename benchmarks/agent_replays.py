"""The conversations issue #45 was filed on, replayed on the integrations as a user runs them.

    python benchmarks/agent_replays.py                    # the default preset, as the issue ran it
    python benchmarks/agent_replays.py --members qwen2.5-coder-1.5b --out /tmp/one.json
    python benchmarks/agent_replays.py --smoke            # seconds: SmolLM2 alone, 16 tokens
    python benchmarks/agent_replays.py --regrade --out benchmarks/results/agent_replays.json  # no models

Each replay is what a new user tried on ``b687d1e`` with the default preset, and what went wrong
then (``before``, quoted from the issue and from the first LlamaIndex replays of
``benchmarks/results/agents_replays_llamaindex.json``):

* ``chat-repeat``: ``ChatSpecEM(max_tokens=64).bind_tools([add, multiply])`` on the history
  "What is 12 times 7?" → a ``multiply(12, 7)`` call → its result "84": the call's JSON came back
  as *content*, finish ``stop``;
* ``react-agent``: LangGraph's ``create_react_agent`` on "What is 12 times 7?" returned that JSON
  as its final answer;
* ``create-agent-two-steps``: ``langchain.agents.create_agent`` on "What is 12 times 7, plus 5? Use
  the tools." went on past 89 (``multiply(89, 5)``, ``add(445, 5)``) and ended on an empty message;
* ``function-agent-*``: LlamaIndex ``FunctionAgent`` on "What is 123 times 45?" with no system
  prompt, the guide's system prompt of the time and a plain one, and on "Add 17 and 25, then
  multiply the result by 3" (one call, then 425).

Per replay: the tool calls made (with their results), the final answer, whether it is a raw call
(``agents.is_raw_call``), whether it is right, whether the framework's limit stopped the loop, and
seconds. Writes ``benchmarks/results/agent_replays.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from agents import MAX_ITERATIONS, RECURSION_LIMIT, SYSTEM_PROMPT, code_version, grade, is_raw_call  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "agent_replays.json"
GUIDE_SYSTEM_PROMPT = (  # the LlamaIndex guide's system prompt when the issue was filed
    "To compute a product, call the multiply tool. Once you have the tool result, do not call a tool again: "
    "answer in one short sentence that states the result."
)
FUNCTION_AGENT_REPLAYS = [
    # (id, question, system prompt, tools, expected answer, what happened when the issue was filed)
    ("function-agent-no-system", "What is 123 times 45?", None, ("multiply",), 5535, "right (5535)"),
    (
        "function-agent-guide-system",
        "What is 123 times 45?",
        GUIDE_SYSTEM_PROMPT,
        ("multiply",),
        5535,
        'no tool call, "123 times 45 equals 5415."',
    ),
    ("function-agent-plain-system", "What is 123 times 45?", SYSTEM_PROMPT, ("multiply",), 5535, "a refusal"),
    (
        "function-agent-two-steps",
        "Add 17 and 25, then multiply the result by 3",
        None,
        ("add", "multiply"),
        126,
        "one call, then 425",
    ),
]


REPLAY_ANSWERS: dict[str, Any] = {
    "chat-repeat": 84,
    "react-agent": 84,
    "create-agent-two-steps": 89,
    **{replay: answer for replay, _, _, _, answer, _ in FUNCTION_AGENT_REPLAYS},
}
"""The answer each replay's question expects (what ``--regrade`` grades the recorded finals against)."""


def regrade(records: list[dict[str, Any]], name: str) -> list[str]:
    """Grade the replays' recorded finals again with :func:`agents.grade` (no model work); returns a
    line per record whose verdict moved."""
    moved = []
    for n, r in enumerate(records):
        ok = grade(REPLAY_ANSWERS[r["replay"]], r["final"], r["question"])
        if ok != r["ok"]:
            moved.append(f"{name} record {n}: {r['replay']} {r['ok']} -> {ok}: {r['final']!r}")
        r["ok"] = ok
    return moved


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOLS = {"add": add, "multiply": multiply}


def _call(name: str, args: dict[str, Any], result: Any) -> str:
    return f"{name}({json.dumps(args, sort_keys=True)}) -> {result}"


def _record(replay: str, question: str, before: str, answer: Any, final: str, **extra: Any) -> dict[str, Any]:
    return {
        "replay": replay,
        "question": question,
        "before": before,
        "final": final,
        "raw_call": is_raw_call(final),
        "ok": grade(answer, final, question),
        **extra,
    }


def chat_model(args: argparse.Namespace, max_tokens: int) -> Any:
    # a fresh engine per replay, as each was a fresh run in the issue: no replay reads another's cache
    from specem_integrations.langchain import ChatSpecEM

    return ChatSpecEM(max_tokens=args.max_tokens or max_tokens, members=args.members, backend=args.backend)


def replay_chat_repeat(args: argparse.Namespace) -> dict[str, Any]:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    question = "What is 12 times 7?"
    history = [
        HumanMessage(question),
        AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 12, "b": 7}, "id": "call_1"}]),
        ToolMessage("84", tool_call_id="call_1"),
    ]
    started = time.perf_counter()
    message = chat_model(args, 64).bind_tools([add, multiply]).invoke(history)
    seconds = time.perf_counter() - started
    return _record(
        "chat-repeat",
        question,
        'the call\'s JSON as content, finish "stop": {{"name": "multiply", "arguments": {"a": 12, "b": 7}}',
        84,
        str(message.content),
        tool_calls=[_call(c["name"], c["args"], "(not run)") for c in message.tool_calls],
        finish_reason=message.response_metadata.get("finish_reason"),
        limit=False,
        seconds=round(seconds, 1),
    )


def _langgraph_run(agent: Any, question: str) -> tuple[str, list[str], bool, float]:
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.runnables import RunnableConfig
    from langgraph.errors import GraphRecursionError

    started = time.perf_counter()
    messages: list[Any] = []
    limit = False
    try:
        messages = agent.invoke({"messages": [("user", question)]}, RunnableConfig(recursion_limit=RECURSION_LIMIT))[
            "messages"
        ]
    except GraphRecursionError:
        limit = True
    seconds = time.perf_counter() - started
    results = {m.tool_call_id: m.content for m in messages if isinstance(m, ToolMessage)}
    calls = [
        _call(c["name"], c["args"], results.get(c["id"] or "", "(not run)"))
        for m in messages
        if isinstance(m, AIMessage)
        for c in m.tool_calls
    ]
    final = messages[-1] if messages else None
    return (str(final.content) if isinstance(final, AIMessage) else ""), calls, limit, seconds


def replay_react_agent(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings():  # create_react_agent is deprecated for create_agent; the issue ran it
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

        agent = create_react_agent(chat_model(args, 64), tools=[add, multiply])
    question = "What is 12 times 7?"
    final, calls, limit, seconds = _langgraph_run(agent, question)
    return _record(
        "react-agent",
        question,
        "the call's JSON as the agent's final answer",
        84,
        final,
        tool_calls=calls,
        limit=limit,
        seconds=round(seconds, 1),
    )


def replay_create_agent(args: argparse.Namespace) -> dict[str, Any]:
    from langchain.agents import create_agent

    question = "What is 12 times 7, plus 5? Use the tools."
    final, calls, limit, seconds = _langgraph_run(create_agent(chat_model(args, 96), tools=[add, multiply]), question)
    return _record(
        "create-agent-two-steps",
        question,
        "multiply(12, 7), add(84, 5), then multiply(89, 5), add(445, 5) and an empty final message (308 s)",
        89,
        final,
        tool_calls=calls,
        limit=limit,
        seconds=round(seconds, 1),
    )


def replay_function_agent(
    args: argparse.Namespace,
    replay: str,
    question: str,
    system: str | None,
    tools: tuple[str, ...],
    answer: Any,
    before: str,
) -> dict[str, Any]:
    from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
    from llama_index.core.tools import FunctionTool

    from specem_integrations.llamaindex import SpecEMLLM

    llm = SpecEMLLM(max_tokens=args.max_tokens or 96, members=args.members, backend=args.backend)
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(fn=TOOLS[name]) for name in tools], llm=llm, system_prompt=system
    )
    calls: list[str] = []
    out: dict[str, Any] = {"final": "", "limit": False}

    async def go() -> None:
        handler = agent.run(user_msg=question, max_iterations=MAX_ITERATIONS)
        async for event in handler.stream_events():
            if isinstance(event, ToolCallResult):
                calls.append(_call(event.tool_name, event.tool_kwargs, event.tool_output.content))
        result: Any = await handler
        out["final"] = str(result.response.content or "")

    started = time.perf_counter()
    try:
        asyncio.run(go())
    except Exception as exc:  # FunctionAgent raises when max_iterations is reached
        if "max iterations" not in str(exc).lower():
            raise
        out["limit"] = True
    seconds = time.perf_counter() - started
    return _record(
        replay,
        question,
        before,
        answer,
        out["final"],
        system_prompt=system,
        tool_calls=calls,
        limit=out["limit"],
        seconds=round(seconds, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", nargs="+", help="model names (default: the default preset's)")
    parser.add_argument("--backend", choices=["auto", "transformers", "llamacpp"], default=None)
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="new tokens per model call (default: the issue's, 64 or 96)"
    )
    parser.add_argument("--smoke", action="store_true", help="seconds: SmolLM2 alone, 16 new tokens per call")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--regrade",
        action="store_true",
        help="grade --out's records again from their finals with agents.grade (no model runs); print the moved ones",
    )
    args = parser.parse_args()
    if args.regrade:
        result = json.loads(args.out.read_text())
        moved = regrade(result["records"], args.out.name)
        result.setdefault("regraded", []).append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "code": code_version()})
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(*moved, sep="\n")
        print(f"regraded {args.out}: {len(moved)} records changed")
        return
    if args.smoke:
        args.members = args.members or ["smollm2"]
        args.max_tokens = args.max_tokens or 16

    records = []
    runs = [replay_chat_repeat, replay_react_agent, replay_create_agent]
    for run in runs:
        records.append(run(args))
        print(json.dumps(records[-1]), flush=True)
    for replay in FUNCTION_AGENT_REPLAYS:
        records.append(replay_function_agent(args, *replay))
        print(json.dumps(records[-1]), flush=True)

    meta = {
        "command": " ".join(sys.argv),
        "code": code_version(),
        "members": args.members or "the default preset's",
        "backend": args.backend or "auto",
        "max_tokens": args.max_tokens or "the issue's: 64 (chat-repeat, react-agent), 96 (the others)",
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    right, raw = sum(r["ok"] for r in records), sum(r["raw_call"] for r in records)
    print(f"{right}/{len(records)} right; {raw} raw-call finals")


if __name__ == "__main__":
    main()
