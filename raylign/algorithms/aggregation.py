"""Turning per-token losses ``[batch, seq]`` into the scalar that one micro-batch backpropagates.

Convention (global batch = all micro-batches of one optimizer step on all data-parallel ranks):

* each rank calls ``backward`` on every micro-batch's loss, gradients are **summed** over
  micro-batches, and DDP / FSDP **average** them over the ``world_size`` ranks;
* so each micro-batch loss is ``(its share of the global numerator) / global_denominator * world_size``,
  and the gradient at the optimizer step equals the gradient of the one-big-batch loss.

``LossScale`` carries the global denominators. Build it once per optimizer step with
:func:`compute_loss_scale` from the masks of all the step's micro-batches (it all-reduces
over the process group). Without a ``LossScale`` the micro-batch is taken to be the whole
batch on a single rank. If your backend sums gradients over ranks instead of averaging,
pass ``world_size=1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raylign.algorithms.checks import check_like_mask, zero_masked
from raylign.algorithms.registry import LOSS_AGGREGATIONS


@dataclass(frozen=True)
class LossScale:
    """Global sizes of one optimizer step, summed over micro-batches and ranks.

    Attributes:
        global_tokens: counted tokens (``mask == 1``) in the whole step.
        global_sequences: sequences with at least one counted token in the whole step.
        world_size: ranks over which the backend averages gradients (1 if it sums them).
        max_response_length: the constant of Dr.GRPO's normaliser (the generation length limit).
    """

    global_tokens: float | None = None
    global_sequences: float | None = None
    world_size: int = 1
    max_response_length: int | None = None


def compute_loss_scale(
    micro_batch_masks: Sequence[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
    max_response_length: int | None = None,
) -> LossScale:
    """Count tokens and non-empty sequences over this rank's micro-batches, then sum over ranks.

    ``world_size`` is the size of ``process_group`` (1 without one). Every rank must call it; the
    counts travel on the masks' device (so put the masks on the GPU for an NCCL group).
    """
    tokens = sum(float(m.bool().sum()) for m in micro_batch_masks)
    sequences = sum(float(m.bool().any(dim=-1).sum()) for m in micro_batch_masks)
    world_size = 1
    if process_group is not None:
        device = micro_batch_masks[0].device if micro_batch_masks else None
        totals = torch.tensor([tokens, sequences], dtype=torch.float64, device=device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=process_group)
        tokens, sequences = float(totals[0]), float(totals[1])
        world_size = dist.get_world_size(process_group)
    return LossScale(tokens, sequences, world_size, max_response_length)


def _local_or(value: float | None, local: torch.Tensor) -> torch.Tensor:
    """The global denominator if given, else this batch's own (clamped to 1 so empty batches give 0, not NaN)."""
    if value is None:
        return local.clamp(min=1)
    return torch.as_tensor(max(float(value), 1.0), dtype=local.dtype, device=local.device)


@LOSS_AGGREGATIONS.register("token_mean")
def aggregate_token_mean(
    token_losses: torch.Tensor, mask: torch.Tensor, scale: LossScale | None = None
) -> torch.Tensor:
    """Token mean over the global batch: ``sum_{i,t} m_it l_it / N_tokens * W``.

    Every token weighs the same wherever it sits (DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", token-level policy gradient loss).
    """
    check_like_mask("token_losses", token_losses, mask)
    scale = scale or LossScale()
    total = zero_masked(token_losses, mask).sum()
    local_tokens = mask.bool().sum().to(token_losses.dtype)
    return total / _local_or(scale.global_tokens, local_tokens) * scale.world_size


def _sequence_counts(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = mask.bool().sum(dim=-1).to(dtype)
    non_empty = (lengths > 0).sum().to(dtype)
    return lengths, non_empty


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def aggregate_seq_mean_token_mean(
    token_losses: torch.Tensor, mask: torch.Tensor, scale: LossScale | None = None
) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean: ``sum_i (sum_t m_it l_it / |y_i|) / N_seq * W``.

    The original GRPO objective (Shao et al. 2024, "DeepSeekMath", eq. 3). Sequences without
    counted tokens contribute nothing and are not counted.
    """
    check_like_mask("token_losses", token_losses, mask)
    scale = scale or LossScale()
    lengths, non_empty = _sequence_counts(mask, token_losses.dtype)
    per_sequence = zero_masked(token_losses, mask).sum(dim=-1) / lengths.clamp(min=1)
    return per_sequence.sum() / _local_or(scale.global_sequences, non_empty) * scale.world_size


@LOSS_AGGREGATIONS.register("seq_mean_token_sum")
def aggregate_seq_mean_token_sum(
    token_losses: torch.Tensor, mask: torch.Tensor, scale: LossScale | None = None
) -> torch.Tensor:
    """Mean over sequences of each sequence's token sum: ``sum_{i,t} m_it l_it / N_seq * W``."""
    check_like_mask("token_losses", token_losses, mask)
    scale = scale or LossScale()
    _, non_empty = _sequence_counts(mask, token_losses.dtype)
    total = zero_masked(token_losses, mask).sum()
    return total / _local_or(scale.global_sequences, non_empty) * scale.world_size


@LOSS_AGGREGATIONS.register("constant_normalizer")
def aggregate_constant_normalizer(
    token_losses: torch.Tensor, mask: torch.Tensor, scale: LossScale | None = None
) -> torch.Tensor:
    """Dr.GRPO's length-unbiased sum: ``sum_{i,t} m_it l_it / (N_seq * L_max) * W``.

    The normaliser is a constant (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", section 3.1), so long and short responses are not reweighted by their length.
    Requires ``scale.max_response_length``.
    """
    check_like_mask("token_losses", token_losses, mask)
    if scale is None or scale.max_response_length is None:
        raise ValueError("constant_normalizer needs LossScale(max_response_length=...) (the generation length limit)")
    _, non_empty = _sequence_counts(mask, token_losses.dtype)
    total = zero_masked(token_losses, mask).sum()
    sequences = _local_or(scale.global_sequences, non_empty)
    return total / (sequences * scale.max_response_length) * scale.world_size


def aggregate_loss(
    token_losses: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    scale: LossScale | None = None,
) -> torch.Tensor:
    """Aggregate with the registered aggregation named ``mode`` (see ``LOSS_AGGREGATIONS.names()``)."""
    return LOSS_AGGREGATIONS.get(mode)(token_losses, mask, scale)
