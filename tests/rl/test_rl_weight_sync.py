"""After one policy update and a weight sync, the rollout engines sample from the trained policy.

For each training backend (``local`` on one rank, ``fsdp2`` and DeepSpeed ZeRO-3 on two) the pieces
the controller uses are driven directly: a policy ``WorkerGroup``, ``connect_engines`` to two engine
actors at once (hf; vLLM, which takes the weights through its weight-transfer API on raylign's gloo
backend), one ``train_policy`` step on hand-made micro-batches, ``sync_weights``. Then each engine's
greedy log-probs of fixed prompts must equal the workers' ``compute_logprobs`` of the same sequences.
The model has tied embeddings (vLLM on CPU keeps a separately repacked output head, which must follow).

On the same two engines (each start costs seconds), the probe that checks a sync (raylign/rl/verify.py):
after a sync the policy and every engine agree on it, and an engine whose weights were changed behind the
trainer's back, or that holds another version, stops the check naming the sync and the engine.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.rl.experience import pack_samples, response_tensor
from raylign.rl.group import WorkerGroup
from raylign.rl.verify import WeightSyncDrift, verify_sync
from raylign.rollout.pool import RolloutPool, launch_engines, stop_engines
from raylign.rollout.weight_sync import WeightSyncMismatch

from .rl_helpers import fp32_model, make_sample, perturbed_fp32_model, response_logprobs, shard_for_ranks, worker_config

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [100, 7, 300, 12]]
# hf engine: both sides run the same fp32 torch model; only the order of floating-point sums
# differs (the engine decodes token by token with a KV cache, the worker runs one packed forward).
# fp32 rounding is ~6e-8 relative per operation; on every backend the measured gaps are at most
# 1e-6 (a few ulps of log-probs near -5), so 1e-5. One step at lr 1e-2 moves these log-probs by
# about 0.5, so an engine left with stale weights fails by far.
LOGPROB_TOL = 1e-5
STALE_GAP = 1e-2
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
BACKENDS = [
    pytest.param("local", 1, 2, 0, id="local-1"),
    pytest.param("local", 1, 2, 4, id="local-1-lora"),  # adapters merged into plain weights before the sync
    pytest.param("fsdp2", 2, 2, 0, id="fsdp2-2"),
    pytest.param(
        "deepspeed",
        2,
        3,
        0,
        id="zero3-2",
        marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed"),
    ),
]


# The vLLM engine takes the weights through vLLM's weight-transfer API (raylign's gloo backend)
# and computes with its own CPU kernels (repacked GEMMs, paged attention): against the torch
# forward its fp32 log-probs differ by < 5e-6 on these models (tests/rollout/test_vllm_engine.py).
ENGINES = {"hf": LOGPROB_TOL, "vllm": 1e-4}
if importlib.util.find_spec("vllm") is None:
    del ENGINES["vllm"]


@pytest.fixture(scope="module")
def engines(ray_session, rl_model_dir):
    """One engine actor of each kind, with its log-prob tolerance against the trainer's forward. Each
    policy group connects to both at once (one sync group of three), as to a pool of engines."""
    launched = {}
    try:
        for kind in ENGINES:
            config = RolloutConfig(
                engine=kind, dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256, sync_timeout_s=60
            )
            (launched[kind],) = launch_engines(rl_model_dir, config, env_vars=ENV)
        yield launched
    finally:
        stop_engines(list(launched.values()))


def _training_batch(model_dir) -> tuple[list, dict[str, torch.Tensor]]:
    """Four samples with opposite advantages; old log-probs from a plain fp32 forward (ratio 1)."""
    samples = [
        make_sample([11, 12, 13], [20, 21, 22, 23]),
        make_sample([30, 31], [40, 41, 42]),
        make_sample([50, 51, 52, 53], [60, 61]),
        make_sample([70], [80, 81, 82, 83, 84]),
    ]
    model = fp32_model(model_dir)
    with torch.no_grad():
        old = [response_logprobs(model, s.prompt_ids, s.response_ids).tolist() for s in samples]
    advantages = response_tensor([[a] * len(s.response_ids) for a, s in zip([1.0, -1.0, 0.5, -0.5], samples)])
    return samples, {
        "old_logprobs": response_tensor(old),
        "rollout_logprobs": response_tensor(old),
        "advantages": advantages,
    }


def _greedy(ray, engine) -> list:
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=6)
    return ray.get(engine.generate.remote(PROMPTS, sampling))


def _trainer_logprobs(group: WorkerGroup, completions: list) -> torch.Tensor:
    """Every rank runs the same batch (sharded forwards are collectives); rank 0's answer."""
    samples = [make_sample(c.prompt_token_ids, c.response_token_ids) for c in completions]
    return group.call("compute_logprobs", [pack_samples(samples)])[0][0]


