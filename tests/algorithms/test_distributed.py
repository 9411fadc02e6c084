"""Global-batch loss normalisation over 2 real gloo ranks x 2 micro-batches equals one big batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raylign.algorithms import LossScale, compute_ppo_policy_loss, masked_whiten
from tests.spawned_ranks import import_worker, spawn_and_join

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

worker = import_worker(__file__, "algorithms_distributed_worker")


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ranks")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        spawn_and_join(worker.run_rank, (str(out_dir),), worker.WORLD_SIZE, 300, "gloo ranks")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(worker.WORLD_SIZE)]


def one_big_batch() -> dict[str, torch.Tensor]:
    parts = [worker.micro_batch(i) for i in range(worker.WORLD_SIZE * worker.MICRO_BATCHES_PER_RANK)]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def reference_gradient(mode: str) -> list[torch.Tensor]:
    policy = worker.make_policy()
    batch = one_big_batch()
    loss, _ = compute_ppo_policy_loss(
        worker.token_logprobs(policy, batch),
        batch["old_logprobs"],
        batch["advantages"],
        batch["mask"],
        aggregation=mode,
        scale=LossScale(max_response_length=worker.SEQ),
    )
    return list(torch.autograd.grad(loss, list(policy.parameters())))


@pytest.mark.parametrize("mode", worker.MODES)
def test_gradient_over_ranks_and_micro_batches_equals_one_batch_gradient(rank_results, mode):
    expected = reference_gradient(mode)
    for rank in rank_results:
        for got, want in zip(rank[mode], expected, strict=True):
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (mode, (got - want).abs().max())


def test_loss_scale_counts_the_whole_step_on_every_rank(rank_results):
    mask = one_big_batch()["mask"]
    for rank in rank_results:
        scale = rank["scale"]
        assert scale.global_tokens == float(mask.sum())
        assert scale.global_sequences == float((mask.sum(-1) > 0).sum())
        assert scale.world_size == worker.WORLD_SIZE


def test_running_normalizer_merges_all_ranks(rank_results):
    batch = one_big_batch()
    rewards = batch["advantages"][:, 0].tolist()
    mean = sum(rewards) / len(rewards)
    m2 = sum((r - mean) ** 2 for r in rewards)
    for rank in rank_results:
        state = rank["normalizer"]
        assert state["count"] == len(rewards)
        assert state["mean"] == pytest.approx(mean, rel=1e-12)
        assert state["m2"] == pytest.approx(m2, rel=1e-12)


def test_kto_kl_estimate_is_the_mean_over_all_ranks(rank_results):
    # rank r's KL samples are all 0.1 * r + 0.05; rank sizes differ, so weight by sample count
    sizes = [
        sum(
            worker.micro_batch(r * worker.MICRO_BATCHES_PER_RANK + k)["mask"].shape[0]
            for k in range(worker.MICRO_BATCHES_PER_RANK)
        )
        for r in range(worker.WORLD_SIZE)
    ]
    expected = sum(n * (0.1 * r + 0.05) for r, n in enumerate(sizes)) / sum(sizes)
    for rank in rank_results:
        assert rank["kto_kl"].item() == pytest.approx(expected, rel=1e-9)


def test_whitening_with_a_process_group_uses_the_global_batch_statistics(rank_results):
    batch = one_big_batch()
    expected = masked_whiten(batch["advantages"], batch["mask"])
    got = torch.cat([rank["whitened"] for rank in rank_results])
    assert torch.allclose(got, expected, atol=1e-12)
