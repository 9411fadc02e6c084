"""LoRA and QLoRA through every offline command: two steps of each shipped tiny example with adapters on a
full-precision base and on a 4-bit one, and the export that results.

The exported folder must be the base model's own full-precision weights with the adapter merged in
(``W + alpha / r * B @ A``, computed here by hand from the exported adapter); with a 4-bit base, not
the 4-bit values, which differ from the base by up to about 15% of each block's largest weight.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylign.cli.main import main
from raylign.trainers.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
RANK, ALPHA = 4, 8.0
PEFT_PREFIX = "base_model.model."


@pytest.mark.parametrize("quantize_base", ["none", "nf4"])
@pytest.mark.parametrize("command", ["sft", "dpo", "kto", "rm", "kd"])
def test_adapters_train_and_export_merged_into_the_full_base(
    command, quantize_base, tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.chdir(REPO)
    out = tmp_path / command
    args = [command, "--config", f"examples/{command}_tiny.yaml", "--model.path", str(tiny_model_dir)]
    args += [
        "--model.lora.rank",
        str(RANK),
        "--model.lora.alpha",
        str(ALPHA),
        "--model.lora.quantize_base",
        quantize_base,
    ]
    args += ["--train.output_dir", str(out), "--train.max_steps", "2", "--train.logging.progress_bar", "false"]
    if command == "kd":
        args += ["--teacher.path", str(tiny_model_dir)]
    assert main(args) == 0

    base = load_file(tiny_model_dir / "model.safetensors")
    merged = load_file(out / "final" / "model.safetensors")
    adapter = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    moved = 0
    for key, value in base.items():
        if key not in merged:  # a tied output head is stored once
            continue
        module = key.removesuffix(".weight")
        lora_a = adapter.get(f"{PEFT_PREFIX}{module}.lora_A.weight")
        if lora_a is None:
            assert torch.equal(merged[key], value), key
            continue
        delta = ALPHA / RANK * adapter[f"{PEFT_PREFIX}{module}.lora_B.weight"] @ lora_a
        torch.testing.assert_close(merged[key], value + delta, rtol=0, atol=1e-6, msg=key)
        moved += bool(delta.abs().max() > 1e-6)
    assert moved >= 7, "two steps should move the adapters of every projection of a layer"
    if command == "rm":  # the score head trains whole, travels in the adapter folder, and is exported as trained
        head = adapter[f"{PEFT_PREFIX}score.weight"]
        assert torch.equal(merged["score.weight"], head)


@pytest.mark.parametrize(
    "command, options",
    [("dpo", ["--dpo.precompute_reference", "true"]), ("dpo", ["--dpo.precompute_reference", "false"]), ("kto", [])],
)
def test_a_4bit_lora_policy_starts_equal_to_its_reference(command, options, tmp_path, tiny_model_dir, monkeypatch):
    """Before its first update a LoRA policy is its base (the adapters' B is zero), so every implied
    reward ``log pi - log pi_ref`` is 0 when the reference is that base, 4-bit as the policy's is: the
    DPO loss is ln 2 and its rewards 0; KTO's z0 is 0 and its loss 1 - sigmoid(0) = 0.5 per example.
    (A full-precision reference differs from a 4-bit base by its quantisation error.)"""
    monkeypatch.chdir(REPO)
    out = tmp_path / command
    args = [command, "--config", f"examples/{command}_tiny.yaml", "--model.path", str(tiny_model_dir), *options]
    args += ["--model.lora.rank", str(RANK), "--model.lora.quantize_base", "nf4", "--train.output_dir", str(out)]
    args += ["--train.max_steps", "1", "--optim.warmup_steps", "0", "--train.export", "false"]
    assert main(args) == 0
    first = next(r for r in read_metrics(out) if "train/loss" in r)  # measured before the step's update
    if command == "dpo":
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert first["train/rewards_chosen"] == pytest.approx(0.0, abs=1e-6)
        assert first["train/rewards_rejected"] == pytest.approx(0.0, abs=1e-6)
    else:
        assert first["train/loss"] == pytest.approx(0.5, abs=1e-6)
        assert first["train/kl"] == pytest.approx(0.0, abs=1e-6)
