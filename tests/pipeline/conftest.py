"""A tiny model for the pipeline tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """Qwen2, fp32, head size 32 (the smallest vLLM's CPU attention supports)."""
    from raylign.models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("pipeline") / "model", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3
    )
