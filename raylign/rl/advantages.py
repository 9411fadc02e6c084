"""From rewards and log-probs of one step's samples to advantages, with the configured estimator."""

from __future__ import annotations

import torch

from raylign.algorithms import (
    ADVANTAGE_ESTIMATORS,
    clip_rewards,
    compute_token_kl,
    dapo_overlong_penalty,
    kl_reward_penalty,
)
from raylign.config.rl import GROUP_ESTIMATORS, RLConfig


def shaped_rewards(rewards: torch.Tensor, lengths: torch.Tensor, cfg: RLConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Outcome rewards after DAPO's overlong penalty and clipping."""
    a = cfg.algorithm
    metrics: dict[str, float] = {}
    if a.overlong_buffer > 0:
        penalty = dapo_overlong_penalty(lengths, max_length=cfg.sampling.max_new_tokens,
                                        cache_length=a.overlong_buffer, penalty_factor=a.overlong_penalty)
        rewards = rewards + penalty
        metrics["reward/overlong_penalty"] = float(penalty.mean())
    if a.reward_clip is not None:
        rewards = clip_rewards(rewards, low=-a.reward_clip, high=a.reward_clip)
    return rewards, metrics


def compute_advantages(
    cfg: RLConfig,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    values: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(advantages, returns, metrics)``, all ``[batch, R]`` but the metrics."""
    a = cfg.algorithm
    kwargs: dict = {}
    metrics: dict[str, float] = {}
    if a.advantage in GROUP_ESTIMATORS:
        kwargs["group_size"] = group_size
    if a.advantage == "grpo":
        kwargs["normalize_std"] = a.normalize_std
    if a.advantage in ("gae", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        kwargs["gamma"] = a.gamma
    if a.advantage == "gae":
        kwargs.update(values=values, lam=a.lam)
    if ref_logprobs is not None:
        token_kl = compute_token_kl(old_logprobs, ref_logprobs, mask, estimator=a.kl_estimator)
        metrics["kl/reference"] = float((token_kl * mask).sum() / mask.sum().clamp(min=1))
        if a.kl_mode == "reward":
            if "gamma" in kwargs:  # these estimators take the KL inside their returns
                kwargs.update(token_kl=token_kl.detach(), kl_coef=a.kl_coef)
            else:
                penalty = kl_reward_penalty(old_logprobs, ref_logprobs, mask, a.kl_coef, estimator=a.kl_estimator)
                rewards = rewards + (penalty * mask).sum(dim=-1)
    advantages, returns = ADVANTAGE_ESTIMATORS.get(a.advantage)(rewards, mask, **kwargs)
    counted = mask.sum().clamp(min=1)
    metrics["advantage/mean"] = float((advantages * mask).sum() / counted)
    metrics["advantage/abs_mean"] = float((advantages.abs() * mask).sum() / counted)
    return advantages, returns, metrics
