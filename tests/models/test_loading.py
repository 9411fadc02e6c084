"""Loading causal LMs and tokenizers: dtype, attention kernel, checkpointing, LoRA, errors."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from raylign.config.model import LoraConfig, ModelConfig
from raylign.models import load_causal_lm, load_tokenizer, resolve_model_path, token_logprobs
from raylign.models.packed_attention import PER_SAMPLE_SDPA
from raylign.models.tiny import build_tiny_tokenizer


def config(path, **fields) -> ModelConfig:
    return ModelConfig(path=str(path), **fields)


def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ---------------------------------------------------------------- dtype and kernel


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_loads_with_requested_dtype(tiny_model_dir, dtype, expected):
    model = load_causal_lm(config(tiny_model_dir, dtype=dtype))
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.dtype == expected


@pytest.mark.parametrize(("kernel", "loaded"), [("sdpa", PER_SAMPLE_SDPA), ("eager", "eager")])
def test_loads_with_requested_attention_kernel(tiny_qwen2, kernel, loaded):
    """sdpa becomes raylign's per-sample sdpa on a Qwen2 (which computes packed samples apart)."""
    model = load_causal_lm(config(tiny_qwen2, attn_implementation=kernel))
    assert model.config._attn_implementation == loaded


def test_loaded_weights_are_the_saved_ones(tiny_llama):
    model = load_causal_lm(config(tiny_llama, dtype="float32"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name


# ---------------------------------------------------------------- gradient checkpointing


def gradients(model, inputs) -> dict[str, torch.Tensor]:
    model.train()
    logits = model(**inputs, use_cache=False).logits
    logits.float().logsumexp(-1).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def count_mlp_forwards(model, inputs) -> int:
    """How often layer 0's MLP runs for one forward and backward (module hooks do not see recomputation)."""
    mlp = model.model.layers[0].mlp
    original, calls = mlp.forward, []

    def counting_forward(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    mlp.forward = counting_forward
    model.train()
    model(**inputs, use_cache=False).logits.sum().backward()
    del mlp.forward
    return len(calls)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    plain = load_causal_lm(config(tiny_model_dir, dtype="float32"))
    checkpointed = load_causal_lm(config(tiny_model_dir, dtype="float32", gradient_checkpointing=True))
    expected, got = gradients(plain, batch()), gradients(checkpointed, batch())
    assert expected.keys() == got.keys() and len(got) > 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0, msg=name)


def test_gradient_checkpointing_recomputes_layers_in_backward(tiny_qwen2):
    plain = load_causal_lm(config(tiny_qwen2, dtype="float32"))
    checkpointed = load_causal_lm(config(tiny_qwen2, dtype="float32", gradient_checkpointing=True))
    assert count_mlp_forwards(plain, batch()) == 1
    assert count_mlp_forwards(checkpointed, batch()) == 2  # forward, then again during backward


def test_gradient_checkpointing_is_non_reentrant(tiny_qwen2):
    model = load_causal_lm(config(tiny_qwen2, gradient_checkpointing=True))
    checkpoint_fn = model.model.layers[0]._gradient_checkpointing_func
    assert checkpoint_fn.keywords["use_reentrant"] is False


# ---------------------------------------------------------------- LoRA


LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def randomize_lora_b(model) -> None:
    """peft starts B at zero (adapter = identity); give it values so the adapter changes the output."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def test_lora_trains_only_adapter_weights(tiny_qwen2):
    model = load_causal_lm(config(tiny_qwen2, dtype="float32", lora=LORA))
    trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    # per layer: q_proj 64->64, v_proj 64->32 (2 kv heads of 16), down_proj 256->64; rank 4 adds r*(in+out)
    per_layer = 4 * (64 + 64) + 4 * (64 + 32) + 4 * (256 + 64)
    assert sum(trainable.values()) == 2 * per_layer


def test_merged_lora_model_equals_adapted_forward(tiny_qwen2):
    model = load_causal_lm(config(tiny_qwen2, dtype="float32", lora=LORA))
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    randomize_lora_b(model)
    inputs = batch()
    with torch.no_grad():
        adapted = model(**inputs).logits
        unadapted = base(**inputs).logits
        merged_model = model.merge_and_unload()
        merged = merged_model(**inputs).logits
    assert (adapted - unadapted).abs().max() > 1e-3  # the adapter does change the output
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


def test_merged_lora_weight_is_w_plus_scaled_b_a(tiny_qwen2):
    model = load_causal_lm(config(tiny_qwen2, dtype="float32", lora=LORA))
    randomize_lora_b(model)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    w, a, b = q_proj.base_layer.weight.clone(), q_proj.lora_A["default"].weight, q_proj.lora_B["default"].weight
    expected = w + (8.0 / 4) * b @ a
    merged = model.merge_and_unload().model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(merged, expected, atol=1e-6, rtol=0)


def test_token_logprobs_of_packed_lora_model_equal_merged_model_per_sample(tiny_qwen2):
    model = load_causal_lm(config(tiny_qwen2, dtype="float32", lora=LORA))
    randomize_lora_b(model)
    samples = [torch.tensor([7, 80, 9, 120]), torch.tensor([33, 41, 250, 6, 18])]
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        got = token_logprobs(model, ids, position_ids=positions)[0]
        merged = model.merge_and_unload()
        expected = []
        for s in samples:
            log_p = torch.log_softmax(merged(input_ids=s[None]).logits[0, :-1], dim=-1)
            expected += [0.0, *log_p.gather(-1, s[1:, None]).squeeze(-1).tolist()]
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=0)


def test_lora_with_gradient_checkpointing_gives_the_adapters_gradients_without_it(tiny_qwen2):
    def lora_gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # peft draws the A matrices at random: the same ones for both models
        model = load_causal_lm(config(tiny_qwen2, dtype="float32", lora=LORA, gradient_checkpointing=checkpointing))
        randomize_lora_b(model)
        return gradients(model, batch())

    expected, got = lora_gradients(False), lora_gradients(True)
    assert got.keys() == expected.keys() and got and all("lora_" in name for name in got)
    for name in expected:
        assert expected[name].abs().sum() > 0, name  # the comparison below is not between zeros
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0, msg=name)


# ---------------------------------------------------------------- paths and errors


def test_missing_path_error_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist.*config.json"):
        load_causal_lm(config(missing))


def test_folder_without_config_is_not_a_model_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match=r"not a model folder: no config.json in it \(found notes.txt\)"):
        resolve_model_path(str(tmp_path))


def test_file_is_not_a_model_folder(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="model.safetensors' is a file"):
        resolve_model_path(str(weights))


def test_resolve_model_path_accepts_a_model_folder(tiny_qwen2):
    assert resolve_model_path(str(tiny_qwen2)) == tiny_qwen2


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("side", ["left", "right"])
def test_tokenizer_pads_on_the_requested_side(tiny_qwen2, side):
    tokenizer = load_tokenizer(tiny_qwen2, padding_side=side)
    batch_ids = tokenizer(["a", "the answer is"], padding=True)["input_ids"]
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    short = batch_ids[0]
    assert tokenizer.padding_side == side
    assert (short[0] == pad) == (side == "left") and (short[-1] == pad) == (side == "right")


def test_tokenizer_keeps_its_own_pad_token(tiny_qwen2):
    tokenizer = load_tokenizer(tiny_qwen2)
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|im_end|>"


def test_tokenizer_without_pad_token_pads_with_eos(tmp_path, caplog):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="raylign.models.loading"):
        loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<|im_end|>"
    assert loaded.pad_token_id == loaded.convert_tokens_to_ids("<|im_end|>")
    assert "no pad token" in caplog.text


def test_tokenizer_rejects_unknown_padding_side(tiny_qwen2):
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right', got 'top'"):
        load_tokenizer(tiny_qwen2, padding_side="top")


def test_tokenizer_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("adapted", ["embed_tokens", "lm_head"])
def test_lora_on_a_tied_embedding_or_head_is_refused_naming_the_setting(tiny_qwen2, adapted):
    """PEFT adapts the embedding lookup without the tied head (or the head without the lookup), which a tied
    export or rollout engine, one matrix for both, cannot compute: the model is refused at load."""
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", adapted])
    with pytest.raises(ValueError, match=rf"LoRA adapts {adapted} .*model\.lora\.target_modules.*tie_word_embeddings"):
        load_causal_lm(config(tiny_qwen2, dtype="float32", lora=lora))


def test_lora_on_an_untied_embedding_loads(tiny_llama):
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "embed_tokens"])
    model = load_causal_lm(config(tiny_llama, dtype="float32", lora=lora))
    assert any(".embed_tokens.lora_embedding_A." in name for name, _ in model.named_parameters())
