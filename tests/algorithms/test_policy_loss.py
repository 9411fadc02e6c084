"""PPO-family and GSPO policy losses, entropy bonus: plain-Python references and hand values."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.algorithms import (
    LossScale,
    compute_entropy_bonus,
    compute_gspo_policy_loss,
    compute_ppo_policy_loss,
)
from raylign.models import entropy_from_logits

from .helpers import fill_masked


def py_ppo_token(logp, old, adv, eps_low, eps_high, dual_c=None):
    ratio = math.exp(logp - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - eps_low), 1 + eps_high))
    if dual_c is not None and adv < 0:
        loss = min(loss, -dual_c * adv)
    return loss


def make_batch(seed=0):
    torch.manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]])
    old = -torch.rand(3, 4, dtype=torch.float64) * 2
    logp = old + torch.randn(3, 4, dtype=torch.float64) * 0.4
    adv = torch.randn(3, 4, dtype=torch.float64)
    return logp, old, adv, mask


def py_token_mean(fn, logp, old, adv, mask):
    values = [fn(logp[i][j], old[i][j], adv[i][j]) for i in range(len(mask)) for j in range(len(mask[0])) if mask[i][j]]
    return sum(values) / len(values)


@pytest.mark.parametrize(("eps_low", "eps_high", "dual_c"), [(0.2, None, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_ppo_loss_matches_python_reference(eps_low, eps_high, dual_c):
    logp, old, adv, mask = make_batch()
    loss, _ = compute_ppo_policy_loss(
        fill_masked(logp, mask),
        fill_masked(old, mask),
        fill_masked(adv, mask),
        mask,
        clip_eps_low=eps_low,
        clip_eps_high=eps_high,
        dual_clip_c=dual_c,
    )
    high = eps_low if eps_high is None else eps_high
    expected = py_token_mean(
        lambda lp, o, a: py_ppo_token(lp, o, a, eps_low, high, dual_c),
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_clip_higher_lets_positive_advantages_grow_further():
    logp = torch.tensor([[math.log(1.25)]])
    zeros, adv, mask = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    symmetric, _ = compute_ppo_policy_loss(logp, zeros, adv, mask, clip_eps_low=0.2)
    asymmetric, _ = compute_ppo_policy_loss(logp, zeros, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    assert symmetric.item() == pytest.approx(-1.2)
    assert asymmetric.item() == pytest.approx(-1.25)


def test_dual_clip_bounds_negative_advantage_loss_and_stops_its_gradient():
    logp = torch.tensor([[math.log(5.0), math.log(2.0)]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0]])
    loss, metrics = compute_ppo_policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), dual_clip_c=3.0)
    # token 0: max(5, 1.2) = 5 -> min(5, 3) = 3; token 1: max(2, 1.2) = 2 < 3
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    loss.backward()
    assert logp.grad.tolist() == [[0.0, pytest.approx(2.0 / 2)]]
    assert metrics["dual_clip_fraction"].item() == pytest.approx(0.5)


def test_clip_fraction_and_approx_kl_by_hand():
    # ratios 1.5 (A>0: clipped high), 0.5 (A<0: clipped low), 1.1 (inside), 0.5 with A>0 (unclipped branch wins)
    ratios = [1.5, 0.5, 1.1, 0.5]
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    _, metrics = compute_ppo_policy_loss(logp, torch.zeros_like(logp), adv, torch.ones(1, 4))
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)
    assert metrics["clip_fraction_high"].item() == pytest.approx(0.25)
    assert metrics["clip_fraction_low"].item() == pytest.approx(0.25)
    expected_k3 = sum(r - 1 - math.log(r) for r in ratios) / 4
    assert metrics["approx_kl"].item() == pytest.approx(expected_k3)
    assert metrics["approx_kl_k1"].item() == pytest.approx(-sum(math.log(r) for r in ratios) / 4)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    assert all(not v.requires_grad for v in metrics.values())


def test_ppo_gradient_is_minus_advantage_times_ratio_over_tokens_where_unclipped():
    logp = torch.tensor([[math.log(1.1), math.log(1.5), 0.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, 1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, _ = compute_ppo_policy_loss(logp, torch.zeros(1, 3, dtype=torch.float64), adv, mask)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-2.0 * 1.1 / 2, 0.0, 0.0])


def test_token_weights_scale_each_token_loss():
    logp = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 3.0]])
    loss, _ = compute_ppo_policy_loss(logp, logp, adv, torch.ones(1, 2), token_weights=torch.tensor([[0.5, 2.0]]))
    assert loss.item() == pytest.approx(-(0.5 * 1.0 + 2.0 * 3.0) / 2)


def test_ppo_sequence_advantages_broadcast_and_other_aggregations():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = compute_ppo_policy_loss(logp, logp, torch.tensor([1.0, 4.0]), mask, aggregation="seq_mean_token_mean")
    assert loss.item() == pytest.approx(-(1.0 + 4.0) / 2)
    loss, _ = compute_ppo_policy_loss(
        logp,
        logp,
        torch.tensor([1.0, 4.0]),
        mask,
        aggregation="constant_normalizer",
        scale=LossScale(max_response_length=10),
    )
    assert loss.item() == pytest.approx(-(3 * 1.0 + 4.0) / (2 * 10))


def test_ppo_all_masked_and_garbage_give_finite_zero_loss_and_gradient():
    logp = fill_masked(torch.zeros(2, 3), torch.zeros(2, 3)).requires_grad_(True)
    loss, metrics = compute_ppo_policy_loss(logp, logp.detach(), torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logp.grad).all() and logp.grad.abs().sum().item() == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())


def test_gradcheck_ppo_with_dual_clip():
    logp, old, adv, mask = make_batch(3)
    logp.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: compute_ppo_policy_loss(x, old, adv, mask, clip_eps_high=0.3, dual_clip_c=2.0)[0], (logp,)
    )


# ---------------------------------------------------------------- GSPO


def gspo_sequence_reference(logp, old, seq_adv, mask, eps_low, eps_high):
    """The GSPO objective written at sequence level, directly from the paper's eq. (5)-(7)."""
    losses = []
    for i in range(logp.shape[0]):
        counted = mask[i].bool()
        s = torch.exp((logp[i][counted] - old[i][counted]).mean())
        a = seq_adv[i]
        losses.append(-torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a))
    return torch.stack(losses).mean()