def _gap(completions: list, trainer: torch.Tensor) -> float:
    engine = response_tensor([c.response_logprobs for c in completions], trainer.shape[1])
    mask = response_tensor([[1.0] * len(c.response_token_ids) for c in completions], trainer.shape[1])
    return float(((engine - trainer) * mask).abs().max())


@pytest.mark.parametrize(("backend", "workers", "zero_stage", "lora_rank"), BACKENDS)
def test_engines_match_the_trained_policy_after_sync(
    backend, workers, zero_stage, lora_rank, engines, ray_session, rl_model_dir, prompt_file, tmp_path
):
    cfg = worker_config(
        rl_model_dir, prompt_file, tmp_path / "run", backend, workers, zero_stage=zero_stage, optim={"lr": 1e-2}
    )
    cfg["model"]["lora"]["rank"] = lora_rank
    group = WorkerGroup("policy", cfg, workers, 1, None, env=ENV)
    try:
        group.call("connect_engines", list(engines.values()))
        group.call("sync_weights")  # the initial weights: whatever an earlier test left in the engines is gone
        initial = {kind: _greedy(ray_session, engine) for kind, engine in engines.items()}
        for kind, completions in initial.items():
            assert _gap(completions, _trainer_logprobs(group, completions)) <= ENGINES[kind], kind

        samples, per_token = _training_batch(rl_model_dir)
        stats = group.call_sharded("train_policy", shard_for_ranks(samples, per_token, workers, max_tokens=16))
        assert all(s["grad_norm"].value > 0 for s in stats)
        # The engines still hold the initial weights: their log-probs are now off (so the check below can fail).
        for kind, completions in initial.items():
            assert _gap(completions, _trainer_logprobs(group, completions)) > STALE_GAP, kind

        sync = group.call("sync_weights")
        assert sync[0]["sync/num_buckets"] > 1 and sync[0]["sync/num_bytes"] > 0
        assert all(s == {} for s in sync[1:])  # only rank 0 talks to the engines

        for kind, engine in engines.items():
            trained = _greedy(ray_session, engine)
            assert _gap(trained, _trainer_logprobs(group, trained)) <= ENGINES[kind], kind
    finally:
        group.kill()


# ---- the probe that checks a sync (raylign/rl/verify.py), on the same engines ----------------------
# One fixed sequence, scored by the policy and by every engine after a sync. fp32 everywhere, different
# kernels: measured gaps below 1e-5 (above, and tests/rollout/test_vllm_engine.py).
PROBE = [(13 * i + 7) % 450 + 3 for i in range(48)]
NAMES = ["rollout engine 0", "rollout engine 1"]
PROBE_TOL = 1e-4
NEEDS_VLLM = pytest.mark.skipif("vllm" not in ENGINES, reason="vllm is not installed")


def _probe_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(model, PROBE[:1], PROBE[1:])


