"""Masked statistics over ``[batch, seq]`` tensors, optionally reduced across data-parallel ranks.

Masked positions (``mask == 0``) never enter a result, whatever they hold (even inf or NaN).
With ``process_group`` the sums and counts are all-reduced over that group, so every rank
gets the statistic of the union of all ranks' tokens. The all-reduce carries no gradient
from other ranks: the result's gradient flows to this rank's own values only, which is the
gradient of the global statistic with respect to the local inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raylign.algorithms.checks import zero_masked


def _all_reduce_sum(value: torch.Tensor, process_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``value`` over the group; keeps the local autograd path (global = local + detached others)."""
    if process_group is None:
        return value
    total = value.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group)
    return value + (total - value.detach())


def _check_reduction(dim: int | None, process_group: dist.ProcessGroup | None) -> None:
    if dim is not None and process_group is not None:
        raise ValueError("process_group reductions are over all tokens; use dim=None with a process_group")


def masked_sum(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1: ``sum_i m_i x_i`` (over ``dim`` or all elements)."""
    _check_reduction(dim, process_group)
    kept = zero_masked(values, mask)
    total = kept.sum() if dim is None else kept.sum(dim=dim)
    return _all_reduce_sum(total, process_group)


def masked_count(
    mask: torch.Tensor,
    dim: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Number of counted positions ``sum_i m_i`` (over ``dim`` or all elements)."""
    _check_reduction(dim, process_group)
    counted = mask.bool().to(dtype)
    total = counted.sum() if dim is None else counted.sum(dim=dim)
    return _all_reduce_sum(total, process_group)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Mean over counted positions: ``sum_i m_i x_i / max(sum_i m_i, 1)``; 0 where nothing is counted."""
    total = masked_sum(values, mask, dim=dim, process_group=process_group)
    count = masked_count(mask, dim=dim, process_group=process_group, dtype=values.dtype)
    return total / count.clamp(min=1)


def masked_var(
    values: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    dim: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Variance over counted positions, two-pass: ``sum_i m_i (x_i - mean)^2 / (n - 1)`` (``/ n`` if not unbiased).

    Returns 0 when fewer than two positions (one, if ``unbiased=False``) are counted, never NaN.
    """
    values = zero_masked(values, mask)  # garbage at masked positions must not reach the square's gradient
    mean = masked_mean(values, mask, dim=dim, process_group=process_group)
    centred = values - (mean if dim is None else mean.unsqueeze(dim))
    square_sum = masked_sum(centred.square(), mask, dim=dim, process_group=process_group)
    count = masked_count(mask, dim=dim, process_group=process_group, dtype=values.dtype)
    denominator = count - 1 if unbiased else count
    variance = square_sum / denominator.clamp(min=1)
    return torch.where(denominator > 0, variance, torch.zeros_like(variance))


def masked_std(
    values: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    dim: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Square root of :func:`masked_var`."""
    return masked_var(values, mask, unbiased=unbiased, dim=dim, process_group=process_group).sqrt()


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    unbiased: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Whitening over all counted positions: ``(x - mean) / (std + eps)``, or ``x / (std + eps)`` without the shift.

    Masked positions of the result are 0. The statistics are global over ``process_group``.
    """
    values = zero_masked(values, mask)
    mean = masked_mean(values, mask, process_group=process_group)
    std = masked_std(values, mask, unbiased=unbiased, process_group=process_group)
    centred = values - mean if shift_mean else values
    return zero_masked(centred / (std + eps), mask)
