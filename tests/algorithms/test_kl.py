"""KL estimators k1/k2/k3 against hand-computed values, as reward penalty and as loss."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.algorithms import compute_kl_loss, compute_token_kl, kl_reward_penalty

from .helpers import fill_masked

LOGP = [[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.5]]
REF = [[-1.5, -1.0, -0.5], [-0.2, -1.0, -9.0]]
MASK = [[1, 1, 0], [1, 1, 1]]


def inputs():
    logp = torch.tensor(LOGP, dtype=torch.float64)
    ref = torch.tensor(REF, dtype=torch.float64)
    mask = torch.tensor(MASK)
    return fill_masked(logp, mask), fill_masked(ref, mask), mask


def hand_kl(estimator, d):
    """d = log pi - log pi_ref."""
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[estimator]


def default_kl(estimator, d):
    """With the default clamps: k3 at most 10 per token, k1 and k2 as they are (|d| < 20 here)."""
    value = hand_kl(estimator, d)
    return min(value, 10.0) if estimator == "k3" else value


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_token_kl_matches_formula_and_ignores_masked_positions(estimator):
    logp, ref, mask = inputs()
    kl = compute_token_kl(logp, ref, mask, estimator)
    for i in range(2):
        for j in range(3):
            expected = default_kl(estimator, LOGP[i][j] - REF[i][j]) if MASK[i][j] else 0.0
            assert kl[i, j].item() == pytest.approx(expected, rel=1e-12)


def test_k3_values_by_hand():
    # d = 0.5: exp(-0.5) - 1 + 0.5 = 0.10653...; d = -3: exp(3) - 4 = 16.0855...
    logp, ref, mask = torch.tensor([[0.5, -3.0]]), torch.zeros(1, 2), torch.ones(1, 2)
    unclamped = compute_token_kl(logp, ref, mask, "k3", value_clamp=None)
    assert unclamped.tolist()[0] == pytest.approx([0.1065306597, 16.0855369232], rel=1e-6)
    assert compute_token_kl(logp, ref, mask, "k3").tolist()[0] == pytest.approx([0.1065306597, 10.0], rel=1e-6)


def test_k3_is_clamped_at_10_by_default_with_zero_gradient_where_it_binds():
    # d = -19: exp(19) - 20 = 1.78e8 unclamped; d = -2: exp(2) - 3 = 4.389, below the clamp, gradient 1 - e^2
    logp = torch.tensor([[-19.0, -2.0]], dtype=torch.float64, requires_grad=True)
    kl = compute_token_kl(logp, torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2), "k3")
    assert kl.tolist()[0] == pytest.approx([10.0, math.exp(2) - 3], rel=1e-12)
    kl.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 1 - math.exp(2)], rel=1e-12)


def test_k3_default_clamp_applies_to_the_loss_and_the_reward_penalty():
    logp, ref, mask = torch.tensor([[-19.0]], requires_grad=True), torch.zeros(1, 1), torch.ones(1, 1)
    loss, metrics = compute_kl_loss(logp, ref, mask, "k3")
    assert (loss.item(), metrics["kl"].item()) == (10.0, 10.0)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert kl_reward_penalty(logp, ref, mask, kl_coef=0.1, estimator="k3").item() == pytest.approx(-1.0)


def test_k3_without_value_clamp_follows_the_formula():
    kl = compute_token_kl(
        torch.tensor([[-19.0]], dtype=torch.float64),
        torch.zeros(1, 1, dtype=torch.float64),
        torch.ones(1, 1),
        "k3",
        value_clamp=None,
    )
    assert kl.item() == pytest.approx(math.exp(19) - 20, rel=1e-12)


def test_k1_and_k2_are_not_value_clamped_by_default():
    logp, ref, mask = torch.tensor([[-19.0]]), torch.zeros(1, 1), torch.ones(1, 1)
    assert compute_token_kl(logp, ref, mask, "k1").item() == -19.0
    assert compute_token_kl(logp, ref, mask, "k2").item() == 180.5


def test_clamps_bound_log_ratio_and_value():
    logp = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[-100.0, 100.0]])
    kl = compute_token_kl(logp, ref, torch.ones(1, 2), "k1", log_ratio_clamp=5.0)
    assert kl.tolist() == [[5.0, -5.0]]
    kl3 = compute_token_kl(logp, ref, torch.ones(1, 2), "k3", log_ratio_clamp=20.0, value_clamp=10.0)
    assert kl3.tolist() == [[10.0, 10.0]]
    assert torch.isfinite(compute_token_kl(logp, ref, torch.ones(1, 2), "k3")).all()


def test_reward_penalty_is_minus_coef_times_kl_and_detached():
    logp, ref, mask = inputs()
    logp.requires_grad_(True)
    penalty = kl_reward_penalty(logp, ref, mask, kl_coef=0.1, estimator="k1")
    assert not penalty.requires_grad
    assert penalty[0, 0].item() == pytest.approx(-0.1 * 0.5)
    assert penalty[1, 2].item() == pytest.approx(-0.1 * 7.5)
    assert penalty[0, 2].item() == 0.0


def test_kl_loss_is_token_mean_of_k3():
    logp, ref, mask = inputs()
    values = [default_kl("k3", LOGP[i][j] - REF[i][j]) for i in range(2) for j in range(3) if MASK[i][j]]
    loss, metrics = compute_kl_loss(logp, ref, mask, "k3")
    assert loss.item() == pytest.approx(sum(values) / len(values))
    assert metrics["kl"].item() == pytest.approx(sum(values) / len(values))
    assert not metrics["kl"].requires_grad


def test_kl_loss_gradient_flows_to_policy_only_where_counted():
    logp, ref, mask = inputs()
    logp.requires_grad_(True)
    loss, _ = compute_kl_loss(logp, ref, mask, "k3")
    loss.backward()
    # d/d logp of (exp(ref - logp) - 1 + logp - ref) / N = (1 - exp(ref - logp)) / N
    assert logp.grad[0, 0].item() == pytest.approx((1 - math.exp(-0.5)) / 5)
    assert logp.grad[0, 2].item() == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_gradcheck_kl_loss(estimator):
    logp = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, 3, dtype=torch.float64)
    mask = torch.tensor(MASK)
    assert torch.autograd.gradcheck(lambda x: compute_kl_loss(x, ref, mask, estimator)[0], (logp,))


def test_all_masked_rows_give_zero_kl():
    kl, _ = compute_kl_loss(torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3))
    assert kl.item() == 0.0


def test_unknown_estimator_names_the_choices():
    with pytest.raises(KeyError, match="k1, k2, k3"):
        compute_token_kl(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "k4")


def test_shape_mismatch_names_the_argument():
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_token_kl(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
