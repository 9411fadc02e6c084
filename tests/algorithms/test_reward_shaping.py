"""Reward clipping, length penalties, running normalisation and the dynamic-sampling filter."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from raylign.algorithms import (
    RunningRewardNormalizer,
    clip_rewards,
    dapo_overlong_penalty,
    filter_zero_variance_groups,
    kimi_length_penalty,
    linear_length_penalty,
)


def test_clip_rewards():
    assert clip_rewards(torch.tensor([-5.0, 0.3, 9.0]), low=-1.0, high=1.0).tolist() == pytest.approx([-1, 0.3, 1])
    with pytest.raises(ValueError, match="low <= high"):
        clip_rewards(torch.zeros(1), low=1.0, high=0.0)


def test_dapo_overlong_penalty_zones_by_hand():
    # L_max = 20, L_cache = 4: free up to 16, linear from 16 to 20, -1 beyond
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty = dapo_overlong_penalty(lengths, max_length=20, cache_length=4)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    scaled = dapo_overlong_penalty(lengths, max_length=20, cache_length=4, penalty_factor=0.5)
    assert scaled[3].item() == pytest.approx(-0.25)


def test_linear_length_penalty():
    penalty = linear_length_penalty(torch.tensor([5, 12, 30]), coef=0.01, free_length=10)
    assert penalty.tolist() == pytest.approx([0.0, -0.02, -0.2])


def test_kimi_length_penalty_by_hand():
    # group 0 lengths 10, 20, 30 -> lambda 0.5, 0, -0.5; group 1 all equal -> 0
    lengths = torch.tensor([10, 20, 30, 7, 7, 7])
    correct = torch.tensor([1, 0, 0, 1, 0, 1])
    penalty = kimi_length_penalty(lengths, correct, group_size=3)
    assert penalty.tolist() == pytest.approx([0.5, 0.0, -0.5, 0.0, 0.0, 0.0])
    wrong_short = kimi_length_penalty(torch.tensor([10, 30]), torch.tensor([0, 1]), group_size=2)
    assert wrong_short.tolist() == pytest.approx([0.0, -0.5])  # incorrect responses get min(0, lambda)


def test_running_normalizer_matches_statistics_of_all_seen_rewards():
    batches = [[1.0, 2.0, 3.0], [10.0], [-4.0, 0.5]]
    normalizer = RunningRewardNormalizer(eps=0.0)
    seen: list[float] = []
    for values in batches:
        out = normalizer(torch.tensor(values, dtype=torch.float64))
        seen += values
        mean, std = statistics.fmean(seen), statistics.pstdev(seen)
        assert normalizer.mean == pytest.approx(mean)
        assert normalizer.std == pytest.approx(std)
        assert out.tolist() == pytest.approx([(v - mean) / std for v in values])


def test_running_normalizer_state_round_trip():
    first = RunningRewardNormalizer(shift_mean=False)
    first.update(torch.tensor([1.0, 5.0, 2.0]))
    second = RunningRewardNormalizer()
    second.load_state_dict(first.state_dict())
    rewards = torch.tensor([3.0, -1.0])
    assert torch.equal(second.normalize(rewards), first.normalize(rewards))
    assert second.shift_mean is False
    with pytest.raises(KeyError, match="m2"):
        second.load_state_dict({"count": 1.0, "mean": 0.0})


def test_running_normalizer_before_any_update_returns_the_rewards_less_a_zero_mean():
    """No reward seen: no scale to divide by, and a mean of 0 to subtract (not a division by eps)."""
    rewards = torch.tensor([1.0, -2.5])
    for shift_mean in (True, False):
        assert torch.equal(RunningRewardNormalizer(shift_mean=shift_mean).normalize(rewards), rewards)


def test_dynamic_sampling_keeps_groups_with_reward_variance():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.2])
    result = filter_zero_variance_groups(rewards, group_size=2)
    assert result.keep.tolist() == [True, True, False, False, False, False, True, True]
    assert result.kept_indices.tolist() == [0, 1, 6, 7]
    assert result.dropped_indices.tolist() == [2, 3, 4, 5]
    assert result.kept_groups.tolist() == [0, 3]
    assert result.dropped_groups.tolist() == [1, 2]


def test_dynamic_sampling_reports_caller_group_ids_and_drops_singletons():
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.3, 9.0])
    result = filter_zero_variance_groups(rewards, group_ids=torch.tensor([7, 7, 4, 4, 11]))
    assert result.kept_groups.tolist() == [7]
    assert result.dropped_groups.tolist() == [4, 11]
    assert result.kept_indices.tolist() == [0, 1]


def test_nan_free_on_all_equal_batch():
    result = filter_zero_variance_groups(torch.zeros(4), group_size=4)
    assert result.kept_indices.numel() == 0 and not math.isnan(float(result.keep.float().sum()))


def test_running_normalizer_on_equal_rewards_gives_exact_zeros():
    # 0.1 three times: the running mean's rounding must not be divided by eps
    normalizer = RunningRewardNormalizer()
    rewards = torch.full((3,), 0.1, dtype=torch.float32)
    assert normalizer(rewards).tolist() == [0.0, 0.0, 0.0]
    assert normalizer(rewards).tolist() == [0.0, 0.0, 0.0]
    assert normalizer.std == 0.0


def test_running_normalizer_without_shift_leaves_equal_rewards_unscaled():
    # no spread seen: no scale to divide by (1 / eps would give 1e8)
    normalizer = RunningRewardNormalizer(shift_mean=False)
    assert normalizer(torch.tensor([1.0, 1.0])).tolist() == [1.0, 1.0]
    assert RunningRewardNormalizer(shift_mean=False).normalize(torch.tensor([2.0])).tolist() == [2.0]


def test_running_normalizer_scales_once_rewards_differ():
    normalizer = RunningRewardNormalizer(eps=0.0)
    normalizer.update(torch.tensor([1.0, 1.0], dtype=torch.float64))
    out = normalizer(torch.tensor([3.0, 3.0], dtype=torch.float64))
    # seen 1, 1, 3, 3: mean 2, population std 1
    assert out.tolist() == pytest.approx([1.0, 1.0])


def test_running_normalizer_state_without_range_assumes_rewards_differed():
    normalizer = RunningRewardNormalizer(eps=0.0)
    normalizer.load_state_dict({"count": 4.0, "mean": 2.0, "m2": 4.0})
    assert normalizer.normalize(torch.tensor([3.0], dtype=torch.float64)).tolist() == [1.0]
