"""RL with a tensor-parallel policy: two ranks that split every matrix of the policy (one data-parallel
shard, given to both) train like two data-parallel ranks holding whole layers.

Two seeded GRPO runs on the same tiny model (two key/value heads, so two ranks can split them), the
policy on 2 fsdp2 ranks with ``engine.tensor_parallel_size`` 1 and 2. Rewards, the policy's loss
terms and gradient norms of both steps, and the exported weights agree: the controller hands each
tensor-parallel group one shard and counts its answer once.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from raylign.models.tiny import build_tiny_model
from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data

pytestmark = pytest.mark.slow


def test_a_tensor_parallel_policy_trains_like_data_parallel_ranks(ray_session, prompt_file, tmp_path):
    model_dir = build_tiny_model(tmp_path / "policy", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, seed=3)
    records, weights = {}, {}
    for tp in (1, 2):
        data = rl_config_data(model_dir, prompt_file, tmp_path / f"tp{tp}")
        data["engine"] = {"backend": "fsdp2", "tensor_parallel_size": tp}
        data["placement"] = {"policy_workers": 2}
        trainer = RLTrainer(resolve(tmp_path, data))
        trainer.run()
        records[tp] = read_metrics(trainer.out)
        weights[tp] = load_file(trainer.out / "final" / "model.safetensors")
    assert [r["step"] for r in records[2]] == [r["step"] for r in records[1]] == [1, 2]
    for whole, split in zip(records[1], records[2], strict=True):
        assert split["reward/mean"] == whole["reward/mean"]
        policy = [k for k in whole if k.startswith("policy/") and isinstance(whole[k], float)]
        assert "policy/grad_norm" in policy
        # fp32; the layouts differ in summation order only. Loss terms of an on-policy step sit near 0
        # (ratio 1, advantages summing to ~0): measured ~1e-6 apart there, hence the absolute 1e-5.
        for key in policy:
            assert split[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-5), (whole["step"], key)
    for name, value in weights[1].items():
        torch.testing.assert_close(weights[2][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert any(
        not torch.equal(value, load_file(model_dir / "model.safetensors")[name]) for name, value in weights[1].items()
    )


def test_rl_refuses_tensor_parallel_it_cannot_split(prompt_file, tmp_path):
    from raylign.config.base import ConfigError

    data = rl_config_data(tmp_path / "m", prompt_file, tmp_path / "out")
    data["engine"] = {"backend": "fsdp2", "tensor_parallel_size": 2}
    data["placement"] = {"policy_workers": 3}
    data["train"]["prompts_per_step"] = 3
    with pytest.raises(
        (ConfigError, ValueError), match=r"tensor_parallel_size \(2\) must divide placement.policy_workers \(3\)"
    ):
        resolve(tmp_path, data)
    data["placement"]["policy_workers"] = 2
    data["train"]["prompts_per_step"] = 4
    data["preset"] = "ppo"
    with pytest.raises((ConfigError, ValueError), match="the critic .* does not support it yet"):
        resolve(tmp_path, data)
