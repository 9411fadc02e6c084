"""train.early_reference: the reference log-probs of each prompt group are computed as soon as the
group is scored, while others still generate; a step then gets the same numbers it would have
computed itself in its experience phase."""

from __future__ import annotations

import pytest

from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data

pytestmark = pytest.mark.slow

# Per-group packing against whole-batch packing changes only the summation order of fp32 forwards.
KL_ATOL = 1e-6


def _run(rl_model_dir, prompt_file, tmp_path, early: bool, reference_workers: int) -> list[dict]:
    out = tmp_path / f"early-{early}-{reference_workers}"
    data = rl_config_data(rl_model_dir, prompt_file, out)
    data["algorithm"] = {"kl_mode": "loss", "kl_coef": 0.1}
    data["optim"] = {"lr": 5e-3}
    data["placement"] = {"reference_workers": reference_workers}
    data["engine"] = {"backend": "fsdp2", "dist_timeout_s": 120}
    data["train"]["early_reference"] = early
    data["rollout"]["reproducible"] = True  # seeded sampling, groups in start order: both runs see the same samples
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
