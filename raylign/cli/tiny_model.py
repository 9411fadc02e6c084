"""``raylign tiny-model``: a small random model with a locally trained tokenizer, for examples."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field, model_validator

from raylign.config.base import Section

log = logging.getLogger("raylign")


def check_attention_shape(hidden_size: int, num_heads: int, num_kv_heads: int) -> None:
    """A ValueError naming the values when the model's attention cannot take these shapes: every head
    needs an even size (rotary position embeddings turn pairs of dimensions), and every key/value head
    serves a whole group of query heads."""
    if hidden_size % (2 * num_heads):
        suggestion = -(-hidden_size // (2 * num_heads)) * 2 * num_heads
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of twice num_heads ({num_heads}), so that each "
            f"attention head has an even size; e.g. hidden_size {suggestion}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}): each key/value head "
            "serves a whole group of query heads"
        )


class TinyModelConfig(Section):
    """raylign tiny-model: build a tiny random causal LM and its tokenizer (nothing is downloaded)."""

    output_dir: str = Field("outputs/tiny-model", description="Folder to write the model and tokenizer to.")
    arch: Literal["qwen2", "llama"] = Field("qwen2", description="Architecture of the model.")
    hidden_size: int = Field(64, ge=8, description="Width: a multiple of twice num_heads (each head has an even size).")
    num_layers: int = Field(2, ge=1, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention): a divisor of num_heads.")
    seed: int = Field(0, description="Seed of the random weights.")

    @model_validator(mode="after")
    def _attention_shape(self) -> TinyModelConfig:
        check_attention_shape(self.hidden_size, self.num_heads, self.num_kv_heads)
        return self


def run_tiny_model(cfg: TinyModelConfig) -> str:
    from raylign.models.tiny import build_tiny_model

    path = build_tiny_model(
        cfg.output_dir,
        arch=cfg.arch,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        seed=cfg.seed,
    )
    log.info("tiny %s model and tokenizer written to %s", cfg.arch, path)
    return str(path)
