"""DataConfig: validated ranges, cross-field rules, shorthands and help text."""

from __future__ import annotations

import re

import pytest

from raylign.config.base import ConfigError, describe_fields, parse_config
from raylign.config.data import DataConfig, DatasetSpec


def test_a_bare_path_is_a_dataset_and_a_single_dataset_a_list():
    cfg = parse_config(DataConfig, {"train": "a.jsonl", "eval": ["b.parquet"]})
    assert [spec.path for spec in cfg.train] == ["a.jsonl"]
    assert cfg.eval[0].path == "b.parquet" and cfg.eval[0].input_key == "prompt"


def test_unknown_dataset_key_is_rejected_with_its_path():
    with pytest.raises(ConfigError, match=r"train\.0\.prompt_key: unknown field"):
        parse_config(DataConfig, {"train": [{"path": "a.jsonl", "prompt_key": "q"}]})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"max_length": 64, "truncation": "truncate", "min_response_tokens": 64},
            r"min_response_tokens \(64\) must be below max_length \(64\)",
        ),
        # Read only when truncating: accepted and unread before. Its default passes (as in a dumped config).
        (
            {"max_length": 64, "min_response_tokens": 8},
            r"min_response_tokens \(8\) is read only with truncation: truncate \(truncation is 'error'\)",
        ),
        ({"eval": ["b.jsonl"], "eval_fraction": 0.1}, "set either eval .* or eval_fraction"),
        ({"prompt_template": "Q: {question}"}, r"must contain the field \{input\} and no other fields"),
        ({"prompt_template": "Q: {input"}, "not a valid format string"),
        ({"eval_fraction": 1.0}, r"eval_fraction: Input should be less than 1"),
        ({"truncation": "cut"}, r"truncation: Input should be 'error', 'truncate' or 'drop'"),
    ],
)
def test_invalid_settings_name_the_field_and_the_rule(settings, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(DataConfig, {"train": ["a.jsonl"], **settings})


def test_a_short_max_length_needs_min_response_tokens_only_when_truncating():
    # min_response_tokens (default 64) used to be checked against max_length whatever the truncation, so a
    # max_length of 64 or less needed a setting that nothing read.
    assert parse_config(DataConfig, {"train": ["a.jsonl"], "max_length": 32}).max_length == 32
    assert parse_config(DataConfig, {"train": ["a.jsonl"], "max_length": 32, "truncation": "drop"}).max_length == 32
    with pytest.raises(ConfigError, match=r"min_response_tokens \(64\) must be below max_length \(32\)"):
        parse_config(DataConfig, {"train": ["a.jsonl"], "max_length": 32, "truncation": "truncate"})
    cfg = {"train": ["a.jsonl"], "max_length": 32, "truncation": "truncate", "min_response_tokens": 8}
    assert parse_config(DataConfig, cfg).min_response_tokens == 8


def test_weights_are_set_on_every_train_dataset_or_none():
    with pytest.raises(ConfigError, match="set a weight on every train dataset or on none"):
        parse_config(DataConfig, {"train": [{"path": "a.jsonl", "weight": 2}, "b.jsonl"]})
    with pytest.raises(ConfigError, match=r"train\.0\.weight: Input should be greater than 0"):
        parse_config(DataConfig, {"train": [{"path": "a.jsonl", "weight": 0}]})


def test_train_datasets_are_required():
    with pytest.raises(ConfigError, match="train: Field required"):
        parse_config(DataConfig, {})


@pytest.mark.parametrize("section", [DataConfig, DatasetSpec])
def test_every_field_has_help_text(section):
    assert all(description for _, _, _, description in describe_fields(section))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt_template": "Q: {input}\nA:"}, "data.prompt_template 'Q: {input}\\nA:'"),
        ({"add_eos": False}, "data.add_eos False"),
    ],
)
def test_plain_format_settings_under_the_chat_format_are_refused(fields, named, tmp_path):
    # Under chat (the default) the chat template writes the prompt: the template was accepted and unread.
    with pytest.raises(ValueError, match=re.escape(f"{named}: read by data.format plain only")):
        DataConfig(train=["x.jsonl"], **fields)
    assert DataConfig(train=["x.jsonl"], format="plain", **fields).format == "plain"


def test_rl_and_generate_refuse_a_prompt_template_under_the_chat_format():
    from raylign.config.pipeline import PromptDataConfig
    from raylign.config.rl import RLDataConfig

    for cls, data in ((RLDataConfig, {"train": ["p.jsonl"]}), (PromptDataConfig, {"prompts": ["p.jsonl"]})):
        with pytest.raises(ValueError, match="data.prompt_template 'Q: {input}': read by data.format plain only"):
            cls(**data, prompt_template="Q: {input}")
        assert cls(**data, format="plain", prompt_template="Q: {input}").prompt_template == "Q: {input}"
