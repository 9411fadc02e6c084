"""Preference-optimisation losses on sequence log-probs ``[batch]``.

Inputs are the summed log-probs of each response under the policy (with gradient) and the
reference (detached). Length-normalised losses (IPO, SimPO, ORPO) take per-token average
log-probs, or sums plus ``chosen_lengths`` / ``rejected_lengths`` from which they average.
Each returns ``(loss, metrics)``: the batch mean of the per-pair losses, and detached metrics
(implicit rewards, their accuracy and margin).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from raylign.algorithms.checks import check_same_shape, check_sequence
from raylign.algorithms.registry import PREFERENCE_LOSSES


def _check_pairs(**tensors: torch.Tensor | None) -> None:
    given = {name: t for name, t in tensors.items() if t is not None}
    first = next(iter(given.values()))
    if first.dim() != 1:
        raise ValueError(f"{next(iter(given))} must be [batch], got shape {tuple(first.shape)}")
    check_same_shape(tuple(given), tuple(given.values()))


def _average(logps: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Sum -> per-token average when ``lengths`` is given; already-averaged values otherwise."""
    return logps if lengths is None else logps / lengths.to(logps.dtype).clamp(min=1)


def _reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    chosen, rejected = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards_chosen": chosen.mean(),
        "rewards_rejected": rejected.mean(),
        "reward_accuracy": (chosen > rejected).to(chosen.dtype).mean(),
        "reward_margin": (chosen - rejected).mean(),
    }


def _smoothed_logistic(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1 - eps) log sigma(z) - eps log sigma(-z)``: logistic loss with labels flipped with probability eps."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


@PREFERENCE_LOSSES.register("dpo", uses_reference=True)
def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO, sigmoid loss (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7):

    ``h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))``,
    ``L = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``; ``eps = label_smoothing`` gives
    conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences & relationship to IPO").
    """
    _check_pairs(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()
    losses = _smoothed_logistic(beta * (chosen_logratios - rejected_logratios), label_smoothing)
    return losses.mean(), _reward_metrics(beta * chosen_logratios, beta * rejected_logratios)


@PREFERENCE_LOSSES.register("cdpo", uses_reference=True)
def conservative_dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Conservative DPO (Mitchell 2023): DPO with labels assumed flipped with probability
    ``label_smoothing``: ``L = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``."""
    return dpo_loss(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta=beta,
        label_smoothing=label_smoothing,
    )


@PREFERENCE_LOSSES.register("ipo", uses_reference=True)
def ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", eq. 17): ``L = (h - 1 / (2 beta))^2`` with ``beta`` the paper's tau.

    The IPO authors use per-token average log-ratios for ``h``: pass lengths to average sums.
    """
    _check_pairs(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    chosen_logratios = _average(policy_chosen_logps - ref_chosen_logps.detach(), chosen_lengths)
    rejected_logratios = _average(policy_rejected_logps - ref_rejected_logps.detach(), rejected_lengths)
    losses = (chosen_logratios - rejected_logratios - 1 / (2 * beta)).square()
    return losses.mean(), _reward_metrics(beta * chosen_logratios, beta * rejected_logratios)


@PREFERENCE_LOSSES.register("dpo_nll", uses_reference=True)
def dpo_nll_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    chosen_lengths: torch.Tensor,
    beta: float = 0.1,
    nll_coef: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO plus NLL on the chosen response (Pang et al. 2024, "Iterative Reasoning Preference
    Optimization", eq. 1): ``L = L_DPO + alpha * mean_i(-log pi(y_w,i) / |y_w,i|)``."""
    check_sequence("chosen_lengths", chosen_lengths, policy_chosen_logps.shape[0])
    loss, metrics = dpo_loss(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta
    )
    nll = -_average(policy_chosen_logps, chosen_lengths).mean()
    return loss + nll_coef * nll, {**metrics, "nll": nll.detach()}


