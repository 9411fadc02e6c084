"""Reward shaping on sequence rewards ``[batch]``: clipping, length penalties, running normalisation,
and DAPO's dynamic-sampling filter.

The penalty functions return the term to *add* to the rewards (``<= 0``), so several can be
combined explicitly: ``rewards + dapo_overlong_penalty(...) + linear_length_penalty(...)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raylign.algorithms.checks import check_sequence
from raylign.algorithms.groups import group_stats, resolve_group_ids
from raylign.algorithms.registry import REWARD_SHAPERS, SAMPLE_FILTERS
from raylign.algorithms.stats import masked_count, masked_mean, masked_min_max, masked_var


@REWARD_SHAPERS.register("clip")
def clip_rewards(rewards: torch.Tensor, *, low: float = -math.inf, high: float = math.inf) -> torch.Tensor:
    """``clip(r, low, high)`` (e.g. Mnih et al. 2015, DQN's reward clipping; OpenRLHF ``reward_clip_range``)."""
    if low > high:
        raise ValueError(f"clip_rewards needs low <= high, got low={low}, high={high}")
    return rewards.clamp(low, high)


@REWARD_SHAPERS.register("dapo_overlong")
def dapo_overlong_penalty(
    lengths: torch.Tensor, *, max_length: int, cache_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), to add to the reward:

    ``0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` inside the cache
    zone; ``-1`` beyond ``L_max``; all times ``penalty_factor``.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length} and {max_length}")
    lengths = lengths.to(torch.get_default_dtype()) if not lengths.is_floating_point() else lengths
    expected = max_length - cache_length
    penalty = ((expected - lengths) / cache_length).clamp(min=-1.0, max=0.0)
    return penalty * penalty_factor


@REWARD_SHAPERS.register("linear_length")
def linear_length_penalty(lengths: torch.Tensor, *, coef: float, free_length: int = 0) -> torch.Tensor:
    """Linear length penalty ``-coef * max(|y| - free_length, 0)``, to add to the reward (a token
    cost as in Singhal et al. 2023, "A Long Way to Go: Investigating Length Correlations in RLHF")."""
    lengths = lengths.to(torch.get_default_dtype()) if not lengths.is_floating_point() else lengths
    return -coef * (lengths - free_length).clamp(min=0)


@REWARD_SHAPERS.register("kimi_length", needs_groups=True)
def kimi_length_penalty(
    lengths: torch.Tensor,
    correct: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    coef: float = 1.0,
) -> torch.Tensor:
    """Group-relative length reward of Kimi k1.5 (Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement
    Learning with LLMs", section 2.3.3), to add to the reward:

    ``lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)`` within the group;
    ``coef * lambda_i`` for correct responses, ``coef * min(0, lambda_i)`` for incorrect ones; 0 when
    all lengths in the group are equal.
    """
    check_sequence("correct", correct, lengths.shape[0])
    lengths = lengths.to(torch.get_default_dtype()) if not lengths.is_floating_point() else lengths
    ids = resolve_group_ids(lengths.shape[0], group_size, group_ids, lengths.device)
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    zeros = lengths.new_zeros(num_groups)
    longest = zeros.scatter_reduce(0, ids, lengths, "amax", include_self=False)[ids]
    shortest = zeros.scatter_reduce(0, ids, lengths, "amin", include_self=False)[ids]
    spread = longest - shortest
    lam = torch.where(spread > 0, 0.5 - (lengths - shortest) / spread.clamp(min=1e-12), torch.zeros_like(lengths))
    return coef * torch.where(correct.bool(), lam, lam.clamp(max=0.0))


class RunningRewardNormalizer:
    """Running mean / variance of rewards (Chan et al. 1979 parallel update), used to normalise
    rewards as ``(r - mean) / (std + eps)`` (or ``r / (std + eps)`` without ``shift_mean``), as in
    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences".

    Until the rewards seen differ (all equal, or none seen yet) there is no scale to divide by:
    ``normalize`` returns ``r - mean`` (``r`` without ``shift_mean``), so rewards equal to those
    seen map to exactly 0 rather than to rounding error divided by ``eps``.

    ``update`` with a ``process_group`` merges the whole data-parallel batch, so all ranks keep
    the same statistics. Checkpoint it with ``state_dict`` / ``load_state_dict``.
    """

    def __init__(self, eps: float = 1e-8, shift_mean: bool = True) -> None:
        self.eps = eps
        self.shift_mean = shift_mean
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean
        self.lowest = math.inf  # smallest and largest reward seen, to tell equal rewards apart from close ones
        self.highest = -math.inf

    @property
    def std(self) -> float:
        """Population standard deviation of everything seen so far (0 before any update)."""
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 0.0

    def update(self, rewards: torch.Tensor, process_group: dist.ProcessGroup | None = None) -> None:
        """Merge a batch of rewards (any shape; all elements count) into the running statistics."""
        values = rewards.detach().to(torch.float64).reshape(-1)
        ones = torch.ones_like(values)
        batch_count = float(masked_count(ones, process_group=process_group, dtype=torch.float64))
        if batch_count == 0:
            return
        batch_mean = float(masked_mean(values, ones, process_group=process_group))
        batch_m2 = float(masked_var(values, ones, unbiased=False, process_group=process_group)) * batch_count
        batch_lowest, batch_highest = masked_min_max(values, ones, process_group=process_group)
        total = self.count + batch_count
        delta = batch_mean - self.mean
        self.mean += delta * batch_count / total
        self.m2 += batch_m2 + delta * delta * self.count * batch_count / total
        self.count = total
        self.lowest = min(self.lowest, float(batch_lowest))
        self.highest = max(self.highest, float(batch_highest))
        if self.highest == self.lowest:  # all equal: exact statistics, free of the update's rounding
            self.mean, self.m2 = self.highest, 0.0

    def normalize(self, rewards: torch.Tensor) -> torch.Tensor:
        """Normalise with the current statistics (without updating them)."""
        centred = rewards - self.mean if self.shift_mean else rewards
        if self.highest <= self.lowest:
            return centred
        return centred / (self.std + self.eps)

    def __call__(self, rewards: torch.Tensor, process_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Update with ``rewards``, then normalise them."""
        self.update(rewards, process_group)
        return self.normalize(rewards)

    def state_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": self.mean,
            "m2": self.m2,
            "lowest": self.lowest,
            "highest": self.highest,
            "eps": self.eps,
            "shift_mean": self.shift_mean,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            raise KeyError(f"RunningRewardNormalizer state is missing {sorted(missing)}")
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
        # a state saved without the range: take the rewards seen to have differed if any were seen
        seen = self.count > 0
        self.lowest = float(state.get("lowest", -math.inf if seen else math.inf))
        self.highest = float(state.get("highest", math.inf if seen else -math.inf))
        self.eps = float(state.get("eps", self.eps))
        self.shift_mean = bool(state.get("shift_mean", self.shift_mean))


@dataclass(frozen=True)
class GroupFilterResult:
    """What a group filter kept and dropped; ``*_groups`` hold the caller's group ids."""

    keep: torch.Tensor  # [batch] bool
    kept_indices: torch.Tensor
    dropped_indices: torch.Tensor
    kept_groups: torch.Tensor
    dropped_groups: torch.Tensor


@SAMPLE_FILTERS.register("nonzero_reward_variance", needs_groups=True)
def filter_zero_variance_groups(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> GroupFilterResult:
    """DAPO's dynamic-sampling predicate (Yu et al. 2025, "DAPO", eq. 11, ``0 < |correct| < G``): keep
    groups whose rewards are not all equal (their group advantages are non-zero); drop the others,
    groups of one included."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be sequence rewards [batch], got shape {tuple(rewards.shape)}")
    dense = resolve_group_ids(rewards.shape[0], group_size, group_ids, rewards.device)
    original_ids = dense if group_ids is None else group_ids.to(rewards.device)
    keep = group_stats(rewards, dense).has_signal
    return GroupFilterResult(
        keep=keep,
        kept_indices=torch.nonzero(keep).squeeze(-1),
        dropped_indices=torch.nonzero(~keep).squeeze(-1),
        kept_groups=torch.unique(original_ids[keep]),
        dropped_groups=torch.unique(original_ids[~keep]),
    )
