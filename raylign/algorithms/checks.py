"""Shape checks shared by the algorithm functions, with errors that name the argument."""

from __future__ import annotations

import torch


def check_token_mask(mask: torch.Tensor, name: str = "mask") -> None:
    """A mask must be ``[batch, seq]``."""
    if mask.dim() != 2:
        raise ValueError(f"{name} must be [batch, seq], got shape {tuple(mask.shape)}")


def check_like_mask(name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
    """A per-token tensor must have the mask's ``[batch, seq]`` shape."""
    check_token_mask(mask)
    if values.shape != mask.shape:
        raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(values.shape)}")


def check_sequence(name: str, values: torch.Tensor, batch_size: int) -> None:
    """A sequence-level tensor must be ``[batch]``."""
    if values.dim() != 1 or values.shape[0] != batch_size:
        raise ValueError(f"{name} must be [batch] = [{batch_size}], got shape {tuple(values.shape)}")


def check_same_shape(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """All tensors must share the first one's shape."""
    first = tensors[0].shape
    for name, tensor in zip(names[1:], tensors[1:], strict=True):
        if tensor.shape != first:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but {names[0]} has {tuple(first)}")


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` with masked positions set to 0 (``where``, so inf/NaN there cannot leak through ``* 0``)."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
