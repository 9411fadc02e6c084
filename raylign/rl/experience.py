"""Experience: the completions of one RL step and everything computed for them.

Per-token quantities are response-aligned ``[batch, max_response_len]`` tensors with a
``mask``; the algorithm library works on exactly these. For the model forward passes the
samples of a micro-batch are packed into one padding-free row, and ``resp_index`` maps each
response token to its position in that row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raylign.data import balance_micro_batches


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    group: int  # index of the prompt within the step; samples of a group are consecutive
    prompt_text: str
    response_text: str
    label: Any
    source: str
    finish_reason: str
    reward: float = 0.0
    reward_metrics: dict[str, float] = field(default_factory=dict)


def response_tensor(rows: list[list[float]], width: int | None = None) -> torch.Tensor:
    """Right-padded ``[batch, width]`` float tensor of ragged rows."""
    width = width if width is not None else max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), max(width, 1), dtype=torch.float32)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out


def response_mask(samples: list[Sample], width: int | None = None) -> torch.Tensor:
    return response_tensor([[1.0] * len(s.response_ids) for s in samples], width)


def pack_samples(samples: list[Sample], per_token: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One packed micro-batch: ``input_ids``/``position_ids`` ``[1, T]``, ``resp_index`` and ``mask``
    ``[b, R]``, plus the given response-aligned tensors cut to width ``R``."""
    ids: list[int] = []
    positions: list[int] = []
    width = max(len(s.response_ids) for s in samples)
    resp_index = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        start = len(ids) + len(s.prompt_ids)
        seq = s.prompt_ids + s.response_ids
        ids.extend(seq)
        positions.extend(range(len(seq)))
        resp_index[i, : len(s.response_ids)] = torch.arange(start, start + len(s.response_ids))
    batch = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "resp_index": resp_index,
        "mask": response_mask(samples, width),
    }
    for name, tensor in (per_token or {}).items():
        batch[name] = tensor[:, :width].contiguous()
    return batch


def gather_responses(packed: torch.Tensor, resp_index: torch.Tensor, mask: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """Pick response positions out of a packed ``[1, T]`` tensor: ``[b, R]``, 0 where masked.
    ``shift=-1`` reads the position before each token (a critic's value of the state)."""
    index = (resp_index + shift).clamp(min=0)
    return packed[0, index] * mask.to(packed.dtype)


def micro_batches_for_ranks(
    samples: list[Sample], world_size: int, max_tokens: int
) -> list[list[list[int]]]:
    """Split sample positions into ``world_size`` contiguous shards, then each shard into token-balanced
    micro-batches; every rank gets the same number of micro-batches (collectives need it)."""
    n = len(samples)
    base, extra = divmod(n, world_size)
    shards, start = [], 0
    for rank in range(world_size):
        size = base + (rank < extra)
        shards.append(list(range(start, start + size)))
        start += size
    lengths = [[len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in shard] for shard in shards]
    plans = [balance_micro_batches(lens, max_tokens) for lens in lengths]
    count = max(len(p) for p in plans)
    plans = [balance_micro_batches(lens, max_tokens, min_micro_batches=count) for lens in lengths]
    return [[[shard[j] for j in micro] for micro in plan] for shard, plan in zip(shards, plans)]
