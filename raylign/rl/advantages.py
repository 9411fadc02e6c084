"""From rewards and log-probs of one step's samples to advantages, with the configured estimator."""

from __future__ import annotations

from typing import Any

import torch

from raylign.algorithms import (
    ADVANTAGE_ESTIMATORS,
    RunningRewardNormalizer,
    clip_rewards,
    compute_token_kl,
    dapo_overlong_penalty,
    kimi_length_penalty,
    kl_reward_penalty,
    linear_length_penalty,
)
from raylign.config.rl import RLConfig


class RewardShaping:
    """The outcome rewards a step trains on, from the reward sources' scores, in this order: running
    normalisation (its statistics span the whole run and are checkpointed), a length penalty, DAPO's
    overlong penalty, clipping. A group's samples are consecutive (``cfg.sampling.n`` each)."""

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.normalizer = RunningRewardNormalizer() if cfg.algorithm.normalize_rewards else None

    def __call__(self, rewards: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.cfg.algorithm
        metrics: dict[str, float] = {}
        correct = rewards >= a.correct_reward
        if self.normalizer is not None:
            rewards = self.normalizer(rewards.double()).to(rewards.dtype)
            metrics.update({"reward/running_mean": self.normalizer.mean, "reward/running_std": self.normalizer.std})
        penalty = self._length_penalty(lengths, correct)
        if penalty is not None:
            rewards = rewards + penalty.to(rewards.dtype)
            metrics["reward/length_penalty"] = float(penalty.mean())
        if a.overlong_buffer > 0:
            penalty = dapo_overlong_penalty(
                lengths,
                max_length=self.cfg.sampling.max_new_tokens,
                cache_length=a.overlong_buffer,
                penalty_factor=a.overlong_penalty,
            )
            rewards = rewards + penalty.to(rewards.dtype)
            metrics["reward/overlong_penalty"] = float(penalty.mean())
        if a.reward_clip is not None:
            rewards = clip_rewards(rewards, low=-a.reward_clip, high=a.reward_clip)
        return rewards, metrics

    def _length_penalty(self, lengths: torch.Tensor, correct: torch.Tensor) -> torch.Tensor | None:
        a = self.cfg.algorithm
        if a.length_penalty == "linear":
            return linear_length_penalty(lengths, coef=a.length_penalty_coef, free_length=a.length_penalty_free_tokens)
        if a.length_penalty == "kimi":
            return kimi_length_penalty(lengths, correct, group_size=self.cfg.sampling.n, coef=a.length_penalty_coef)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"normalizer": self.normalizer.state_dict() if self.normalizer is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])


def compute_advantages(
    cfg: RLConfig,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    behaviour_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    values: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(advantages, returns, metrics)``, all ``[batch, R]`` but the metrics.

    The estimator's registration metadata says which inputs it takes (groups, values, config
    options, a per-token KL). A KL-in-reward penalty goes into the per-token rewards of the
    estimators that take a token KL, and onto the rewards of the others: summed onto an outcome reward
    ``[batch]``, token by token onto per-token rewards ``[batch, R]`` (which those estimators sum).
    """
    a = cfg.algorithm
    takes = ADVANTAGE_ESTIMATORS.metadata(a.advantage)
    kwargs: dict = {name: getattr(a, name) for name in takes.get("options", ())}
    if takes.get("needs_groups"):
        kwargs["group_size"] = group_size
    if takes.get("needs_values"):
        kwargs["values"] = values
    metrics: dict[str, float] = {}
    if ref_logprobs is not None:
        token_kl = compute_token_kl(behaviour_logprobs, ref_logprobs, mask, estimator=a.kl_estimator)
        metrics["kl/reference"] = float((token_kl * mask).sum() / mask.sum().clamp(min=1))
        if a.kl_mode == "reward" and takes.get("takes_token_kl"):
            kwargs.update(token_kl=token_kl.detach(), kl_coef=a.kl_coef)
        elif a.kl_mode == "reward":
            penalty = kl_reward_penalty(behaviour_logprobs, ref_logprobs, mask, a.kl_coef, estimator=a.kl_estimator)
            penalty = penalty * mask  # per-token rewards [batch, R] (agent turns) take it token by token
            rewards = rewards + (penalty if rewards.dim() == 2 else penalty.sum(dim=-1))
    advantages, returns = ADVANTAGE_ESTIMATORS.get(a.advantage)(rewards, mask, **kwargs)
    counted = mask.sum().clamp(min=1)
    metrics["advantage/mean"] = float((advantages * mask).sum() / counted)
    metrics["advantage/abs_mean"] = float((advantages.abs() * mask).sum() / counted)
    return advantages, returns, metrics
