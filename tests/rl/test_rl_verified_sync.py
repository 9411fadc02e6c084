"""The probe that checks a weight sync: a policy worker and two real engines (hf and vLLM) score
one fixed sequence; their log-probs agree after a sync, and an engine whose weights were changed
behind the trainer's back, or that holds another version, stops the check naming the sync and
the engine. End to end: a run whose engine drifts stops at that sync."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from raylign.config.rollout import RolloutConfig
from raylign.rl.group import WorkerGroup
from raylign.rl.trainer import RLTrainer
from raylign.rl.verify import WeightSyncDrift, probe_sequence, verify_sync
from raylign.rollout.pool import RolloutPool, launch_engines, stop_engines
from raylign.rollout.weight_sync import WeightSyncMismatch
from raylign.trainers.metrics import read_metrics

from .rl_helpers import fp32_model, resolve, response_logprobs, rl_config_data, worker_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PROBE = [(13 * i + 7) % 450 + 3 for i in range(48)]
NAMES = ["rollout engine 0", "rollout engine 1"]
# fp32 everywhere, different kernels: measured gaps below 1e-5 (test_rl_weight_sync.py, test_vllm_engine.py).
LOGPROB_TOL = 1e-4


def _perturbed(model_dir, seed: int = 21) -> torch.nn.Module:
    model = fp32_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _probe_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(model, PROBE[:1], PROBE[1:])


@pytest.fixture(scope="module")
def setup(ray_session, rl_model_dir, prompt_file, tmp_path_factory):
    """A one-rank policy, an hf engine (0) and a vLLM engine (1), connected for weight sync."""
    cfg = worker_config(rl_model_dir, prompt_file, tmp_path_factory.mktemp("verify") / "run", "local", 1)
    group = WorkerGroup("policy", cfg, 1, 1, None, env=ENV)
    base = dict(dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256, sync_timeout_s=60)
    (hf,) = launch_engines(rl_model_dir, RolloutConfig(engine="hf", **base), env_vars=ENV)
    (vllm,) = launch_engines(rl_model_dir, RolloutConfig(engine="vllm", **base), env_vars=ENV)
    group.call("connect_engines", [hf, vllm])
    yield group, RolloutPool([hf, vllm], timeout_s=120), [hf, vllm]
    group.call("close")
    stop_engines([hf, vllm])
    group.kill()


def test_after_a_sync_every_engine_agrees_with_the_policy_on_the_probe(setup, rl_model_dir):
    group, pool, _ = setup
    group.call("sync_weights", 1)
    metrics = verify_sync(pool, group, PROBE, 1, NAMES, None)
    assert metrics["sync/engine_version"] == 1
    assert metrics["sync/probe_logprob_diff_max"] <= LOGPROB_TOL
    assert 0 <= metrics["sync/probe_logprob_diff_mean"] <= metrics["sync/probe_logprob_diff_max"]
    # And both sides computed the model's own log-probs (a plain fp32 forward of the untrained policy).
    expected = _probe_logprobs(fp32_model(rl_model_dir))
    for scores in pool.score(PROBE):
        assert scores.logprobs == pytest.approx(expected.tolist(), abs=LOGPROB_TOL)


def test_scored_one_after_the_other_the_probe_gives_the_same_answer(setup):
    """Where the policy and the engines would share cores, the policy scores first, then the engines."""
    group, pool, _ = setup
    group.call("sync_weights", 1)
    together = verify_sync(pool, group, PROBE, 1, NAMES, None)
    in_turn = verify_sync(pool, group, PROBE, 1, NAMES, None, at_once=False)
    assert in_turn["sync/engine_version"] == 1
    for key in ("sync/probe_logprob_diff_max", "sync/probe_logprob_diff_mean"):
        assert in_turn[key] == pytest.approx(together[key], abs=1e-7)


def test_an_engine_changed_behind_the_trainers_back_is_named_with_the_sync_and_the_gap(
    ray_session, setup, rl_model_dir
):
    group, pool, engines = setup
    group.call("sync_weights", 1)
    drifted = _perturbed(rl_model_dir)
    # Same version label: nothing but the probe can tell.
    ray_session.get(engines[1].update_weights.remote(list(drifted.state_dict().items()), False, 1), timeout=120)
    try:
        gap = float((_probe_logprobs(drifted) - _probe_logprobs(fp32_model(rl_model_dir))).abs().max())
        assert gap > 0.05  # far past the fp32 default of 1e-3
        measured = verify_sync(pool, group, PROBE, 1, NAMES, max_diff=100.0)
        assert measured["sync/probe_logprob_diff_max"] == pytest.approx(gap, abs=LOGPROB_TOL)
        with pytest.raises(WeightSyncDrift) as raised:
            verify_sync(pool, group, PROBE, 1, NAMES, None)
        message = str(raised.value)
        assert message.startswith("weight sync 1: rollout engine 1 disagrees with the policy on the probe sequence")
        assert f"differ by up to {gap:.3g}" in message
        assert "rollout.verify_max_logprob_diff=0.001 (the default for float32 policy, float32 engine)" in message
    finally:
        group.call("sync_weights", 2)  # the engines hold the policy's weights again
    assert verify_sync(pool, group, PROBE, 2, NAMES, None)["sync/probe_logprob_diff_max"] <= LOGPROB_TOL


def test_an_engine_holding_another_version_is_named(ray_session, setup):
    group, pool, engines = setup
    group.call("sync_weights", 3)
    ray_session.get(engines[0].update_weights.remote([], False, 2), timeout=120)  # relabelled, weights unchanged
    with pytest.raises(WeightSyncMismatch, match="weight sync 3: rollout engine 0 reports weight version 2"):
        verify_sync(pool, group, PROBE, 3, NAMES, None)


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

            drifted = _perturbed(self.model_path)
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
