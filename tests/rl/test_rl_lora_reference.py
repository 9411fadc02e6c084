"""A LoRA policy is its own reference: with its adapters turned off it computes the base model's
log-probs, so a KL run with a LoRA policy starts no reference workers."""

from __future__ import annotations

import pytest
import torch

from raylign.rl.experience import micro_batches_for_ranks, response_tensor
from raylign.rl.group import WorkerGroup

from .rl_helpers import fp32_model, make_sample, resolve, response_logprobs, rl_config_data, shard_for_ranks

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}
# fp32 on both sides; packing changes only the summation order (~1e-7).
LOGPROB_ATOL = 1e-5


def _data(model_dir, prompt_file, tmp_path, **model) -> dict:
    data = rl_config_data(model_dir, prompt_file, tmp_path / "out")
    data["model"].update(model)
    data["algorithm"] = {"kl_mode": "loss", "kl_coef": 0.1}
    return data


def test_a_lora_policy_without_a_reference_of_its_own_starts_no_reference_workers(rl_model_dir, prompt_file, tmp_path):
    lora = resolve(tmp_path, _data(rl_model_dir, prompt_file, tmp_path, lora=LORA))
    assert lora.reference_in_policy and "reference" not in lora.worker_roles
    full = resolve(tmp_path, _data(rl_model_dir, prompt_file, tmp_path))
    assert not full.reference_in_policy and "reference" in full.worker_roles
    own = _data(rl_model_dir, prompt_file, tmp_path, lora=LORA)
    own["reference"] = {"path": str(rl_model_dir), "dtype": "float32"}
    separate = resolve(tmp_path, own)
    assert not separate.reference_in_policy and "reference" in separate.worker_roles


def test_with_its_adapters_off_a_trained_lora_policy_computes_the_base_models_log_probs(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    samples = [make_sample([11, 12, 13, 14], [40, 41, 42, 43, 44]), make_sample([7, 8], [300, 301, 302])]
    base = fp32_model(rl_model_dir)
    with torch.no_grad():
        base_lp = [response_logprobs(base, s.prompt_ids, s.response_ids) for s in samples]
    per_token = {  # a large step: lora_B starts at zero, so the adapters only matter after an update
        "old_logprobs": response_tensor([lp.tolist() for lp in base_lp]),
        "advantages": response_tensor([[1.0] * 5, [-1.0] * 3]),
        "ref_logprobs": response_tensor([lp.tolist() for lp in base_lp]),
    }
    data = _data(rl_model_dir, prompt_file, tmp_path, lora=LORA)
    data["optim"] = {"lr": 5e-2, "scheduler": "constant"}
    cfg = resolve(tmp_path, data).model_dump(mode="json")
    group = WorkerGroup("policy", cfg, 1, 1, None, env=ENV)
    (plan,) = micro_batches_for_ranks(samples, 1, 64)
    try:
        (batches,) = shard_for_ranks(samples, per_token, 1, 64, plan=[plan])
        group.call_sharded("train_policy", [batches])
        (policy,) = group.call_sharded("compute_logprobs", [batches])
        (reference,) = group.call_sharded("compute_reference_logprobs", [batches])
        (policy_again,) = group.call_sharded("compute_logprobs", [batches])  # the adapters are back on
    finally:
        group.kill()
    order = [i for micro in plan for i in micro]  # sample of each returned row, in order
    assert sorted(order) == [0, 1]
    for i, ref, pol, again in zip(order, _rows(reference), _rows(policy), _rows(policy_again)):
        n = len(base_lp[i])
        torch.testing.assert_close(ref[:n], base_lp[i], atol=LOGPROB_ATOL, rtol=0)
        assert (pol[:n] - base_lp[i]).abs().max() > 1e-3  # the adapters moved the policy away from its base
        assert torch.equal(again[:n], pol[:n])


def _rows(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [row for t in tensors for row in t]


def test_a_grpo_run_with_a_lora_policy_measures_its_kl_to_the_base(ray_session, rl_model_dir, prompt_file, tmp_path):
    from raylign.rl.trainer import RLTrainer
    from raylign.trainers.metrics import read_metrics

    data = _data(rl_model_dir, prompt_file, tmp_path, lora=LORA)
    data["optim"] = {"lr": 5e-2}
    cfg = resolve(tmp_path, data)
    RLTrainer(cfg).run()
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2]
    # Step 1: lora_B starts at zero, so the policy is its base and the KL is zero to rounding; after one
    # update the adapters have moved it (measured 0.0099).
    assert abs(records[0]["kl/reference"]) < 1e-6
    assert records[1]["kl/reference"] > 1e-3
