"""RL with model-parallel training: two ranks that split every matrix (tensor parallel) or every packed
row (sequence parallel) of the policy and the critic, one data-parallel shard given to both, train
like two data-parallel ranks holding whole layers and whole rows; and a LoRA policy, whose reference is
itself with its adapters off, with its matrices split over pairs of ranks and its rows within each pair.

Seeded PPO runs (a policy and a critic, no KL term) on the same tiny model (two key/value heads, so two ranks can
split them), each model on 2 fsdp2 ranks, with ``engine.tensor_parallel_size`` 2, with
``engine.sequence_parallel_size`` 2 (and gradient checkpointing), and with neither; and on 2
deepspeed ranks with AutoTP 2. The workers split rows the same way whichever backend steps the
weights (``raylign/rl/worker.py``); DeepSpeed's side of split rows, its gradients over ranks that
share a row, is held to whole rows in the SFT layouts (``tests/trainers/sft_sequence_parallel_worker.py``
with ZeRO-3, ``test_sft_tensor_parallel.py`` with AutoTP).
Rewards, the policy's and critic's loss terms (an entropy bonus keeps the policy's total loss away
from 0, so its logged value is checked, not only its sign) and gradient norms of both steps, and the
exported weights agree: the controller hands each group one shard and counts its answer once.

Every run generates with engines in the policy workers (``placement.colocate``): each engine gets the
weights every rank gathers from the split matrices and rows (``iter_full_state(every_rank=True)``),
the same gather that feeds rank 0's broadcast to separate engines, whose path tests/rl/test_rl_weight_sync.py
follows; and a run starts one process fewer (8-9 s each on one core).
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

LAYOUTS = {
    "data": {},
    "tensor": {"tensor_parallel_size": 2},
    "sequence": {"sequence_parallel_size": 2},
    "deepspeed_tensor": {"backend": "deepspeed", "zero_stage": 1, "tensor_parallel_size": 2},
}


@pytest.fixture(scope="module")
def runs(ray_session, prompt_file, tmp_path_factory):
    """Each layout's metrics and exported weights, and the initial weights."""
    tmp_path = tmp_path_factory.mktemp("model_parallel")
    model_dir = build_tiny_model(tmp_path / "policy", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, seed=3)
    out = {"initial": load_file(model_dir / "model.safetensors")}
    for layout, engine in LAYOUTS.items():
        data = rl_config_data(model_dir, prompt_file, tmp_path / layout, preset="ppo")
        data["engine"] = {"backend": "fsdp2", **engine}
        # The split run also recomputes its layers in backward: the recomputed ring attention must reach
        # the other rank's half again (the whole-row runs keep their activations).
        data["model"]["gradient_checkpointing"] = layout.endswith("sequence")
        data["placement"] = {"policy_workers": 2, "critic_workers": 2, "colocate": True}
        # No KL term: a reference would be one more whole (unsplit) actor in every layout, its log-probs
        # those of the initial weights; the LoRA runs below check a reference with rows and matrices split.
        data["algorithm"] = {"entropy_coef": 0.01, "kl_mode": "none", "kl_coef": 0.0}
        trainer = RLTrainer(resolve(tmp_path, data))
        trainer.run()
        out[layout] = (read_metrics(trainer.out), load_file(trainer.out / "final" / "model.safetensors"))
    return out


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "data"])
def test_model_parallel_training_equals_data_parallel_ranks(runs, layout):
    (whole_records, whole_weights), (split_records, split_weights) = runs["data"], runs[layout]
    assert [r["step"] for r in split_records] == [r["step"] for r in whole_records] == [1, 2]
    for whole, split in zip(whole_records, split_records, strict=True):
        assert split["reward/mean"] == whole["reward/mean"]
        trained = [k for k in whole if k.startswith(("policy/", "critic/")) and isinstance(whole[k], float)]
        assert {"policy/grad_norm", "critic/grad_norm", "critic/value_loss"} <= set(trained)
        # The entropy bonus: -0.01 x the token-mean entropy of a random model's answers (a few nats).
        assert whole["policy/policy_loss_total"] < -0.01
        # fp32; the layouts differ in summation order only. Loss terms of an on-policy step sit near 0
        # (ratio 1, advantages summing to ~0): measured ~1e-6 apart there, hence the absolute 1e-5.
        for key in trained:
            assert split[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-5), (whole["step"], key)
    # AdamW moves each weight by about lr * m / sqrt(v) per step, at most ~lr: for a weight whose gradient
    # is as small as the layouts' rounding differences (measured: 1 of 16,384 in one matrix), that ratio
    # is not reproducible, so a few weights may differ by up to lr per step; every other one agrees to 1e-5.
    lr, steps = 1e-3, 2
    for name, value in whole_weights.items():
        diff = (split_weights[name] - value).abs()
        near = diff <= 1e-5 + 1e-5 * value.abs()
        assert float(near.float().mean()) >= 0.999 and float(diff.max()) <= lr * steps, (name, float(diff.max()))
    assert any(not torch.equal(value, runs["initial"][name]) for name, value in whole_weights.items())


