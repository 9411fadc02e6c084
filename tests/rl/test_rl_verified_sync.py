"""The probe that checks a weight sync. Against a policy worker and two real engines, on the engines
tests/rl/test_rl_weight_sync.py starts: their log-probs agree after a sync, and an engine whose weights
were changed behind the trainer's back, or that holds another version, stops the check naming the
sync and the engine. Here: the probe sequence, and end to end, a run whose engine drifts stops at
that sync."""

from __future__ import annotations

import pytest

from raylign.rl.trainer import RLTrainer
from raylign.rl.verify import WeightSyncDrift, probe_sequence
from raylign.trainers.metrics import read_metrics

from .rl_helpers import perturbed_fp32_model, resolve, rl_config_data

pytestmark = pytest.mark.slow


def test_the_probe_is_the_training_prompts_concatenated_and_cut():
    assert probe_sequence([[1, 2, 3], [4, 5], [6, 7, 8]], 6) == [1, 2, 3, 4, 5, 6]
    assert probe_sequence([[1, 2, 3]], 64) == [1, 2, 3]
    with pytest.raises(ValueError, match="rollout.verify_every: 0"):
        probe_sequence([[9]], 64)


class DriftingTrainer(RLTrainer):
    """Changes engine 0's weights right after weight sync 1 (before its probe), keeping its version."""

    def verify_sync(self, version):
        if version == 1:
            import ray

            drifted = perturbed_fp32_model(self.model_path)
            ray.get(self.engines[0].update_weights.remote(list(drifted.state_dict().items()), False, 1), timeout=120)
        return super().verify_sync(version)


def test_a_run_whose_engine_drifts_stops_at_that_sync(ray_session, rl_model_dir, prompt_file, tmp_path):
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run")
    data["train"]["max_steps"] = 3
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}  # no reference actor: the run stops at its first sync
    with pytest.raises(WeightSyncDrift, match=r"^weight sync 1: rollout engine 0 disagrees with the policy"):
        DriftingTrainer(resolve(tmp_path, data)).run()
    logged = read_metrics(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert [r["step"] for r in logged if "reward/mean" in r] == []  # it stopped within step 1, before logging it
