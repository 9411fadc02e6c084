"""Masked statistics against plain Python over the counted elements."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.algorithms import masked_mean, masked_min_max, masked_std, masked_sum, masked_var, masked_whiten

from .helpers import fill_masked

VALUES = [[1.0, 2.0, 3.0, 4.0], [5.0, -1.0, 0.5, 7.0]]
MASK = [[1, 1, 0, 0], [0, 1, 1, 1]]


def counted(values=VALUES, mask=MASK):
    return [v for row, mrow in zip(values, mask) for v, m in zip(row, mrow) if m]


def py_mean(xs):
    return sum(xs) / len(xs)


def py_var(xs, unbiased=True):
    mu = py_mean(xs)
    return sum((x - mu) ** 2 for x in xs) / (len(xs) - (1 if unbiased else 0))


def with_garbage():
    values = torch.tensor(VALUES, dtype=torch.float64)
    mask = torch.tensor(MASK)
    return fill_masked(values, mask), mask


def test_masked_sum_and_mean_ignore_garbage_at_masked_positions():
    values, mask = with_garbage()
    assert masked_sum(values, mask).item() == pytest.approx(sum(counted()))
    assert masked_mean(values, mask).item() == pytest.approx(py_mean(counted()))


def test_masked_mean_along_rows():
    values, mask = with_garbage()
    expected = [py_mean([1.0, 2.0]), py_mean([-1.0, 0.5, 7.0])]
    assert masked_mean(values, mask, dim=-1).tolist() == pytest.approx(expected)


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_and_std_match_python(unbiased):
    values, mask = with_garbage()
    expected = py_var(counted(), unbiased)
    assert masked_var(values, mask, unbiased=unbiased).item() == pytest.approx(expected)
    assert masked_std(values, mask, unbiased=unbiased).item() == pytest.approx(math.sqrt(expected))


def test_masked_whiten_matches_python_and_zeroes_masked_positions():
    values, mask = with_garbage()
    xs = counted()
    mu, sd = py_mean(xs), math.sqrt(py_var(xs))
    whitened = masked_whiten(values, mask, eps=0.0)
    for i in range(2):
        for j in range(4):
            expected = (VALUES[i][j] - mu) / sd if MASK[i][j] else 0.0
            assert whitened[i, j].item() == pytest.approx(expected)


def test_whiten_without_mean_shift_only_scales():
    values, mask = with_garbage()
    sd = math.sqrt(py_var(counted()))
    whitened = masked_whiten(values, mask, shift_mean=False, eps=0.0)
    assert whitened[0, 0].item() == pytest.approx(1.0 / sd)


def test_empty_and_single_element_statistics_are_finite():
    values = torch.tensor([[3.0, 4.0]])
    nothing = torch.zeros(1, 2)
    one = torch.tensor([[1, 0]])
    assert masked_mean(values, nothing).item() == 0.0
    assert masked_var(values, nothing).item() == 0.0
    assert masked_var(values, one).item() == 0.0
    assert torch.isfinite(masked_whiten(values, one)).all()
    assert masked_whiten(values, nothing).abs().sum().item() == 0.0


def test_gradient_of_masked_whiten_is_finite_with_garbage_and_zero_on_masked_positions():
    values, mask = with_garbage()
    values.requires_grad_(True)
    (masked_whiten(values, mask) * torch.arange(8.0, dtype=torch.float64).view(2, 4)).sum().backward()
    assert torch.isfinite(values.grad).all()
    assert values.grad[mask == 0].abs().sum().item() == 0.0


def test_gradcheck_masked_var_and_whiten():
    values = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK)
    assert torch.autograd.gradcheck(lambda v: masked_var(v, mask), (values,))
    assert torch.autograd.gradcheck(lambda v: masked_whiten(v, mask), (values,))


def test_dim_with_process_group_is_rejected():
    with pytest.raises(ValueError, match="dim=None"):
        masked_sum(torch.ones(2, 2), torch.ones(2, 2), dim=-1, process_group=object())


# ---------------------------------------------------------------- values without spread


def test_masked_min_max_ignores_masked_garbage_and_is_infinite_when_empty():
    values, mask = with_garbage()
    lowest, highest = masked_min_max(values, mask)
    assert (lowest.item(), highest.item()) == (-1.0, 7.0)
    empty_low, empty_high = masked_min_max(torch.zeros(2, 3), torch.zeros(2, 3))
    assert (empty_low.item(), empty_high.item()) == (math.inf, -math.inf)


@pytest.mark.parametrize("constant", [3.0, 0.1])
def test_whitening_equal_fp32_values_gives_exact_zeros(constant):
    # 0.1 * 7 in fp32: the two-pass mean is off by one ulp, and (x - mean) / (std + eps) would be -0.41
    values = torch.full((1, 7), constant, dtype=torch.float32)
    assert masked_whiten(values, torch.ones(1, 7)).tolist() == [[0.0] * 7]


def test_whitening_equal_values_without_shift_returns_them_unscaled():
    # std 0: no scale to divide by; dividing by eps alone would give 1e7
    values = torch.full((1, 7), 0.1, dtype=torch.float32)
    whitened = masked_whiten(values, torch.ones(1, 7), shift_mean=False)
    assert whitened.tolist() == [[pytest.approx(0.1, rel=1e-7)] * 7]


def test_whitening_counts_spread_over_counted_positions_only():
    values = fill_masked(torch.tensor([[2.0, 2.0, 0.0], [2.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_whiten(values, mask).tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert masked_whiten(values, mask, shift_mean=False).tolist() == [[2.0, 2.0, 0.0], [2.0, 0.0, 0.0]]


def test_whitening_a_single_counted_value_gives_zero():
    values = torch.tensor([[0.3, 5.0]])
    assert masked_whiten(values, torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]


def test_gradients_at_zero_variance_are_zero_not_nan():
    # sqrt'(0) is infinite; the std of equal values has the subgradient 0
    values = torch.full((1, 5), 3.0, dtype=torch.float64, requires_grad=True)
    masked_std(values, torch.ones(1, 5)).backward()
    assert values.grad.tolist() == [[0.0] * 5]
    values.grad = None
    masked_whiten(values, torch.ones(1, 5)).sum().backward()
    assert values.grad.tolist() == [[0.0] * 5]


def test_whitening_without_eps_stays_finite_when_the_variance_underflows():
    # fp32: the squares of +-5e-31 underflow, so std is 0 although the values differ; nothing to divide by
    whitened = masked_whiten(torch.tensor([[0.0, 1e-30]]), torch.ones(1, 2), eps=0.0)
    assert whitened.tolist()[0] == pytest.approx([-5e-31, 5e-31], rel=1e-6)