@pytest.fixture(scope="module")
def verified(engines, ray_session, rl_model_dir, prompt_file, tmp_path_factory):
    """A one-rank policy connected for weight sync to the module's engines: hf (0) and vLLM (1)."""
    cfg = worker_config(rl_model_dir, prompt_file, tmp_path_factory.mktemp("verify") / "run", "local", 1)
    group = WorkerGroup("policy", cfg, 1, 1, None, env=ENV)
    pair = [engines["hf"], engines["vllm"]]
    try:
        group.call("connect_engines", pair)
        yield group, RolloutPool(pair, timeout_s=120), pair
        group.call("close")
    finally:
        group.kill()


@NEEDS_VLLM
def test_after_a_sync_every_engine_agrees_with_the_policy_on_the_probe(verified, rl_model_dir):
    group, pool, _ = verified
    group.call("sync_weights", 1)
    metrics = verify_sync(pool, group, PROBE, 1, NAMES, None)
    assert metrics["sync/engine_version"] == 1
    assert metrics["sync/probe_logprob_diff_max"] <= PROBE_TOL
    assert 0 <= metrics["sync/probe_logprob_diff_mean"] <= metrics["sync/probe_logprob_diff_max"]
    # And both sides computed the model's own log-probs (a plain fp32 forward of the untrained policy).
    expected = _probe_logprobs(fp32_model(rl_model_dir))
    for scores in pool.score(PROBE):
        assert scores.logprobs == pytest.approx(expected.tolist(), abs=PROBE_TOL)


@NEEDS_VLLM
def test_scored_one_after_the_other_the_probe_gives_the_same_answer(verified):
    """Where the policy and the engines would share cores, the policy scores first, then the engines."""
    group, pool, _ = verified
    group.call("sync_weights", 1)
    together = verify_sync(pool, group, PROBE, 1, NAMES, None)
    in_turn = verify_sync(pool, group, PROBE, 1, NAMES, None, at_once=False)
    assert in_turn["sync/engine_version"] == 1
    for key in ("sync/probe_logprob_diff_max", "sync/probe_logprob_diff_mean"):
        assert in_turn[key] == pytest.approx(together[key], abs=1e-7)


@NEEDS_VLLM
def test_an_engine_changed_behind_the_trainers_back_is_named_with_the_sync_and_the_gap(
    ray_session, verified, rl_model_dir
):
    group, pool, engines = verified
    group.call("sync_weights", 1)
    drifted = perturbed_fp32_model(rl_model_dir)
    # Same version label: nothing but the probe can tell.
    ray_session.get(engines[1].update_weights.remote(list(drifted.state_dict().items()), False, 1), timeout=120)
    try:
        gap = float((_probe_logprobs(drifted) - _probe_logprobs(fp32_model(rl_model_dir))).abs().max())
        assert gap > 0.05  # far past the fp32 default of 1e-3
        measured = verify_sync(pool, group, PROBE, 1, NAMES, max_diff=100.0)
        assert measured["sync/probe_logprob_diff_max"] == pytest.approx(gap, abs=PROBE_TOL)
        with pytest.raises(WeightSyncDrift) as raised:
            verify_sync(pool, group, PROBE, 1, NAMES, None)
        message = str(raised.value)
        assert message.startswith("weight sync 1: rollout engine 1 disagrees with the policy on the probe sequence")
        assert f"differ by up to {gap:.3g}" in message
        assert "rollout.verify_max_logprob_diff=0.001 (the default for float32 policy, float32 engine)" in message
    finally:
        group.call("sync_weights", 2)  # the engines hold the policy's weights again
    assert verify_sync(pool, group, PROBE, 2, NAMES, None)["sync/probe_logprob_diff_max"] <= PROBE_TOL


@NEEDS_VLLM
def test_an_engine_holding_another_version_is_named(ray_session, verified):
    group, pool, engines = verified
    group.call("sync_weights", 3)
    ray_session.get(engines[0].update_weights.remote([], False, 2), timeout=120)  # relabelled, weights unchanged
    with pytest.raises(WeightSyncMismatch, match="weight sync 3: rollout engine 0 reports weight version 2"):
        verify_sync(pool, group, PROBE, 3, NAMES, None)
