"""The question ``benchmarks/bfcl_openings.py --fit-question`` asks, without models."""

from __future__ import annotations

from script_loader import load_script

openings = load_script("benchmarks/bfcl_openings.py", "bfcl_openings_benchmark")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_discoverer",
            "description": "Get the person or team who made a particular scientific discovery",
            "parameters": {
                "type": "object",
                "properties": {"discovery": {"type": "string"}, "detail": {"type": "boolean"}},
                "required": ["discovery"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {"type": "object"}}},
]


def test_fit_prompt_shows_the_users_words_and_each_function_with_its_parameters() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Who discovered the neutron?"},
    ]
    prompt = openings.fit_prompt(messages, TOOLS)
    assert prompt.startswith("A user asked:\n\nWho discovered the neutron?\n\n")
    assert "You are terse." not in prompt  # the question is the user's, not the system prompt's
    assert (
        "- get_discoverer(discovery: string, detail: boolean): Get the person or team who made a particular"
        " scientific discovery\n- now(): The time.\n\n"
    ) in prompt
    assert prompt.endswith("Answer yes or no.")
