"""Advantage estimators. Each returns ``(advantages, returns)``, both ``[batch, seq]`` and 0 at masked positions.

Inputs shared by all estimators:

* ``rewards``: outcome rewards ``[batch]`` (placed on the last counted token of each response)
  or per-token rewards ``[batch, seq]``; group estimators sum per-token rewards per sequence.
* ``mask``: ``[batch, seq]``, 1 for response tokens that count. The recursions run over counted
  tokens only; masked tokens in between (prompt, padding, tool output) are skipped as if absent.
* group estimators take ``group_size`` or ``group_ids`` (see :mod:`raylign.algorithms.groups`).
  Groups of one sample and groups whose rewards are all equal get advantage 0.
* whitening estimators (GAE with ``whiten``, REINFORCE++, REINFORCE++-baseline) whiten over the
  whole batch with :func:`~raylign.algorithms.stats.masked_whiten`: when all counted values are
  equal (a batch of one sequence with an outcome reward, say) the advantage is exactly 0.
* ``token_kl`` / ``kl_coef`` (where accepted): the reward becomes ``r_t - kl_coef * token_kl_t``.

Registration metadata tells a caller what to pass: ``needs_groups`` (``group_size``/``group_ids``),
``needs_values`` (a critic's ``values``), ``options`` (algorithm-config fields passed on as the
keyword arguments of the same name, e.g. ``gamma``) and ``takes_token_kl`` (``token_kl``/``kl_coef``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raylign.algorithms.checks import check_like_mask, check_token_mask, zero_masked
from raylign.algorithms.groups import group_stats, resolve_group_ids
from raylign.algorithms.registry import ADVANTAGE_ESTIMATORS
from raylign.algorithms.stats import masked_whiten


def sequence_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` rewards: given outcome rewards as they are, per-token rewards summed over counted tokens
    (integer or boolean rewards as the default float dtype)."""
    check_token_mask(mask)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.dim() == 1 and rewards.shape[0] == mask.shape[0]:
        return rewards
    check_like_mask("rewards", rewards, mask)
    return zero_masked(rewards, mask).sum(dim=-1)


