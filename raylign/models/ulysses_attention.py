"""Ulysses attention: exact causal attention over a sequence split across the ranks of a process group,
by trading the sequence split for a head split (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509).

The second way :mod:`raylign.models.sequence_parallel` reaches the other ranks' chunks of a row
(``engine.sequence_parallel_mode: ulysses``), beside :mod:`raylign.models.ring_attention`. Each rank
attends over the whole row with 1/n of the heads, so the attention itself is the ring kernel on one
rank; the all-to-alls around it are differentiable collectives, so autograd brings the gradients back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raylign.models.ring_attention import ring_attention


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    token_index: torch.Tensor,
    sample_ids: torch.Tensor,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's chunk over the whole row, DeepSpeed-Ulysses style (Jacobs et al.
    2023, arXiv:2309.14509): an all-to-all trades the chunk of every head for the whole row of 1/n of
    the heads, each rank attends over the whole row with its heads, and a second all-to-all trades
    back. Arguments and result as :func:`ring_attention`'s (``[B, H, S, D]`` per rank, equal ``S`` on
    every rank, chunks in rank order). The query heads must divide by the group's size; key/value
    heads that do not are repeated to one per query head first. Two all-to-alls of the activations per
    call instead of ``n - 1`` hops of the keys and values, but each rank holds the whole row's scores
    for its heads."""
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return ring_attention(query, key, value, token_index, sample_ids, scale=scale)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size:
        raise ValueError(
            f"engine.sequence_parallel_mode ulysses: {heads} attention heads (per tensor-parallel rank) cannot be "
            f"split over the {size} ranks of a row; use sequence_parallel_mode ring"
        )
    if kv_heads % size:  # each rank needs the key/value heads of its query heads: one per query head then
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    whole_index, whole_samples = (
        torch.cat(_all_gathered(t.contiguous(), group, size), dim=1) for t in (token_index, sample_ids)
    )
    q, k, v = (_sequence_to_heads(t, group, size) for t in (query, key, value))
    out = ring_attention(q, k, v, whole_index, whole_samples, scale=scale)
    return _heads_to_sequence(out, group, size)


def _all_gathered(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return parts


def _sequence_to_heads(part: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """``[B, H, S, D]`` (this rank's chunk, every head) -> ``[B, H/n, n*S, D]`` (the whole row, this rank's
    n-th of the heads), by an all-to-all that autograd differentiates."""
    from torch.distributed.nn.functional import all_to_all_single

    batch, heads, length, dim = part.shape
    send = part.reshape(batch, size, heads // size, length, dim).transpose(0, 1).contiguous()  # [n, B, H/n, S, D]
    received = all_to_all_single(torch.empty_like(send), send, group=group)  # dim 0: the sender, its chunk
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, dim)


def _heads_to_sequence(whole: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`: ``[B, H/n, n*S, D]`` -> ``[B, H, S, D]``."""
    from torch.distributed.nn.functional import all_to_all_single

    batch, local_heads, total, dim = whole.shape
    length = total // size
    send = whole.reshape(batch, local_heads, size, length, dim).permute(2, 0, 1, 3, 4).contiguous()  # by chunk
    received = all_to_all_single(torch.empty_like(send), send, group=group)  # dim 0: the sender, its heads
    return received.transpose(0, 1).reshape(batch, size * local_heads, length, dim)
