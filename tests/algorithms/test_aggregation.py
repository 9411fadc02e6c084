"""Loss aggregation modes, by hand, and micro-batch splitting on one process."""

from __future__ import annotations

import pytest
import torch

from raylign.algorithms import LossScale, aggregate_loss, compute_loss_scale

from .helpers import fill_masked

LOSSES = [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]


def batch():
    mask = torch.tensor(MASK)
    return fill_masked(torch.tensor(LOSSES, dtype=torch.float64), mask), mask


def test_token_mean_weighs_every_token_equally():
    losses, mask = batch()
    assert aggregate_loss(losses, mask, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)


def test_seq_mean_token_mean_averages_sequence_means_over_non_empty_sequences():
    losses, mask = batch()
    assert aggregate_loss(losses, mask, "seq_mean_token_mean").item() == pytest.approx((2.0 + 4.0) / 2)


def test_seq_mean_token_sum_averages_sequence_sums():
    losses, mask = batch()
    assert aggregate_loss(losses, mask, "seq_mean_token_sum").item() == pytest.approx((6.0 + 4.0) / 2)


def test_constant_normalizer_divides_by_sequences_times_max_length():
    losses, mask = batch()
    value = aggregate_loss(losses, mask, "constant_normalizer", LossScale(max_response_length=8))
    assert value.item() == pytest.approx(10.0 / (2 * 8))
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_loss(losses, mask, "constant_normalizer")


def test_global_denominators_and_world_size_are_applied():
    losses, mask = batch()
    scale = LossScale(global_tokens=20, global_sequences=5, world_size=4, max_response_length=8)
    assert aggregate_loss(losses, mask, "token_mean", scale).item() == pytest.approx(10 / 20 * 4)
    assert aggregate_loss(losses, mask, "seq_mean_token_mean", scale).item() == pytest.approx(6 / 5 * 4)
    assert aggregate_loss(losses, mask, "seq_mean_token_sum", scale).item() == pytest.approx(10 / 5 * 4)
    assert aggregate_loss(losses, mask, "constant_normalizer", scale).item() == pytest.approx(10 / 40 * 4)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer"])
def test_micro_batches_with_the_loss_scale_sum_to_the_full_batch_loss_and_gradient(mode):
    torch.manual_seed(0)
    weights = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0]]
    )
    features = torch.randn(6, 5, dtype=torch.float64)

    def token_losses(rows):
        return (weights[rows] * features[rows]).square()

    full = aggregate_loss(token_losses(slice(0, 6)), mask, mode, LossScale(max_response_length=5))
    (full_grad,) = torch.autograd.grad(full, weights)

    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    scale = compute_loss_scale([mask[p] for p in parts], max_response_length=5)
    assert (scale.global_tokens, scale.global_sequences, scale.world_size) == (13.0, 5.0, 1)
    total = sum(aggregate_loss(token_losses(p), mask[p], mode, scale) for p in parts)
    (split_grad,) = torch.autograd.grad(total, weights)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(split_grad, full_grad, atol=1e-12)


def test_empty_batch_aggregates_to_zero():
    zeros = torch.zeros(2, 3)
    for mode in ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]:
        assert aggregate_loss(torch.ones(2, 3), zeros, mode).item() == 0.0


def test_unknown_mode_lists_the_modes():
    with pytest.raises(KeyError, match="constant_normalizer, seq_mean_token_mean"):
        aggregate_loss(torch.ones(1, 1), torch.ones(1, 1), "sum")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer"])
def test_gradcheck_aggregations(mode):
    losses = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    scale = LossScale(global_tokens=9, global_sequences=3, world_size=2, max_response_length=4)
    assert torch.autograd.gradcheck(lambda x: aggregate_loss(x, mask, mode, scale), (losses,))
