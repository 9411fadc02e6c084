"""Rollout-vs-trainer mismatch corrections: truncated IS weights and ratio masking."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.algorithms import importance_ratio_sums, mask_by_importance_ratio, truncated_importance_weights

from .helpers import fill_masked

# rho = old / rollout per token
RHO = [[3.0, 0.5, 1.0], [1.5, 0.25, 1.0]]
MASK = [[1, 1, 0], [1, 1, 1]]


def inputs():
    mask = torch.tensor(MASK)
    old = torch.tensor([[math.log(r) for r in row] for row in RHO], dtype=torch.float64) - 1.0
    rollout = torch.full((2, 3), -1.0, dtype=torch.float64)
    return fill_masked(old, mask), fill_masked(rollout, mask), mask


def test_token_level_truncated_weights_are_min_of_ratio_and_cap():
    old, rollout, mask = inputs()
    weights, metrics = truncated_importance_weights(old, rollout, mask, cap=2.0)
    expected = [[min(r, 2.0) if m else 0.0 for r, m in zip(row, mrow)] for row, mrow in zip(RHO, MASK)]
    assert weights.tolist() == [pytest.approx(row) for row in expected]
    assert metrics["is_capped_fraction"].item() == pytest.approx(1 / 5)
    assert metrics["is_weight_mean"].item() == pytest.approx((2.0 + 0.5 + 1.5 + 0.25 + 1.0) / 5)
    expected_kl = sum(r - 1 - math.log(r) for row, mrow in zip(RHO, MASK) for r, m in zip(row, mrow) if m) / 5
    assert metrics["mismatch_kl"].item() == pytest.approx(expected_kl)
    counted = [3.0, 0.5, 1.5, 0.25, 1.0]  # Kish: (sum rho)^2 / (N sum rho^2), of the uncapped ratios
    assert metrics["is_ess_fraction"].item() == pytest.approx(sum(counted) ** 2 / (5 * sum(r * r for r in counted)))
    assert not weights.requires_grad


def test_importance_ratio_sums_count_only_the_masked_tokens():
    old, rollout, mask = inputs()
    counted = [3.0, 0.5, 1.5, 0.25, 1.0]  # N, sum rho, sum rho^2: what adds up over micro-batches and ranks
    expected = [5.0, sum(counted), sum(r * r for r in counted)]
    assert importance_ratio_sums(old, rollout, mask).tolist() == pytest.approx(expected)


def test_sequence_and_geometric_levels_use_product_and_geometric_mean():
    old, rollout, mask = inputs()
    seq, _ = truncated_importance_weights(old, rollout, mask, cap=10.0, level="sequence")
    geo, _ = truncated_importance_weights(old, rollout, mask, cap=10.0, level="geometric")
    # row 0: product 3 * 0.5 = 1.5; row 1: 1.5 * 0.25 * 1 = 0.375
    assert seq.tolist() == [pytest.approx([1.5, 1.5, 0.0]), pytest.approx([0.375] * 3)]
    assert geo[0, 0].item() == pytest.approx(1.5 ** (1 / 2))
    assert geo[1, 2].item() == pytest.approx(0.375 ** (1 / 3))


def test_ratio_mask_drops_tokens_outside_the_band():
    old, rollout, mask = inputs()
    new_mask, metrics = mask_by_importance_ratio(old, rollout, mask, low=0.4, high=2.0)
    assert new_mask.tolist() == [[0, 1, 0], [1, 0, 1]]
    assert new_mask.dtype == mask.dtype
    assert metrics["is_masked_fraction"].item() == pytest.approx(2 / 5)


def test_sequence_ratio_mask_drops_whole_sequences():
    old, rollout, mask = inputs()
    new_mask, _ = mask_by_importance_ratio(old, rollout, mask, low=0.5, high=2.0, level="sequence")
    assert new_mask.tolist() == [[1, 1, 0], [0, 0, 0]]


def test_bad_level_and_cap_are_rejected():
    old, rollout, mask = inputs()
    with pytest.raises(ValueError, match="level must be one of"):
        truncated_importance_weights(old, rollout, mask, level="sentence")
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(old, rollout, mask, cap=0.0)
