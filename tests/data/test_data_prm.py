"""Process-reward rows to samples: token layout, labels, the step separator, truncation and bad rows."""

from __future__ import annotations

import pytest
import torch

from raylign.config.data import DataConfig, DatasetSpec
from raylign.config.prm import PRMSection
from raylign.data import RowError
from raylign.data.prm import add_step_separator, build_prm_datasets, collate_prm
from raylign.models.tiny import build_tiny_tokenizer

SEP = "<|step|>"


@pytest.fixture(scope="module")
def prm_tokenizer():
    """A tokenizer of its own: adding the separator must not leak into other tests' tokenizer."""
    tokenizer = build_tiny_tokenizer()
    add_step_separator(tokenizer, SEP)
    return tokenizer


def _data_config(path, **overrides) -> DataConfig:
    settings = {"train": [str(path)], "format": "plain", "max_length": 256}
    settings.update(overrides)
    return DataConfig(**settings)


def _build(path, tokenizer, prm: PRMSection | None = None, **overrides):
    prm = prm or PRMSection(step_separator=SEP)
    separator_id = tokenizer.convert_tokens_to_ids(prm.step_separator)
    return build_prm_datasets(_data_config(path, **overrides), prm, tokenizer, separator_id)


def _only(path, tokenizer, prm=None, **overrides):
    data = _build(path, tokenizer, prm, **overrides)
    assert len(data.train) == 1
    return data.train[0]


ROW = {"prompt": "solve", "steps": ["3+4=7", "7-2=1"], "labels": [True, False]}


# --- layout -------------------------------------------------------------------------------


def test_plain_row_is_prompt_then_each_step_followed_by_the_separator(write_dataset, prm_tokenizer):
    sample = _only(write_dataset([ROW]), prm_tokenizer)
    assert prm_tokenizer.decode(sample.input_ids) == "solve\n3+4=7<|step|>7-2=1<|step|>"
    marked = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert marked == [prm_tokenizer.convert_tokens_to_ids(SEP)] * 2
    assert sample.loss_mask[-1] == 1  # the last token is the last step's separator
    assert sample.step_labels == [1.0, 0.0]


def test_chat_prompt_is_a_user_turn_followed_by_the_assistant_header(write_dataset, prm_tokenizer):
    sample = _only(write_dataset([{**ROW, "steps": ["1+1=2"], "labels": [1]}]), prm_tokenizer, format="chat")
    expected = "<|im_start|>user\nsolve<|im_end|>\n<|im_start|>assistant\n1+1=2<|step|>"
    assert prm_tokenizer.decode(sample.input_ids) == expected


def test_custom_keys_are_read(write_dataset, prm_tokenizer):
    row = {"question": "q", "chain": ["2+2=4"], "ok": ["+"]}
    prm = PRMSection(step_separator=SEP, steps_key="chain", labels_key="ok")
    spec = DatasetSpec(path=str(write_dataset([row])), input_key="question")
    data = build_prm_datasets(
        DataConfig(train=[spec], format="plain", max_length=64),
        prm,
        prm_tokenizer,
        prm_tokenizer.convert_tokens_to_ids(SEP),
    )
    assert prm_tokenizer.decode(data.train[0].input_ids) == "q\n2+2=4<|step|>"
    assert data.train[0].step_labels == [1.0]


# --- the separator ------------------------------------------------------------------------


def test_a_separator_missing_from_the_vocabulary_is_added_as_one_token():
    tokenizer = build_tiny_tokenizer()
    size = len(tokenizer)
    assert len(tokenizer.encode(" ки", add_special_tokens=False)) > 1
    token_id = add_step_separator(tokenizer, " ки")
    assert len(tokenizer) == size + 1 and token_id == size
    assert tokenizer.encode("a ки b", add_special_tokens=False).count(token_id) == 1


def test_a_separator_that_is_already_one_token_is_used_as_is():
    tokenizer = build_tiny_tokenizer()
    size = len(tokenizer)
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    assert add_step_separator(tokenizer, "\n") == newline
    assert len(tokenizer) == size


# --- labels -------------------------------------------------------------------------------


