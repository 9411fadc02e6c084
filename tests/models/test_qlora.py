"""QLoRA: a base model held in 4 bits by bitsandbytes (on this CPU), with LoRA adapters training on it.

The expected values are independent of bitsandbytes' own code where it matters: the storage size
of a 4-bit weight by hand, the NormalFloat4 grid's resolution as the bound on the dequantised
weights' error, the adapter parameter count by hand.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from raylign.config.engine import EngineConfig
from raylign.config.model import LoraConfig, ModelConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine
from raylign.models import load_causal_lm
from raylign.models.loading import is_quantized

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"], quantize_base="nf4")
# The 16 NormalFloat4 levels of Dettmers et al. 2023 (appendix E), for values scaled by their block's absmax.
NF4_LEVELS = [
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
]  # fmt: skip
BLOCK = 64  # bitsandbytes' default 4-bit block size: one absmax per 64 consecutive weights


def qlora_config(model_dir, **lora) -> ModelConfig:
    return ModelConfig(path=str(model_dir), dtype="float32", lora=LORA.model_copy(update=lora))


def test_a_4bit_base_stores_half_a_byte_per_weight_within_the_nf4_grid(tiny_qwen2):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    model = load_causal_lm(qlora_config(tiny_qwen2))
    assert is_quantized(model)
    full = load_file(tiny_qwen2 / "model.safetensors")
    # Rounding to the nearest level is off by at most half the widest gap between levels (0.152), times
    # the block's absmax; the absmax itself is stored in 8 bits (double quantisation), which moves a
    # level of magnitude <= 1 by its relative error more: allowed 1% (measured here: 0.44% at worst).
    bound_per_absmax = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:])) / 2 + 0.01
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        weight = module.weight
        key = name.removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"
        original = full[key]
        assert weight.dtype == torch.uint8 and weight.numel() == original.numel() // 2, key
        restored = bnb_functional.dequantize_4bit(weight.data, weight.quant_state).float()
        absmax = original.reshape(-1, BLOCK).abs().amax(dim=1, keepdim=True)
        error = (restored.reshape(-1, BLOCK) - original.reshape(-1, BLOCK)).abs()
        assert bool((error <= bound_per_absmax * absmax + 1e-6).all()), key
        assert float(error.mean()) > 0, f"{key} was not quantised"
        checked += 1
    assert checked == 2 * 7  # every linear layer of both blocks; the output head stays in float32


def test_only_the_adapters_train_on_a_4bit_base(tiny_qwen2):
    model = load_causal_lm(qlora_config(tiny_qwen2))
    trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    per_layer = 4 * (64 + 64) + 4 * (64 + 32) + 4 * (256 + 64)  # r * (in + out) for q, v and down
    assert sum(trainable.values()) == 2 * per_layer


def _step(engine, model, input_ids) -> float:
    loss = model(input_ids=input_ids, labels=input_ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def test_a_qlora_checkpoint_holds_the_adapters_alone_and_restores_them(tiny_qwen2, tmp_path):
    model = load_causal_lm(qlora_config(tiny_qwen2))
    engine = create_engine(model, EngineConfig(), OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    # The CPU kernels repack the 4-bit bytes on first use, so the frozen base is compared by what it computes.
    with torch.no_grad(), model.disable_adapter():
        base_logits = model(input_ids=input_ids).logits
    _step(engine, model, input_ids)
    engine.save_checkpoint(tmp_path / "ckpt", {"step": 1})
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    loss_after_save = _step(engine, model, input_ids)
    assert any(not torch.equal(p, saved[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert engine.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, saved[name]), name
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(model(input_ids=input_ids).logits, base_logits)
    # The same step again from the restored adapters and optimizer gives the same loss.
    assert _step(engine, model, input_ids) == loss_after_save
    stored = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*.pt"))
    adapters = sum(v.numel() * 4 for v in saved.values())
    # adapters + two AdamW moments + small state; the float32 base alone would be several times this
    assert stored < 4 * adapters + 64 * 1024 < (tiny_qwen2 / "model.safetensors").stat().st_size


def test_a_4bit_base_without_adapters_or_on_a_sharding_backend_is_refused(tiny_qwen2):
    from pydantic import ValidationError

    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig

    with pytest.raises(ValidationError, match="only LoRA adapters can train on it; set model.lora.rank > 0"):
        qlora_config(tiny_qwen2, rank=0)
    sft = {"model": {"path": str(tiny_qwen2), "lora": {"rank": 4, "quantize_base": "nf4"}}, "data": {"train": ["x"]}}
    with pytest.raises(Exception, match="sft trains a 4-bit base with engine.backend local, fsdp2, or deepspeed"):
        parse_config(SFTConfig, {**sft, "engine": {"backend": "deepspeed", "zero_stage": 3}})
    from raylign.config.prm import PRMConfig

    with pytest.raises(Exception, match="prm grows the embedding by its step separator"):
        parse_config(PRMConfig, sft)


def test_a_missing_bitsandbytes_is_named_with_the_install_command(tiny_qwen2):
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "from raylign.config.model import ModelConfig\n"
        "from raylign.models import load_causal_lm\n"
        f"load_causal_lm(ModelConfig(path={str(tiny_qwen2)!r}, lora={{'rank': 2, 'quantize_base': 'nf4'}}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "model.lora.quantize_base 'nf4' needs the bitsandbytes package" in proc.stderr
    assert "pip install bitsandbytes" in proc.stderr


def test_the_engines_base_is_the_4bit_base_dequantised_and_computes_with_the_adapters_as_the_policy(
    tiny_qwen2, tmp_path
):
    """What rl's rollout engines start from under a 4-bit policy base: the values the policy's layers
    compute with, not the folder's full-precision weights, so engine and policy log-probs agree."""
    import json

    import bitsandbytes.functional as bnb_functional
    from transformers import AutoModelForCausalLM

    model = load_causal_lm(qlora_config(tiny_qwen2))
    engine = create_engine(model, EngineConfig(), OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    _step(engine, model, input_ids)  # lora_B leaves zero: the base written below must hold no adapter
    engine.write_base_folder(tmp_path / "base")

    written = load_file(tmp_path / "base" / "model.safetensors")
    original = load_file(tiny_qwen2 / "model.safetensors")
    assert set(written) == set(original)
    quantised = 0
    for key, value in written.items():
        if key.endswith("proj.weight"):  # every linear layer of the blocks is held in 4 bits
            # Quantised again here from the stored weight as the loader does (NF4, 64-weight blocks, 8-bit
            # absmax), and dequantised: the base's values, independent of the model's own layers.
            packed, state = bnb_functional.quantize_4bit(
                original[key], blocksize=BLOCK, compress_statistics=True, quant_type="nf4"
            )
            torch.testing.assert_close(value, bnb_functional.dequantize_4bit(packed, state), atol=0, rtol=0)
            assert not torch.equal(value, original[key]), key
            quantised += 1
        else:
            assert torch.equal(value, original[key]), key
    assert quantised == 2 * 7
    assert "quantization_config" not in json.loads((tmp_path / "base" / "config.json").read_text())

    def with_adapters(path) -> torch.nn.Module:
        """A plain float32 model from ``path`` with the policy's adapters added by hand: W + s B A."""
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        scaling = LORA.alpha / LORA.rank
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith(tuple(LORA.target_modules)) and hasattr(module, "lora_A"):
                    delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
                    plain.get_submodule(name.removeprefix("base_model.model.")).weight += scaling * delta
        return plain

    with torch.no_grad():
        policy = model(input_ids=input_ids).logits
        served = with_adapters(tmp_path / "base")
        torch.testing.assert_close(served(input_ids=input_ids).logits, policy, atol=1e-5, rtol=0)
        # The folder's full-precision weights under the same adapters compute something else.
        assert float((with_adapters(tiny_qwen2)(input_ids=input_ids).logits - policy).abs().max()) > 1e-3
    # A merged weight sync sends the same: the dequantised base with the adapters folded in.
    merged = engine.full_state_dict()
    for key, value in served.state_dict().items():
        torch.testing.assert_close(merged[key], value, atol=1e-6, rtol=0)
