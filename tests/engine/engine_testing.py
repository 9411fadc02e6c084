"""Helpers shared by the engine tests (tiny models, configs, export checks)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from raylign.config.engine import EngineConfig


def tiny_config(**overrides):
    """The brief's test model: Qwen2, hidden 32, 2 layers, 4 heads (2 KV), vocab 128."""
    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
    )
    fields.update(overrides)
    return AutoConfig.for_model("qwen2", **fields)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(**overrides), dtype=dtype)


def local_cfg() -> EngineConfig:
    return EngineConfig(backend="local")


def token_batch(seed: int, batch: int = 2, length: int = 12, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_export_loads_and_generates(folder: Path, expected: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    """``from_pretrained`` reloads ``folder`` with exactly ``expected``'s weights, and it generates."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loaded = model.state_dict()
    assert set(expected) <= set(loaded), f"missing after reload: {sorted(set(expected) - set(loaded))}"
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor.float(), atol=atol, rtol=0, msg=f"weight {name}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "add 2 and 3"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 4)
