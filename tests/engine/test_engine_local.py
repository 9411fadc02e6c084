"""The single-process engine: step semantics, bf16 master weights, Hugging Face export, LoRA merge."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine
from raylign.engine.deepspeed import deepspeed_config, torch_extensions_dir
from raylign.engine.distributed import all_reduce_scalars, init_distributed
from raylign.engine.export import without_tied_output
from raylign.engine.fsdp2 import decoder_layers

from .engine_testing import assert_export_loads_and_generates, local_cfg, tiny_model, token_batch


def summed_loss(model: torch.nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    return sum(model(input_ids=ids, labels=ids).loss / len(batches) for ids in batches)


def train_steps(engine, seeds: list[int], vocab: int = 128) -> None:
    for seed in seeds:
        ids = token_batch(seed, vocab=vocab)
        engine.backward(engine.module(input_ids=ids, labels=ids).loss)
        engine.step()


def test_step_sums_micro_batch_gradients_clips_and_applies_adamw():
    """One step checked against the AdamW formulas by hand.

    At the first step Adam's bias-corrected moments are m = g and v = g^2, so the update is
    w <- w (1 - lr wd) - lr g / (|g| + eps), with g the clipped gradient of the summed losses.
    """
    cfg = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=0.5, eps=1e-8)
    model = tiny_model()
    reference = copy.deepcopy(model)
    engine = create_engine(model, local_cfg(), cfg, total_steps=10)
    batches = [token_batch(1), token_batch(2)]
    for ids in batches:
        engine.backward(engine.module(input_ids=ids, labels=ids).loss / 2)
    metrics = engine.step()

    names, params = zip(*reference.named_parameters(), strict=True)
    grads = torch.autograd.grad(summed_loss(reference, batches), params)
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-6)
    lr = 1e-2 * 1 / 2  # first of two warmup steps
    assert metrics["lr"] == pytest.approx(lr)
    assert norm > 0.5, "the test must exercise clipping"
    clip = 0.5 / (norm + 1e-6)
    for name, w0, g in zip(names, params, grads, strict=True):
        g = g * clip
        decay = 0.0 if w0.ndim < 2 else 0.1
        expected = w0.detach() * (1 - lr * decay) - lr * g / (g.abs() + 1e-8)
        torch.testing.assert_close(model.get_parameter(name).detach(), expected, atol=1e-7, rtol=1e-5, msg=name)


def test_bf16_model_updates_fp32_master_weights():
    """An update of 1e-5 is below bf16 resolution for weights of size ~0.02; the fp32 masters keep it."""
    lr = 1e-5
    cfg = OptimConfig(lr=lr, scheduler="constant", weight_decay=0.0, max_grad_norm=0.0)
    model = tiny_model(dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    engine = create_engine(model, local_cfg(), cfg, total_steps=1)
    ids = token_batch(3)
    engine.backward(engine.module(input_ids=ids, labels=ids).loss)
    engine.step()

    names, params = zip(*reference.named_parameters(), strict=True)
    grads = torch.autograd.grad(reference(input_ids=ids, labels=ids).loss, params)
    masters = dict(engine.master.named_masters)
    for name, w0, g in zip(names, params, grads, strict=True):
        g = g.float()
        expected_master = w0.detach().float() - lr * g / (g.abs() + 1e-8)
        torch.testing.assert_close(masters[name].detach(), expected_master, atol=1e-9, rtol=1e-6, msg=name)
        assert torch.equal(model.get_parameter(name).detach(), masters[name].detach().to(torch.bfloat16)), name
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    moved_in_fp32 = (masters[q_proj] != reference.get_parameter(q_proj).float()).float().mean()
    moved_in_bf16 = (model.get_parameter(q_proj) != reference.get_parameter(q_proj)).float().mean()
    assert moved_in_fp32 > 0.9 and moved_in_bf16 < 0.5


def test_bf16_micro_batch_gradients_reach_the_optimizer_summed_in_fp32():
    """With master weights, the optimizer sees the fp32 sum of the micro-batches' bf16 gradients, as
    fsdp2 and DeepSpeed give it: summed in bf16, every addition would round to 8 significant bits."""
    micro_batches = 32
    model = tiny_model(dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    cfg = OptimConfig(lr=1e-5, scheduler="constant", weight_decay=0.0, max_grad_norm=0.0)
    engine = create_engine(model, local_cfg(), cfg, total_steps=1)
    seen: dict[str, torch.Tensor] = {}
    engine.optimizer.register_step_pre_hook(
        lambda *_: seen.update({name: m.grad.clone() for name, m in engine.master.named_masters})
    )
    for seed in range(micro_batches):
        ids = token_batch(seed)
        engine.backward(engine.module(input_ids=ids, labels=ids).loss / micro_batches)
    engine.step()

    names, params = zip(*reference.named_parameters(), strict=True)
    fp32_sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    bf16_sums = [torch.zeros_like(p) for p in params]
    for seed in range(micro_batches):
        ids = token_batch(seed)
        grads = torch.autograd.grad(reference(input_ids=ids, labels=ids).loss / micro_batches, params)
        for fp32_sum, bf16_sum, g in zip(fp32_sums, bf16_sums, grads, strict=True):
            fp32_sum += g.float()
            bf16_sum += g
    for name, fp32_sum in zip(names, fp32_sums, strict=True):
        torch.testing.assert_close(seen[name], fp32_sum, atol=1e-12, rtol=1e-6, msg=name)
    bf16_error = math.sqrt(sum(float((b.float() - f).square().sum()) for b, f in zip(bf16_sums, fp32_sums)))
    fp32_norm = math.sqrt(sum(float(f.square().sum()) for f in fp32_sums))
    assert bf16_error / fp32_norm > 1e-3, "bf16 accumulation must be measurably off for the test to tell"


def test_export_reloads_with_trained_weights_and_generates(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    engine = create_engine(model, local_cfg(), OptimConfig(lr=1e-2), total_steps=3)
    train_steps(engine, [1, 2], vocab=model.config.vocab_size)
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}

    folder = tmp_path / "export"
    engine.export_hf(folder, AutoTokenizer.from_pretrained(tiny_model_dir))
    with safe_open(folder / "model.safetensors", "pt") as handle:
        saved_keys = set(handle.keys())
    assert "lm_head.weight" not in saved_keys  # tied: transformers re-ties it on load
    assert "model.embed_tokens.weight" in saved_keys
    assert_export_loads_and_generates(folder, trained)

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = token_batch(7, vocab=model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, engine.module(input_ids=ids).logits)


def test_export_of_untied_model_keeps_lm_head(tmp_path):
    model = tiny_model(tie_word_embeddings=False)
    engine = create_engine(model, local_cfg(), OptimConfig(lr=1e-2), total_steps=2)
    train_steps(engine, [1])
    engine.export_hf(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert not torch.equal(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_without_tied_output_drops_the_head_only_when_the_config_ties_it():
    tied, untied = tiny_model(tie_word_embeddings=True), tiny_model(tie_word_embeddings=False)
    names = set(tied.state_dict())
    assert "lm_head.weight" in names  # state dicts list a tied head under both names
    assert set(without_tied_output(tied.state_dict(), tied)) == names - {"lm_head.weight"}
    assert set(without_tied_output(untied.state_dict(), untied)) == set(untied.state_dict())
    # Through PEFT the state dict to filter has the plain HF names (what full_state_dict returns).
    wrapped = get_peft_model(tiny_model(tie_word_embeddings=True), LoraConfig(r=2, target_modules=["q_proj"]))
    assert set(without_tied_output(tied.state_dict(), wrapped)) == names - {"lm_head.weight"}


def test_lora_export_merges_adapters_into_plain_weights(tmp_path):
    base_before = {k: v.clone() for k, v in tiny_model().state_dict().items()}
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "embed_tokens"])
    peft_model = get_peft_model(tiny_model(), lora)
    engine = create_engine(peft_model, local_cfg(), OptimConfig(lr=1e-2), total_steps=3)
    train_steps(engine, [1, 2])  # lora_B starts at zero; after two steps the adapters matter
    ids = token_batch(5)
    peft_model.eval()
    with torch.no_grad():
        expected_logits = peft_model(input_ids=ids).logits  # peft's own forward with the adapters
        with peft_model.disable_adapter():
            unadapted_logits = peft_model(input_ids=ids).logits
    engine.export_hf(tmp_path / "merged")

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected_logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unadapted_logits, expected_logits, atol=1e-4)
    for adapted in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        assert not torch.equal(merged.state_dict()[adapted], base_before[adapted]), adapted  # folded in
    k_key = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(merged.state_dict()[k_key], base_before[k_key])  # frozen, not adapted


def test_offload_and_onload_keep_training_on_cpu():
    engine = create_engine(tiny_model(), local_cfg(), OptimConfig(lr=1e-2), total_steps=3)
    train_steps(engine, [1])
    engine.offload()
    engine.onload()
    train_steps(engine, [2])
    assert all(p.device.type == "cpu" for p in engine.module.parameters())


def test_single_process_without_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rank, world_size, device = init_distributed()
    assert (rank, world_size, device.type) == (0, 1, "cpu")
    assert all_reduce_scalars([1.5, 2.0], op="sum") == [1.5, 2.0]


def test_fsdp2_finds_each_decoder_layer():
    model = tiny_model()
    assert decoder_layers(model) == [model.model.layers[1], model.model.layers[0]]
    with pytest.raises(ValueError, match="cannot find the decoder layers of Sequential"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_deepspeed_config_leaves_accumulation_and_schedule_to_the_caller():
    optim = OptimConfig(max_grad_norm=0.7)
    zero3 = EngineConfig(backend="deepspeed", zero_stage=3)
    config = deepspeed_config(zero3, optim, torch.float32, torch.device("cpu"))
    assert config["gradient_accumulation_steps"] == 1
    assert config["managed_gradient_accumulation"] is False
    assert config["gradient_clipping"] == 0.7
    assert config["zero_optimization"]["stage"] == 3
    assert "scheduler" not in config and "optimizer" not in config and "bf16" not in config
    bf16 = deepspeed_config(EngineConfig(backend="deepspeed"), optim, torch.bfloat16, torch.device("cpu"))
    assert bf16["bf16"] == {"enabled": True}


def test_deepspeed_param_offload_needs_zero3():
    with pytest.raises(ValueError, match=r"offload_params needs engine\.zero_stage 3"):
        EngineConfig(backend="deepspeed", zero_stage=2, offload_params=True)
    cfg = EngineConfig(backend="deepspeed", zero_stage=3, offload_params=True)
    config = deepspeed_config(cfg, OptimConfig(), torch.float32, torch.device("cpu"))
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}


def test_torch_extensions_dir_is_the_users_or_one_per_environment(monkeypatch):
    """Where scripts/install.sh prebuilds DeepSpeed's ops and runs look for them."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/ops")
    assert torch_extensions_dir() == Path("/somewhere/ops")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    default = torch_extensions_dir()
    assert default.parent == Path.home() / ".cache" / "raylign" / "torch_extensions"
    monkeypatch.setattr(sys, "prefix", "/another/venv")  # its builds record other include paths
    assert torch_extensions_dir().parent == default.parent and torch_extensions_dir() != default


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_export_loads_in_vllm_with_the_same_log_probs(tmp_path):
    """vLLM's greedy tokens and log-probs on the exported folder match transformers on the trained model.

    Tolerance as in the rollout tests: both compute in fp32 with different kernels, ~1e-6 relative
    per op; a wrong or missing weight (e.g. an untied head) is off by far more than 1e-4.
    """
    from raylign.models.tiny import build_tiny_model

    # Head size 32, the smallest vLLM's CPU attention supports; tied embeddings.
    base = build_tiny_model(tmp_path / "base", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    engine = create_engine(model, local_cfg(), OptimConfig(lr=1e-2), total_steps=3)
    train_steps(engine, [1, 2], vocab=model.config.vocab_size)
    engine.export_hf(tmp_path / "export", AutoTokenizer.from_pretrained(base))

    prompt = [5, 60, 7, 300, 9, 41]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = Path(__file__).with_name("vllm_generate.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "export"), json.dumps(prompt)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))

    ids = torch.tensor([prompt + result["tokens"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(engine.module(input_ids=ids).logits[0].double(), dim=-1)
    positions = range(len(prompt) - 1, ids.shape[1] - 1)
    expected = [float(logprobs[pos, ids[0, pos + 1]]) for pos in positions]
    greedy = [int(logprobs[pos].argmax()) for pos in positions]
    assert result["tokens"] == greedy
    assert result["logprobs"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_loss_or_gradient_skips_the_update_and_leaves_everything_as_it_was(dtype):
    """A step whose loss is NaN, or whose loss is finite but whose gradient is not, changes no
    weight, no optimizer moment and no learning rate; the next finite step is the one a run
    without the bad step would have taken first."""
    cfg = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=1.0)
    engine = create_engine(tiny_model().to(dtype), local_cfg(), cfg, total_steps=10)
    clean = create_engine(copy.deepcopy(engine.module), local_cfg(), cfg, total_steps=10)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}

    ids = token_batch(1)
    engine.backward(engine.module(input_ids=ids, labels=ids).loss * float("nan"))
    nan_loss = engine.step(finite_loss=False)
    weight = next(engine.module.parameters())
    engine.backward((weight * float("inf")).sum() * 0)  # 0 * inf: a NaN loss nobody reported, NaN gradients
    inf_grad = engine.step()  # the caller saw nothing wrong; the gradient norm does
    for metrics in (nan_loss, inf_grad):
        assert metrics["skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
        assert metrics["lr"] == pytest.approx(1e-2 / 2)  # the schedule did not move
    for name, value in engine.module.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(not s for s in engine.optimizer.state.values())  # no moments yet

    for e in (engine, clean):
        e.backward(e.module(input_ids=ids, labels=ids).loss)
        assert e.step()["skipped"] == 0.0
    for name, value in engine.module.state_dict().items():
        assert torch.equal(value, clean.module.state_dict()[name]), name
