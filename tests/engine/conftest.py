"""Fixtures of the engine tests: one tiny model folder per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylign.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 (hidden 32, tied embeddings) with a chat tokenizer, saved once."""
    return build_tiny_model(
        tmp_path_factory.mktemp("engine") / "tiny-qwen2",
        arch="qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=128,
    )
