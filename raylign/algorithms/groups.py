"""Groups of samples drawn for the same prompt, and per-group statistics of sequence rewards.

A batch is grouped either by ``group_size`` (consecutive runs of ``group_size`` samples,
the layout of ``n`` samples per prompt) or by ``group_ids`` (``[batch]`` integers, equal for
samples of one prompt, in any order). Groups live within one batch on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylign.algorithms.stats import safe_sqrt


def resolve_group_ids(
    batch_size: int,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Dense group index ``[batch]`` (0..num_groups-1) from exactly one of ``group_size`` / ``group_ids``."""
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size (consecutive groups) or group_ids ([batch] ids)")
    if group_size is not None:
        if group_size < 1 or batch_size % group_size != 0:
            raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch size {batch_size}")
        return torch.arange(batch_size, device=device) // group_size
    assert group_ids is not None
    if group_ids.dim() != 1 or group_ids.shape[0] != batch_size:
        raise ValueError(f"group_ids must be [batch] = [{batch_size}], got shape {tuple(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise ValueError("group_ids must be integers (one id per prompt)")
    _, dense = torch.unique(group_ids, return_inverse=True)
    return dense.to(device) if device is not None else dense


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each sample's group, broadcast back to ``[batch]``."""

    mean: torch.Tensor
    std: torch.Tensor  # unbiased (n - 1); 0 for groups of one, with gradient 0 where it is 0
    size: torch.Tensor  # samples in the group
    total: torch.Tensor  # sum of the group's values
    spread: torch.Tensor  # max - min within the group; exactly 0 when all values are equal

    @property
    def has_signal(self) -> torch.Tensor:
        """True for samples whose group has at least two members with different values."""
        return (self.size > 1) & (self.spread > 0)


def group_stats(values: torch.Tensor, dense_ids: torch.Tensor) -> GroupStats:
    """Mean, unbiased std, size and sum of ``values [batch]`` within each group (see :func:`resolve_group_ids`)."""
    num_groups = int(dense_ids.max()) + 1 if dense_ids.numel() else 0
    zeros = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    totals = zeros.index_add(0, dense_ids, values)
    sizes = zeros.index_add(0, dense_ids, torch.ones_like(values))
    means = totals / sizes.clamp(min=1)
    centred = values - means[dense_ids]
    squares = zeros.index_add(0, dense_ids, centred.square())
    variances = torch.where(sizes > 1, squares / (sizes - 1).clamp(min=1), zeros)
    maxima = zeros.scatter_reduce(0, dense_ids, values, "amax", include_self=False)
    minima = zeros.scatter_reduce(0, dense_ids, values, "amin", include_self=False)
    return GroupStats(
        mean=means[dense_ids],
        std=safe_sqrt(variances)[dense_ids],
        size=sizes[dense_ids],
        total=totals[dense_ids],
        spread=(maxima - minima)[dense_ids],
    )
