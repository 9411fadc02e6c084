"""Policy-gradient losses (PPO family, GSPO) and the entropy bonus.

Inputs: ``logprobs`` of the policy being trained (with gradient), ``old_logprobs`` of the
behaviour policy (detached), ``advantages`` ``[batch, seq]`` (or ``[batch]``, broadcast over
tokens) and ``mask``. ``token_weights`` (e.g. truncated importance weights from
:mod:`raylign.algorithms.off_policy`) multiply the per-token loss. The per-token loss is
aggregated by the named aggregation (:mod:`raylign.algorithms.aggregation`).
Each returns ``(loss, metrics)``; metrics are detached means over counted tokens.
"""

from __future__ import annotations

import torch

from raylign.algorithms.aggregation import LossScale, aggregate_loss
from raylign.algorithms.checks import check_like_mask, zero_masked
from raylign.algorithms.registry import POLICY_LOSSES
from raylign.algorithms.stats import masked_mean


def _token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        advantages = advantages.unsqueeze(-1).expand(mask.shape)
    check_like_mask("advantages", advantages, mask)
    return zero_masked(advantages, mask).detach()  # advantages are constants of the surrogate


def _apply_token_weights(
    token_losses: torch.Tensor, token_weights: torch.Tensor | None, mask: torch.Tensor
) -> torch.Tensor:
    if token_weights is None:
        return token_losses
    check_like_mask("token_weights", token_weights, mask)
    return token_losses * zero_masked(token_weights, mask).detach()


def _ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """approx_kl = mean((r - 1) - log r) (k3 of KL(old || new)); approx_kl_k1 = mean(-log r)."""
    log_ratio, ratio = log_ratio.detach(), ratio.detach()
    counted = mask.bool()
    return {
        "approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
        "approx_kl_k1": masked_mean(-log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        # ratios are positive, so 0 at masked positions never wins the max (and is the empty-batch value)
        "ratio_max": torch.where(counted, ratio, torch.zeros_like(ratio)).max(),
    }


@POLICY_LOSSES.register("ppo")
def compute_ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    token_weights: torch.Tensor | None = None,
    aggregation: str = "token_mean",
    scale: LossScale | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7):

    ``r_t = exp(logp - logp_old)``, ``l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))``.

    * asymmetric clip / clip-higher: ``clip_eps_high`` != ``clip_eps_low`` (DAPO, Yu et al. 2025);
      ``None`` means symmetric.
    * dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
      Learning"): for ``A_t < 0``, ``l_t = min(l_t, -c A_t)`` with ``c = dual_clip_c > 1``.

    Metrics: ``clip_fraction`` (tokens whose clipped term is active), ``clip_fraction_low`` /
    ``_high``, ``dual_clip_fraction``, ``approx_kl`` / ``approx_kl_k1`` (old vs new), ratio stats.
    """
    for name, tensor in (("logprobs", logprobs), ("old_logprobs", old_logprobs)):
        check_like_mask(name, tensor, mask)
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    adv = _token_advantages(advantages, mask)
    log_ratio = (zero_masked(logprobs, mask) - zero_masked(old_logprobs, mask).detach()).clamp(
        -log_ratio_clamp, log_ratio_clamp
    )
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + eps_high)
    token_losses = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip_c is not None:
        floor = -adv * dual_clip_c
        dual_active = (adv < 0) & (token_losses > floor)
        token_losses = torch.where(adv < 0, torch.minimum(token_losses, floor), token_losses)
    token_losses = _apply_token_weights(token_losses, token_weights, mask)
    loss = aggregate_loss(token_losses, mask, aggregation, scale)

    ratio_d = ratio.detach()
    metrics = {
        "clip_fraction": masked_mean((clipped > unclipped).to(ratio_d.dtype).detach(), mask),
        "clip_fraction_low": masked_mean(((ratio_d < 1 - clip_eps_low) & (adv < 0)).to(ratio_d.dtype), mask),
        "clip_fraction_high": masked_mean(((ratio_d > 1 + eps_high) & (adv > 0)).to(ratio_d.dtype), mask),
        "dual_clip_fraction": masked_mean(dual_active.to(ratio_d.dtype), mask),
        **_ratio_metrics(log_ratio, ratio, mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def compute_gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    token_weights: torch.Tensor | None = None,
    aggregation: str = "seq_mean_token_mean",
    scale: LossScale | None = None,
    log_ratio_clamp: float = 10.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), sequence-level ratio:

    ``s_i = exp((1/|y_i|) sum_t (logp_it - logp_old_it))`` (geometric mean of the token ratios),
    ``l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))``.

    Computed in the GSPO-token form ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: equal to ``s_i`` in
    value and, with the default ``seq_mean_token_mean`` aggregation and sequence-level advantages,
    in gradient; it also accepts per-token advantages.
    """
    for name, tensor in (("logprobs", logprobs), ("old_logprobs", old_logprobs)):
        check_like_mask(name, tensor, mask)
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    adv = _token_advantages(advantages, mask)
    logprobs = zero_masked(logprobs, mask)
    token_log_ratio = logprobs - zero_masked(old_logprobs, mask).detach()
    lengths = mask.bool().sum(dim=-1).clamp(min=1).to(logprobs.dtype)
    sequence_log_ratio = token_log_ratio.sum(dim=-1) / lengths
    log_ratio = logprobs - logprobs.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    log_ratio = log_ratio.clamp(max=log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + eps_high)
    token_losses = _apply_token_weights(torch.maximum(unclipped, clipped), token_weights, mask)
    loss = aggregate_loss(token_losses, mask, aggregation, scale)
    ratio_d = ratio.detach()
    metrics = {
        "clip_fraction": masked_mean((clipped > unclipped).to(ratio_d.dtype).detach(), mask),
        **_ratio_metrics(log_ratio, ratio, mask),
    }
    return loss, metrics


def compute_entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    aggregation: str = "token_mean",
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus as a loss term: ``-coef * agg_t H_t`` (Mnih et al. 2016, "Asynchronous Methods for
    Deep Reinforcement Learning"; PPO eq. 9). Returns ``(loss, {"entropy": mean entropy})``."""
    check_like_mask("entropy", entropy, mask)
    loss = -coef * aggregate_loss(entropy, mask, aggregation, scale)
    return loss, {"entropy": masked_mean(entropy.detach(), mask)}
