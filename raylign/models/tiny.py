"""Tiny random models with a locally trained tokenizer, for tests, examples and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained in a second on a small
built-in corpus (so any text tokenizes, without unknown tokens), and the model is a
randomly initialised Qwen2 or Llama built from a config.
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

EOS_TOKEN = "<|im_end|>"
BOS_CHAT_TOKEN = "<|im_start|>"
PAD_TOKEN = "<|pad|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, BOS_CHAT_TOKEN, EOS_TOKEN, PAD_TOKEN]

# ChatML. The {% generation %} block marks assistant tokens, so
# apply_chat_template(..., return_assistant_tokens_mask=True) can mask everything else.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Short lines of words, letters, digits and arithmetic, enough for useful BPE merges."""
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "an",
        "of",
        "to",
        "and",
        "in",
        "is",
        "it",
        "that",
        "for",
        "on",
        "with",
        "as",
        "was",
        "be",
        "by",
        "this",
        "are",
        "or",
        "from",
        "at",
        "his",
        "her",
        "user",
        "assistant",
        "system",
        "answer",
        "question",
        "reverse",
        "copy",
        "sort",
        "count",
        "add",
        "sum",
        "total",
        "number",
        "step",
        "so",
        "then",
        "because",
        "therefore",
        "first",
        "second",
        "third",
        "final",
        "result",
        "is",
        "equals",
        "plus",
        "minus",
        "times",
    ]
    lines = []
    for _ in range(num_lines):
        kind = rng.randrange(3)
        if kind == 0:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        elif kind == 1:
            letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 10)))
            lines.append(f"{letters} {letters[::-1]} {letters.upper()}")
        else:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"{a} + {b} = {a + b}. {a} * 2 = {a * 2}")
    return lines


def build_tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_tiny_model(
    out_dir: str | Path,
    arch: Literal["qwen2", "llama"] = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a random ``arch`` model and its tokenizer to ``out_dir``; returns the folder.

    The folder is an ordinary Hugging Face model folder: ``from_pretrained`` and vLLM load it.
    """
    out_dir = Path(out_dir)
    if out_dir.is_file():
        raise NotADirectoryError(
            f"output folder '{out_dir}' is a file, not a folder; give the path of a folder (it is created when missing)"
        )
    tokenizer = build_tiny_tokenizer(vocab_size)
    config = AutoConfig.for_model(
        arch,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        dtype=dtype,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
