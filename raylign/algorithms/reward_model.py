"""Reward-model losses: pairwise outcome rewards and process (per-step) rewards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raylign.algorithms.aggregation import LossScale, aggregate_token_mean
from raylign.algorithms.checks import check_same_shape, check_token_mask, zero_masked
from raylign.algorithms.registry import REWARD_MODEL_LOSSES
from raylign.algorithms.stats import masked_mean


def _pair_margin(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | float | None
) -> torch.Tensor:
    check_same_shape(("chosen_rewards", "rejected_rewards"), (chosen_rewards, rejected_rewards))
    if chosen_rewards.dim() != 1:
        raise ValueError(f"chosen_rewards must be [batch], got shape {tuple(chosen_rewards.shape)}")
    difference = chosen_rewards - rejected_rewards
    if margin is not None:
        margin_t = torch.as_tensor(margin, dtype=difference.dtype, device=difference.device)
        if margin_t.dim() not in (0, 1) or (margin_t.dim() == 1 and margin_t.shape != difference.shape):
            raise ValueError(f"margin must be a scalar or [batch], got shape {tuple(margin_t.shape)}")
        difference = difference - margin_t
    return difference


def _pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    chosen, rejected = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "accuracy": (chosen > rejected).to(chosen.dtype).mean(),
        "reward_margin": (chosen - rejected).mean(),
        "rewards_chosen": chosen.mean(),
        "rewards_rejected": rejected.mean(),
    }


@REWARD_MODEL_LOSSES.register("bradley_terry")
def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | float | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pairwise Bradley-Terry loss (Bradley & Terry 1952; Ouyang et al. 2022, InstructGPT, eq. 1):

    ``L = -log sigma(r_w - r_l - m)`` with an optional margin ``m`` (Touvron et al. 2023, Llama 2,
    eq. 2), plus ``center_coef * mean((r_w + r_l)^2)`` to keep rewards centred (Eisenstein et al.
    2023, "Helping or Herding?").
    """
    losses = -F.logsigmoid(_pair_margin(chosen_rewards, rejected_rewards, margin))
    loss = losses.mean()
    if center_coef:
        loss = loss + center_coef * (chosen_rewards + rejected_rewards).square().mean()
    return loss, _pair_metrics(chosen_rewards, rejected_rewards)


@REWARD_MODEL_LOSSES.register("log_exp")
def log_exp_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-exp pairwise loss ``L = log(1 + exp(r_l - r_w + m))`` (the form used by Stiennon et al.
    2020-style RLHF code bases; equal to Bradley-Terry), computed as a softplus for stability."""
    losses = F.softplus(-_pair_margin(chosen_rewards, rejected_rewards, margin))
    return losses.mean(), _pair_metrics(chosen_rewards, rejected_rewards)


def step_separator_mask(
    input_ids: torch.Tensor, separator_token_id: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Positions ``[batch, seq]`` holding the step-separator token (optionally within ``mask``)."""
    check_token_mask(input_ids, "input_ids")
    steps = input_ids == separator_token_id
    return steps & mask.bool() if mask is not None else steps


def _soft_targets(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Target distribution ``[batch, seq, classes]`` from hard or soft labels."""
    num_classes = logits.shape[-1]
    if not labels.is_floating_point():
        if labels.shape != logits.shape[:-1]:
            expected = tuple(logits.shape[:-1])
            raise ValueError(f"hard labels must be [batch, seq] = {expected}, got {tuple(labels.shape)}")
        return F.one_hot(labels.clamp(0, num_classes - 1), num_classes).to(logits.dtype)
    if labels.shape == logits.shape:
        return labels.to(logits.dtype)
    if labels.shape == logits.shape[:-1] and num_classes == 2:
        positive = labels.to(logits.dtype)
        return torch.stack([1 - positive, positive], dim=-1)
    raise ValueError(
        "soft labels must be [batch, seq, classes] or, for 2 classes, [batch, seq] (probability of class 1); "
        f"got {tuple(labels.shape)} for logits {tuple(logits.shape)}"
    )


@REWARD_MODEL_LOSSES.register("process_reward")
def process_reward_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    step_mask: torch.Tensor,
    *,
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Process-reward loss: cross-entropy at step-separator positions (Lightman et al. 2023, "Let's Verify
    Step by Step"; soft labels as in Wang et al. 2024, "Math-Shepherd").

    ``logits`` ``[batch, seq, classes]`` (e.g. the LM logits of the label tokens at each position);
    ``labels``: hard class indices (long ``[batch, seq]``) or soft targets (float ``[batch, seq]`` =
    probability of class 1 for two classes, or ``[batch, seq, classes]``). Only positions with
    ``step_mask == 1`` count; ``L = -mean_steps sum_c q_c log softmax(z)_c``.
    Metrics: ``step_accuracy`` (argmax of logits equals argmax of the target).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, seq, classes], got shape {tuple(logits.shape)}")
    check_token_mask(step_mask, "step_mask")
    if step_mask.shape != logits.shape[:-1]:
        raise ValueError(f"step_mask must be {tuple(logits.shape[:-1])}, got {tuple(step_mask.shape)}")
    keep = step_mask.bool().unsqueeze(-1)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    safe_logits = torch.where(keep, logits, zero)
    targets = torch.where(keep, _soft_targets(logits, labels), zero)
    token_losses = -(targets * torch.log_softmax(safe_logits, dim=-1)).sum(dim=-1)
    loss = aggregate_token_mean(zero_masked(token_losses, step_mask), step_mask, scale)
    correct = (safe_logits.detach().argmax(dim=-1) == targets.argmax(dim=-1)).to(logits.dtype)
    return loss, {"step_accuracy": masked_mean(correct, step_mask)}
