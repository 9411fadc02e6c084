"""The controller's advantage step (``compute_advantages`` on ``sample_rewards``): a KL-in-reward penalty
reaches each sample's own reward whether its rewards are an outcome or per-token (agent turns)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raylign.config.rl import AlgorithmConfig
from raylign.rl.advantages import compute_advantages
from raylign.rl.experience import sample_rewards

from .rl_helpers import make_sample

# Four samples in two groups of two (RLOO), responses of 5, 3, 4 and 5 tokens in a width of 5.
LENGTHS = [5, 3, 4, 5]
TURNS = [[(1, 0.5), (4, 0.5)], [(2, 0.0)], [(3, 1.0)], [(4, 0.0)]]  # episode totals 1, 0, 1, 0
KL_PER_TOKEN = [0.2, 0.0, 0.5, 0.0]  # behaviour log-prob 0, reference -KL: k1 is KL at every token
KL_COEF = 0.1


def samples(with_turns: bool) -> list:
    out = []
    for length, turns in zip(LENGTHS, TURNS):
        sample = make_sample([1], [7] * length)
        sample.reward = sum(reward for _, reward in turns)
        sample.turn_rewards = turns if with_turns else None
        out.append(sample)
    return out


@pytest.mark.parametrize("with_turns", [False, True], ids=["outcome", "agent_turns"])
def test_kl_in_reward_lands_on_each_samples_own_reward(with_turns):
    batch = samples(with_turns)
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in LENGTHS])
    behaviour = torch.zeros(4, 5)
    reference = -torch.tensor(KL_PER_TOKEN)[:, None] * mask
    rewards = sample_rewards(batch, 5, torch.tensor([s.reward for s in batch]))
    assert rewards.dim() == (2 if with_turns else 1)
    algorithm = AlgorithmConfig(advantage="rloo", kl_mode="reward", kl_estimator="k1", kl_coef=KL_COEF)
    cfg = SimpleNamespace(algorithm=algorithm)  # all compute_advantages reads of an RLConfig
    advantages, _, metrics = compute_advantages(cfg, rewards, mask, 2, behaviour, reference, None)
    # By hand: penalised rewards 1 - 0.1 x 5 x 0.2 = 0.9, 0, 1 - 0.1 x 4 x 0.5 = 0.8, 0; RLOO in
    # groups of two: each minus the other, on every response token.
    expected = torch.tensor([0.9, -0.9, 0.8, -0.8])[:, None] * mask
    torch.testing.assert_close(advantages * mask, expected, atol=1e-6, rtol=0)
    assert metrics["kl/reference"] == pytest.approx((5 * 0.2 + 4 * 0.5) / sum(LENGTHS))
