"""``raylign tiny-model``: a small random model with a locally trained tokenizer, for examples."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field

from raylign.config.base import Section

log = logging.getLogger("raylign")


class TinyModelConfig(Section):
    """raylign tiny-model: build a tiny random causal LM and its tokenizer (nothing is downloaded)."""

    output_dir: str = Field("outputs/tiny-model", description="Folder to write the model and tokenizer to.")
    arch: Literal["qwen2", "llama"] = Field("qwen2", description="Architecture of the model.")
    hidden_size: int = Field(64, ge=8, description="Width.")
    num_layers: int = Field(2, ge=1, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    seed: int = Field(0, description="Seed of the random weights.")


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
