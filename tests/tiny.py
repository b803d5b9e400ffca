"""Tiny random models with real (in-process trained) tokenizers, for fast offline tests.

Two tokenizers that differ on purpose (vocabulary size, digit splitting, chat format) and three
architectures (Llama, Qwen2, Gemma 3 with a small sliding window).
"""

from __future__ import annotations

import functools
from typing import Any

CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "Hello world! hello there, how are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Numbers: 12345 678 90 3.14159 42 2026-11-23",
    "Café naïve résumé — déjà vu. 中文字符测试 東京 😀🚀 ünïcödé",
    "SpecEM ensembles several language models while they generate, segment by segment.",
    "The answer is 42. The answer is forty-two. Answer: yes.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<tool_call> </tool_call> ### User: ### Assistant:",
] * 20

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@functools.cache
def chatml_tokenizer() -> Any:
    """Byte-level BPE (GPT-2 style), ChatML template, EOS = <|im_end|>, no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    fast.chat_template = CHATML
    return fast


@functools.cache
def turns_tokenizer() -> Any:
    """A different byte-level BPE (digits split, larger vocab), Gemma-style turns, BOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>")
    fast.chat_template = TURNS
    return fast


def _seeded(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def tiny_llama(seed: int = 0) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = chatml_tokenizer()
    _seeded(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval(), tok


def tiny_qwen2(seed: int = 1, max_position_embeddings: int = 512) -> tuple[Any, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = turns_tokenizer()
    _seeded(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    return Qwen2ForCausalLM(cfg).eval(), tok


def tiny_gemma3(seed: int = 2, sliding_window: int = 16) -> tuple[Any, Any]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = turns_tokenizer()
    _seeded(seed)
    cfg = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    return Gemma3ForCausalLM(cfg).eval(), tok


def member(kind: str, name: str | None = None, **kwargs: Any) -> Any:
    """A :class:`TransformersMember` over a tiny model of ``kind`` (llama, qwen2, gemma3)."""
    from specem_core.backends.transformers import TransformersMember

    model, tok = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3}[kind]()
    return TransformersMember(model, tok, name=name or kind, **kwargs)
