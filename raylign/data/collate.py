"""Batching samples into tensors: right-padded, one sample per row, or packed several to a row.

Packed batches carry no attention mask: position ids restart at 0 for every sample, and
Transformers (5.x) turns such position ids into a block-diagonal causal mask so attention
never crosses samples. It does so only when the forward pass has no attention mask and no
KV cache, so the model must be called with ``use_cache=False`` (a model in its default
``use_cache=True`` creates an empty cache and then silently attends across samples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch


class TokenSample(Protocol):
    input_ids: list[int]
    loss_mask: list[int]


def _check_lengths(samples: Sequence[TokenSample]) -> None:
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    for i, sample in enumerate(samples):
        if len(sample.input_ids) != len(sample.loss_mask):
            raise ValueError(f"sample {i}: {len(sample.input_ids)} input ids but {len(sample.loss_mask)} mask entries")
        if not sample.input_ids:
            raise ValueError(f"sample {i} has no tokens")


def collate_padded(
    samples: Sequence[TokenSample], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``loss_mask``, ``position_ids``, each ``[B, T]``, right padded.

    ``T`` is the longest sample, rounded up to a multiple of ``pad_to_multiple_of`` when given.
    Padding has attention and loss mask 0.
    """
    _check_lengths(samples)
    length = max(len(s.input_ids) for s in samples)
    if pad_to_multiple_of:
        length = math.ceil(length / pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), length), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask)
    position_ids = torch.arange(length).expand(len(samples), length).clone()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
    }


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, each row holding at most ``row_tokens`` tokens.

    ``row_tokens`` below the longest sample is raised to it. Rows are returned in order of their
    first sample, samples within a row in their original order.
    """
    capacity = max([row_tokens, *lengths])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return sorted((sorted(r) for r in rows), key=lambda r: r[0])


def collate_packed(samples: Sequence[TokenSample], pad_token_id: int, row_tokens: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids``, ``loss_mask``, ``position_ids`` as ``[rows, L]``; ``seq_starts`` and ``seq_lens`` ``[B]``.

    Samples are placed first-fit decreasing into rows of at most ``row_tokens`` tokens (0, or
    anything below the longest sample: rows as long as the longest sample; see :func:`pack_rows`)
    and rows are right-padded with ``pad_token_id`` to the longest row ``L``. Position ids restart
    at 0 for each sample and for the padding at a row's end; padding has loss mask 0. Sample ``i``
    occupies positions ``seq_starts[i] .. seq_starts[i] + seq_lens[i] - 1`` of the flattened
    ``[rows * L]`` batch. Attention cost grows with the square of a row's length, hence short rows.

    Call the model with ``position_ids`` and ``use_cache=False`` and without ``attention_mask``
    (see the module docstring). Since every sample's first token has loss mask 0, shifting targets
    along a row never trains one sample's first token on the previous sample's last.
    """
    _check_lengths(samples)
    lengths = [len(s.input_ids) for s in samples]
    layout = pack_rows(lengths, row_tokens)
    row_length = max(sum(lengths[i] for i in row) for row in layout)
    input_ids = torch.full((len(layout), row_length), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(layout), row_length), dtype=torch.long)
    position_ids = torch.zeros((len(layout), row_length), dtype=torch.long)
    seq_starts = torch.zeros(len(samples), dtype=torch.long)
    for r, row in enumerate(layout):
        offset = 0
        for i in row:
            end = offset + lengths[i]
            input_ids[r, offset:end] = torch.tensor(samples[i].input_ids)
            loss_mask[r, offset:end] = torch.tensor(samples[i].loss_mask)
            position_ids[r, offset:end] = torch.arange(lengths[i])
            seq_starts[i] = r * row_length + offset
            offset = end
        position_ids[r, offset:] = torch.arange(row_length - offset)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "seq_starts": seq_starts,
        "seq_lens": torch.tensor(lengths, dtype=torch.long),
    }


def _fill_bins(lengths: Sequence[int], num_bins: int, max_tokens: int) -> list[list[int]] | None:
    """Longest first, each sample into the least-loaded bin (balanced); where that would overflow, into
    the first bin it fits (first-fit decreasing: 3,3,2,2,2 in two bins of 6 go 3+3 and 2+2+2, which
    balancing alone misses). None if the samples do not fit in ``num_bins`` non-empty bins that way."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    for spread in (True, False):
        bins: list[list[int]] = [[] for _ in range(num_bins)]
        loads = [0] * num_bins
        for index in order:
            fits = [b for b in range(num_bins) if loads[b] + lengths[index] <= max_tokens]
            if not fits:
                break
            target = min(fits, key=lambda b: (loads[b], b)) if spread else fits[0]
            bins[target].append(index)
            loads[target] += lengths[index]
        else:
            if all(bins):  # every micro-batch runs a forward pass: none may be empty
                return bins
    return None


def balance_micro_batches(lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Group sample indices into few micro-batches of at most ``max_tokens`` tokens, balanced by tokens.

    Uses at least ``min_micro_batches`` groups (data-parallel ranks must run the same number
    of forward passes: pass the maximum over ranks). Groups are filled longest sample first
    into the least-loaded group, or where that overflows into the first group with room
    (:func:`_fill_bins`); each group's indices are sorted, and groups are ordered by their
    first index. A sample longer than ``max_tokens`` is an error.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sample {i} has no tokens")
        if length > max_tokens:
            raise ValueError(f"sample {i} has {length} tokens, over the micro-batch budget of {max_tokens} tokens")
    if min_micro_batches > len(lengths):
        raise ValueError(f"cannot make {min_micro_batches} non-empty micro-batches from {len(lengths)} samples")
    num_bins = max(min_micro_batches, math.ceil(sum(lengths) / max_tokens), 1 if lengths else 0)
    while num_bins <= len(lengths):
        bins = _fill_bins(lengths, num_bins, max_tokens)
        if bins is not None:
            return sorted((sorted(b) for b in bins), key=lambda b: b[0])
        num_bins += 1
    return []
