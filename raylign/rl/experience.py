"""Experience: the completions of one RL step and everything computed for them.

Per-token quantities are response-aligned ``[batch, max_response_len]`` tensors with a
``mask``; the algorithm library works on exactly these. For the model forward passes the
samples of a micro-batch are packed into rows (several samples per row, position ids restarting
at each sample), and ``resp_index`` maps each response token to its position in the flattened
``[rows * row_length]`` batch.

Why several short rows rather than one long one: with ``sdpa`` or ``eager`` attention the cost
of a row grows with the square of its length, and a packed row attends over a block-diagonal
mask it still has to evaluate in full. Rows about as long as the longest sample cost close to a
padded batch while wasting almost no tokens on padding.
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
    weight_version: int = 0  # weight updates the engine had received when it generated this sample


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


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
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


def pack_samples(
    samples: list[Sample], per_token: dict[str, torch.Tensor] | None = None, row_tokens: int = 0
) -> dict[str, torch.Tensor]:
    """One packed micro-batch.

    ``input_ids``/``position_ids`` are ``[rows, L]``: samples placed first-fit into rows of
    ``row_tokens`` tokens (0, or anything below the longest sample: rows as long as the longest
    sample), right-padded with token 0 at positions restarting from 0. ``resp_index`` and
    ``mask`` are ``[b, R]``: ``resp_index`` holds each response token's position in the
    flattened ``[rows * L]`` batch. The given response-aligned tensors are cut to width ``R``.
    """
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    layout = pack_rows(lengths, row_tokens)
    row_length = max(sum(lengths[i] for i in row) for row in layout)
    width = max(len(s.response_ids) for s in samples)
    input_ids = torch.zeros(len(layout), row_length, dtype=torch.long)
    position_ids = torch.zeros(len(layout), row_length, dtype=torch.long)
    resp_index = torch.zeros(len(samples), width, dtype=torch.long)
    for r, row in enumerate(layout):
        offset = 0
        for i in row:
            s = samples[i]
            input_ids[r, offset: offset + lengths[i]] = torch.tensor(s.prompt_ids + s.response_ids)
            position_ids[r, offset: offset + lengths[i]] = torch.arange(lengths[i])
            start = r * row_length + offset + len(s.prompt_ids)
            resp_index[i, : len(s.response_ids)] = torch.arange(start, start + len(s.response_ids))
            offset += lengths[i]
        position_ids[r, offset:] = torch.arange(row_length - offset)
    batch = {"input_ids": input_ids, "position_ids": position_ids, "resp_index": resp_index,
             "mask": response_mask(samples, width)}
    for name, tensor in (per_token or {}).items():
        batch[name] = tensor[:, :width].contiguous()
    return batch


def gather_responses(packed: torch.Tensor, resp_index: torch.Tensor, mask: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """Pick response positions out of a packed ``[rows, L]`` tensor: ``[b, R]``, 0 where masked.
    ``shift=-1`` reads the position before each token (a critic's value of the state; a response
    always follows at least one prompt token of its own row)."""
    index = (resp_index + shift).clamp(min=0)
    return packed.reshape(-1)[index] * mask.to(packed.dtype)


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


def reward_metrics(samples: list[Sample]) -> dict[str, float]:
    """Reward mean and std, response lengths, the truncated fraction and each reward source's mean."""
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
    metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(samples) > 1 else 0.0,
               "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
               "response/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples)}
    for key in samples[0].reward_metrics:
        metrics[f"reward/{key}"] = sum(s.reward_metrics[key] for s in samples) / len(samples)
    return metrics


def mismatch_metrics(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's on the same tokens."""
    diff = (rollout_lp - trainer_lp) * mask
    counted = mask.sum().clamp(min=1)
    return {"mismatch/logprob_abs_diff": float(diff.abs().sum() / counted),
            "mismatch/logprob_max_abs_diff": float(diff.abs().max()),
            "mismatch/kl_k3": float(((torch.exp(-diff) - 1 + diff) * mask).sum() / counted)}


def split_by_reward_variance(samples: list[Sample], n: int) -> tuple[list[Sample], list[Sample]]:
    """Groups of ``n`` samples whose rewards differ (kept), and those whose rewards are all equal."""
    from raylign.algorithms import filter_zero_variance_groups

    result = filter_zero_variance_groups(torch.tensor([s.reward for s in samples]), group_size=n)
    keep = set(result.kept_groups.tolist())
    kept, dropped = [], []
    for g in range(len(samples) // n):
        group = samples[g * n:(g + 1) * n]
        (kept if g in keep else dropped).extend(group)
    return kept, dropped
