"""Critic (value-function) losses."""

from __future__ import annotations

import torch

from raylign.algorithms.aggregation import LossScale, aggregate_loss
from raylign.algorithms.checks import check_like_mask, zero_masked
from raylign.algorithms.registry import VALUE_LOSSES
from raylign.algorithms.stats import masked_mean


@VALUE_LOSSES.register("ppo_clipped")
def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
    aggregation: str = "token_mean",
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss with value clipping (Schulman et al. 2017, PPO; the clipped form of the OpenAI
    baselines implementation, studied in Engstrom et al. 2020, "Implementation Matters in Deep RL"):

    ``l_t = 0.5 * max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -eps, eps) - R_t)^2)``;
    ``clip_eps=None`` gives the plain ``0.5 * (V_t - R_t)^2``.

    Metrics: ``value_clip_fraction`` (tokens where the clipped term is larger), ``value_mse``.
    """
    for name, tensor in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_like_mask(name, tensor, mask)
    values = zero_masked(values, mask)
    old_values = zero_masked(old_values, mask).detach()
    returns = zero_masked(returns, mask).detach()
    unclipped = (values - returns).square()
    if clip_eps is None:
        token_losses = 0.5 * unclipped
        clip_active = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (clipped_values - returns).square()
        token_losses = 0.5 * torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = aggregate_loss(token_losses, mask, aggregation, scale)
    dtype = unclipped.dtype
    metrics = {
        "value_clip_fraction": masked_mean(clip_active.to(dtype).detach(), mask),
        "value_mse": masked_mean(unclipped.detach(), mask),
    }
    return loss, metrics
