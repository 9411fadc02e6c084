"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html).

With ``log_ratio = log pi(y_t) - log pi_ref(y_t)`` for tokens sampled from pi:

* k1 = log_ratio                               (unbiased, high variance, can be negative)
* k2 = log_ratio^2 / 2                         (biased, low variance, >= 0)
* k3 = exp(-log_ratio) - 1 + log_ratio         (unbiased, low variance, >= 0)

k3 grows as ``exp(-log_ratio)``: at the default log-ratio clamp of 20 it reaches about 5e8 per
token, with a gradient of that size. So k3 is clamped at 10 per token by default (the bound of
verl's low-variance KL); k1 and k2 are left unclamped, bounded by the log-ratio clamp alone.

Use them as a per-token reward penalty (:func:`kl_reward_penalty`, PPO-style RLHF) or as a
loss term against the reference policy (:func:`compute_kl_loss`, GRPO-style). Masked
positions are 0.
"""

from __future__ import annotations

from typing import Literal

import torch

from raylign.algorithms.aggregation import LossScale, aggregate_loss
from raylign.algorithms.checks import check_like_mask, zero_masked
from raylign.algorithms.registry import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi / pi_ref)."""
    return log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """k2 = (log(pi / pi_ref))^2 / 2."""
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3", default_value_clamp=10.0)
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = pi_ref/pi - 1 - log(pi_ref/pi) = exp(-log_ratio) - 1 + log_ratio (unclamped here)."""
    return torch.expm1(-log_ratio) + log_ratio


ValueClamp = float | None | Literal["default"]


def _value_clamp(estimator: str, value_clamp: ValueClamp) -> float | None:
    """``"default"``: the clamp the estimator was registered with (10 for k3, none for k1 / k2)."""
    if value_clamp == "default":
        return KL_ESTIMATORS.metadata(estimator).get("default_value_clamp")
    return value_clamp


def compute_token_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k1",
    log_ratio_clamp: float | None = 20.0,
    value_clamp: ValueClamp = "default",
) -> torch.Tensor:
    """Per-token KL estimate ``[batch, seq]`` of pi (``logprobs``) against pi_ref (``ref_logprobs``).

    ``log_ratio_clamp`` bounds ``|log pi - log pi_ref|`` before the estimator (keeps k3's exp finite);
    ``value_clamp`` bounds ``|estimate|`` after it: ``"default"`` is 10 for k3 and no clamp for k1
    and k2, ``None`` is no clamp. Both stop the gradient where they bind.
    """
    check_like_mask("logprobs", logprobs, mask)
    check_like_mask("ref_logprobs", ref_logprobs, mask)
    value_clamp = _value_clamp(estimator, value_clamp)
    log_ratio = zero_masked(logprobs, mask) - zero_masked(ref_logprobs, mask)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    kl = KL_ESTIMATORS.get(estimator)(log_ratio)
    if value_clamp is not None:
        kl = kl.clamp(-value_clamp, value_clamp)
    return zero_masked(kl, mask)


def kl_reward_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
    log_ratio_clamp: float | None = 20.0,
    value_clamp: ValueClamp = "default",
) -> torch.Tensor:
    """Per-token reward term ``-kl_coef * KL_t`` (Ziegler et al. 2019, "Fine-Tuning Language Models
    from Human Preferences"; Ouyang et al. 2022, InstructGPT, eq. 2). Detached: rewards carry no gradient.
    Clamps as in :func:`compute_token_kl` (k3 at 10 per token by default).
    """
    kl = compute_token_kl(logprobs, ref_logprobs, mask, estimator, log_ratio_clamp, value_clamp)
    return (-kl_coef * kl).detach()


def compute_kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k3",
    aggregation: str = "token_mean",
    scale: LossScale | None = None,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: ValueClamp = "default",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference as a loss term, aggregated: ``agg_t KL_t`` (GRPO, Shao et al. 2024,
    "DeepSeekMath", eq. 4 uses k3). The caller multiplies by its coefficient. Clamps as in
    :func:`compute_token_kl`: k3 is clamped at 10 per token by default, where its gradient is 0.

    Returns ``(loss, {"kl": mean KL per token})``.
    """
    kl = compute_token_kl(logprobs, ref_logprobs, mask, estimator, log_ratio_clamp, value_clamp)
    loss = aggregate_loss(kl, mask, aggregation, scale)
    count = mask.bool().sum().clamp(min=1)
    return loss, {"kl": (kl.detach().sum() / count)}
