"""Tool calling and JSON output for SpecEM: schemas in, parsed calls out, constrained segments.

The ensemble writes tool calls in one canonical syntax whatever each member's chat template
prefers, the Hermes / Qwen2.5 one that :mod:`specem_core.chat_format`'s fallback prompt asks for::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

This package holds everything the engine needs around that syntax, one concern per module (each
imports only the ones listed before it):

* :mod:`~specem_core.tools._jsonschema` — the JSON-schema helpers the others share (local
  ``$ref`` s, the JSON types a schema allows, ``anyOf`` / ``oneOf`` variants).
* :mod:`~specem_core.tools.schema` — :func:`normalize_tools` / :func:`normalize_tool_choice` check
  OpenAI-style tool schemas and ``tool_choice`` values (bad input raises
  :class:`~specem_core.errors.InputError`); :func:`coerce_arguments` fits arguments to a schema.
* :mod:`~specem_core.tools.parse` — :func:`parse_tool_calls` turns committed text into answer
  text, :class:`~specem_core.types.ToolCall` s (with ids and arguments coerced to the tool's JSON
  schema) and :class:`~specem_core.types.InvalidToolCall` s; :func:`loads_lenient` reads JSON
  that is fenced or cut short. It never raises on model output.
* :mod:`~specem_core.tools.json_prefix` — a JSON parser that accepts any prefix of a valid
  document and checks a JSON schema on the way.
* :mod:`~specem_core.tools.constraints` — what a constraint is (:class:`CandidateFilter`, the
  protocols of its optional methods, the :class:`Constraint` base class) and
  :class:`ToolCallConstraint`, :class:`JSONConstraint` and :class:`PlainTextConstraint` (and
  :class:`AnswerConstraint`, the words of a final answer after tool results), the constraints
  that keep a segment a valid prefix (of a call to a known tool with arguments fitting its schema, of a JSON
  answer, of plain text) during generation.
* :mod:`~specem_core.tools.plan` — :class:`OutputPlan` puts it together for one request: which
  tools to render, a *prefill* that forces a call for ``tool_choice="required"`` or a named tool,
  the constraint, ``response_format`` (an instruction, a ``{`` prefill and a schema constraint),
  the answer text that is safe to stream (:func:`visible_content`) and the calls a conversation
  already answered.

Every public name is re-exported here: ``from specem_core.tools import OutputPlan`` etc.
"""

from specem_core.tools.constraints import (
    AnswerConstraint,
    CandidateFilter,
    CompletingFilter,
    Constraint,
    JSONConstraint,
    ListingFilter,
    PlainTextConstraint,
    ToolCallConstraint,
    TrimmingFilter,
    as_constraint,
)
from specem_core.tools.parse import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedResponse,
    call_in_progress,
    loads_lenient,
    new_call_id,
    opens_call,
    opens_tool_listing,
    parse_tool_calls,
)
from specem_core.tools.plan import (
    ANSWER_FROM_RESULTS,
    JSON_INSTRUCTION,
    JSON_SCHEMA_INSTRUCTION,
    MAX_TOOL_ROUNDS,
    ContentStream,
    OutputPlan,
    answer_words,
    answered_calls,
    reapplies_last_call,
    repeats_answered_calls,
    tool_results_summary,
    tool_rounds,
    visible_answer,
    visible_content,
)
from specem_core.tools.schema import (
    ToolChoice,
    ToolChoiceMode,
    coerce_arguments,
    normalize_tool,
    normalize_tool_choice,
    normalize_tools,
)

__all__ = [
    "ANSWER_FROM_RESULTS",
    "JSON_INSTRUCTION",
    "JSON_SCHEMA_INSTRUCTION",
    "MAX_TOOL_ROUNDS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "AnswerConstraint",
    "CandidateFilter",
    "CompletingFilter",
    "Constraint",
    "ContentStream",
    "JSONConstraint",
    "ListingFilter",
    "OutputPlan",
    "ParsedResponse",
    "PlainTextConstraint",
    "ToolCallConstraint",
    "ToolChoice",
    "ToolChoiceMode",
    "TrimmingFilter",
    "answer_words",
    "answered_calls",
    "as_constraint",
    "call_in_progress",
    "coerce_arguments",
    "loads_lenient",
    "new_call_id",
    "normalize_tool",
    "normalize_tool_choice",
    "normalize_tools",
    "opens_call",
    "opens_tool_listing",
    "parse_tool_calls",
    "reapplies_last_call",
    "repeats_answered_calls",
    "tool_results_summary",
    "tool_rounds",
    "visible_answer",
    "visible_content",
]
