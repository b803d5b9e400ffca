"""A server member's local tokenizer (``specem_core.backends.http.tokenizer``): a plain
``tokenizer.json`` directory is read with ``tokenizers`` alone, as transformers reads it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specem_core.backends.http.tokenizer import TokenizerFile, end_of_turn_token, load_tokenizer, stop_token_ids
from specem_core.chat_format import ChatFormat
from specem_core.models import convert, find_packaged

PACKAGED = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
TEXTS = [
    "Hello world",
    " The capital of France is Paris.",
    "<|im_end|>\n<|im_start|>user",
    "日本語のテキスト ✓ 🙂 naïve café",
    "def f(x):\n    return x * 2\n\n\n",
    "   leading spaces and\ttabs",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again?"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


def converted(name: str) -> Path:
    packaged = find_packaged(name)
    assert packaged is not None
    return Path(convert(packaged))


@pytest.mark.parametrize("name", PACKAGED)
def test_a_packaged_tokenizer_reads_as_transformers_reads_it(name: str) -> None:
    from transformers import AutoTokenizer

    path = converted(name)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(ours, TokenizerFile)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text, add_special_tokens=True), text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            assert ChatFormat(ours).render(messages, tools) == ChatFormat(theirs).render(messages, tools)
    assert ours.eos_token_id == theirs.eos_token_id
    end = end_of_turn_token(ChatFormat(ours), ours)
    assert end == end_of_turn_token(ChatFormat(theirs), theirs) == "<|im_end|>"
    assert stop_token_ids(ours, end) == stop_token_ids(theirs, end)
    assert set(ours.all_special_ids) == set(theirs.all_special_ids)


def test_a_new_process_reads_a_packaged_tokenizer_without_importing_transformers() -> None:
    path = converted("smollm2-135m-instruct")
    code = (
        "import sys; from specem_core.backends.http.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(path)!r}); print(type(t).__name__, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["TokenizerFile", "False"]


def test_another_tokenizer_class_is_loaded_by_transformers(tmp_path: Path) -> None:
    """A class transformers may rewrite at load (e.g. Llama's ``legacy`` handling) is not read
    from the file alone."""
    target = tmp_path / "tok"
    shutil.copytree(converted("smollm2-135m-instruct"), target, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizer"
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    assert not TokenizerFile.reads(target)
    assert not isinstance(load_tokenizer(target), TokenizerFile)


def test_a_tokenizer_file_shows_its_directory_only(tmp_path: Path) -> None:
    path = converted("smollm2-135m-instruct")
    assert repr(load_tokenizer(path)) == f"TokenizerFile({str(path)!r})"


def test_named_templates_render_with_the_default_one(tmp_path: Path) -> None:
    source = converted("smollm2-135m-instruct")
    target = tmp_path / "tok"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "chat_template.jinja"))
    template = load_tokenizer(source).chat_template
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "{{ 'tools' }}"},
        {"name": "default", "template": template},
    ]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    messages = CONVERSATIONS[1]
    assert ChatFormat(load_tokenizer(target)).render(messages) == ChatFormat(load_tokenizer(source)).render(messages)
