"""``raylign estimate-memory``: what the command counts on the device for the engine settings it is given."""

from __future__ import annotations

import pytest

from raylign.cli.estimate_memory import EstimateMemoryConfig, run_estimate_memory

QWEN25_7B_PARAMETERS = 7_615_616_512  # Qwen2.5-7B's published parameter count


@pytest.mark.parametrize("flag", ["offload_params", "offload_optimizer"])
def test_fsdp2_offload_by_either_flag_takes_weights_gradients_and_optimizer_off_the_device(flag, capsys):
    """fsdp2 offloads through one CPUOffloadPolicy whichever flag asks for it: the fp32 weight and gradient
    shards and AdamW's two moments (4 + 4 + 8 bytes a parameter, over 8 ranks) all leave the device."""
    kept = run_estimate_memory(EstimateMemoryConfig(model="7b", backend="fsdp2", num_processes=8))
    offloaded = run_estimate_memory(EstimateMemoryConfig(model="7b", backend="fsdp2", num_processes=8, **{flag: True}))
    assert sorted(offloaded) == ["activations", "gathered layers", "logits", "total"]
    assert offloaded["total"] == pytest.approx(kept["total"] - QWEN25_7B_PARAMETERS * (4 + 4 + 8) / 8)
    host = [line for line in capsys.readouterr().out.splitlines() if "in host memory" in line]
    assert sorted(line.split()[0] for line in host) == ["gradients", "optimizer", "weights"]


def test_deepspeed_optimizer_offload_leaves_the_bf16_weights_and_gradients_on_the_device():
    """ZeRO-Offload moves the optimizer and the fp32 master weights only (8 + 8 bytes a parameter, ZeRO-2 over
    8 ranks); the bf16 weights and gradient shards stay."""
    layout = {"model": "7b", "backend": "deepspeed", "zero_stage": 2, "num_processes": 8}
    kept = run_estimate_memory(EstimateMemoryConfig(**layout))
    offloaded = run_estimate_memory(EstimateMemoryConfig(**layout, offload_optimizer=True))
    assert offloaded["weights"] == kept["weights"] == QWEN25_7B_PARAMETERS * 2
    assert offloaded["gradients"] == kept["gradients"] == QWEN25_7B_PARAMETERS * 2 / 8
    assert offloaded["total"] == pytest.approx(kept["total"] - QWEN25_7B_PARAMETERS * (8 + 8) / 8)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"backend": "local", "num_processes": 2, "tensor_parallel_size": 2}, "needs engine.backend 'fsdp2' or"),
        ({"backend": "local", "num_processes": 8}, "engine.num_processes 8 needs engine.backend"),
        ({"backend": "deepspeed", "zero_stage": 2, "offload_params": True}, "offload_params needs engine.zero_stage 3"),
        ({"backend": "deepspeed", "master_weights": False}, "master_weights: false needs engine.backend 'local' or"),
    ],
)
def test_a_layout_training_refuses_gets_no_estimate(fields, error):
    # Each printed figures (the local TP run's weights halved, ZeRO-2's weights offloaded) for a layout
    # whose training run stops at its config.
    with pytest.raises(ValueError, match=error):
        EstimateMemoryConfig(model="0.5b", **fields)
