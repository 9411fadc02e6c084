"""Code run inside the spawned gloo ranks of ``test_distributed.py`` (kept light to import)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

WORLD_SIZE = 2
MICRO_BATCHES_PER_RANK = 2
SEQ, FEATURES, VOCAB = 5, 4, 7
MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer")


def micro_batch(index: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``index`` of the global batch: different sizes and ragged masks, float64."""
    generator = torch.Generator().manual_seed(100 + index)
    rows = 2 + index % 3
    lengths = torch.randint(0, SEQ + 1, (rows,), generator=generator)
    lengths[0] = max(int(lengths[0]), 1)
    mask = (torch.arange(SEQ).expand(rows, SEQ) < lengths.unsqueeze(-1)).to(torch.int64)
    return {
        "features": torch.randn(rows, SEQ, FEATURES, generator=generator, dtype=torch.float64),
        "actions": torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
        "old_logprobs": -torch.rand(rows, SEQ, generator=generator, dtype=torch.float64) - 1.5,
        "advantages": torch.randn(rows, SEQ, generator=generator, dtype=torch.float64),
        "mask": mask,
    }


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, VOCAB).double()


def token_logprobs(policy: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = policy(batch["features"])
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["actions"].unsqueeze(-1)).squeeze(-1)


def run_rank(rank: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from raylign.algorithms import (
        RunningRewardNormalizer,
        compute_loss_scale,
        compute_ppo_policy_loss,
        kto_loss,
        masked_whiten,
    )

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    # The group is never destroyed: the rank ends through exit_process (see spawned_ranks.as_gloo_rank).
    group = dist.group.WORLD
    mine = [micro_batch(rank * MICRO_BATCHES_PER_RANK + k) for k in range(MICRO_BATCHES_PER_RANK)]
    results: dict[str, object] = {}
    for mode in MODES:
        policy = make_policy()
        ddp = torch.nn.parallel.DistributedDataParallel(policy)
        scale = compute_loss_scale([b["mask"] for b in mine], process_group=group, max_response_length=SEQ)
        for k, batch in enumerate(mine):
            # gradients are summed locally over micro-batches and averaged by DDP on the last one
            sync = contextlib.nullcontext() if k == len(mine) - 1 else ddp.no_sync()
            with sync:
                logprobs = token_logprobs(ddp, batch)
                loss, _ = compute_ppo_policy_loss(
                    logprobs,
                    batch["old_logprobs"],
                    batch["advantages"],
                    batch["mask"],
                    aggregation=mode,
                    scale=scale,
                )
                loss.backward()
        results[mode] = [p.grad.clone() for p in policy.parameters()]
    results["scale"] = scale
    local_advantages = torch.cat([b["advantages"] for b in mine])
    local_mask = torch.cat([b["mask"] for b in mine])
    results["whitened"] = masked_whiten(local_advantages, local_mask, process_group=group)
    rewards = torch.cat([b["advantages"][:, 0] for b in mine])  # any per-sample numbers will do
    normalizer = RunningRewardNormalizer()
    normalizer.update(rewards, process_group=group)
    results["normalizer"] = normalizer.state_dict()
    _, kto_metrics = kto_loss(
        rewards,
        rewards * 0.5,
        rewards > 0,
        policy_kl_logps=rewards,
        ref_kl_logps=rewards - 0.1 * rank - 0.05,
        process_group=group,
    )
    results["kto_kl"] = kto_metrics["kl"]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
