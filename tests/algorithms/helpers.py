"""Shared test helpers."""

from __future__ import annotations

import torch

GARBAGE = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30]


def fill_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with NaN / inf / huge numbers cycled into the positions where ``mask == 0``.

    Built with ``where``, so gradients still reach ``values`` at counted positions.
    """
    keep = mask.bool().reshape(mask.shape + (1,) * (values.dim() - mask.dim())).expand_as(values)
    cycle = torch.tensor(GARBAGE, dtype=values.dtype)
    garbage = cycle[torch.arange(values.numel()) % len(GARBAGE)].view(values.shape)
    return torch.where(keep, values, garbage)
