"""Corrections for the mismatch between the rollout engine's and the trainer's log-probs.

The rollout engine (vLLM, other kernels, other precision) samples from ``pi_rollout``; the
trainer's recomputed ``old_logprobs`` describe ``pi_old``. The importance ratio
``rho_t = pi_old(y_t) / pi_rollout(y_t)`` corrects the policy gradient for that gap:

* ``truncated_is``: multiply per-token losses by ``min(rho, C)`` (pass as ``token_weights``).
* ``ratio_mask``: drop tokens (or whole sequences) whose ratio leaves ``[low, high]``
  (use the result as the loss ``mask``).

``level``: ``token`` uses ``rho_t``; ``sequence`` the product ``prod_t rho_t``; ``geometric`` the
geometric mean ``exp(mean_t log rho_t)``; sequence values apply to every token of the sequence.
Both return detached tensors and metrics (``mismatch_kl``: k3 estimate of KL(rollout || old)).
"""

from __future__ import annotations

import torch

from raylign.algorithms.checks import check_like_mask, zero_masked
from raylign.algorithms.registry import OFF_POLICY_CORRECTIONS
from raylign.algorithms.stats import masked_mean

LEVELS = ("token", "sequence", "geometric")


def importance_log_ratio(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """``log rho`` at the chosen level, ``[batch, seq]``, 0 at masked positions, detached."""
    check_like_mask("old_logprobs", old_logprobs, mask)
    check_like_mask("rollout_logprobs", rollout_logprobs, mask)
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    token = (zero_masked(old_logprobs, mask) - zero_masked(rollout_logprobs, mask)).detach()
    if level == "token":
        log_ratio = token
    else:
        total = token.sum(dim=-1, keepdim=True)
        if level == "geometric":
            total = total / mask.bool().sum(dim=-1, keepdim=True).clamp(min=1).to(total.dtype)
        log_ratio = total.expand(mask.shape)
    return zero_masked(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp), mask)


def importance_ratio_sums(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``[N, sum rho, sum rho^2]`` of the token ratios over ``mask``'s ``N`` counted tokens, detached.

    The sums behind Kish's effective sample size fraction ``(sum rho)^2 / (N sum rho^2)``: those of
    micro-batches and ranks add up to those of all their tokens, where their fractions do not average
    to it (each micro-batch of equal ratios has fraction 1, whatever the spread between them).
    """
    rho = zero_masked(importance_log_ratio(old_logprobs, rollout_logprobs, mask).exp(), mask)
    return torch.stack([mask.sum().to(rho.dtype), rho.sum(), (rho**2).sum()])


def _mismatch_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    token = importance_log_ratio(old_logprobs, rollout_logprobs, mask)
    # samples come from the rollout policy: k3 of KL(rollout || old) with ratio old / rollout
    kl = masked_mean(torch.expm1(token) - token, mask)
    # Kish's effective sample size of the token ratios, as a fraction of the tokens counted:
    # 1 when every ratio is equal, 1/N when one token carries all weight.
    count, rho_sum, rho_sq_sum = importance_ratio_sums(old_logprobs, rollout_logprobs, mask)
    ess = rho_sum**2 / (count.clamp(min=1) * rho_sq_sum.clamp(min=1e-30))
    return {"mismatch_kl": kl, "is_ess_fraction": ess}


@OFF_POLICY_CORRECTIONS.register("truncated_is")
def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling (Ionides 2008, "Truncated Importance Sampling"; applied to the
    rollout/trainer gap by Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): ``w = min(rho, C)``. Returns ``(weights [batch, seq], metrics)``."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    ratio = importance_log_ratio(old_logprobs, rollout_logprobs, mask, level).exp()
    weights = zero_masked(ratio.clamp(max=cap), mask)
    metrics = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_capped_fraction": masked_mean((ratio > cap).to(ratio.dtype), mask),
        **_mismatch_metrics(old_logprobs, rollout_logprobs, mask),
    }
    return weights, metrics


@OFF_POLICY_CORRECTIONS.register("ratio_mask")
def mask_by_importance_ratio(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling (Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
    from the Training-Inference Mismatch"): keep a token only if ``low <= rho <= high``.

    Returns ``(new_mask, metrics)``; ``new_mask`` has ``mask``'s dtype and is 0 wherever ``mask`` is.
    """
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    ratio = importance_log_ratio(old_logprobs, rollout_logprobs, mask, level).exp()
    keep = mask.bool() & (ratio >= low) & (ratio <= high)
    metrics = {
        "is_masked_fraction": masked_mean((~keep).to(ratio.dtype), mask),
        **_mismatch_metrics(old_logprobs, rollout_logprobs, mask),
    }
    return keep.to(mask.dtype), metrics
