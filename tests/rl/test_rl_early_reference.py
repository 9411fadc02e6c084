"""train.early_reference: the reference log-probs of each prompt group are computed as soon as the
group is scored, while others still generate; a step then gets the same numbers it would have
computed itself in its experience phase."""

from __future__ import annotations

import pytest

from raylign.rl.reference import plan_with_stand_ins
from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import make_sample, resolve, rl_config_data

pytestmark = pytest.mark.slow

# Per-group packing against whole-batch packing changes only the summation order of fp32 forwards.
KL_ATOL = 1e-6
PROMPT_TOKENS = 20  # the copy prompts take 16-18 tokens in the tiny model's chat template


def _run(rl_model_dir, prompt_file, tmp_path, early: bool, reference_workers: int) -> list[dict]:
    out = tmp_path / f"early-{early}-{reference_workers}"
    data = rl_config_data(rl_model_dir, prompt_file, out)
    # Groups of 3 over 2 reference ranks, with micro-batches that hold about one sample: the rank
    # with 2 samples runs 2 micro-batches, so its peer, with 1, runs a stand-in beside its own.
    data["sampling"]["n"] = 3
    data["data"]["max_prompt_length"] = PROMPT_TOKENS
    data["train"]["micro_batch_tokens"] = PROMPT_TOKENS + data["sampling"]["max_new_tokens"]
    data["algorithm"] = {"kl_mode": "loss", "kl_coef": 0.1}
    data["optim"] = {"lr": 5e-3}
    data["placement"] = {"reference_workers": reference_workers}
    data["engine"] = {"backend": "fsdp2", "dist_timeout_s": 120}
    data["train"]["early_reference"] = early
    RLTrainer(resolve(out.parent, data)).run()
    return read_metrics(out)


def test_early_reference_log_probs_are_the_experience_phases_own(ray_session, rl_model_dir, prompt_file, tmp_path):
    # Without the early passes the policy's workers host the reference (placement.reference_with_policy auto)
    # and compute it in the experience phase: two ways to the same numbers.
    late = _run(rl_model_dir, prompt_file, tmp_path, False, 1)
    early = _run(rl_model_dir, prompt_file, tmp_path, True, 2)  # also through a reference sharded over 2 ranks
    assert all("experience/reference_early" not in r for r in late)
    assert [r["experience/reference_early"] for r in early] == [1.0, 1.0]
    for a, b in zip(late, early):
        assert b["reward/mean"] == a["reward/mean"]  # the same samples
        assert b["kl/reference"] == pytest.approx(a["kl/reference"], abs=KL_ATOL)
    # Step 1: the policy is still the reference, so the KL is zero to rounding; after one update it is not,
    # so the comparison is not one of zeros.
    assert abs(early[0]["kl/reference"]) < 1e-6 and late[1]["kl/reference"] > 1e-3


def _samples(lengths: list[int]) -> list:
    return [make_sample([1] * (length - 1), [2]) for length in lengths]


def test_a_group_smaller_than_the_reference_ranks_gives_the_idle_ranks_a_stand_in():
    # Groups of 2 over 4 ranks: ranks 2 and 3 have no sample of their own, and every rank runs one
    # micro-batch (a sharded reference's forward is collective); theirs hold the shortest sample, 1.
    plan, real = plan_with_stand_ins(_samples([9, 5]), ranks=4, max_tokens=64)
    assert plan == [[[0]], [[1]], [[1]], [[1]]]
    assert real == [1, 1, 0, 0]


def test_a_rank_with_fewer_samples_than_its_peers_micro_batches_runs_stand_ins():
    # Groups of 3 over 2 ranks, micro-batches of at most 10 tokens: rank 0 holds the samples of 8 and
    # 6 tokens (token-balanced shards: the longest first to the emptier rank), which need one micro-batch
    # each; rank 1 holds the 7, so it runs its own and a stand-in (the shortest sample, position 2).
    plan, real = plan_with_stand_ins(_samples([8, 7, 6]), ranks=2, max_tokens=10)
    assert plan == [[[0], [2]], [[1], [2]]]
    assert real == [2, 1]
