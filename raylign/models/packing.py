"""Attention inputs for padded and packed batches.

Two batch layouts reach the models:

- **padded**: one sample per row, ``attention_mask`` marks real tokens (left or right padding);
- **packed**: several samples concatenated in a row, ``position_ids`` restarting at 0 at each
  sample start, no ``attention_mask`` (rows may still carry right padding).

Transformers 5 keeps packed samples apart only when it can see them: its mask builder
(``transformers.masking_utils._preprocess_mask_arguments``) derives a per-sample block mask from
``position_ids`` (a new sample wherever the position does not grow by one), and only when the
2D ``attention_mask`` is None *and* no KV cache is passed. A model in eval mode creates a
``DynamicCache`` by itself unless ``use_cache=False``, which silently switches the detection off
and lets tokens attend across samples. Hence every forward here passes ``use_cache=False`` and
drops a right-padding-only mask from packed rows (the causal mask already keeps trailing pads
from influencing real tokens).
"""

from __future__ import annotations

from typing import Any

import torch


def positions_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token counted over real tokens only (left padding starts real tokens at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def has_packed_samples(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> bool:
    """True when some row's positions restart between two real tokens: the row holds several samples.

    Padding is ignored, so left-padded rows with positions counted from the first real token
    (0, 0, 0, 1, 2) are not mistaken for packed ones.
    """
    if position_ids.shape[-1] < 2:
        return False
    restarts = position_ids[..., 1:] != position_ids[..., :-1] + 1
    if attention_mask is not None:
        real = attention_mask.bool()
        restarts = restarts & real[:, 1:] & real[:, :-1]
    return bool(restarts.any())


def _is_right_padded(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per row: True when the mask is ones followed by zeros only."""
    mask = attention_mask.long()
    return (mask[:, 1:] <= mask[:, :-1]).all(dim=-1)


def attention_kwargs(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> dict[str, Any]:
    """Keyword arguments for a Hugging Face decoder forward that keep samples apart.

    Always includes ``use_cache=False`` (see the module docstring for why).
    """
    kwargs: dict[str, Any] = {"use_cache": False}
    if position_ids is None:
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
            kwargs["position_ids"] = positions_from_attention_mask(attention_mask)
        return kwargs
    kwargs["position_ids"] = position_ids
    if attention_mask is None:
        return kwargs
    if not has_packed_samples(position_ids, attention_mask):
        kwargs["attention_mask"] = attention_mask
        return kwargs
    right_padded = _is_right_padded(attention_mask)
    if not bool(right_padded.all()):
        bad_row = int((~right_padded).nonzero()[0, 0])
        raise ValueError(
            f"packed batch (position_ids restart within a row) has padding that is not at the end of "
            f"row {bad_row}; packed rows may only be padded on the right"
        )
    return kwargs


def has_predecessor_mask(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[B, T]``: True where token t is real and follows a real token of the same sample.

    False at t = 0, at padding, at the first real token after left padding and at every packed
    sample start; these are the positions that have no next-token prediction.
    """
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    mask[:, 0] = False
    if attention_mask is not None:
        real = attention_mask.bool()
        mask &= real
        mask[:, 1:] &= real[:, :-1]
    if position_ids is not None:
        positions = position_ids.expand_as(input_ids)
        mask[:, 1:] &= positions[:, 1:] == positions[:, :-1] + 1
    return mask
