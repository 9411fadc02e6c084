"""KTO rows to samples: scored tokens, boolean labels, mismatched pairs and bad rows."""

from __future__ import annotations

import pytest

from raylign.config.data import DataConfig, DatasetSpec
from raylign.data import RowError
from raylign.data.kto import build_kto_datasets, collate_kto, mismatched_samples

EOS = "<|im_end|>"


def _config(path, **overrides) -> DataConfig:
    settings = {"train": [str(path)], "max_length": 128}
    settings.update(overrides)
    return DataConfig(**settings)


def _targets(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


ROWS = [
    {"prompt": "say a", "completion": "a", "label": True},
    {"prompt": "say b", "completion": "no", "label": False},
    {"prompt": "say c", "completion": "c", "label": True},
]


def test_completion_tokens_are_scored_and_the_label_kept(write_dataset, tokenizer):
    data = build_kto_datasets(_config(write_dataset(ROWS)), tokenizer)
    first = data.train[0]
    rendered = "<|im_start|>user\nsay a<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
    assert tokenizer.decode(first.input_ids) == rendered
    assert _targets(tokenizer, first) == "a" + EOS
    assert [s.desirable for s in data.train] == [True, False, True]
    assert data.label_stats() == {"train_desirable": 2, "train_undesirable": 1}


def test_plain_format_scores_completion_and_eos(write_dataset, tokenizer):
    data = build_kto_datasets(_config(write_dataset(ROWS[:1]), format="plain"), tokenizer)
    assert tokenizer.decode(data.train[0].input_ids) == "say a\na" + EOS
    assert _targets(tokenizer, data.train[0]) == "a" + EOS


def test_keys_come_from_the_dataset_spec(write_dataset, tokenizer):
    path = write_dataset([{"q": "hi", "a": "yo", "good": False}])
    spec = DatasetSpec(path=str(path), input_key="q", output_key="a", label_key="good")
    data = build_kto_datasets(DataConfig(train=[spec], max_length=64), tokenizer)
    assert _targets(tokenizer, data.train[0]) == "yo" + EOS and data.train[0].desirable is False


@pytest.mark.parametrize("label", [1, 0, "true", "yes", 1.0])
def test_a_non_boolean_label_names_the_row_and_key(write_dataset, tokenizer, label):
    path = write_dataset([ROWS[0], {"prompt": "p", "completion": "c", "label": label}])
    with pytest.raises(RowError) as err:
        build_kto_datasets(_config(path), tokenizer)
    assert f"{path}, row 2, key 'label': expected a boolean" in str(err.value)


def test_a_csv_file_gives_its_labels_as_the_text_true_or_false(write_dataset, tokenizer):
    # CSV cells are all text: the same rows as in JSONL, written by pyarrow (true/false cells), load
    # alike; other text is still refused, naming the row.
    data = build_kto_datasets(_config(write_dataset(ROWS, fmt="csv")), tokenizer)
    assert [s.desirable for s in data.train] == [True, False, True]
    path = write_dataset([{"prompt": "p", "completion": "c", "label": "yes"}], fmt="csv", name="yes")
    with pytest.raises(RowError, match=r"yes\.csv, row 1, key 'label': expected a boolean"):
        build_kto_datasets(_config(path), tokenizer)


@pytest.mark.parametrize("missing", ["prompt", "completion", "label"])
def test_a_missing_key_is_named(write_dataset, tokenizer, missing):
    path = write_dataset([{k: v for k, v in ROWS[0].items() if k != missing}])
    with pytest.raises(RowError) as err:
        build_kto_datasets(_config(path), tokenizer)
    assert f"{path}, row 1, key '{missing}': missing key" in str(err.value)


def test_bad_rows_are_skipped_and_counted_when_asked(write_dataset, tokenizer):
    rows = [*ROWS, {"prompt": "p", "completion": "c", "label": "no"}, {"prompt": "p", "label": True}]
    data = build_kto_datasets(_config(write_dataset(rows), skip_bad_rows=True), tokenizer)
    assert len(data.train) == 3
    assert dict(data.stats.skipped) == {"wrong_type": 1, "missing_key": 1}


def test_mismatched_pairs_put_the_previous_completion_under_each_prompt(write_dataset, tokenizer):
    samples = build_kto_datasets(_config(write_dataset(ROWS)), tokenizer).train
    pairs = mismatched_samples(samples, max_length=128)
    texts = [tokenizer.decode(p.input_ids) for p in pairs]
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"
    assert texts == [turn.format("say a", "c"), turn.format("say b", "a"), turn.format("say c", "no")]
    assert [_targets(tokenizer, p) for p in pairs] == ["c" + EOS, "a" + EOS, "no" + EOS]


def test_mismatched_pairs_are_cut_to_max_length(write_dataset, tokenizer):
    samples = build_kto_datasets(_config(write_dataset(ROWS)), tokenizer).train
    pairs = mismatched_samples(samples, max_length=5)
    assert all(len(p.input_ids) == 5 and len(p.loss_mask) == 5 and p.truncated for p in pairs)


def test_collated_batch_carries_labels_and_the_mismatched_batch(write_dataset, tokenizer):
    samples = build_kto_datasets(_config(write_dataset(ROWS)), tokenizer).train
    batch = collate_kto(samples, tokenizer.pad_token_id, packing=False, with_kl_pairs=True, max_length=128)
    assert batch["desirable"].tolist() == [True, False, True]
    assert batch["kl_input_ids"].shape[0] == 3 and batch["kl_loss_mask"].shape == batch["kl_input_ids"].shape
    packed = collate_kto(samples, tokenizer.pad_token_id, packing=True, with_kl_pairs=False, max_length=128)
    assert "kl_input_ids" not in packed and packed["seq_lens"].tolist() == [len(s.input_ids) for s in samples]
    flat_mask = packed["loss_mask"].flatten().tolist()
    for sample, start in zip(samples, packed["seq_starts"].tolist(), strict=True):
        assert flat_mask[start : start + len(sample.loss_mask)] == sample.loss_mask
    assert packed["loss_mask"].sum() == sum(sum(s.loss_mask) for s in samples)  # padding is never scored
