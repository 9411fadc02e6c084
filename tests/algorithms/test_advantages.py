"""Advantage estimators against hand-computed values and plain-Python recursions."""

from __future__ import annotations

import math

import pytest
import torch

import raylign.algorithms as alg
from raylign.algorithms import (
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
    token_rewards,
)

from .helpers import fill_masked


def py_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE over the counted positions of one row, in plain Python."""
    counted = [t for t, m in enumerate(mask) if m]
    advantages = [0.0] * len(mask)
    next_value = next_advantage = 0.0
    for t in reversed(counted):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        next_value = values[t]
        advantages[t] = next_advantage
    return advantages


def py_whiten(rows, mask):
    xs = [x for row, mrow in zip(rows, mask) for x, m in zip(row, mrow) if m]
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return [[(x - mean) / std if m else 0.0 for x, m in zip(row, mrow)] for row, mrow in zip(rows, mask)]


# ---------------------------------------------------------------- reward placement


def test_outcome_reward_goes_on_the_last_counted_token():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    placed = token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert placed.tolist() == [[0, 0, 2, 0], [0, 0, 0, 3], [0, 0, 0, 0]]


def test_bad_reward_shape_is_named():
    with pytest.raises(ValueError, match="rewards"):
        token_rewards(torch.zeros(3), torch.ones(2, 4))


# ---------------------------------------------------------------- GAE


def test_gae_two_tokens_by_hand():
    # delta_1 = 1 - 0.2 = 0.8 -> A_1 = 0.8; delta_0 = 0.9*0.2 - 0.5 = -0.32 -> A_0 = -0.32 + 0.72*0.8 = 0.256
    adv, ret = compute_gae_advantages(
        torch.tensor([1.0]), torch.ones(1, 2), values=torch.tensor([[0.5, 0.2]]), gamma=0.9, lam=0.8, whiten=False
    )
    assert adv.tolist()[0] == pytest.approx([0.256, 0.8])
    assert ret.tolist()[0] == pytest.approx([0.756, 1.0])


def test_gae_skips_masked_tokens_inside_a_response():
    # an observation token between two counted tokens behaves as if absent
    mask = torch.tensor([[1, 0, 1, 0]])
    values = fill_masked(torch.tensor([[0.5, 0.0, 0.2, 0.0]]), mask)
    adv, ret = compute_gae_advantages(torch.tensor([1.0]), mask, values=values, gamma=0.9, lam=0.8, whiten=False)
    assert adv.tolist()[0] == pytest.approx([0.256, 0.0, 0.8, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.756, 0.0, 1.0, 0.0])


def test_gae_matches_python_on_random_ragged_batch():
    torch.manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1], [1, 1, 0, 1, 1, 0]])
    rewards = torch.randn(4, 6, dtype=torch.float64)
    values = torch.randn(4, 6, dtype=torch.float64)
    adv, ret = compute_gae_advantages(
        fill_masked(rewards, mask), mask, values=fill_masked(values, mask), gamma=0.97, lam=0.9, whiten=False
    )
    for i in range(4):
        expected = py_gae(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), 0.97, 0.9)
        assert adv[i].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        expected_returns = [a + v if m else 0.0 for a, v, m in zip(expected, values[i].tolist(), mask[i].tolist())]
        assert ret[i].tolist() == pytest.approx(expected_returns, rel=1e-12, abs=1e-12)


def test_gae_whitening_uses_counted_tokens_only():
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    values = torch.randn(2, 4, dtype=torch.float64)
    rewards = torch.tensor([1.0, -1.0], dtype=torch.float64)
    raw, _ = compute_gae_advantages(rewards, mask, values=values, gamma=1.0, lam=0.95, whiten=False)
    adv, _ = compute_gae_advantages(rewards, mask, values=fill_masked(values, mask), gamma=1.0, lam=0.95)
    expected = py_whiten(raw.tolist(), mask.tolist())
    assert adv.tolist() == [pytest.approx(row, rel=1e-6) for row in expected]


def test_gae_adds_token_level_kl_to_the_reward():
    # r = [0 - 0.5*0.2, 1 - 0.5*0.4], V = 0, gamma = lam = 1 -> A_1 = 0.8, A_0 = -0.1 + 0.8
    adv, _ = compute_gae_advantages(
        torch.tensor([1.0]),
        torch.ones(1, 2),
        values=torch.zeros(1, 2),
        gamma=1.0,
        lam=1.0,
        token_kl=torch.tensor([[0.2, 0.4]]),
        kl_coef=0.5,
        whiten=False,
    )
    assert adv.tolist()[0] == pytest.approx([0.7, 0.8])


# ---------------------------------------------------------------- REINFORCE family


def test_reinforce_discounted_returns_by_hand():
    adv, ret = compute_reinforce_advantages(torch.tensor([1.0]), torch.tensor([[0, 1, 1, 1]]), gamma=0.5)
    assert adv.tolist() == [[0.0, 0.25, 0.5, 1.0]]
    assert ret.tolist() == [[0.0, 0.25, 0.5, 1.0]]


def test_reinforce_plus_plus_whitens_returns_over_the_batch():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    token_kl = fill_masked(torch.tensor([[0.1, 0.2, 0.0], [0.0, 0.3, -0.2]], dtype=torch.float64), mask)
    adv, ret = compute_reinforce_plus_plus_advantages(
        torch.tensor([1.0, 0.0], dtype=torch.float64), mask, token_kl=token_kl, kl_coef=0.5
    )
    # token rewards: row0 [-0.05, 1 - 0.1], row1 [0, -0.15, 0.1]; gamma = 1 returns:
    expected_returns = [[0.85, 0.9, 0.0], [-0.05, -0.05, 0.1]]
    assert ret.tolist() == [pytest.approx(r) for r in expected_returns]
    assert adv.tolist() == [pytest.approx(r, rel=1e-6) for r in py_whiten(expected_returns, mask.tolist())]


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    adv, ret = compute_reinforce_plus_plus_baseline_advantages(rewards, mask, group_size=2)
    # group 0: mean 0.5 -> [0.5, -0.5]; group 1: equal rewards -> 0
    expected_returns = [[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]
    assert ret.tolist() == expected_returns
    assert adv.tolist() == [pytest.approx(r, rel=1e-6) for r in py_whiten(expected_returns, mask.tolist())]


def test_reinforce_plus_plus_baseline_without_batch_mean_keeps_flat_groups_at_zero():
    mask = torch.ones(4, 2)
    adv, _ = compute_reinforce_plus_plus_baseline_advantages(
        torch.tensor([1.0, 0.0, 0.5, 0.5]), mask, group_size=2, subtract_batch_mean=False
    )
    assert adv[2:].abs().sum().item() == 0.0
    assert adv[0, 0].item() > 0 > adv[1, 0].item()


# ---------------------------------------------------------------- group estimators


def test_rloo_leave_one_out_by_hand():
    mask = torch.ones(4, 2)
    adv, _ = compute_rloo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), mask, group_size=4)
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0])
    assert torch.equal(adv[:, 0], adv[:, 1])


def test_grpo_group_mean_and_unbiased_std_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    adv, ret = compute_grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), mask, group_size=4, eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)  # |r - 0.5| / std, std = sqrt(4 * 0.25 / 3)
    assert adv.tolist() == [pytest.approx(r) for r in [[a, a, 0], [-a, 0, 0], [a, a, a], [-a, -a, -a]]]
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("rewards", [torch.tensor([1, 0, 0, 1]), torch.tensor([True, False, False, True])])
def test_integer_and_boolean_rewards_are_read_as_their_float_values(rewards):
    # A verifier's 0/1 (or True/False) outcome. GRPO: +-0.5 / std, std = sqrt(4 * 0.25 / 3); RLOO: the
    # mean of the other three is 1/3 for a 1 and 2/3 for a 0, so +-2/3.
    mask = torch.ones(4, 1)
    grpo, _ = compute_grpo_advantages(rewards, mask, group_size=4, eps=0.0)
    rloo, _ = alg.compute_rloo_advantages(rewards, mask, group_size=4)
    a = 0.5 / math.sqrt(1 / 3)
    assert grpo.dtype == rloo.dtype == torch.float32
    assert grpo[:, 0].tolist() == pytest.approx([a, -a, -a, a])
    assert rloo[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_grpo_without_std_and_dr_grpo_subtract_the_mean_only():
    mask = torch.ones(3, 1)
    rewards = torch.tensor([3.0, 0.0, 0.0])
    plain, _ = compute_grpo_advantages(rewards, mask, group_size=3, normalize_std=False)
    dr, _ = compute_dr_grpo_advantages(rewards, mask, group_size=3)
    assert plain[:, 0].tolist() == pytest.approx([2.0, -1.0, -1.0])
    assert dr[:, 0].tolist() == pytest.approx([2.0, -1.0, -1.0])


def test_group_ids_in_any_order_equal_consecutive_groups():
    mask = torch.ones(6, 2)
    rewards = torch.tensor([1.0, 0.2, 0.0, 0.7, 0.4, 0.9])
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    ids = torch.tensor([10, 10, 10, 20, 20, 20])
    for name in ["rloo", "grpo", "dr_grpo", "reinforce_plus_plus_baseline"]:
        estimator = alg.ADVANTAGE_ESTIMATORS.get(name)
        by_size, _ = estimator(rewards, mask, group_size=3)
        by_ids, _ = estimator(rewards[order], mask, group_ids=ids[order])
        assert torch.allclose(by_ids, by_size[order], atol=1e-6), name


@pytest.mark.parametrize("name", ["rloo", "grpo", "dr_grpo", "reinforce_plus_plus_baseline"])
def test_groups_of_one_and_flat_groups_give_zero_never_nan(name):
    estimator = alg.ADVANTAGE_ESTIMATORS.get(name)
    mask = torch.ones(3, 2)
    single, _ = estimator(torch.tensor([1.0, 0.3, 7.0]), mask, group_size=1)
    flat, _ = estimator(torch.tensor([0.1, 0.1, 0.1]), mask, group_size=3)
    assert single.abs().sum().item() == 0.0
    assert flat.abs().sum().item() == 0.0


@pytest.mark.parametrize("name", sorted(alg.ADVANTAGE_ESTIMATORS.names()))
def test_masked_garbage_all_masked_rows_and_length_one_responses_stay_finite(name):
    estimator = alg.ADVANTAGE_ESTIMATORS.get(name)
    mask = torch.tensor([[0, 0, 0], [0, 1, 0], [1, 1, 1], [0, 0, 1]])
    rewards = fill_masked(torch.randn(4, 3), mask)
    kwargs = {"values": fill_masked(torch.randn(4, 3), mask)} if name == "gae" else {}
    if alg.ADVANTAGE_ESTIMATORS.metadata(name).get("needs_groups"):
        kwargs["group_size"] = 2
    adv, ret = estimator(rewards, mask, **kwargs)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv[mask == 0].abs().sum().item() == 0.0
    assert ret[mask == 0].abs().sum().item() == 0.0


def test_per_token_rewards_are_summed_for_group_estimators():
    mask = torch.tensor([[1, 1], [1, 0]])
    per_token = fill_masked(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), mask)
    adv, _ = compute_dr_grpo_advantages(per_token, mask, group_size=2)
    assert adv.tolist() == [[0.5, 0.5], [-0.5, 0.0]]


def test_bad_group_size_is_explained():
    with pytest.raises(ValueError, match="group_size=3 must be >= 1 and divide the batch size 4"):
        compute_grpo_advantages(torch.zeros(4), torch.ones(4, 2), group_size=3)
    with pytest.raises(ValueError, match="exactly one of group_size"):
        compute_grpo_advantages(torch.zeros(4), torch.ones(4, 2))


# ---------------------------------------------------------------- batch whitening without spread


def test_reinforce_plus_plus_on_one_sequence_gives_zero_advantage():
    # one outcome reward, gamma 1: every counted return is 0.1; whitening constants gives 0, not -0.41
    adv, ret = compute_reinforce_plus_plus_advantages(torch.tensor([0.1]), torch.ones(1, 7))
    assert ret.tolist() == [[pytest.approx(0.1)] * 7]
    assert adv.tolist() == [[0.0] * 7]


def test_reinforce_plus_plus_baseline_on_equal_returns_gives_zero_advantage():
    # groups of one: centred rewards are 0, so only the KL term (equal in both rows) makes the returns
    mask = torch.ones(3, 3)
    token_kl = torch.tensor([[0.0, 0.0, 0.2]] * 3)
    adv, ret = compute_reinforce_plus_plus_baseline_advantages(
        torch.tensor([1.0, 0.0, 0.5]), mask, group_size=1, token_kl=token_kl, kl_coef=0.5
    )
    # token rewards -0.1 on the last token only: returns -0.1 on every token of every row
    assert ret.tolist() == [[pytest.approx(-0.1)] * 3] * 3
    assert adv.tolist() == [[0.0] * 3] * 3


def test_whitened_gae_with_equal_advantages_gives_zero():
    # single-token responses with reward 0.1 and value 0: every A_t = 0.1
    adv, ret = compute_gae_advantages(torch.full((7,), 0.1), torch.ones(7, 1), values=torch.zeros(7, 1))
    assert ret.flatten().tolist() == [pytest.approx(0.1)] * 7
    assert adv.flatten().tolist() == [0.0] * 7
