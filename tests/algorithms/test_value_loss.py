"""Clipped value loss against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from raylign.algorithms import compute_value_loss

from .helpers import fill_masked


def test_clipped_value_loss_takes_the_larger_error_by_hand():
    values = torch.tensor([[1.0, 0.1, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = compute_value_loss(
        fill_masked(values, mask), fill_masked(old, mask), fill_masked(returns, mask), mask, clip_eps=0.2
    )
    # token 0: unclipped (1 - 0)^2 = 1, clipped V = 0.7 -> 0.49 -> max 1
    # token 1: unclipped (0.1 - 1)^2 = 0.81, clipped V = 0.1 (inside) -> 0.81
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.81) / 2)
    assert metrics["value_clip_fraction"].item() == 0.0
    assert metrics["value_mse"].item() == pytest.approx((1.0 + 0.81) / 2)
    loss.backward()
    assert values.grad.tolist()[0] == pytest.approx([(1.0 - 0.0) / 2, (0.1 - 1.0) / 2, 0.0])


def test_clipping_binds_when_the_clipped_value_is_further_from_the_return():
    values = torch.tensor([[2.0]], requires_grad=True)
    loss, metrics = compute_value_loss(values, torch.tensor([[0.0]]), torch.tensor([[1.9]]), torch.ones(1, 1))
    # unclipped (0.1)^2 = 0.01; clipped V = 0.2 -> (1.7)^2 = 2.89
    assert loss.item() == pytest.approx(0.5 * 2.89)
    assert metrics["value_clip_fraction"].item() == 1.0
    loss.backward()
    assert values.grad.item() == 0.0


def test_unclipped_value_loss_is_half_mse():
    loss, _ = compute_value_loss(
        torch.tensor([[2.0, 3.0]]), torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), clip_eps=None
    )
    assert loss.item() == pytest.approx(0.5 * (4.0 + 4.0) / 2)


def test_gradcheck_value_loss():
    values = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    old = values.detach() + 0.3 * torch.randn(2, 3, dtype=torch.float64)
    returns = torch.randn(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.autograd.gradcheck(lambda v: compute_value_loss(v, old, returns, mask)[0], (values,))


def test_all_masked_value_loss_is_zero():
    loss, _ = compute_value_loss(torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    assert loss.item() == 0.0