def test_hard_labels_accept_booleans_ones_and_zeros_and_signs(write_dataset, prm_tokenizer):
    steps = ["1+1=2"] * 7
    labels = [True, False, 1, 0, "+", "-", "\u2212"]
    sample = _only(write_dataset([{"prompt": "p", "steps": steps, "labels": labels}]), prm_tokenizer)
    assert sample.step_labels == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_soft_labels_are_probabilities(write_dataset, prm_tokenizer):
    row = {"prompt": "p", "steps": ["1+1=2"] * 4, "labels": [0.25, 1, True, "-"]}
    sample = _only(write_dataset([row]), prm_tokenizer, PRMSection(step_separator=SEP, label_type="soft"))
    assert sample.step_labels == [0.25, 1.0, 1.0, 0.0]


# --- bad rows -----------------------------------------------------------------------------


def test_label_count_differing_from_step_count_names_file_row_and_key(write_dataset, prm_tokenizer):
    bad = {"prompt": "p", "steps": ["1+1=2", "2+2=4", "4+4=8"], "labels": [True, True]}
    path = write_dataset([ROW, bad])
    with pytest.raises(RowError) as err:
        _build(path, prm_tokenizer)
    assert f"{path}, row 2, key 'labels'" in str(err.value)
    assert "2 labels for 3 steps" in str(err.value)


@pytest.mark.parametrize(
    ("label_type", "value"),
    [("hard", "maybe"), ("hard", 2), ("hard", 0.5), ("hard", None), ("soft", 1.5), ("soft", -0.1), ("soft", "yes")],
)
def test_a_bad_label_value_names_the_label(write_dataset, prm_tokenizer, label_type, value):
    path = write_dataset([{"prompt": "p", "steps": ["1+1=2", "2+2=4"], "labels": [True, value]}])
    with pytest.raises(RowError) as err:
        _build(path, prm_tokenizer, PRMSection(step_separator=SEP, label_type=label_type))
    assert f"{path}, row 1, key 'labels[1]'" in str(err.value)
    assert f"bad {label_type} step label" in str(err.value)


@pytest.mark.parametrize("missing", ["prompt", "steps", "labels"])
def test_a_missing_key_is_named(write_dataset, prm_tokenizer, missing):
    row = {k: v for k, v in ROW.items() if k != missing}
    path = write_dataset([row])
    with pytest.raises(RowError) as err:
        _build(path, prm_tokenizer)
    assert f"{path}, row 1, key '{missing}': missing key" in str(err.value)


def test_a_step_holding_the_separator_is_rejected(write_dataset, prm_tokenizer):
    path = write_dataset([{"prompt": "p", "steps": ["1+1=2<|step|>2+2=4"], "labels": [True]}])
    with pytest.raises(RowError, match=r"row 1, key 'steps\[0\]': the step contains the step separator"):
        _build(path, prm_tokenizer)


def test_skip_bad_rows_counts_them_by_reason(write_dataset, prm_tokenizer):
    rows = [ROW, {**ROW, "labels": [True]}, {**ROW, "labels": [True, "?"]}, {**ROW, "steps": "3+4=7"}]
    data = _build(write_dataset(rows), prm_tokenizer, skip_bad_rows=True)
    assert len(data.train) == 1
    assert dict(data.stats.skipped) == {"label_count": 1, "bad_label": 1, "wrong_type": 1}


# --- length -------------------------------------------------------------------------------


def test_truncate_keeps_the_whole_steps_that_fit(write_dataset, prm_tokenizer):
    prompt_len = len(prm_tokenizer("p\n")["input_ids"])
    step_len = len(prm_tokenizer.encode("3+4=7", add_special_tokens=False)) + 1  # with its separator
    row = {"prompt": "p", "steps": ["3+4=7", "7-2=5", "5+1=6"], "labels": [True, False, True]}
    # room for the prompt, two whole steps and part of the third
    max_length = prompt_len + 2 * step_len + 2
    sample = _only(
        write_dataset([row]), prm_tokenizer, max_length=max_length, truncation="truncate", min_response_tokens=4
    )
    assert prm_tokenizer.decode(sample.input_ids) == "p\n3+4=7<|step|>7-2=5<|step|>"
    assert sample.step_labels == [1.0, 0.0] and sample.truncated


