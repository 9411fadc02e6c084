"""The rewards an RL step trains on: running normalisation, length penalties, DAPO's overlong penalty
and clipping as the config asks for them, each value worked out by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from raylign.rl.advantages import RewardShaping

from .rl_helpers import resolve, rl_config_data


@pytest.fixture
def config(rl_model_dir, prompt_file, tmp_path):
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run", "grpo")
    data["sampling"].update(n=2, max_new_tokens=10)

    def build(**algorithm):
        run = copy.deepcopy(data)
        run.setdefault("algorithm", {}).update(algorithm)
        return resolve(tmp_path, run)

    return build


def test_without_shaping_the_rewards_are_the_scores(config):
    rewards, metrics = RewardShaping(config())(torch.tensor([1.0, 0.0, 0.5, 0.25]), torch.tensor([3, 4, 5, 6]))
    assert rewards.tolist() == [1.0, 0.0, 0.5, 0.25]
    assert metrics == {}


def test_linear_length_penalty_costs_each_token_past_the_free_ones(config):
    shaping = RewardShaping(config(length_penalty="linear", length_penalty_coef=0.1, length_penalty_free_tokens=4))
    rewards, metrics = shaping(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([2, 4, 5, 10]))
    # Tokens past 4: 0, 0, 1, 6.
    assert rewards.tolist() == pytest.approx([1.0, 1.0, -0.1, -0.6])
    assert metrics["reward/length_penalty"] == pytest.approx(-0.7 / 4)


def test_kimi_length_penalty_is_group_relative_and_spares_nothing_wrong(config):
    shaping = RewardShaping(config(length_penalty="kimi", length_penalty_coef=0.2, correct_reward=1.0))
    # Groups of n=2: (correct len 2, correct len 6) and (wrong len 3, wrong len 5).
    rewards, _ = shaping(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([2, 6, 3, 5]))
    # lambda = 0.5 - (len - min) / (max - min): 0.5 and -0.5 in each group; a wrong answer keeps
    # only the negative part.
    assert rewards.tolist() == pytest.approx([1.0 + 0.1, 1.0 - 0.1, 0.0, -0.1])


def test_running_normalisation_uses_every_reward_seen_and_survives_a_checkpoint(config):
    cfg = config(normalize_rewards=True)
    shaping = RewardShaping(cfg)
    first, metrics = shaping(torch.tensor([0.0, 2.0, 4.0, 6.0]), torch.tensor([1, 1, 1, 1]))
    std = math.sqrt(5.0)  # population std of 0, 2, 4, 6 around 3
    assert first.tolist() == pytest.approx([(r - 3.0) / std for r in (0, 2, 4, 6)])
    assert metrics["reward/running_mean"] == pytest.approx(3.0)
    resumed = RewardShaping(cfg)
    resumed.load_state_dict(shaping.state_dict())
    # All eight rewards 0, 2, 4, 6, 8, 8, 8, 8: mean 5.5, population variance 70 / 8 = 8.75.
    second, _ = resumed(torch.tensor([8.0, 8.0, 8.0, 8.0]), torch.tensor([1, 1, 1, 1]))
    assert second.tolist() == pytest.approx([(8.0 - 5.5) / math.sqrt(8.75)] * 4)


def test_normalisation_then_penalties_then_clipping(config):
    cfg = config(
        normalize_rewards=True,
        length_penalty="linear",
        length_penalty_coef=1.0,
        overlong_buffer=4,
        overlong_penalty=1.0,
        reward_clip=1.0,
    )
    rewards, metrics = RewardShaping(cfg)(torch.tensor([0.0, 2.0, 0.0, 2.0]), torch.tensor([0, 0, 1, 8]))
    # Normalised: -1, 1, -1, 1. Linear: 0, 0, -1, -8. Overlong (max 10, buffer 4: free up to 6): 0, 0, 0,
    # -2/4. Then clipped to [-1, 1].
    assert rewards.tolist() == pytest.approx([-1.0, 1.0, -1.0, -1.0])
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.5 / 4)
    assert set(metrics) == {
        "reward/running_mean",
        "reward/running_std",
        "reward/length_penalty",
        "reward/overlong_penalty",
    }