def test_gspo_value_and_gradient_equal_the_sequence_level_objective():
    torch.manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 0, 0]])
    old = -torch.rand(3, 4, dtype=torch.float64)
    logp = (old + 0.001 * torch.randn(3, 4, dtype=torch.float64)).requires_grad_(True)
    seq_adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    loss, metrics = compute_gspo_policy_loss(fill_masked(logp, mask), old, seq_adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    reference = gspo_sequence_reference(logp, old, seq_adv, mask, 3e-4, 4e-4)
    (ref_grad,) = torch.autograd.grad(reference, logp)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    assert torch.allclose(grad, ref_grad, atol=1e-12)
    assert 0.0 <= metrics["clip_fraction"].item() <= 1.0


def test_gspo_ratio_is_geometric_mean_by_hand():
    # token ratios 2 and 0.5 -> geometric mean 1 -> not clipped, loss = -A
    logp = torch.tensor([[math.log(2.0), math.log(0.5)]])
    loss, metrics = compute_gspo_policy_loss(logp, torch.zeros(1, 2), torch.tensor([3.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-3.0)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)


def test_gradcheck_gspo_with_sequence_advantages():
    # GSPO-token's gradient equals the derivative of its value when advantages are per sequence
    logp, old, _, mask = make_batch(5)
    logp = (old + 1e-4 * torch.randn_like(old)).requires_grad_(True)
    seq_adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: compute_gspo_policy_loss(x, old, seq_adv, mask)[0], (logp,))


# ---------------------------------------------------------------- entropy


def test_entropy_bonus_is_minus_coef_times_token_mean():
    entropy = fill_masked(torch.tensor([[1.0, 2.0, 0.0]], dtype=torch.float64), torch.tensor([[1, 1, 0]]))
    entropy.requires_grad_(True)
    loss, metrics = compute_entropy_bonus(entropy, torch.tensor([[1, 1, 0]]), coef=0.01)
    assert loss.item() == pytest.approx(-0.01 * 1.5)
    assert metrics["entropy"].item() == pytest.approx(1.5)
    loss.backward()
    assert entropy.grad.tolist() == [[-0.005, -0.005, 0.0]]


def test_gradcheck_entropy_bonus_through_logits():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.autograd.gradcheck(
        lambda z: compute_entropy_bonus(entropy_from_logits(z), mask, coef=0.1)[0], (logits,)
    )
