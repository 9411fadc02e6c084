"""Token-level distillation losses between student and teacher distributions.

Logits are ``[batch, seq, vocab]``, both divided by ``temperature`` before the softmax. The
per-token divergence (summed over the vocabulary) is averaged over tokens with ``mask == 1``
(or aggregated with a global :class:`~raylign.algorithms.aggregation.LossScale`).
The teacher is detached: gradients flow to the student only.
Each returns ``(loss, {"divergence": mean per-token divergence})``.
"""

from __future__ import annotations

import math

import torch

from raylign.algorithms.aggregation import LossScale, aggregate_token_mean
from raylign.algorithms.checks import check_token_mask
from raylign.algorithms.registry import DISTILLATION_LOSSES
from raylign.algorithms.stats import masked_mean


def _log_probs(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if student_logits.dim() != 3 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            "student_logits and teacher_logits must both be [batch, seq, vocab]; "
            f"got {tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    check_token_mask(mask)
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask must be {tuple(student_logits.shape[:-1])}, got {tuple(mask.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    keep = mask.bool().unsqueeze(-1)
    zero = torch.zeros((), dtype=student_logits.dtype, device=student_logits.device)
    # masked rows become uniform, so garbage there cannot reach values or gradients
    student = torch.log_softmax(torch.where(keep, student_logits, zero) / temperature, dim=-1)
    teacher = torch.log_softmax(torch.where(keep, teacher_logits.detach(), zero) / temperature, dim=-1)
    return student, teacher


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(p || q) = sum_v p_v (log p_v - log q_v)``, with ``0 log 0 = 0`` (e.g. -inf logits)."""
    p = p_log.exp()
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros((), dtype=p.dtype, device=p.device))
    return terms.sum(dim=-1)


def _finish(
    per_token: torch.Tensor, mask: torch.Tensor, scale: LossScale | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = aggregate_token_mean(per_token, mask, scale)
    return loss, {"divergence": masked_mean(per_token.detach(), mask)}


@DISTILLATION_LOSSES.register("forward_kl")
def forward_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward KL ``KL(p_T || p_S)`` per token (Hinton et al. 2015, "Distilling the Knowledge in a
    Neural Network"; word-level KD of Kim & Rush 2016): mode-covering."""
    student, teacher = _log_probs(student_logits, teacher_logits, mask, temperature)
    return _finish(_kl(teacher, student), mask, scale)


@DISTILLATION_LOSSES.register("reverse_kl")
def reverse_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reverse KL ``KL(p_S || p_T)`` per token (Gu et al. 2024, "MiniLLM: Knowledge Distillation of
    Large Language Models"): mode-seeking."""
    student, teacher = _log_probs(student_logits, teacher_logits, mask, temperature)
    return _finish(_kl(student, teacher), mask, scale)


@DISTILLATION_LOSSES.register("generalized_jsd")
def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Generalised Jensen-Shannon divergence (Agarwal et al. 2024, "On-Policy Distillation of Language
    Models: Learning from Self-Generated Mistakes" (GKD), eq. 1):

    ``M = beta * p_T + (1 - beta) * p_S``, ``JSD(beta) = beta KL(p_T || M) + (1 - beta) KL(p_S || M)``.
    At the end points it is taken as the KL the family interpolates between:
    ``beta = 0`` gives forward ``KL(p_T || p_S)``, ``beta = 1`` reverse ``KL(p_S || p_T)``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    student, teacher = _log_probs(student_logits, teacher_logits, mask, temperature)
    if beta == 0.0:
        per_token = _kl(teacher, student)
    elif beta == 1.0:
        per_token = _kl(student, teacher)
    else:
        mixture = torch.logsumexp(torch.stack([student + math.log(1 - beta), teacher + math.log(beta)]), dim=0)
        per_token = beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)
    return _finish(per_token, mask, scale)
