"""Reading an RL run's prompt files: conversations that end before the reply, and mixing weights."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from raylign.config.base import ConfigError, parse_config
from raylign.config.rl import RLDataConfig
from raylign.data import RowError
from raylign.models.loading import load_tokenizer
from raylign.rl.prompts import load_train_prompts


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_conversation_prompt_that_ends_with_the_assistants_turn_names_its_row(rl_model_dir, tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}]},
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    cfg = RLDataConfig(train=[{"path": write_rows(tmp_path / "chats.jsonl", rows)}])
    with pytest.raises(RowError, match=r"chats.jsonl.*row 2.*prompt.*must end before the reply"):
        load_train_prompts(cfg, load_tokenizer(str(rl_model_dir)))


def test_a_text_prompts_system_field_is_its_system_message_as_in_sft(rl_model_dir, tmp_path):
    # It was passed through to the outputs and reward functions but never shown to the model.
    rows = [{"prompt": "reverse: a b", "system": "Answer briefly."}, {"prompt": "reverse: c d"}]
    tokenizer = load_tokenizer(str(rl_model_dir))
    cfg = RLDataConfig(train=[{"path": write_rows(tmp_path / "prompts.jsonl", rows)}])
    with_system, without = load_train_prompts(cfg, tokenizer)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "reverse: a b"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert with_system.text == expected and "Answer briefly." in expected
    assert without.text == tokenizer.apply_chat_template(
        [{"role": "user", "content": "reverse: c d"}], tokenize=False, add_generation_prompt=True
    )
    cfg = RLDataConfig(train=[{"path": str(tmp_path / "prompts.jsonl"), "system_key": "instructions"}])
    assert "Answer briefly." not in load_train_prompts(cfg, tokenizer)[0].text  # another key named: not read


def test_a_system_field_beside_a_conversation_prompt_is_refused_not_dropped(rl_model_dir, tmp_path):
    # It reached the reward functions as metadata, but the model never saw it.
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "system": "Answer in French."}]
    cfg = RLDataConfig(train=[{"path": write_rows(tmp_path / "chats.jsonl", rows)}])
    with pytest.raises(RowError, match=r"chats.jsonl, row 1, key 'system': a system prompt beside the conversation in"):
        load_train_prompts(cfg, load_tokenizer(str(rl_model_dir)))


def test_weighted_train_files_mix_into_their_shares(rl_model_dir, tmp_path):
    big = write_rows(tmp_path / "big.jsonl", [{"prompt": f"big {i}"} for i in range(3)])
    small = write_rows(tmp_path / "small.jsonl", [{"prompt": "small 0"}])
    tokenizer = load_tokenizer(str(rl_model_dir))

    plain = load_train_prompts(RLDataConfig(train=[big, small], format="plain"), tokenizer)
    assert sorted(p.text for p in plain) == ["big 0", "big 1", "big 2", "small 0"]  # every row once

    # Equal weights over an epoch of 4 prompts: 2 each, so 2 of the 3 big rows and the small row twice.
    weighted = [{"path": big, "weight": 1.0}, {"path": small, "weight": 1.0}]
    mixed = load_train_prompts(RLDataConfig(train=weighted, format="plain"), tokenizer)
    counts = Counter(p.text for p in mixed)
    assert len(mixed) == 4 and counts["small 0"] == 2
    big_rows = [text for text in counts if text.startswith("big")]
    assert len(big_rows) == 2 and all(counts[text] == 1 for text in big_rows)


def test_a_plain_prompt_starts_with_the_bos_its_tokenizer_adds_as_in_sft(tmp_path):
    from tokenizers import processors

    from raylign.data.formatting import encode_plain
    from raylign.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    bos = "<|endoftext|>"
    tokenizer.bos_token = bos
    bos_id = tokenizer.convert_tokens_to_ids(bos)
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, bos_id)]
    )
    path = write_rows(tmp_path / "plain.jsonl", [{"prompt": "two plus two"}])
    cfg = RLDataConfig(train=[path], format="plain", prompt_template="Q: {input}\nA:")
    (prompt,) = load_train_prompts(cfg, tokenizer)
    body = tokenizer("Q: two plus two\nA:", add_special_tokens=False)["input_ids"]
    assert prompt.token_ids == [bos_id, *body]
    sft_ids, sft_prompt_length = encode_plain(tokenizer, "Q: two plus two\nA:", " 4", add_eos=False)
    assert prompt.token_ids == sft_ids[:sft_prompt_length]


def test_a_weight_on_some_train_files_only_is_refused():
    with pytest.raises(ConfigError, match="weight on every train dataset or on none"):
        parse_config(RLDataConfig, {"train": [{"path": "a.jsonl", "weight": 2.0}, "b.jsonl"]})
