"""Masked statistics over ``[batch, seq]`` tensors, optionally reduced across data-parallel ranks.

Masked positions (``mask == 0``) never enter a result, whatever they hold (even inf or NaN).
With ``process_group`` the sums and counts are all-reduced over that group, so every rank
gets the statistic of the union of all ranks' tokens. The all-reduce carries no gradient
from other ranks: the result's gradient flows to this rank's own values only, which is the
gradient of the global statistic with respect to the local inputs.
"""

from __future__ import annotations

import math

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


def _all_reduce_max(value: torch.Tensor, process_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise maximum of a detached ``value`` over the group."""
    if process_group is None:
        return value
    highest = value.detach().clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=process_group)
    return highest


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


def safe_sqrt(values: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` for ``x >= 0``, with gradient 0 at ``x == 0``.

    sqrt's derivative is infinite at 0, and the chain rule turns it into NaN even where the
    result is not used (``0 * inf``); the std of equal values is a kink, and 0 is its symmetric
    subgradient.
    """
    positive = values > 0
    return torch.where(positive, torch.where(positive, values, 1).sqrt(), 0)


def masked_std(
    values: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    dim: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Square root of :func:`masked_var`; its gradient is 0 where the variance is 0 (see :func:`safe_sqrt`)."""
    return safe_sqrt(masked_var(values, mask, unbiased=unbiased, dim=dim, process_group=process_group))


def masked_min_max(
    values: torch.Tensor,
    mask: torch.Tensor,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest counted value over all elements (and all ranks of ``process_group``), detached.

    ``(inf, -inf)`` when nothing is counted. Unlike a floating-point std, ``max - min`` is exactly 0
    when all counted values are equal, so it tells "no spread" apart from "small spread".
    """
    counted = mask.bool().reshape(-1)
    flat = values.detach().reshape(-1)
    inf = torch.full((1,), math.inf, dtype=flat.dtype, device=flat.device)
    # the appended inf keeps the reductions defined for empty tensors
    lowest = torch.cat([torch.where(counted, flat, inf), inf]).min()
    highest = torch.cat([torch.where(counted, flat, -inf), -inf]).max()
    extremes = _all_reduce_max(torch.stack([-lowest, highest]), process_group)
    return -extremes[0], extremes[1]


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    unbiased: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Whitening over all counted positions: ``(x - mean) / (std + eps)``, or ``x / (std + eps)`` without the shift.

    When the counted values have no spread (all equal, ``max == min``; one counted value included),
    there is no scale to divide by: the result is exactly 0 with ``shift_mean``, and ``x`` unscaled
    without it. (A two-pass mean leaves rounding error in ``x - mean`` that ``std + eps`` would
    otherwise blow up to values of order 1 with an arbitrary sign.) Likewise nothing is divided by
    ``std + eps == 0``, which only ``eps=0`` and a variance that underflows can give.

    Masked positions of the result are 0. The statistics, the spread included, are global over
    ``process_group``.
    """
    values = zero_masked(values, mask)
    mean = masked_mean(values, mask, process_group=process_group)
    std = masked_std(values, mask, unbiased=unbiased, process_group=process_group)
    lowest, highest = masked_min_max(values, mask, process_group=process_group)
    has_spread = highest > lowest
    # 1 where there is nothing to divide by keeps values and gradients finite
    scale = torch.where(has_spread & (std + eps > 0), std + eps, 1)
    whitened = torch.where(has_spread, (values - mean) / scale, 0) if shift_mean else values / scale
    return zero_masked(whitened, mask)