def test_truncate_drops_and_counts_rows_left_without_a_whole_step(write_dataset, prm_tokenizer):
    # max_length 20, min_response_tokens 4; "3+4=7" and the other short steps are 5 tokens, plus a separator.
    fits = ROW  # 5 prompt tokens + 2 * 6 = 17
    long_first_step = {"prompt": "p", "steps": ["1+1=2 " * 10, "2+2=4"], "labels": [True, False]}  # 2 + 52: cut
    long_prompt = {"prompt": "word " * 20, "steps": ["3+4=7", "7-2=1"], "labels": [True, False]}  # 16 + 4 kept
    three_of_four = {"prompt": "p", "steps": ["3+4=7", "7-2=5", "5+1=6", "6+1=7"], "labels": [0, 1, 1, 0]}  # 2 + 24
    path = write_dataset([fits, long_first_step, long_prompt, three_of_four])
    data = _build(path, prm_tokenizer, max_length=20, truncation="truncate", min_response_tokens=4)
    assert [prm_tokenizer.decode(s.input_ids) for s in data.train] == [
        "solve\n3+4=7<|step|>7-2=1<|step|>",
        "p\n3+4=7<|step|>7-2=5<|step|>5+1=6<|step|>",
    ]
    assert [s.step_labels for s in data.train] == [[1.0, 0.0], [0.0, 1.0, 1.0]]
    assert [(s.row, s.truncated) for s in data.train] == [(1, False), (4, True)]
    assert (data.stats.rows_read, data.stats.rows_kept, dict(data.stats.skipped)) == (4, 2, {"no_step_fits": 2})
    assert [example.split(": ")[0] for example in data.stats.skip_examples] == [
        f"{path}, row 2, key 'steps'",
        f"{path}, row 3, key 'steps'",
    ]
    assert "no whole step fits after the prompt" in data.stats.skip_examples[0]


def test_drop_skips_long_rows_and_error_names_them(write_dataset, prm_tokenizer):
    long_row = {"prompt": "p", "steps": ["3+4=7"] * 10, "labels": [True] * 10}
    path = write_dataset([ROW, long_row])
    data = _build(path, prm_tokenizer, max_length=20, truncation="drop")
    assert len(data.train) == 1 and data.stats.skipped["too_long"] == 1
    with pytest.raises(RowError, match=r"row 2, key 'steps': \d+ tokens, over data.max_length=20"):
        _build(path, prm_tokenizer, max_length=20, truncation="error")


# --- batching -----------------------------------------------------------------------------


def _two_samples(write_dataset, tokenizer):
    rows = [ROW, {"prompt": "p", "steps": ["1+1=2"], "labels": [True]}]
    return _build(write_dataset(rows), tokenizer, PRMSection(step_separator=SEP, label_type="soft")).train


def test_padded_batch_has_labels_at_the_separators(write_dataset, prm_tokenizer):
    a, b = _two_samples(write_dataset, prm_tokenizer)
    batch = collate_prm([a, b], prm_tokenizer.pad_token_id, packing=False, soft_labels=False)
    sep = prm_tokenizer.convert_tokens_to_ids(SEP)
    assert torch.equal(batch["loss_mask"].bool(), batch["input_ids"].eq(sep) & batch["attention_mask"].bool())
    assert batch["step_labels"].dtype == torch.long
    assert batch["step_labels"][batch["loss_mask"].bool()].tolist() == [1, 0, 1]
    assert batch["step_labels"][~batch["loss_mask"].bool()].abs().sum() == 0


def test_packed_batch_keeps_soft_labels_in_order(write_dataset, prm_tokenizer):
    a, b = _two_samples(write_dataset, prm_tokenizer)
    batch = collate_prm([a, b], prm_tokenizer.pad_token_id, packing=True, soft_labels=True)
    # Two samples never share a row as long as the longer one: one row each, padded to the longer.
    assert batch["input_ids"].shape == (2, max(len(a.input_ids), len(b.input_ids)))
    assert batch["step_labels"].dtype == torch.float32
    assert batch["step_labels"][batch["loss_mask"].bool()].tolist() == [1.0, 0.0, 1.0]