def last_token_positions(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last counted token in each row ``[batch]``; -1 for rows without one."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, -1).max(dim=-1).values


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` rewards: an outcome reward ``[batch]`` goes on the last counted token of its row
    (integer or boolean rewards as the default float dtype)."""
    check_token_mask(mask)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.dim() == 2:
        check_like_mask("rewards", rewards, mask)
        return zero_masked(rewards, mask)
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"rewards must be [batch] or [batch, seq] with batch={mask.shape[0]}, got {tuple(rewards.shape)}"
        )
    last = last_token_positions(mask)
    placed = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    placed[rows, last[rows]] = rewards[rows]
    return placed


def _shaped_token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, token_kl: torch.Tensor | None, kl_coef: float
) -> torch.Tensor:
    shaped = token_rewards(rewards, mask)
    if token_kl is not None:
        check_like_mask("token_kl", token_kl, mask)
        shaped = shaped - kl_coef * zero_masked(token_kl, mask)
    return shaped


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go over counted tokens: ``G_t = r_t + gamma * G_next``, ``next`` = the next counted token."""
    check_like_mask("rewards", rewards, mask)
    keep = mask.bool()
    rewards = zero_masked(rewards, mask)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(keep[:, t], running, 0.0)
    return returns


def _broadcast(sequence_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A ``[batch]`` value on every counted token of its row."""
    return zero_masked(sequence_values.unsqueeze(-1).expand(mask.shape), mask)


@ADVANTAGE_ESTIMATORS.register("gae", needs_values=True, options=("gamma", "lam"), takes_token_kl=True)
def compute_gae_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    whiten: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation"):

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, ``R_t = A_t + V_t``,
    with ``V = 0`` after the last counted token. Returns are unwhitened; advantages are whitened over
    the batch (all ranks of ``process_group``) when ``whiten``, and then 0 if they are all equal.
    """
    check_like_mask("values", values, mask)
    rewards = _shaped_token_rewards(rewards, mask, token_kl, kl_coef)
    values = zero_masked(values, mask)
    keep = mask.bool()
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_advantage = torch.where(keep[:, t], advantage, next_advantage)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(keep[:, t], advantage, 0.0)
    returns = zero_masked(advantages + values, mask)
    if whiten:
        advantages = masked_whiten(advantages, mask, process_group=process_group)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("reinforce", options=("gamma",), takes_token_kl=True)
def compute_reinforce_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE (Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist
    Reinforcement Learning"): ``A_t = G_t = sum_{k>=t} gamma^(k-t) r_k``, no baseline."""
    returns = discounted_returns(_shaped_token_rewards(rewards, mask, token_kl, kl_coef), mask, gamma)
    return returns.clone(), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus", options=("gamma",), takes_token_kl=True)
def compute_reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models"): token rewards ``r_t - kl_coef * KL_t`` (outcome on the last token), returns ``G_t``,
    then global-batch whitening ``A_t = (G_t - mean(G)) / (std(G) + eps)`` over all counted tokens
    of all ranks in ``process_group``; ``A = 0`` when all counted ``G_t`` are equal."""
    returns = discounted_returns(_shaped_token_rewards(rewards, mask, token_kl, kl_coef), mask, gamma)
    advantages = masked_whiten(returns, mask, eps=eps, process_group=process_group)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register(
    "reinforce_plus_plus_baseline", needs_groups=True, options=("gamma",), takes_token_kl=True
)
def compute_reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    gamma: float = 1.0,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    subtract_batch_mean: bool = True,
    eps: float = 1e-8,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, "REINFORCE++", section 3.2): ``r'_i = r_i - mean_group(r)``,
    token rewards ``r'_i`` on the last token minus ``kl_coef * KL_t``, returns ``G_t``, then global
    whitening ``(G - mean(G)) / (std(G) + eps)`` over all ranks of ``process_group``; ``A = 0`` when
    all counted ``G_t`` are equal.

    With ``subtract_batch_mean=False`` the global step only divides by the std, which keeps
    groups with equal rewards (and no KL term) at exactly 0 advantage; if all counted ``G_t`` are
    equal there is no std to divide by and ``A = G``.
    """
    outcome = sequence_rewards(rewards, mask)
    ids = resolve_group_ids(outcome.shape[0], group_size, group_ids, outcome.device)
    stats = group_stats(outcome, ids)
    centred = torch.where(stats.has_signal, outcome - stats.mean, torch.zeros_like(outcome))
    shaped = _shaped_token_rewards(centred, mask, token_kl, kl_coef)
    returns = discounted_returns(shaped, mask, gamma)
    advantages = masked_whiten(returns, mask, shift_mean=subtract_batch_mean, eps=eps, process_group=process_group)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("rloo", needs_groups=True)
def compute_rloo_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
    Ahmadian et al. 2024, "Back to Basics"): ``A_i = r_i - (sum_{j != i} r_j) / (n - 1)`` on every
    token of response i; 0 for groups of one. A sequence-level KL penalty, as in Ahmadian et al., is
    folded into ``rewards`` beforehand: ``r - kl_coef * sum_t KL_t``."""
    outcome = sequence_rewards(rewards, mask)
    stats = group_stats(outcome, resolve_group_ids(outcome.shape[0], group_size, group_ids, outcome.device))
    others_mean = (stats.total - outcome) / (stats.size - 1).clamp(min=1)
    advantage = torch.where(stats.has_signal, outcome - others_mean, torch.zeros_like(outcome))
    advantages = _broadcast(advantage, mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("grpo", needs_groups=True, options=("normalize_std",))
def compute_grpo_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (Shao et al. 2024, "DeepSeekMath", section 4.1.2):
    ``A_i = (r_i - mean_group(r)) / (std_group(r) + eps)`` (unbiased std) on every token of response i,
    or ``r_i - mean_group(r)`` when ``normalize_std`` is False. 0 for groups of one or of equal rewards."""
    outcome = sequence_rewards(rewards, mask)
    stats = group_stats(outcome, resolve_group_ids(outcome.shape[0], group_size, group_ids, outcome.device))
    advantage = outcome - stats.mean
    if normalize_std:
        # 1 where there is nothing to divide by (flat groups get 0 below) keeps the gradient finite
        advantage = advantage / torch.where(stats.has_signal & (stats.std + eps > 0), stats.std + eps, 1)
    advantage = torch.where(stats.has_signal, advantage, torch.zeros_like(advantage))
    advantages = _broadcast(advantage, mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("dr_grpo", needs_groups=True)
def compute_dr_grpo_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``A_i = r_i - mean_group(r)``,
    no std division. Pair it with the ``constant_normalizer`` loss aggregation (no length normalisation)."""
    return compute_grpo_advantages(rewards, mask, group_size=group_size, group_ids=group_ids, normalize_std=False)