@PREFERENCE_LOSSES.register("simpo", uses_reference=False)
def simpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6):

    ``L = -log sigma(beta * avg log pi(y_w) - beta * avg log pi(y_l) - gamma)`` with target margin
    ``gamma``; ``label_smoothing`` as in conservative DPO. Takes averages, or sums plus lengths.
    """
    _check_pairs(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps)
    chosen = _average(policy_chosen_logps, chosen_lengths)
    rejected = _average(policy_rejected_logps, rejected_lengths)
    losses = _smoothed_logistic(beta * (chosen - rejected) - gamma, label_smoothing)
    return losses.mean(), _reward_metrics(beta * chosen, beta * rejected)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@PREFERENCE_LOSSES.register("orpo", uses_reference=False)
def orpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    *,
    lam: float = 0.1,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eqs. 6-7):

    ``odds(y) = p / (1 - p)`` with ``p = exp(avg log pi(y))``,
    ``L = NLL(y_w) - lam * log sigma(log odds(y_w) - log odds(y_l))``.

    NLL: with lengths, the token mean over all chosen tokens of the batch (the paper's SFT loss);
    without, the mean of the per-response averages.
    """
    _check_pairs(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps)
    chosen = _average(policy_chosen_logps, chosen_lengths)
    rejected = _average(policy_rejected_logps, rejected_lengths)
    # p = 1 would make the odds infinite; keep log p strictly below 0
    chosen_c, rejected_c = chosen.clamp(max=-1e-7), rejected.clamp(max=-1e-7)
    log_odds = (chosen_c - rejected_c) - (log1mexp(chosen_c) - log1mexp(rejected_c))
    odds_term = F.logsigmoid(log_odds)
    if chosen_lengths is None:
        nll = -chosen.mean()
    else:
        nll = -policy_chosen_logps.sum() / chosen_lengths.to(chosen.dtype).sum().clamp(min=1)
    loss = nll - lam * odds_term.mean()
    metrics = {
        **_reward_metrics(lam * chosen, lam * rejected),
        "nll": nll.detach(),
        "log_odds_ratio": log_odds.detach().mean(),
    }
    return loss, metrics


def _global_mean(values: torch.Tensor, process_group: dist.ProcessGroup | None) -> torch.Tensor:
    totals = torch.stack([values.sum(), values.new_tensor(float(values.numel()))])
    if process_group is not None:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=process_group)
    return totals[0] / totals[1].clamp(min=1)


@PREFERENCE_LOSSES.register("kto", uses_reference=True, unpaired=True)
def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    *,
    policy_kl_logps: torch.Tensor | None = None,
    ref_kl_logps: torch.Tensor | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8):

    ``r = log pi(y|x) - log pi_ref(y|x)``, ``z0 = max(0, mean_j(log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)))``
    estimated on mismatched pairs (``*_kl_logps``), detached and averaged over all ranks of
    ``process_group``; ``L = lambda_D (1 - sigma(beta (r - z0)))`` for desirable examples,
    ``lambda_U (1 - sigma(beta (z0 - r)))`` for undesirable ones, averaged over the batch.
    Without ``*_kl_logps``, ``z0 = 0``.
    """
    check_sequence("ref_logps", ref_logps, policy_logps.shape[0])
    check_sequence("desirable", desirable, policy_logps.shape[0])
    if (policy_kl_logps is None) != (ref_kl_logps is None):
        raise ValueError("give both policy_kl_logps and ref_kl_logps, or neither")
    if policy_kl_logps is not None and ref_kl_logps is not None:
        check_same_shape(("policy_kl_logps", "ref_kl_logps"), (policy_kl_logps, ref_kl_logps))
        kl = _global_mean((policy_kl_logps - ref_kl_logps).detach(), process_group).clamp(min=0)
    else:
        kl = policy_logps.new_zeros(())
    logratios = policy_logps - ref_logps.detach()
    is_desirable = desirable.bool()
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    losses = torch.where(is_desirable, desirable_losses, undesirable_losses)
    rewards = (beta * logratios).detach()
    zero = rewards.new_zeros(())
    metrics = {
        "kl": kl.detach(),
        "rewards_chosen": rewards[is_desirable].mean() if is_desirable.any() else zero,
        "rewards_rejected": rewards[~is_desirable].mean() if (~is_desirable).any() else zero,
    }
    return losses.mean(), metrics