@pytest.fixture(scope="module")
def lora_runs(ray_session, prompt_file, tmp_path_factory):
    """A LoRA policy's GRPO run with a KL term to its base (the policy with its adapters off), on 2
    data-parallel ranks, and on 4 ranks that split every matrix and its adapter over pairs and share every
    row within each pair (each row's 2 chunks, ring attention): each layout's metrics and merged export.
    Both of the workers' model-parallel branches run with the adapters in the 4-rank layout; each alone is
    trained in the PPO runs above (without adapters) and in the SFT LoRA layouts (test_sft_tensor_parallel.py,
    test_sft_sequence_parallel.py). Ulysses attention takes the same path through the RL workers
    (engine.sequence_parallel_mode only picks the attention function): it is checked against whole attention
    in tests/models/test_sequence_parallel.py and trained in the SFT layouts."""
    tmp_path = tmp_path_factory.mktemp("model_parallel_lora")
    model_dir = build_tiny_model(tmp_path / "policy", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, seed=3)
    out = {}
    layouts = {
        "data": {},
        "tensor_sequence": {"tensor_parallel_size": 2, "sequence_parallel_size": 2},
    }
    for layout, engine in layouts.items():
        data = rl_config_data(model_dir, prompt_file, tmp_path / layout)
        data["model"]["lora"] = {"rank": 4, "alpha": 8.0}
        data["engine"] = {"backend": "fsdp2", **engine}
        data["placement"] = {"policy_workers": 4 if layout == "tensor_sequence" else 2, "colocate": True}
        data["algorithm"] = {"kl_mode": "loss", "kl_coef": 0.1}
        data["optim"] = {"lr": 1e-2}
        trainer = RLTrainer(resolve(tmp_path, data))
        trainer.run()
        out[layout] = (read_metrics(trainer.out), load_file(trainer.out / "final" / "model.safetensors"))
    out["initial"] = load_file(model_dir / "model.safetensors")
    return out


def test_a_lora_policy_trains_with_rows_and_matrices_split_like_data_parallel_ranks(lora_runs):
    (whole_records, whole_weights), (split_records, split_weights) = lora_runs["data"], lora_runs["tensor_sequence"]
    assert [r["step"] for r in split_records] == [r["step"] for r in whole_records] == [1, 2]
    for whole, split in zip(whole_records, split_records, strict=True):
        assert split["reward/mean"] == whole["reward/mean"]
        trained = [k for k in whole if k.startswith(("policy/", "kl/")) and isinstance(whole[k], float)]
        assert {"policy/grad_norm", "kl/reference"} <= set(trained)
        for key in trained:
            assert split[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-5), (whole["step"], key)
    assert whole_records[-1]["kl/reference"] > 1e-4  # the second step's policy has left its base (measured 7.8e-4)
    for name, value in whole_weights.items():
        torch.testing.assert_close(split_weights[name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert any(not torch.equal(value, lora_runs["initial"][name]) for name, value in whole_weights.items())


@pytest.mark.parametrize("field", ["tensor_parallel_size", "sequence_parallel_size"])
def test_rl_refuses_model_parallel_layouts_it_cannot_split(prompt_file, tmp_path, field):
    from raylign.config.base import ConfigError

    data = rl_config_data(tmp_path / "m", prompt_file, tmp_path / "out")
    data["engine"] = {"backend": "fsdp2", field: 2}
    data["placement"] = {"policy_workers": 3}
    data["train"]["prompts_per_step"] = 3
    with pytest.raises((ConfigError, ValueError), match=rf"{field} \(2\) must divide placement.policy_workers \(3\)"):
        resolve(tmp_path, data)
    data["placement"]["policy_workers"] = 2
    data["train"]["prompts_per_step"] = 4
    if field == "tensor_parallel_size":
        lora = {**data, "model": {**data["model"], "lora": {"rank": 4}}}
        assert resolve(tmp_path, lora).engine.tensor_parallel_size == 2  # fsdp2 splits the adapters too
        with pytest.raises((ConfigError, ValueError), match=r"\(AutoTP\) does not support model.lora"):
            resolve(tmp_path, {**lora, "engine": {**data["engine"], "backend": "deepspeed"}})
    data["preset"] = "ppo"
    with pytest.raises((ConfigError, ValueError), match=rf"{field} \(2\) must divide placement.critic_workers \(1\)"):
        resolve(tmp_path, data)
    data["placement"]["critic_workers"] = 2
    assert resolve(tmp_path, data).uses_critic


def test_rl_refuses_tensor_and_sequence_parallel_that_together_do_not_fit_the_ranks(prompt_file, tmp_path):
    from raylign.config.base import ConfigError

    data = rl_config_data(tmp_path / "m", prompt_file, tmp_path / "out")
    data["engine"] = {"backend": "fsdp2", "tensor_parallel_size": 2, "sequence_parallel_size": 2}
    data["placement"] = {"policy_workers": 2}
    match = r"tensor_parallel_size x engine.sequence_parallel_size \(4\) must divide placement.policy_workers \(2\)"
    with pytest.raises((ConfigError, ValueError), match=match):
        resolve(tmp_path, data)
    data["placement"] = {"policy_workers": 4}
    assert resolve(tmp_path, data).engine.sequence_parallel_size == 2
