"""Collators and micro-batch balancing; packed and padded batches give the same per-sample loss."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from raylign.config.data import DataConfig
from raylign.data import balance_micro_batches, build_sft_datasets, collate_packed, collate_padded, pack_rows


@dataclass
class Seq:
    input_ids: list[int]
    loss_mask: list[int]


def test_padded_batch_by_hand():
    batch = collate_padded([Seq([5, 6, 7], [0, 1, 1]), Seq([8, 9], [0, 1])], pad_token_id=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]


def test_padded_batch_rounds_length_up_to_a_multiple():
    batch = collate_padded([Seq([5, 6, 7], [0, 1, 1])], pad_token_id=0, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0]]


def test_pack_rows_first_fit_decreasing_by_hand():
    # Capacity 5 (the longest sample): 5 -> row A (full), 4 -> row B (1 left), 3 -> row C (2 left),
    # 2 -> neither A nor B fits it, C does. Rows are listed by their first sample.
    assert pack_rows([5, 3, 4, 2], 0) == [[0], [1, 3], [2]]
    # Capacity 9: 5 -> A (4 left), 4 -> A (0 left), 3 -> B (6 left), 2 -> B.
    assert pack_rows([5, 3, 4, 2], 9) == [[0, 2], [1, 3]]
    # A capacity below the longest sample is raised to it (7: samples of 3 and 4 then share a row);
    # one huge capacity gives one row.
    assert pack_rows([7, 3, 4], 3) == [[0], [1, 2]]
    assert pack_rows([2, 2, 2], 1000) == [[0, 1, 2]]


def test_packed_batch_fills_rows_as_long_as_the_longest_sample():
    # Lengths 3, 2, 1: capacity 3 -> sample 0 fills row A, sample 1 opens row B (1 left), sample 2 fits B.
    batch = collate_packed([Seq([5, 6, 7], [0, 1, 1]), Seq([8, 9], [0, 1]), Seq([4], [0])], pad_token_id=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 4]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert batch["seq_starts"].tolist() == [0, 3, 5]
    assert batch["seq_lens"].tolist() == [3, 2, 1]
    assert "attention_mask" not in batch


def test_packed_rows_are_right_padded_with_positions_restarting():
    # Lengths 2, 4, 3, 3 with a budget of 6 tokens: 4 -> row A (2 left), 3 -> row B (3 left), 3 -> B (full),
    # 2 -> A (full); rows listed by first sample: A = [0, 1], B = [2, 3]. Length 1 and 1: one row of 2.
    batch = collate_packed(
        [Seq([1, 2], [0, 1]), Seq([3, 4, 5, 6], [0, 1, 1, 1]), Seq([7, 8, 9], [0, 0, 1]), Seq([10, 11, 12], [0, 1, 1])],
        pad_token_id=0,
        row_tokens=6,
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    assert batch["seq_starts"].tolist() == [0, 2, 6, 9]
    # Lengths 4, 1, 2 with rows as long as the longest (4): 4 -> A, 2 -> B (2 left), 1 -> B; B is padded.
    batch = collate_packed([Seq([3, 4, 5, 6], [0, 1, 1, 1]), Seq([7], [0]), Seq([8, 9], [0, 1])], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[3, 4, 5, 6], [7, 8, 9, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 1, 0]]
    assert batch["seq_starts"].tolist() == [0, 4, 5]


def test_mismatched_mask_length_names_the_sample():
    with pytest.raises(ValueError, match="sample 1: 2 input ids but 1 mask entries"):
        collate_packed([Seq([1], [0]), Seq([1, 2], [0])], pad_token_id=0)


def test_micro_batches_respect_the_budget_and_balance_tokens():
    lengths = [5, 4, 3, 3, 1]
    groups = balance_micro_batches(lengths, max_tokens=8)
    # 16 tokens need at least 2 groups of 8; longest-first into the lighter group: 5+3 and 4+3+1
    assert groups == [[0, 3], [1, 2, 4]]


def test_micro_batches_use_more_groups_when_the_minimum_does_not_fit_and_honour_a_floor():
    lengths = [6, 6, 6]  # 18 tokens -> 3 groups of 10 at least, since no two fit together
    assert balance_micro_batches(lengths, max_tokens=10) == [[0], [1], [2]]
    assert balance_micro_batches([1, 1, 1, 1], max_tokens=100, min_micro_batches=2) == [[0, 2], [1, 3]]


def test_micro_batches_that_balancing_cannot_fill_pack_first_fit_instead_of_adding_one():
    # 12 tokens in groups of 6: balancing puts a 3 in each group and the last 2 fits in neither, but
    # 3+3 and 2+2+2 fill two groups exactly; a third forward pass would be wasted.
    assert balance_micro_batches([3, 3, 2, 2, 2], max_tokens=6) == [[0, 1], [2, 3, 4]]


def test_a_sample_over_the_token_budget_is_an_error():
    with pytest.raises(ValueError, match="sample 1 has 12 tokens, over the micro-batch budget of 10 tokens"):
        balance_micro_batches([3, 12], max_tokens=10)


def _per_sample_losses(rows) -> list[float]:
    """Mean cross-entropy over each sample's target tokens, token by token, from (logits, ids, loss_mask)."""
    losses = []
    for logits, ids, mask in rows:
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        terms = [-log_probs[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t]]
        losses.append(float(sum(terms) / len(terms)))
    return losses


@pytest.fixture(scope="module")
def chat_samples(tmp_path_factory, tokenizer):
    import json

    path = tmp_path_factory.mktemp("collate") / "chat.jsonl"
    rows = [
        {"prompt": "add 2 and 3", "completion": "5"},
        {"prompt": "reverse abc", "completion": "the result is cba, because reversing"},
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "count to three"},
                {"role": "assistant", "content": "1 2 3"},
            ]
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_sft_datasets(DataConfig(train=[str(path)], max_length=128), tokenizer).train


def test_packed_and_padded_batches_give_the_same_per_sample_loss(tiny_model_dir, chat_samples, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert len({len(s.input_ids) for s in chat_samples}) == 3  # different lengths, so padding matters

    with torch.no_grad():
        alone = [
            (model(input_ids=torch.tensor([s.input_ids])).logits[0], s.input_ids, s.loss_mask) for s in chat_samples
        ]

        padded = collate_padded(chat_samples, tokenizer.pad_token_id)
        padded_logits = model(
            input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], position_ids=padded["position_ids"]
        ).logits
        lengths = padded["attention_mask"].sum(dim=1).tolist()
        padded_rows = [
            (padded_logits[i, :n], padded["input_ids"][i, :n].tolist(), padded["loss_mask"][i, :n].tolist())
            for i, n in enumerate(lengths)
        ]

        packed = collate_packed(chat_samples, tokenizer.pad_token_id)
        assert packed["input_ids"].shape[0] > 1  # several rows, each holding samples back to back
        # use_cache=False: Transformers isolates packed samples only when no KV cache is passed around
        packed_logits = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits.flatten(0, 1)
        flat_ids, flat_mask = packed["input_ids"].flatten(), packed["loss_mask"].flatten()
        spans = [slice(a, a + n) for a, n in zip(packed["seq_starts"].tolist(), packed["seq_lens"].tolist())]
        packed_rows = [(packed_logits[s], flat_ids[s].tolist(), flat_mask[s].tolist()) for s in spans]

    reference = _per_sample_losses(alone)
    assert _per_sample_losses(padded_rows) == pytest.approx(reference, abs=1e-5)
    assert _per_sample_losses(packed_rows) == pytest.approx(reference, abs=1e-5)
