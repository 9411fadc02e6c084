"""A reference on two fsdp2 ranks (placement.shard_reference): each rank holds half of the frozen
model, and together they compute the log-probs a plain fp32 forward of the whole model computes.
(A GRPO run through a sharded reference: tests/rl/test_rl_early_reference.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from raylign.rl.experience import micro_batches_for_ranks, pack_samples
from raylign.rl.group import WorkerGroup

from .rl_helpers import fp32_model, make_sample, resolve, response_logprobs, rl_config_data

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
MAX_TOKENS = 24  # two to three micro-batches per rank
# fp32 on both sides; the shards are gathered exactly, so only packing changes the summation order.
LOGPROB_ATOL = 1e-5


def _config(model_dir, prompt_file, tmp_path, shard: bool) -> dict:
    data = rl_config_data(model_dir, prompt_file, tmp_path / "out")
    data["engine"] = {"backend": "fsdp2", "dist_timeout_s": 120}
    data["placement"] = {"reference_workers": 2, "shard_reference": shard}
    data["algorithm"] = {"kl_mode": "loss", "kl_coef": 0.1}
    cfg = resolve(tmp_path, data)
    assert cfg.shards_reference is shard
    return cfg.model_dump(mode="json")


def _rank_rows(rows: int) -> list[int]:
    """Rows of a dim-0 shard per rank of two, as torch.chunk splits them."""
    first = min(rows, -(-rows // 2))
    return [first, rows - first]


def test_a_sharded_reference_computes_the_whole_models_log_probs_holding_half_of_it(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    rng = random.Random(0)
    lengths = [(3, 9), (5, 7), (2, 8), (4, 6), (6, 2), (3, 3), (5, 4), (2, 1)]
    samples = [
        make_sample([rng.randrange(10, 500) for _ in range(p)], [rng.randrange(10, 500) for _ in range(r)])
        for p, r in lengths
    ]
    plan = micro_batches_for_ranks(samples, 2, MAX_TOKENS)
    group = WorkerGroup("reference", _config(rl_model_dir, prompt_file, tmp_path, True), 2, 1, None, env=ENV)
    try:
        per_rank = [[pack_samples([samples[i] for i in micro]) for micro in rank_plan] for rank_plan in plan]
        results = group.call_sharded("compute_logprobs", per_rank)
        held = [info["weight_bytes"] for info in group.call("placement_info")]
        rendezvous = [info["rendezvous"] for info in group.call("placement_info")]
    finally:
        group.kill()

    model = fp32_model(rl_model_dir)
    with torch.no_grad():
        for rank_plan, rank_results in zip(plan, results):
            for micro, values in zip(rank_plan, rank_results):
                for row, i in enumerate(micro):
                    expected = response_logprobs(model, samples[i].prompt_ids, samples[i].response_ids)
                    got = values[row, : len(expected)]
                    torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)
    # Each rank holds its rows of every weight (fp32, as stored), never the whole model.
    expected_bytes = [0, 0]
    for param in model.parameters():
        per_row = param[0].numel() * param.element_size() if param.dim() else param.element_size()
        for rank, rows in enumerate(_rank_rows(param.shape[0] if param.dim() else 1)):
            expected_bytes[rank] += rows * per_row
    assert held == expected_bytes
    assert rendezvous[0] is not None and rendezvous[0] == rendezvous[1]  # one process group


def test_without_sharding_each_reference_worker_holds_a_whole_replica(ray_session, rl_model_dir, prompt_file, tmp_path):
    group = WorkerGroup("reference", _config(rl_model_dir, prompt_file, tmp_path, False), 2, 1, None, env=ENV)
    try:
        infos = group.call("placement_info")
    finally:
        group.kill()
    whole = sum(p.numel() * p.element_size() for p in fp32_model(rl_model_dir).parameters())
    assert [info["weight_bytes"] for info in infos] == [whole, whole]
    assert [info["rendezvous"] for info in infos] == [None, None]
