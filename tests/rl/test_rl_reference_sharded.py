"""A reference on two fsdp2 ranks (placement.shard_reference): each rank holds half of the frozen
model, and together they compute the log-probs a plain fp32 forward of the whole model computes; so
does a reference the two policy ranks host (placement.reference_with_policy), sharded over them or
whole on each. (A GRPO run through a sharded reference: tests/rl/test_rl_early_reference.py; runs whose
policy hosts the reference: tests/rl/test_rl_presets_end_to_end.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from raylign.models.tiny import build_tiny_model
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


def _samples() -> list:
    rng = random.Random(0)
    lengths = [(3, 9), (5, 7), (2, 8), (4, 6), (6, 2), (3, 3), (5, 4), (2, 1)]
    return [
        make_sample([rng.randrange(10, 500) for _ in range(p)], [rng.randrange(10, 500) for _ in range(r)])
        for p, r in lengths
    ]


def _assert_whole_model_logprobs(model_dir, samples, plan, results) -> None:
    """Each sample's log-probs, from whichever rank and micro-batch computed it, are a plain fp32 forward's."""
    model = fp32_model(model_dir)
    with torch.no_grad():
        for rank_plan, rank_results in zip(plan, results):
            for micro, values in zip(rank_plan, rank_results):
                for row, i in enumerate(micro):
                    expected = response_logprobs(model, samples[i].prompt_ids, samples[i].response_ids)
                    got = values[row, : len(expected)]
                    torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)


def _half_bytes(model_dir) -> list[int]:
    """Bytes each of two ranks holds of the model's weights (fp32, as stored) when its dim-0 rows are split."""
    held = [0, 0]
    for param in fp32_model(model_dir).parameters():
        per_row = param[0].numel() * param.element_size() if param.dim() else param.element_size()
        for rank, rows in enumerate(_rank_rows(param.shape[0] if param.dim() else 1)):
            held[rank] += rows * per_row
    return held


def test_a_sharded_reference_computes_the_whole_models_log_probs_holding_half_of_it(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    samples = _samples()
    plan = micro_batches_for_ranks(samples, 2, MAX_TOKENS)
    group = WorkerGroup("reference", _config(rl_model_dir, prompt_file, tmp_path, True), 2, 1, None, env=ENV)
    try:
        per_rank = [[pack_samples([samples[i] for i in micro]) for micro in rank_plan] for rank_plan in plan]
        results = group.call_sharded("compute_logprobs", per_rank)
        held = [info["weight_bytes"] for info in group.call("placement_info")]
        rendezvous = [info["rendezvous"] for info in group.call("placement_info")]
    finally:
        group.kill()

    _assert_whole_model_logprobs(rl_model_dir, samples, plan, results)
    # Each rank holds its rows of every weight (fp32, as stored), never the whole model.
    assert held == _half_bytes(rl_model_dir)
    assert rendezvous[0] is not None and rendezvous[0] == rendezvous[1]  # one process group


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "replicas"])
def test_policy_ranks_hosting_the_reference_compute_its_log_probs_not_their_own(
    ray_session, rl_model_dir, prompt_file, tmp_path, shard
):
    """The reference is another model than the policy (``reference:``), so log-probs that equal it came
    from the hosted reference, not from the policy's own module."""
    reference_dir = build_tiny_model(
        tmp_path / "reference", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=4
    )
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "out")
    data["reference"] = {"path": str(reference_dir), "dtype": "float32"}
    data["engine"] = {"backend": "fsdp2", "dist_timeout_s": 120}
    data["placement"] = {"policy_workers": 2, "reference_with_policy": True, "shard_reference": shard}
    data["algorithm"] = {"kl_mode": "loss", "kl_coef": 0.1}
    cfg = resolve(tmp_path, data)
    assert cfg.hosts_reference and "reference" not in cfg.worker_roles
    samples = _samples()
    plan = micro_batches_for_ranks(samples, 2, MAX_TOKENS)
    group = WorkerGroup("policy", cfg.model_dump(mode="json"), 2, 1, None, env=ENV)
    try:
        per_rank = [[pack_samples([samples[i] for i in micro]) for micro in rank_plan] for rank_plan in plan]
        results = group.call_sharded("compute_reference_logprobs", per_rank)
        held = [info["reference_weight_bytes"] for info in group.call("placement_info")]
    finally:
        group.kill()
    _assert_whole_model_logprobs(reference_dir, samples, plan, results)
    whole = sum(p.numel() * p.element_size() for p in fp32_model(reference_dir).parameters())
    assert held == (_half_bytes(reference_dir) if shard else [whole, whole])


def test_without_sharding_each_reference_worker_holds_a_whole_replica(ray_session, rl_model_dir, prompt_file, tmp_path):
    group = WorkerGroup("reference", _config(rl_model_dir, prompt_file, tmp_path, False), 2, 1, None, env=ENV)
    try:
        infos = group.call("placement_info")
    finally:
        group.kill()
    whole = sum(p.numel() * p.element_size() for p in fp32_model(rl_model_dir).parameters())
    assert [info["weight_bytes"] for info in infos] == [whole, whole]
    assert [info["rendezvous"] for info in infos] == [None, None]
