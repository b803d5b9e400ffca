"""Render a conversation into one member's own prompt text.

Each member uses its own chat template (``tokenizer.chat_template``), with tools passed through
``tools=`` when the template uses them. Members without a template (base models such as
Gemma-3-270M) get the plain format below; templates that ignore tools get the tool schemas and
the canonical call syntax in a system message. Both fallbacks are documented in
docs/guides/agents-and-tools.md ("How tool calls work").
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

PLAIN_USER = "### User:\n"
PLAIN_ASSISTANT = "### Assistant:\n"
PLAIN_SYSTEM = "### System:\n"
PLAIN_TOOL = "### Tool result:\n"
PLAIN_TURN_STOPS = ("\n### User:", "\n### System:", "\n### Tool result:")
"""A base model writing one of these has finished its turn."""

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

TOOL_SYSTEM_PROMPT = (
    "You can call these tools:\n{tools}\n\n"
    "To call a tool, answer with exactly one line per call:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{...}}}}</tool_call>\n'
    "and nothing else. When no tool is needed, answer normally."
)
"""Fallback instruction for templates that cannot render tools (Hermes/Qwen call syntax)."""


def template_supports_tools(template: str | None) -> bool:
    """True when a Jinja chat template reads the ``tools`` variable."""
    if not template:
        return False
    try:
        import jinja2
        import jinja2.meta

        env = jinja2.Environment()
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except Exception:
        return "tools" in template


def tool_system_message(tools: Sequence[Mapping[str, Any]]) -> str:
    """The fallback system text listing the tools."""
    lines = [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    return TOOL_SYSTEM_PROMPT.format(tools="\n".join(lines))


def with_tool_instructions(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Prepend (or extend) the system message with the fallback tool instructions."""
    out = [dict(m) for m in messages]
    text = tool_system_message(tools)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".strip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def flatten_tool_turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rewrite assistant tool calls and tool results as plain text (for templates without tools)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        content = m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([content, *calls]).strip()})
        elif role == "tool":
            name = m.get("name")
            label = f"Result of {name}" if name else "Tool result"
            out.append({"role": "user", "content": f"{label}: {content}"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    return out


def arguments_as_objects(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant tool call's ``arguments`` as a JSON object, not a string.

    OpenAI-style messages (LangChain's and LlamaIndex's included) carry arguments as a JSON
    string, while chat templates render them with ``arguments | tojson`` (Qwen2.5's, Llama 3.1's;
    transformers documents a dict): a string would reach the model quoted twice,
    ``"arguments": "{\\"a\\": 12}"``, unlike any call it was trained on. Arguments that are not a JSON
    object stay as they are."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or not calls:
            out.append(dict(m))
            continue
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            args = fn.get("arguments") if isinstance(fn, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(args, str):
                with contextlib.suppress(ValueError):
                    parsed = json.loads(args)
                    if isinstance(parsed, dict):
                        call = {**call, "function": {**fn, "arguments": parsed}}
            fixed.append(call)
        out.append({**m, "tool_calls": fixed})
    return out


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def render_plain(messages: Sequence[Mapping[str, Any]]) -> str:
    """The plain prompt format for members without a chat template."""
    parts: list[str] = []
    for m in flatten_tool_turns(messages):
        role = m.get("role")
        content = (m.get("content") or "").strip()
        if role in ("system", "developer"):
            parts.append(f"{PLAIN_SYSTEM}{content}\n\n")
        elif role == "assistant":
            parts.append(f"{PLAIN_ASSISTANT}{content}\n\n")
        else:
            parts.append(f"{PLAIN_USER}{content}\n\n")
    parts.append(PLAIN_ASSISTANT)
    return "".join(parts)


class ChatFormat:
    """How one member turns messages into prompt text."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.template: str | None = chat_template or getattr(tokenizer, "chat_template", None) or None
        self.supports_tools = template_supports_tools(self.template)

    @property
    def uses_template(self) -> bool:
        """False for the plain fallback format."""
        return self.template is not None

    @property
    def turn_stop_strings(self) -> tuple[str, ...]:
        """Strings that end the assistant turn in this format (empty for real templates)."""
        return () if self.uses_template else PLAIN_TURN_STOPS

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Prompt text ending where the assistant's answer begins."""
        msgs: list[dict[str, Any]] = [dict(m) for m in messages]
        if tools and not self.supports_tools:
            msgs = with_tool_instructions(flatten_tool_turns(msgs), tools)
        if self.template is None:
            return render_plain(msgs)
        if not self.supports_tools:
            msgs = flatten_tool_turns(msgs)
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools and self.supports_tools:
            kwargs["tools"] = list(tools)
        if self.supports_tools:
            msgs = arguments_as_objects(msgs)
        rendered = self._tokenizer.apply_chat_template(msgs, chat_template=self.template, **kwargs)
        return str(rendered)

    def end_of_turn_text(self) -> str | None:
        """What the template writes right after an assistant message (e.g. ``<|im_end|>``)."""
        if self.template is None:
            return None
        marker = "SPECEMXYZ"
        try:
            text = self._tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}],
                chat_template=self.template,
                tokenize=False,
            )
        except Exception:
            return None
        idx = str(text).rfind(marker)
        return str(text)[idx + len(marker) :] if idx >= 0 else None


class JinjaChatTemplate:
    """Renders a Jinja chat template without a Hugging Face tokenizer (GGUF templates, servers).

    It offers the one method :class:`ChatFormat` calls, ``apply_chat_template``, with the variables
    HF templates expect (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
    ``tools``, ``raise_exception``, ``tojson``).
    """

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        self.chat_template = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled: dict[str, Any] = {}  # compiling costs ~25 ms, every request renders

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_template: str | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        source = chat_template or self.chat_template
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = _compile_template(source)
        return str(
            template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        )


def _compile_template(source: str) -> Any:
    """An HF chat template compiled in jinja2's sandbox, with the helpers HF templates call."""
    import jinja2
    import jinja2.sandbox

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
