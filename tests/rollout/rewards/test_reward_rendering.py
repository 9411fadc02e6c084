"""How a reward model's tokenizer turns (prompt, response) into ids: chat template, rendered prompts, plain text."""

from __future__ import annotations

import pytest

from raylign.models.tiny import build_tiny_tokenizer
from raylign.rollout.rewards.rendering import AssistantTurn, assistant_turn, encode_sample


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_assistant_turn_of_chatml(tokenizer):
    assert assistant_turn(tokenizer) == AssistantTurn("<|im_start|>assistant\n", "", "<|im_end|>\n")


def test_raw_prompt_and_rendered_prompt_give_the_same_ids(tokenizer):
    turn = assistant_turn(tokenizer)
    expected = ids(tokenizer, "<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n")
    assert encode_sample(tokenizer, turn, "add 2 and 3", "5") == expected
    rendered = "<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n"
    assert encode_sample(tokenizer, turn, rendered, "5") == expected


def test_tokenizer_without_template_reads_prompt_then_response_then_eos(tokenizer):
    plain = build_tiny_tokenizer()
    plain.chat_template = None
    expected = ids(plain, "Question: 2 + 2 =") + ids(plain, " 4") + [plain.eos_token_id]
    assert encode_sample(plain, assistant_turn(plain), "Question: 2 + 2 =", " 4") == expected


def test_malformed_prompt_messages_are_rejected(tokenizer):
    with pytest.raises(ValueError, match="prompt_messages' holds 'hi', not a {role, content} message"):
        encode_sample(tokenizer, assistant_turn(tokenizer), "p", "r", ["hi"])
